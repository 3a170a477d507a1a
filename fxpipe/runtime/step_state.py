"""The executor's records of a step: what its actions hand each other (:class:`StepState`), the
action list it runs (:class:`ActionList`), the events and bytes it reports (:data:`Event`,
:class:`BytesSent`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from fxpipe.runtime import p2p
from fxpipe.schedule.actions import Action, Op
from fxpipe.schedule.timeline import TimelineEvent, action_label

#: one wall-clock event per executed action: ``TimelineEvent(global rank, action_label(action),
#: start_s, end_s, "compute")`` (a tuple, the format of :mod:`fxpipe.schedule.timeline` and the
#: simulator); seconds since the epoch (monotonic within a process), comparable across the ranks
#: of one host. Receives are blocking, so a RECV event spans the wait for the peer.
Event = TimelineEvent


@dataclass
class BytesSent:
    """Bytes one rank sent: ``messages`` (activations and their gradients to the stages of other
    pipeline ranks, point to point) and ``gradients`` (its data-parallel all-reduces, counted as
    the ring algorithms send them: ``2 (n-1)/n x`` the payload of an all-reduce over ``n``
    ranks, ``(n-1) x`` that of an all-gather). The loss and inf/NaN-flag all-reduces (a few
    bytes) are not counted."""

    messages: int = 0
    gradients: int = 0

    @property
    def total(self) -> int:
        """``messages + gradients``."""
        return self.messages + self.gradients


@dataclass
class StepState:
    """What one step's actions hand each other across stages and ranks."""

    chunks: dict[str, tuple[torch.Tensor, ...]]
    target: tuple[torch.Tensor, ...] | None
    inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    send_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[p2p.Pending, str]] = field(default_factory=list)
    #: forward sends by (stage, consumer stage, micro-batch), finished when the consumer's
    #: gradient for them arrives (a subset of ``sends``)
    sent_f: dict[tuple[int, int, int], list] = field(default_factory=dict)  # weak refs
    loss_sum: torch.Tensor | None = None
    weights: list[float] | None = None  # per micro-batch; None: 1/m each
    stepped: bool = False
    posted: dict[int, list[tuple[str, p2p.Pending]]] = field(default_factory=dict)  # by index
    index: int = -1  # index of the action being run
    message_bytes: int = 0  # sent to other ranks this step


class ActionList(NamedTuple):
    """An action list to run, with the positions of its cross-rank receives (posted ahead), its
    events' labels and, for the stages it gives no ``ALLREDUCE``, the position after which their
    reduction starts (their last backward)."""

    acts: list[Action]
    recvs: list[int]
    labels: list[str]
    reduce_after: dict[int, int]

    @classmethod
    def of(cls, acts: list[Action], same_rank: Callable[[int, int], bool], split: bool,
           reduce: bool = False) -> "ActionList":
        """``acts`` ready to run (``same_rank(s, t)``: stages on one rank exchange nothing);
        ``reduce``: a stage without ``ALLREDUCE`` starts its reduction after its last ``B``
        (``W`` when ``split``)."""
        recvs = [k for k, a in enumerate(acts)
                 if a.op in (Op.RECV_F, Op.RECV_B) and not same_rank(a.stage, a.peer)]
        has_ar = {a.stage for a in acts if a.op is Op.ALLREDUCE}
        last_bwd = Op.W if split else Op.B
        after = {a.stage: idx for idx, a in enumerate(acts)
                 if reduce and a.op is last_bwd and a.stage not in has_ar}
        return cls(list(acts), recvs, [action_label(a) for a in acts], after)
