"""Gradient reducers: what a rank does with its stages' gradients at the end of a step, behind
the one interface the executor calls (:class:`GradReducer`).

Per step the executor (:mod:`fxpipe.runtime.executor`) tells its reducer

1. ``stage_done(stage)`` when a local stage ran its last backward (the ``ALLREDUCE`` action):
   the reduction of every parameter whose local users are all done starts now, overlapping the
   rank's other stages;
2. ``finish(timeout_s)``: launch what is left, wait for all of it;
3. ``pending()``: the step's reduced gradients that are not in ``.grad`` (yet), for the fp16
   loss scaler's inf/NaN check;
4. ``commit(applied)``: keep the step's gradients, or (``applied=False``: an fp16 step skipped
   for an inf/NaN) drop them, rolling back a compression's error memory;
5. ``take_bytes()``: the bytes sent since the last call (counted as the ring algorithms send);
6. ``reset()``: a new step.

and ``ensure_gathered(timeout_s)`` before a step or an evaluation needs whole parameters.

Implementations, over disjoint parameters:

* :class:`~fxpipe.runtime.data_parallel.GradSynchronizer`: data-parallel all-reduce (exact or
  compressed, :mod:`fxpipe.runtime.compression`), tied parameters summed over every rank
  holding them (the mesh's replica groups);
* :class:`~fxpipe.runtime.data_sharding.DataSharding`: sharded data parallelism, a
  reduce-scatter into this replica's slice (its optimizer all-gathers the parameters);
* :class:`NoGradSync`: nothing leaves the rank (``train.updates: async``: the parameter
  servers sum the replicas' gradients; the executor passes no stand-in mesh);
* :class:`CompositeReducer`: several of them, called in order (sharded data parallelism leaves
  the tied parameters whole and all-reduces them).

:func:`make_grad_reducer` picks one from the executor's settings; :func:`shared_param_map`
finds the tied parameters of the rank's stages (the mesh creates their groups).
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence, runtime_checkable

import torch
import torch.nn as nn

from fxpipe.errors import RuntimeFailure
from fxpipe.runtime.compression import Compression, as_compression
from fxpipe.runtime.data_parallel import GradSynchronizer
from fxpipe.runtime.data_sharding import WIRE_DTYPES, DataSharding

#: parameter object id -> (pipeline ranks holding it, canonical FQN), for tied parameters
SharedParams = dict[int, tuple[tuple[int, ...], str]]


@runtime_checkable
class GradReducer(Protocol):
    """What the executor asks of a gradient reducer, in this order each step (module doc)."""

    def stage_done(self, stage: int) -> None:
        """``stage`` ran its last backward this step: start the reductions that are ready."""

    def finish(self, timeout_s: float) -> None:
        """Launch whatever is left and wait for every reduction of the step.

        Raises:
            RuntimeFailure: a collective timed out or failed (the message names the peers).
        """

    def pending(self) -> list[torch.Tensor]:
        """This step's reduced gradients that are not in ``.grad`` (after :meth:`finish`)."""

    def commit(self, applied: bool = True) -> None:
        """The step's gradients are kept (``applied``) or dropped (an fp16 skipped step)."""

    def take_bytes(self) -> int:
        """Bytes sent since the last call (gradient reductions, parameter gathers)."""

    def reset(self) -> None:
        """Start a new step."""

    def ensure_gathered(self, timeout_s: float) -> None:
        """Make the whole parameters present (sharding ``full`` frees them between steps)."""


