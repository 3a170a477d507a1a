"""Small models shared by several test files."""

from __future__ import annotations

import torch

from fxpipe.examples.cnn import SkipCNN
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.annotations import pipe_split

# Sizes shared by the multi-process equivalence tests (tests/test_executor.py,
# tests/test_schedules_execute.py).
TOL = 1e-5       # max |pipelined - single-process| for losses and parameters, fp32
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
