"""Small models shared by several test files."""

from __future__ import annotations

import torch

from fxpipe.annotations import pipe_split
from fxpipe.examples.gpt import CharGPT


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
