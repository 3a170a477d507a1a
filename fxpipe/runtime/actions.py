"""The schedule IR: per-rank lists of actions.

One representation serves three consumers: the simulator (``simulate.py``) prices it, the
executor (``execute.py``) runs it over torch.distributed, and the timeline writer dumps both as
Chrome trace JSON. Modelled on torch.distributed.pipelining's ``_Action`` lists
(``0F3`` = stage 0, forward, micro-batch 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    """Kinds of action.

    F: forward of one micro-batch on one stage.
    B: backward of one micro-batch. Full backward (input and weight gradients) unless the
       schedule splits the backward (``Schedule.split_backward``), then input gradients only.
    W: weight gradients of one micro-batch (zero-bubble schedules only).
    SEND_F / RECV_F: send / receive the forward values between ``stage`` and ``peer``.
    SEND_B / RECV_B: send / receive the gradients of those values (backward direction).
    ALLREDUCE: start the data-parallel gradient all-reduce of ``stage`` (asynchronous; also
       sums gradients of parameters shared with other stages).
    STEP: wait for this rank's all-reduces, then the optimizer step.
    """

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"


COMPUTE_OPS = (Op.F, Op.B, Op.W)
COMM_OPS = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)


@dataclass(frozen=True)
class Action:
    """One action on one rank.

    Attributes:
        op: the kind of action.
        stage: the (virtual) stage this action belongs to (on this rank).
        microbatch: micro-batch index, or -1 for per-step actions (ALLREDUCE, STEP).
        peer: for SEND/RECV, the other stage; -1 otherwise.
    """

    op: Op
    stage: int
    microbatch: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.op in COMPUTE_OPS:
            return f"{self.stage}{self.op.value}{self.microbatch}"
        if self.op in COMM_OPS:
            return f"{self.stage}{self.op.value}{self.microbatch}@{self.peer}"
        return f"{self.stage}{self.op.value}"


@dataclass
class Schedule:
    """A complete pipeline schedule for one training step of one pipeline group.

    Attributes:
        name: schedule name (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``zb-v``).
        num_ranks: ranks in the pipeline group (``p``).
        num_stages: (virtual) stages (``p * v``).
        microbatches: micro-batches per step (``m``).
        stage_to_rank: rank (pipeline index) that holds each stage.
        actions: per pipeline rank, the actions in execution order.
        split_backward: True when backward is split into B (input grads) and W (weight grads).
    """

    name: str
    num_ranks: int
    num_stages: int
    microbatches: int
    stage_to_rank: list[int]
    actions: list[list[Action]] = field(default_factory=list)
    split_backward: bool = False

    def stages_of_rank(self, rank: int) -> list[int]:
        """Stages held by pipeline rank ``rank``, ascending (a new list; empty for a rank that
        holds none).

        The rank -> stages map is built once, in O(num_stages), and cached outside the dataclass
        fields (``dataclasses.asdict``, ``==`` and ``repr`` do not see it), so calling this for
        every rank costs O(num_stages + num_ranks) in all, not O(num_stages x num_ranks). The
        cache is rebuilt when ``stage_to_rank`` is replaced by another list (treat the list as
        immutable: assign a new one rather than editing it in place).
        """
        s2r = self.stage_to_rank
        cached = self.__dict__.get("_stages_by_rank")
        if cached is None or cached[0] is not s2r or cached[1] != len(s2r):
            by_rank: dict[int, list[int]] = {}
            for s, r in enumerate(s2r):
                by_rank.setdefault(r, []).append(s)
            cached = (s2r, len(s2r), by_rank)
            self.__dict__["_stages_by_rank"] = cached
        return list(cached[2].get(rank, ()))

    def format(self) -> str:
        """One line per rank, actions in the compact ``0F3`` form."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)
        )
