"""Benchmark-only models with deliberately uneven layers (not part of the fxpipe package).

Each model is a plain ``nn.Module`` whose "layers" (the blocks a user would hand DeepSpeed's
``PipelineModule`` as its layer list) are listed by :func:`layer_paths`. Build them under
``torch.device("meta")`` to plan without weight memory (:func:`build`).

* :class:`HeadHeavyLM` - a GPT-style language model with an UNTIED vocabulary head (vocab 32,000,
  width 256): the head holds most parameters and, at short width, most FLOPs.
* :class:`VGGLike` - a VGG-16-shaped CNN (Simonyan & Zisserman, 2015): full-resolution 3x3
  convolutions early (most FLOPs, few parameters), three large fully connected layers late (most
  parameters, few FLOPs).
* :class:`UNetLike` - a U-Net (Ronneberger et al., 2015): each encoder level's features are
  concatenated into the decoder level of the same resolution, so the first level's skip crosses
  every stage boundary of the network's middle.

Shapes: ``HeadHeavyLM``: int64 ``[B, T]`` -> float32 ``[B, T, vocab]``. ``VGGLike``: float32
``[B, 3, H, W]`` (H, W divisible by 32) -> ``[B, classes]``. ``UNetLike``: float32
``[B, C, H, W]`` (H, W divisible by ``2**depth``) -> ``[B, classes, H, W]``.

* :class:`SplitCharGPT` - fxpipe's ``CharGPT`` with a forced stage boundary after block 0
  (``pipe_split()``), so a 2-stage pipeline sends the residual stream across its boundary
  (bench_multinode_link.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe import pipe_split
from fxpipe.examples.gpt import Block, CharGPT

__all__ = ["HeadHeavyLM", "VGGLike", "UNetLike", "SplitCharGPT", "BenchModel", "MODELS", "build",
           "layer_paths"]


class SplitCharGPT(CharGPT):
    """``CharGPT`` with ``pipe_split()`` after block 0 (seeded: ``torch.manual_seed(0)``)."""

    def __init__(self, **kwargs):
        torch.manual_seed(0)
        super().__init__(**kwargs)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.h):
            x = block(x)
            if i == 0:
                pipe_split()
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------------------------
# (a) language model with a large untied vocabulary head


class HeadHeavyLM(nn.Module):
    """GPT-style LM with an untied head: ``idx`` int64 ``[B, T]`` -> logits ``[B, T, vocab]``.

    Layers (in order): ``wte``, ``wpe``, ``h.0 .. h.{n_layer-1}``, ``ln_f``, ``head``. With the
    defaults (vocab 32,000, width 256, 6 blocks, sequence length 512) the untied embedding and the
    head each hold 8.2 M of the model's 21.3 M parameters, and the head does 57% of the FLOPs
    (one matmul, about 8x a transformer block); the embedding does none.
    """

    def __init__(self, vocab_size: int = 32000, block_size: int = 512, n_layer: int = 6,
                 n_head: int = 4, n_embd: int = 256):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)  # untied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------------------------
# (b) CNN: FLOP-heavy early convolutions, parameter-heavy late fully connected layers


class ConvUnit(nn.Module):
    """3x3 convolution + ReLU, optionally followed by 2x2 max pooling: ``[B,Ci,H,W]->[B,Co,H',W']``."""

    def __init__(self, c_in: int, c_out: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        return F.max_pool2d(x, 2) if self.pool else x


class FCUnit(nn.Module):
    """Linear (+ ReLU unless last): ``[B, i] -> [B, o]``."""

    def __init__(self, d_in: int, d_out: int, last: bool):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        return x if self.last else F.relu(x)


#: VGG-16 configuration: channels per conv, "M" = max-pool after the previous conv
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGGLike(nn.Module):
    """VGG-16-shaped CNN: 13 conv units (``features.0..12``) and 3 FC units (``classifier.0..2``).

    At 224x224 the convolutions carry about 99% of the FLOPs and the FC layers about 89% of the
    parameters (25088 -> 4096 -> 4096 -> classes). ``width`` scales every channel count.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 1000, image_size: int = 224,
                 width: float = 1.0, hidden: int = 4096):
        super().__init__()
        if image_size % 32:
            raise ValueError(f"image_size={image_size} must be divisible by 32 (five 2x2 poolings)")
        units, c = [], in_channels
        cfg = list(VGG16)
        for i, v in enumerate(cfg):
            if v == "M":
                continue
            co = max(1, int(v * width))
            units.append(ConvUnit(c, co, pool=i + 1 < len(cfg) and cfg[i + 1] == "M"))
            c = co
        self.features = nn.ModuleList(units)
        flat = c * (image_size // 32) ** 2
        self.classifier = nn.ModuleList([FCUnit(flat, hidden, False), FCUnit(hidden, hidden, False),
                                         FCUnit(hidden, num_classes, True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for u in self.features:
            x = u(x)
        x = x.flatten(1)
        for u in self.classifier:
            x = u(x)
        return x


# --------------------------------------------------------------------------------------------
# (c) U-Net with long skip connections


class DoubleConv(nn.Module):
    """Two 3x3 conv + ReLU: ``[B, Ci, H, W] -> [B, Co, H, W]``."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class Down(nn.Module):
    """Encoder level: (2x2 max-pool unless first) + DoubleConv. Its output is also a skip."""

    def __init__(self, c_in: int, c_out: int, pool: bool):
        super().__init__()
        self.pool = pool
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.max_pool2d(x, 2) if self.pool else x)


class Up(nn.Module):
    """Decoder level: 2x transposed conv, concatenate the encoder skip, DoubleConv."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = DoubleConv(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNetLike(nn.Module):
    """U-Net: ``down.0..depth-1``, ``mid``, ``up.0..depth-1``, ``out``.

    ``down.i`` has ``base * 2**i`` channels at resolution ``H / 2**i``; ``mid`` doubles once more;
    ``up.j`` mirrors ``down.{depth-1-j}`` and reads its output as a skip, so ``down.0``'s
    full-resolution features travel from the first layer to the second-to-last.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 2, base: int = 32, depth: int = 4):
        super().__init__()
        chans = [base * 2**i for i in range(depth)]
        self.down = nn.ModuleList(
            Down(in_channels if i == 0 else chans[i - 1], chans[i], pool=i > 0) for i in range(depth))
        self.mid = Down(chans[-1], 2 * chans[-1], pool=True)
        self.up = nn.ModuleList(
            Up(2 * chans[i], chans[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for d in self.down:
            x = d(x)
            skips.append(x)
        x = self.mid(x)
        for u, s in zip(self.up, reversed(skips)):
            x = u(x, s)
        return self.out(x)


# --------------------------------------------------------------------------------------------
# registry


def layer_paths(model: nn.Module) -> list[str]:
    """The model's "layers" in forward order: top-level children, with a ``ModuleList`` /
    ``Sequential`` child expanded into its items (``h.0``, ``h.1``, ...).

    This is the layer list DeepSpeed's ``PipelineModule`` would receive (its ``uniform`` and
    ``parameters`` partition methods cut only between these). Registration order is assumed to
    be forward order, which holds for the models in this file.
    """
    out: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out.extend(f"{name}.{i}" for i, _ in enumerate(child))
        else:
            out.append(name)
    return out


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model: a factory and its example input (one micro-batch).

    Attributes:
        name: short label used in tables.
        description: one line for BENCHMARKS.md.
        factory: ``(**kwargs) -> nn.Module``.
        example: ``(device) -> tuple of tensors``, one micro-batch of inputs.
    """

    name: str
    description: str
    factory: Callable[..., nn.Module]
    example: Callable[[torch.device], tuple]


def _tokens(b: int, t: int) -> Callable[[torch.device], tuple]:
    return lambda dev: (torch.zeros(b, t, dtype=torch.long, device=dev),)


def _image(b: int, c: int, h: int) -> Callable[[torch.device], tuple]:
    return lambda dev: (torch.zeros(b, c, h, h, device=dev),)


#: full-size benchmark configurations (micro-batch sizes chosen so tracing stays ~1 s here)
MODELS: dict[str, BenchModel] = {
    "lm-vocab32k": BenchModel(
        "lm-vocab32k", "GPT-style LM, 6 blocks x width 256, untied 32k-vocab head, micro-batch 8 x 512",
        lambda: HeadHeavyLM(32000, 512, 6, 4, 256), _tokens(8, 512)),
    "vgg16": BenchModel(
        "vgg16", "VGG-16-shaped CNN, 13 conv + 3 FC (4096 wide), micro-batch 8 x 3 x 224 x 224",
        lambda: VGGLike(3, 1000, 224), _image(8, 3, 224)),
    "unet": BenchModel(
        "unet", "U-Net, 4 levels, base 32 channels, concatenated skips, micro-batch 4 x 3 x 256 x 256",
        lambda: UNetLike(3, 2, 32, 4), _image(4, 3, 256)),
}

#: tiny configurations of the same shapes (for the smoke test)
TINY: dict[str, BenchModel] = {
    "lm-vocab32k": BenchModel("lm-vocab32k", "tiny head-heavy LM",
                              lambda: HeadHeavyLM(4000, 32, 3, 2, 32), _tokens(2, 32)),
    "vgg16": BenchModel("vgg16", "tiny VGG-like CNN",
                        lambda: VGGLike(3, 10, 32, width=0.125, hidden=256), _image(2, 3, 32)),
    "unet": BenchModel("unet", "tiny U-Net",
                       lambda: UNetLike(3, 2, 4, 2), _image(1, 3, 16)),
}


def build(bm: BenchModel, device: str | torch.device = "meta") -> tuple[nn.Module, tuple]:
    """Instantiate ``bm`` on ``device`` (default meta: no weight memory) with its example input."""
    dev = torch.device(device)
    with dev:
        model = bm.factory()
    return model, bm.example(dev)
