"""The blocks of a model as the memory levers see them: its repeated layers, by module path.

A *block* is a child of a module list (``nn.ModuleList`` / ``nn.Sequential`` / any container
whose children are named by index): the path up to and including the first all-digit
component of a parameter's (or a node's module) path, ``transformer.h.3`` for
``transformer.h.3.attn.c_attn.weight``, ``model.layers.10`` for
``model.layers.10.mlp.up_proj.weight`` (an expert list inside a layer stays in its layer). What
lies outside every such list (an embedding, a final norm, a head) is grouped by its own module
(``lm_head.weight`` -> ``lm_head``) and is not a block.

Read by the planner and the runtime alike (they meet in the Plan): per-block parameter
gathering (``parallel.param_gather: block``) gathers one group at a time, partial
recomputation (``train.recompute_layers``) recomputes a stage's first N blocks.
"""

from __future__ import annotations

__all__ = ["block_of", "group_of", "param_groups", "has_blocks"]


def block_of(path: str) -> str | None:
    """The block a parameter or module path lies in (through its first all-digit component),
    or None outside every module list."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


def group_of(param: str) -> str:
    """The gathering group of parameter ``param`` (an FQN): its block, else its module (the
    FQN without the tensor's own name; ``""`` for a parameter of the root module)."""
    b = block_of(param)
    return b if b is not None else param.rpartition(".")[0]


def param_groups(params: list[str]) -> list[tuple[str, list[str]]]:
    """``params`` (FQNs, in the order the stage first uses them) grouped by :func:`group_of`,
    groups in order of their first parameter."""
    out: dict[str, list[str]] = {}
    for p in params:
        out.setdefault(group_of(p), []).append(p)
    return list(out.items())


def has_blocks(paths: list[str]) -> bool:
    """Whether any of ``paths`` lies in a block (the model has repeated layers there)."""
    return any(block_of(p) is not None for p in paths)