class NoGradSync:
    """The reducer of a rank whose gradients stay in ``.grad`` unreduced (asynchronous
    updates: :mod:`fxpipe.runtime.parameter_server` pushes them): every call does nothing and
    nothing is sent."""

    def stage_done(self, stage: int) -> None:
        pass

    def finish(self, timeout_s: float) -> None:
        pass

    def pending(self) -> list[torch.Tensor]:
        return []

    def commit(self, applied: bool = True) -> None:
        pass

    def take_bytes(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def ensure_gathered(self, timeout_s: float) -> None:
        pass


class CompositeReducer:
    """Several reducers over disjoint parameters, each call passed to every part in order
    (the same order on every rank, so their collectives match up)."""

    def __init__(self, parts: Sequence[GradReducer]):
        self.parts = list(parts)

    def stage_done(self, stage: int) -> None:
        for r in self.parts:
            r.stage_done(stage)

    def finish(self, timeout_s: float) -> None:
        for r in self.parts:
            r.finish(timeout_s)

    def pending(self) -> list[torch.Tensor]:
        return [t for r in self.parts for t in r.pending()]

    def commit(self, applied: bool = True) -> None:
        for r in self.parts:
            r.commit(applied)

    def take_bytes(self) -> int:
        return sum(r.take_bytes() for r in self.parts)

    def reset(self) -> None:
        for r in self.parts:
            r.reset()

    def ensure_gathered(self, timeout_s: float) -> None:
        for r in self.parts:
            r.ensure_gathered(timeout_s)


def leaves(reducer: GradReducer) -> Iterator[GradReducer]:
    """The reducers ``reducer`` is made of (itself unless it is a composite)."""
    if isinstance(reducer, CompositeReducer):
        for r in reducer.parts:
            yield from leaves(r)
    else:
        yield reducer


def sharding_of(reducer: GradReducer) -> DataSharding | None:
    """The :class:`DataSharding` among ``reducer``'s parts (its optimizer and checkpoints speak
    to it), or None."""
    return next((r for r in leaves(reducer) if isinstance(r, DataSharding)), None)


def make_grad_reducer(stage_params: dict[int, list[nn.Parameter]], shared: SharedParams, mesh,
                      compression: "str | Compression" = "none", data_sharding: str = "none",
                      sync_gradients: bool = True,
                      groups: dict[int, tuple[int, str]] | None = None) -> GradReducer:
    """The reducer of this rank's stages.

    Args:
        stage_params: local stage -> its trained parameters.
        shared: the tied parameters (:func:`shared_param_map`), summed over their holders.
        mesh: the rank's :class:`~fxpipe.runtime.mesh.Mesh` (its groups).
        compression: the all-reduce's compression (``train.grad_compression``).
        data_sharding: ``none`` or a level of :mod:`fxpipe.runtime.data_sharding`
            (``parallel.data_sharding``); shards only with more than one replica.
        sync_gradients: False: :class:`NoGradSync` (``train.updates: async``).
        groups: per-block parameter gathering: parameter id -> (place, name) of its group
            (:class:`~fxpipe.runtime.data_sharding.DataSharding`).

    Raises:
        RuntimeFailure: sharding with a compression a reduce-scatter cannot send.
    """
    if not sync_gradients:
        return NoGradSync()
    compression = as_compression(compression)
    if data_sharding == "none" or mesh.dp <= 1:
        return GradSynchronizer(stage_params, shared, mesh, compression)
    if compression.method not in WIRE_DTYPES:
        raise RuntimeFailure(f"sharded data parallelism reduce-scatters its gradients: "
                             f"gradient compression {compression.method!r} does not "
                             f"fit it (use one of {sorted(WIRE_DTYPES)})")
    # tied parameters stay whole (summed over their holders), and so do experts (they differ
    # between replicas: reduced over those holding the same experts, by the GradSynchronizer)
    whole_ids = set(shared) | {id(p) for ps in stage_params.values() for p in ps
                               if getattr(p, "fxpipe_expert", False)}
    sharded = DataSharding(data_sharding, stage_params, whole_ids, mesh.dp_group, mesh.dp,
                           mesh.dp_rank, WIRE_DTYPES[compression.method], groups)
    whole = {s: [p for p in ps if not sharded.owns(p)] for s, ps in stage_params.items()}
    return CompositeReducer([GradSynchronizer(whole, shared, mesh, compression), sharded])


def shared_param_map(plan, modules: dict[int, nn.Module], stage_to_rank: Sequence[int],
                     mesh) -> SharedParams:
    """Parameter object id -> (pipeline ranks holding it, canonical FQN), for the parameters
    ``plan.shared_params`` lists, in this rank's stage ``modules``.

    Calls ``mesh.replica_group`` for every shared parameter's rank set on every rank (in sorted
    order) so that the collective group creation matches across ranks.

    Raises:
        RuntimeFailure: a stage's module lacks a parameter the plan lists for it, or a parameter
            is shared inconsistently.
    """
    aliases = plan.param_aliases
    out: SharedParams = {}
    for fqn in sorted(plan.shared_params):
        stages = plan.shared_params[fqn]
        key = tuple(sorted({stage_to_rank[s] for s in stages}))
        mesh.replica_group(key)  # collective: all ranks, same order
        for s in stages:
            if s not in modules:
                continue
            found = None
            for name, p in modules[s].named_parameters(remove_duplicate=False):
                if aliases.get(name, name) == fqn or name == fqn:
                    found = p
                    break
            if found is None:
                raise RuntimeFailure(
                    f"plan.shared_params lists {fqn!r} for stage {s}, but stage {s}'s module "
                    "has no parameter of that name (or an alias of it); build the stage "
                    "modules with the original parameter names")
            if id(found) in out and out[id(found)][0] != key:
                raise RuntimeFailure(f"parameter {fqn!r} is shared inconsistently in the plan")
            out[id(found)] = (key, fqn)
    return out
