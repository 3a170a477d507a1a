"""What crosses between this rank's stages and the other pipeline ranks' (for the executor's
``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B`` actions): the values on the stage edges
forward, their gradients backward.

One point-to-point message per value (:mod:`fxpipe.runtime.p2p`, each wait bounded by the
timeout), addressed to the peer stage's global rank in this replica at this tensor rank and
tagged per (value, consumer stage, micro-batch, direction). Under ``bf16`` / ``fp16`` an fp32
value and its gradient travel in the 16-bit dtype (:func:`~fxpipe.runtime.precision.
message_dtype`: half the bytes) and are cast back to the plan dtype on arrival; a value handed
over in memory between two stages of one rank is rounded the same way (:meth:`Transfers.
handover`), so the numbers do not depend on the placement.
"""

from __future__ import annotations

import torch

from fxpipe.execution.dtypes import message_dtype
from fxpipe.plans.plan import Plan
from fxpipe.runtime import p2p
from fxpipe.schedule.actions import Action, Op


class Transfers:
    """Messages of this rank's stage edges.

    Args:
        plan: the Plan (``values``: per-micro-batch shapes and dtypes).
        edges: ``plan.stage_edges()``: (producer, consumer) -> the values on that edge.
        stage_to_rank: the schedule's stage -> pipeline rank.
        mesh: the rank's mesh (its device, global ranks of the peers).
        precision: ``train.precision`` (the dtype values travel in).
        timeout_s: seconds a send or receive may wait.

    Attributes:
        dtypes: value -> its plan dtype. wire: value -> the dtype it (and its gradient)
            travels in.
    """

    def __init__(self, plan: Plan, edges: dict[tuple[int, int], list[str]],
                 stage_to_rank: list[int], mesh, precision: str, timeout_s: float):
        self.plan, self.edges, self.mesh, self.timeout_s = plan, edges, mesh, timeout_s
        self._stage_rank = list(stage_to_rank)
        self._value_index = {name: i for i, name in enumerate(sorted(plan.values))}
        self.dtypes = {name: getattr(torch, v.dtype) for name, v in plan.values.items()}
        self.wire = {name: message_dtype(d, precision) for name, d in self.dtypes.items()}

    def same_rank(self, s: int, t: int) -> bool:
        """Stages ``s`` and ``t`` are on one pipeline rank (values handed over in memory)."""
        return self._stage_rank[s] == self._stage_rank[t]

    def peer_rank(self, stage: int) -> int:
        """Global rank of the rank holding ``stage`` in this replica, at this tensor rank."""
        return self.mesh.global_rank(self._stage_rank[stage])

    def tag(self, name: str, consumer: int, i: int, backward: bool) -> int:
        return p2p.tag_for(self._value_index[name], consumer, i, backward, self.plan.num_stages,
                           self.plan.microbatches)

    def grad_names(self, s: int, t: int) -> list[str]:
        """The values on edge ``(s, t)`` that carry a gradient back."""
        return [n for n in self.edges[(s, t)] if self.plan.values[n].requires_grad]

    def to_wire(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (value ``name`` or its gradient) in the dtype it travels in."""
        want = self.wire[name]
        return t if t.dtype == want else t.to(want)

    def from_wire(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A received ``t`` back in value ``name``'s plan dtype."""
        want = self.dtypes[name]
        return t if t.dtype == want else t.to(want)

    def handover(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` handed to a stage of this rank, rounded as if it had travelled."""
        return self.from_wire(name, self.to_wire(name, t))

    def send(self, items: list[tuple[str, torch.Tensor]], s: int, t: int, i: int,
             backward: bool, ctx: str) -> tuple[list[tuple[p2p.Pending, str]], int]:
        """Start sending ``items`` (value name, tensor) of edge ``(s, t)``, micro-batch ``i``:
        values to ``t``, or (``backward``) their gradients to ``s``. Returns the pending sends
        (with ``ctx``) and the bytes sent."""
        dst = self.peer_rank(s if backward else t)
        pending, nbytes = [], 0
        for name, tensor in items:
            msg = self.to_wire(name, tensor)
            what = (f"send of the gradient of {name!r} to stage {s}" if backward
                    else f"send of {name!r} to stage {t}")
            pending.append((p2p.isend(msg, dst, self.tag(name, t, i, backward), what, ctx,
                                      self.timeout_s), ctx))
            nbytes += msg.numel() * msg.element_size()
        return pending, nbytes

    def post_recv(self, a: Action, ctx: str) -> list[tuple[str, p2p.Pending]]:
        """Post the receives of a cross-rank ``RECV_F`` (values from ``a.peer``) or ``RECV_B``
        (their gradients from ``a.peer``) action."""
        backward = a.op is not Op.RECV_F
        s, t = (a.stage, a.peer) if backward else (a.peer, a.stage)
        src = self.peer_rank(a.peer)
        names = self.grad_names(s, t) if backward else self.edges[(s, t)]
        return [(n, p2p.irecv(self.plan.values[n].shape, self.wire[n], self.mesh.device, src,
                              self.tag(n, t, a.microbatch, backward),
                              (f"receive of the gradient of {n!r} from stage {t}" if backward
                               else f"receive of {n!r} from stage {s}"), ctx, self.timeout_s))
                for n in names]

    def wait(self, pending: list[tuple[str, p2p.Pending]],
             ctx: str) -> list[tuple[str, torch.Tensor]]:
        """Wait for posted receives: (value name, tensor in its plan dtype) of each."""
        return [(n, self.from_wire(n, p2p.wait(pd, ctx, self.timeout_s))) for n, pd in pending]
