"""A byte-level GPT in plain torch (nanoGPT-style) with tied input embedding and output head.

Shapes: input ``idx`` int64 ``[batch, seq_len]`` with values in ``[0, vocab_size)``; output
logits float32 ``[batch, seq_len, vocab_size]``. Dropout is off by default so a pipelined run
can be compared exactly with a single-process run (each rank draws its own masks). ``dropout``
> 0 and ``fused_attention=False`` give the GPT-3 training shape of Megatron-LM's published runs
(attention written out: scores ``q @ k^T``, causal mask, softmax, dropout, ``@ v``; dropout on
the attention and MLP outputs), whose activation memory selective recomputation addresses.

Reference: Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), and
Karpathy's nanoGPT for the layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, C] -> [B, T, C]``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, fused: bool = True):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head, self.dropout, self.fused = n_head, dropout, fused
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
            y = (F.dropout(att, p) if p else att) @ v
        y = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return F.dropout(y, p) if p else y


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, both residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, fused: bool = True):
        super().__init__()
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, fused)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        p = self.dropout if self.training else 0.0
        y = self.fc_proj(F.gelu(self.fc(self.ln_2(x))))
        return x + (F.dropout(y, p) if p else y)


class CharGPT(nn.Module):
    """Byte-level GPT language model with tied embeddings (``head.weight is wte.weight``).

    Args:
        vocab_size: number of tokens (256 for bytes).
        block_size: longest sequence the position table covers.
        n_layer, n_head, n_embd: depth, heads and width.
        dropout: dropout probability on attention probabilities and on the attention and MLP
            outputs (0: none).
        fused_attention: attention as one ``scaled_dot_product_attention`` call (default), or
            written out (the score matrix materialised, as in Megatron-LM's GPT-3 runs).
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0,
                 fused_attention: bool = True):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout, fused_attention)
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying (Press & Wolf, 2017)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, T]`` token ids (``T <= block_size``) -> float32 logits ``[B, T, vocab]``."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))
