"""How one tensor lies on a tensor-parallel group of ``t`` ranks.

* ``R`` (replicated): every rank holds the whole tensor, the same values; its gradient is whole
  and the same on every rank too (the invariant the rewrite keeps).
* ``S(dim)`` (sharded): rank ``r`` holds the ``r``-th of ``t`` equal contiguous slices along
  ``dim``. ``S(dim, blocks=k)``: the dimension is ``k`` equal blocks (a fused q/k/v projection's
  output, ``[q | k | v]``) and rank ``r`` holds the ``r``-th slice of each block, in block order,
  so that splitting the local tensor into ``k`` gives each block's shard.

A partial sum (each rank holding an addend) only ever lives inside one rewritten op (a
row-parallel linear, a vocabulary-parallel embedding), which reduces it before anyone reads it.
Plain data: :meth:`Placement.to_json` / :meth:`Placement.from_json` for the Plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """``kind`` ``"R"`` or ``"S"``; for ``"S"`` the (non-negative) ``dim`` and ``blocks``."""

    kind: str = "R"
    dim: int = 0
    blocks: int = 1

    @property
    def sharded(self) -> bool:
        return self.kind == "S"

    def __str__(self) -> str:
        if not self.sharded:
            return "R"
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim}, blocks={self.blocks})"

    def to_json(self) -> str:
        """``"R"``, ``"S(1)"`` or ``"S(0,3)"`` (dim, blocks)."""
        if not self.sharded:
            return "R"
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},{self.blocks})"

    @staticmethod
    def from_json(text: str) -> "Placement":
        if text == "R":
            return REPLICATE
        inner = text[2:-1].split(",")
        return Placement("S", int(inner[0]), int(inner[1]) if len(inner) > 1 else 1)

    def local_size(self, size: int, t: int) -> int:
        """The length of the sharded dimension on one rank (``size // t``)."""
        return size // t


REPLICATE = Placement("R")


def shard(dim: int, blocks: int = 1) -> Placement:
    """``S(dim)``, or ``S(dim, blocks)``."""
    return Placement("S", int(dim), int(blocks))


def local_shape(shape, p: Placement, t: int) -> list[int]:
    """The shape one rank holds of a tensor of ``shape`` placed ``p``."""
    out = [int(s) for s in shape]
    if p.sharded:
        out[p.dim] //= t
    return out
