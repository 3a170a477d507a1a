"""The schedule IR: per-rank lists of actions, with a text form and its parser.

One representation serves three consumers: the simulator (:mod:`fxpipe.schedule.simulate`)
prices it, the executor (:mod:`fxpipe.runtime.executor`) runs it over torch.distributed, and the
timeline writer dumps both as Chrome trace JSON. Modelled on torch.distributed.pipelining's
``_Action`` lists. Text form (:meth:`Action.__str__`, read back by :func:`parse_action`):
``0F3`` = stage 0, forward, micro-batch 3; ``1SEND_F3@2`` = stage 1 sends micro-batch 3's values
to stage 2; ``0ALLREDUCE`` / ``0STEP`` for the per-step actions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from fxpipe.errors import ScheduleError


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


_ACTION_TEXT = re.compile(r"^(-?\d+)(SEND_F|RECV_F|SEND_B|RECV_B|ALLREDUCE|STEP|F|B|W)(\d+)?(?:@(\d+))?$")


def parse_action(text: str) -> Action:
    """Read one action from its text form (the inverse of ``str(action)``): ``"0F3"``,
    ``"1RECV_B2@2"``, ``"0ALLREDUCE"``.

    Raises:
        ScheduleError: the text is not an action (the message shows the accepted forms).
    """
    mo = _ACTION_TEXT.match(text.strip())
    forms = "e.g. '0F3', '1B0', '2W1', '0SEND_F3@1', '1RECV_B0@2', '0ALLREDUCE', '0STEP'"
    if mo is None:
        raise ScheduleError(f"{text!r} is not an action; write STAGE OP [MICROBATCH] [@PEER], "
                            f"{forms}")
    stage, op, mb, peer = int(mo[1]), Op(mo[2]), mo[3], mo[4]
    needs_mb, needs_peer = op in COMPUTE_OPS or op in COMM_OPS, op in COMM_OPS
    if needs_mb != (mb is not None) or needs_peer != (peer is not None):
        raise ScheduleError(f"{text!r}: {op.value} takes "
                            + ("a micro-batch and @peer" if needs_peer else
                               "a micro-batch" if needs_mb else "neither micro-batch nor peer")
                            + f"; {forms}")
    return Action(op, stage, int(mb) if mb is not None else -1, int(peer) if peer is not None else -1)


def parse_actions(text: str) -> list[Action]:
    """Read a whitespace-separated action list, e.g. ``"0F0 0F1 0B0 0B1"`` (a ``rank r:``
    prefix, as :meth:`Schedule.format` writes it, is allowed)."""
    if ":" in text:
        text = text.split(":", 1)[1]
    return [parse_action(tok) for tok in text.split()]


@dataclass
class Schedule:
    """A complete pipeline schedule for one training step of one pipeline group.

    Attributes:
        name: schedule name (one of :data:`fxpipe.specs.schema.SCHEDULES`).
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
