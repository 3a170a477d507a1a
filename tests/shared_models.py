"""Small models shared by several test files."""

from __future__ import annotations

import torch

from fxpipe.examples.cnn import SkipCNN
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.annotations import pipe_split

try:
    from tolerances import adamw_param_bound, bound, max_abs
except ImportError:  # tests/ collected as a package
    from tests.tolerances import adamw_param_bound, bound, max_abs

# Sizes shared by the multi-process equivalence tests (tests/test_executor.py,
# tests/test_schedules_execute.py).
MBS = 2          # samples per micro-batch
M = 4            # micro-batches per step per replica
STEPS = 3
VOCAB, SEQ = 64, 16


def tiny_gpt() -> CharGPT:
    """Seeded CharGPT (tied embeddings), vocab 64, 4 layers x 32 wide, sequences of 16."""
    torch.manual_seed(0)
    return CharGPT(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32)


def tiny_cnn() -> SkipCNN:
    """Seeded SkipCNN on 1x8x8 images, 10 classes, with the stem-to-head skip."""
    torch.manual_seed(0)
    return SkipCNN(in_channels=1, width=4, depth=4, num_classes=10, image_size=8, hidden=16)


class SplitGPT(CharGPT):
    """CharGPT with a forced stage boundary (``pipe_split()``) after block 0."""

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for i, block in enumerate(self.h):
            x = block(x)
            if i == 0:
                pipe_split()
        return self.head(self.ln_f(x))


class BufferedGPT(CharGPT):
    """CharGPT with buffers of its own, as user models hold them: non-persistent ones (an
    embedding scale on the model, a gate per block: ``register_buffer(..., persistent=False)``,
    rebuilt by ``__init__`` and absent from ``state_dict()``), a persistent one (a shift after
    the last norm, saved like a parameter), one that ``forward`` never reads (a version
    counter: saved all the same) and one tensor that block 0's attention saves (``mix``)
    while the block reads it as its non-persistent gate."""

    def __init__(self, **kw):
        super().__init__(**kw)
        width = self.wte.weight.shape[1]
        self.register_buffer("emb_scale", torch.tensor(1.25), persistent=False)
        for i, block in enumerate(self.h):
            block.register_buffer("gate", torch.linspace(0.5, 1.5, width) + 0.1 * i,
                                  persistent=False)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, width))
        self.register_buffer("version", torch.arange(3.0))  # never read by forward
        self.h[0].attn.register_buffer("mix", self.h[0].gate)  # persistent here

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) * self.emb_scale + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x) * block.gate
        return self.head(self.ln_f(x) + self.shift)


def buffered_gpt(vocab_size: int = VOCAB, block_size: int = SEQ, n_layer: int = 2,
                 n_embd: int = 32) -> BufferedGPT:
    """Seeded :class:`BufferedGPT` (tied embeddings), 2 heads."""
    torch.manual_seed(0)
    return BufferedGPT(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2,
                       n_embd=n_embd)


def assert_plain_state_keys(model: torch.nn.Module, keys) -> None:
    """``keys`` (saved by a checkpoint, or a pipeline's ``state_dict()``) are the plain
    ``model``'s ``state_dict()`` keys: none it lacks (no non-persistent buffer, no name of
    fxpipe's), and every tensor of it there (under one of its names when tied)."""
    plain = model.state_dict(keep_vars=True)
    extra = sorted(set(keys) - set(plain))
    assert not extra, (type(model).__name__, "keys the plain model lacks", extra)
    held = {id(plain[k]) for k in keys}
    lost = sorted(k for k, v in plain.items() if id(v) not in held)
    assert not lost, (type(model).__name__, "tensors not held", lost)


def exact_bounds(ref_losses: list[float], init: dict[str, torch.Tensor],
                 final: dict[str, torch.Tensor], global_batch: int, steps: int,
                 dtype: torch.dtype = torch.float32,
                 adamw: tuple[float, float] | None = None) -> tuple[float, float]:
    """``(loss bound, parameter bound)`` on ``|pipelined - single-process|`` after ``steps``
    steps of ``global_batch`` samples (tests/tolerances.py): the losses' sums reordered over the
    batch's samples; each parameter's own rounding plus that of the updates that moved it from
    ``init`` to ``final`` (a gradient reordered over the samples moves an SGD update by as much,
    relatively; momentum and weight decay only add updates up). ``adamw=(sum of the learning
    rates, largest gradient entry)``: AdamW's bound instead (its steepest slope, 1/eps, at a zero
    gradient), meant for float64."""
    loss = bound(max(abs(x) for x in ref_losses), global_batch, steps, dtype)
    size = max_abs(final.values())
    if adamw is not None:
        lr_sum, grad = adamw
        return loss, adamw_param_bound(lr_sum, grad, size, global_batch, steps, dtype=dtype)
    moved = max(float((final[k] - init[k]).abs().max()) for k in final)
    return loss, bound(size, 1, steps, dtype) + bound(moved, global_batch, steps, dtype)


def planned_chargpt(recompute: str, memory_gb: float, n_layer: int = 4):
    """``fxpipe.plan`` of a seeded CharGPT (``n_layer`` x 128 wide, sequences of 128) on 2 CPU
    devices of ``memory_gb``, pipeline 2, 8 micro-batches of 4, 1F1B, with
    ``train.activation_recompute: recompute`` (the recomputation tests' tight devices)."""
    import fxpipe

    torch.manual_seed(0)
    model = CharGPT(n_layer=n_layer, n_embd=128, n_head=4, block_size=128)
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT"},
            "data": {"batch_size": 32, "seq_len": 128},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 8, "schedule": "1f1b"},
            "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gb": memory_gb},
            "train": {"activation_recompute": recompute}}
    return fxpipe.plan(model, spec, torch.randint(0, 256, (4, 128)))
