"""Activation offload: the tensors a stage's forward saves for its backward go to host memory
as they are saved and come back to the device when the backward reads them.

``torch.autograd.graph.saved_tensors_hooks`` with a copy out on pack and a copy back on
unpack (``torch.autograd.graph.save_on_cpu`` does the same, but for every saved tensor): the
stage's parameters and buffers, and the inputs the runtime holds for the micro-batch anyway,
stay where they are (moving them would free nothing). The copies are exact, so an offloading
stage trains bit-equal to one that keeps its activations. On CUDA the host buffers are pinned
and the copies run on the compute stream (ordered with the kernels, as the planner prices them:
not overlapped). A split backward reads some saved tensors again in W, and they come back
again. :class:`Offload` counts the bytes each way. On a compiled stage a strided saved tensor moves as the
span of storage it covers and comes back with its strides, which the compiled backward was
generated for. A saved tensor that is written in place
after it was saved (while still alive) fails its backward with autograd's own message, as it
would without offload: the host copy would otherwise hide the write.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

__all__ = ["Offload"]


def _span(t: torch.Tensor) -> torch.Tensor:
    """The storage ``t`` covers, from its first element to its last, as a flat tensor (what a
    strided view needs to come back with its strides)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset())


def _storage(t: torch.Tensor) -> int | None:
    """Address of ``t``'s storage (views share it), or None where it has none of its own."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class Offload:
    """The offload hooks of one stage (``module``'s parameters and buffers stay on the
    device) and the bytes they moved: ``out_bytes`` (device to host), ``in_bytes`` (back)."""

    def __init__(self, module: nn.Module, keep_layout: bool = False) -> None:
        self.module = module
        self.out_bytes = 0
        self.in_bytes = 0
        #: a compiled stage (train.compile): its backward was generated for the saved tensors'
        #: strides, so a strided one moves as the span of storage it covers and comes back
        #: with its strides (gaps and overlaps included)
        self.keep_layout = keep_layout

    @contextmanager
    def saving(self, args: list[Any]) -> Iterator[None]:
        """The forward of one micro-batch on ``args``: what autograd saves goes to the host,
        except the parameters, buffers and ``args``."""
        with torch.autograd.graph.saved_tensors_hooks(*self.hooks(args)):
            yield

    def hooks(self, args: list[Any]) -> tuple[Any, Any]:
        """``(pack, unpack)`` of :meth:`saving` (to compose with other saved-tensor hooks:
        only the innermost ``saved_tensors_hooks`` run)."""
        held = [*self.module.parameters(), *self.module.buffers(),
                *(a for a in args if isinstance(a, torch.Tensor))]
        keep = {_storage(t) for t in held}  # (as they are now: a gathered parameter of data
        # sharding is new storage each step)

        copies: dict[tuple, tuple] = {}  # one host copy of a tensor several ops save

        def pack(t: torch.Tensor) -> Any:
            where = _storage(t)
            if where is None or where in keep or t.numel() == 0:
                return t  # (a tensor subclass without plain storage stays too)
            key = (id(t), t._version)  # the same tensor, alive, unchanged since
            seen = copies.get(key)
            if seen is not None and seen[0]() is t:
                return seen[1]
            pin = t.device.type == "cuda"
            strided = self.keep_layout and not t.is_contiguous() and min(t.stride()) >= 0
            src = _span(t) if strided else t
            host = torch.empty(src.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(src, non_blocking=pin)
            self.out_bytes += host.numel() * host.element_size()
            copies[key] = (weakref.ref(t), (t.device, host, weakref.ref(t), t._version,
                                            (t.size(), t.stride()) if strided else None))
            return copies[key][1]

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host, ref, version, layout = packed
            t = ref()
            if t is not None and t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: [{t.dtype} {list(t.shape)}] is at version "
                    f"{t._version}; expected version {version} instead (activation offload "
                    "keeps autograd's check on the tensors it moves to the host)")
            self.in_bytes += host.numel() * host.element_size()
            back = host.to(device, non_blocking=device.type == "cuda")
            if layout is None:
                return back
            return back.as_strided(*layout)

        return pack, unpack
