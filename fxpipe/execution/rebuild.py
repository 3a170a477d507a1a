"""A GraphModule around a new graph that keeps its root's ``state_dict()`` rule.

``torch.fx.GraphModule(root, graph)`` copies every tensor the graph reads from ``root`` and
registers each buffer as a *persistent* one, whatever it was in ``root``: a rotary
embedding's ``inv_freq`` or Gemma's ``embed_scale`` (``register_buffer(..., persistent=False)``
in the model) would then show up in the new module's ``state_dict()`` and in every checkpoint
saved from it, keys the plain model does not have. :func:`rebuilt` builds the module the same
way and marks the buffers that were non-persistent in ``root`` as non-persistent again.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn


def non_persistent(module: nn.Module) -> set[str]:
    """Dotted paths of ``module``'s non-persistent buffers (every path a shared submodule is
    reached by)."""
    out: set[str] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for leaf in getattr(sub, "_non_persistent_buffers_set", ()):
            out.add(f"{prefix}.{leaf}" if prefix else leaf)
    return out


def mark_non_persistent(module: nn.Module, paths: set[str]) -> None:
    """Mark the buffers of ``module`` at ``paths`` non-persistent (paths it has no buffer at
    are skipped)."""
    for path in paths:
        owner_path, _, leaf = path.rpartition(".")
        try:
            owner = module.get_submodule(owner_path) if owner_path else module
        except AttributeError:
            continue
        if leaf in owner._buffers:
            owner._non_persistent_buffers_set.add(leaf)


def rebuilt(root: nn.Module, graph: fx.Graph, class_name: str = "GraphModule"
            ) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose buffers are persistent exactly where
    they are in ``root`` (the same tensor objects; nothing is copied)."""
    out = fx.GraphModule(root, graph, class_name=class_name)
    mark_non_persistent(out, non_persistent(root))
    return out
