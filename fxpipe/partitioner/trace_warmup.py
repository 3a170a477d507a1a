"""Imported by a fork server (``fxpipe run``'s and :func:`fxpipe.runtime.local_ranks.run_ranks`'):
traces one tiny transformer block on the meta device, so that every process the server forks
starts with what torch.export loads and builds on its first call (about 0.5 s of CPU per
process: lazy modules, decomposition and dispatch tables) instead of each paying it again.

Nothing is computed: the parameters and the input live on the meta device (no kernel runs, no
thread pool starts, no random numbers are drawn: the generators' states are restored anyway). A
failure here only loses the saving.
"""

from __future__ import annotations

import warnings


def warm_up() -> None:
    """Export a tiny attention block on the meta device (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.norm = nn.LayerNorm(4)
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.norm(self.emb(x))
            a = F.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None],
                                               is_causal=True)[:, 0]
            return F.cross_entropy(self.fc(F.gelu(a + h)).transpose(1, 2), x)

    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                block = Block()
                x = torch.zeros(2, 3, dtype=torch.long)
            torch.export.export(block, (x,), strict=False).module()
    except Exception:  # pragma: no cover - a torch without meta kernels for these ops
        pass


warm_up()
