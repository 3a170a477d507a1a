"""Small convolutional models with skip connections, for tests and partition benchmarks.

All take float32 images ``[batch, channels, H, W]`` and return logits ``[batch, num_classes]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) skip: ``[B,Ci,H,W]->[B,Co,H,W]``."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.skip(x))


class SkipCNN(nn.Module):
    """ResNet-style CNN whose stem output also skips over the body to the head.

    The long skip (stem -> head) crosses every stage boundary in between, so it tests that values
    travel between non-adjacent stages. Early layers are FLOP-heavy (full resolution), the head
    is parameter-heavy.

    Args:
        in_channels: image channels. width: stem channels. depth: residual blocks.
        num_classes: logits. image_size: H = W of the input.
    """

    def __init__(self, in_channels: int = 1, width: int = 8, depth: int = 4,
                 num_classes: int = 10, image_size: int = 8, hidden: int = 64):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.blocks = nn.ModuleList(ResidualBlock(width, width) for _ in range(depth))
        self.fc1 = nn.Linear(2 * width * image_size * image_size, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.relu(self.stem(x))
        h = s
        for block in self.blocks:
            h = block(h)
        z = torch.cat([h, s], dim=1).flatten(1)
        return self.fc2(F.relu(self.fc1(z)))
