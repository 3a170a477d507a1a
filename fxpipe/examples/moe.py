"""A byte-level mixture-of-experts GPT: CharGPT's blocks with a routed expert MLP.

Each block's MLP is ``n_expert`` experts (each a 4x GELU MLP) behind a router that sends every
token to its ``top_k`` experts (Switch / GShard / Mixtral style): the router's softmax
probabilities, the top-``k`` renormalised to sum to 1 (Mixtral), tokens placed in their experts
in priority order (every token's first choice before any second choice, then token order,
GShard) up to each expert's capacity ``ceil(capacity_factor * tokens * top_k / n_expert)``;
a token over capacity is dropped by that expert (its other choices still count; a token
dropped by all passes through the residual alone). The shapes are static (dispatch and combine
are one-hot tensors ``[tokens, experts, capacity]``, Lepikhin et al., "GShard", 2020), so
torch.export traces the model whole; the experts' weights are ``[n_expert, ...]`` tensors,
each expert a slice of them.

The load-balancing loss (Fedus et al., "Switch Transformers", 2021): per layer
``n_expert * sum_e f_e * P_e`` (``f_e`` the fraction of routing choices that picked expert
``e``, ``P_e`` its mean router probability), summed over the layers and added to the language
model's cross entropy times ``aux_loss_coef``. Routing and capacity are computed per forward
call, that is per micro-batch in a pipeline: the model's math is the micro-batch's, as in any
MoE training loop that accumulates gradients.

``forward(idx)`` returns the logits; ``forward(idx, labels)`` ``{"loss", "logits"}``, the loss
the cross entropy of ``labels`` (the next tokens, aligned with ``idx``; ``-100`` ignored) plus
the auxiliary loss: train it with ``train.loss: model``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.examples.gpt import CausalSelfAttention


class MoEMLP(nn.Module):
    """Routed experts: ``[B, T, C] -> ([B, T, C], load-balancing loss)`` (module doc)."""

    def __init__(self, n_embd: int, n_expert: int = 4, top_k: int = 2,
                 capacity_factor: float = 1.25):
        super().__init__()
        if not 1 <= top_k <= n_expert:
            raise ValueError(f"top_k={top_k} must be between 1 and n_expert={n_expert}")
        self.n_expert, self.top_k, self.capacity_factor = n_expert, top_k, capacity_factor
        hidden = 4 * n_embd
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.w_in = nn.Parameter(torch.empty(n_expert, n_embd, hidden))
        self.b_in = nn.Parameter(torch.zeros(n_expert, 1, hidden))
        self.w_out = nn.Parameter(torch.empty(n_expert, hidden, n_embd))
        self.b_out = nn.Parameter(torch.zeros(n_expert, 1, n_embd))
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)

    def capacity(self, tokens: int) -> int:
        """Slots per expert for ``tokens`` tokens."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_expert))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        tokens = x.reshape(b * t, c)
        s, e, k = b * t, self.n_expert, self.top_k
        probs = F.softmax(self.router(tokens), dim=-1)  # [S, E]
        top_p, top_i = probs.topk(k, dim=-1)  # [S, k]
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        chosen = F.one_hot(top_i, e).to(x.dtype)  # [S, k, E]
        # priority: every token's first choice, then every second choice..., in token order
        by_slot = chosen.transpose(0, 1).reshape(k * s, e)
        position = (torch.cumsum(by_slot, dim=0) - 1.0).reshape(k, s, e).transpose(0, 1)
        cap = self.capacity(s)
        kept = chosen * (position < cap).to(x.dtype)  # [S, k, E]
        slot = F.one_hot(position.clamp(0, cap - 1).long(), cap).to(x.dtype)  # [S, k, E, C]
        dispatch = (kept.unsqueeze(-1) * slot).sum(dim=1)  # [S, E, C]
        combine = (kept.unsqueeze(-1) * slot * top_p[:, :, None, None]).sum(dim=1)
        xe = torch.einsum("sec,sd->ecd", dispatch, tokens)  # [E, C, d]: each expert's tokens
        h = F.gelu(torch.bmm(xe, self.w_in) + self.b_in)
        ye = torch.bmm(h, self.w_out) + self.b_out  # [E, C, d]
        y = torch.einsum("sec,ecd->sd", combine, ye)
        # Switch's load balancing: fraction of choices per expert x its mean probability
        fraction = chosen.sum(dim=(0, 1)) / (s * k)
        aux = e * (fraction * probs.mean(dim=0)).sum()
        return y.reshape(b, t, c), aux


class MoEBlock(nn.Module):
    """Pre-norm block: attention, then the routed experts; both residual."""

    def __init__(self, n_embd: int, n_head: int, n_expert: int, top_k: int,
                 capacity_factor: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.moe = MoEMLP(n_embd, n_expert, top_k, capacity_factor)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, a = self.moe(self.ln_2(x))
        return x + y, aux + a


class MoEGPT(nn.Module):
    """Byte-level GPT whose MLPs are routed experts (module doc); tied embeddings.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd: as :class:`~fxpipe.examples.gpt.CharGPT`.
        n_expert: experts per layer. top_k: experts per token. capacity_factor: slots per
            expert over an even share of the choices. aux_loss_coef: the load-balancing loss's
            weight in the training loss.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4,
                 n_head: int = 4, n_embd: int = 128, n_expert: int = 4, top_k: int = 2,
                 capacity_factor: float = 1.25, aux_loss_coef: float = 0.01):
        super().__init__()
        self.aux_loss_coef = aux_loss_coef
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(MoEBlock(n_embd, n_head, n_expert, top_k, capacity_factor)
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None):
        """int64 ``[B, T]`` ids -> logits ``[B, T, vocab]``; with ``labels`` (int64
        ``[B, T]``, ``-100`` ignored) ``{"loss": training loss, "logits": logits}``."""
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        aux = x.new_zeros(())
        for block in self.h:
            x, aux = block(x, aux)
        logits = self.head(self.ln_f(x))
        if labels is None:
            return logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             ignore_index=-100)
        return {"loss": ce + self.aux_loss_coef * aux, "logits": logits}
