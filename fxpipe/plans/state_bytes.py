"""The bytes of training state a rank holds, predicted from its plan, at every
``parallel.data_sharding`` level (:mod:`fxpipe.runtime.data_sharding` holds them; the tests
measure the storages and compare).

A rank holding pipeline stages ``S`` keeps, per stage, the parameters no other stage shares
(``P`` elements of ``e`` bytes at the tensor rank's local shapes) and, once, the shared ones
(``W_sh`` bytes, a tied embedding: all-reduced whole, never sharded). Sharded over ``n``
replicas, replica ``d`` owns ``slice = ceil(P / n)`` elements of the stage's flat bucket
(``owned = min(slice, P - d * slice)`` of them real, the rest padding) and holds:

==========  =====================  ===============================  ===========================
level       parameters             gradients                        optimizer state
==========  =====================  ===============================  ===========================
none        whole                  whole                            ``k`` x whole
optimizer   whole                  whole + 4 x slice                ``k`` x (``W_sh`` + owned)
gradients   whole                  ``W_sh`` + 4 x slice             ``k`` x (``W_sh`` + owned)
full        ``W_sh`` + master      ``W_sh`` + 4 x slice             ``k`` x (``W_sh`` + owned)
==========  =====================  ===============================  ===========================

after an optimizer step (``master``: the separate slice ``full`` keeps, ``slice x e`` bytes;
the other levels step the parameters' own elements). ``k``: the optimizer's state tensors per
parameter (AdamW 2, SGD with momentum 1, plain SGD 0); a per-parameter scalar such as AdamW's
``step`` is not counted. During a step (:func:`held_state_bytes` with ``peak=True``) every
level holds the whole parameters and gradients besides its slices: the most a step holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fxpipe.tensor.placement import Placement, local_shape

if TYPE_CHECKING:
    from fxpipe.plans.plan import Plan

#: state tensors of a parameter's shape per ``train.optimizer`` (``sgd`` has no momentum here)
OPTIMIZER_FIELDS = {"adamw": 2, "sgd": 0}


def _local_numel(plan: "Plan", fqn: str) -> int:
    shape = plan.param_shapes[fqn]
    canon = plan.param_aliases.get(fqn, fqn)
    if plan.tensor > 1 and canon in plan.tensor_params:
        shape = local_shape(shape, Placement.from_json(plan.tensor_params[canon]), plan.tensor)
    return math.prod(shape)


def _stage_params(plan: "Plan", s: int) -> tuple[dict[str, int], int]:
    """Stage ``s``'s parameters by canonical FQN -> local elements, and bytes per element."""
    canon = plan.param_aliases
    numel: dict[str, int] = {}
    for f in plan.stages[s].params:
        c = canon.get(f, f)
        shape_of = f if f in plan.param_shapes else c
        if c not in numel and shape_of in plan.param_shapes:
            numel[c] = _local_numel(plan, shape_of)
    return numel, plan.param_itemsize


def _sharded(plan: "Plan", stages: list[int]) -> list[tuple[int, int]]:
    """Per stage of ``stages`` that shards anything: ``(elements sharded, bytes per element)``."""
    out = []
    for s in sorted(stages):
        numel, e = _stage_params(plan, s)
        p = sum(k for f, k in numel.items() if f not in plan.shared_params)
        if p:
            out.append((p, e))
    return out


def sharded_bytes_sent(plan: "Plan", stages: list[int], wire_bytes: int = 4) -> dict[str, int]:
    """Bytes the rank holding ``stages`` sends per step in the reduce-scatters of its sharded
    gradients (``wire_bytes`` per element: 2 under ``fp16`` / ``bf16`` compression) and the
    all-gathers of its parameters, ring algorithms over ``plan.replicas`` replicas (what
    :class:`~fxpipe.runtime.data_sharding.ShardedBucket` counts); 0 without sharding."""
    n = plan.replicas
    if plan.data_sharding == "none" or n <= 1:
        return {"reduce_scatter": 0, "all_gather": 0}
    rs = ag = 0
    for p, e in _sharded(plan, stages):
        sl = -(-p // n)
        rs += round((n - 1) / n * sl * n * wire_bytes)
        ag += (n - 1) * sl * e
    return {"reduce_scatter": rs, "all_gather": ag}


def held_state_bytes(plan: "Plan", stages: list[int], replica: int, fields: int,
                     peak: bool = False) -> dict[str, int]:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state the rank holding ``stages`` (of
    data-parallel replica ``replica``) keeps after an optimizer step, or at its most during a
    step (``peak``), under ``plan.data_sharding`` (see the module doc).

    Needs ``plan.param_shapes`` (every plan keeps them).

    Raises:
        ValueError: the plan has no parameter shapes.
    """
    if not plan.param_shapes:
        raise ValueError("the plan keeps no parameter shapes (a plan from an older fxpipe): "
                         "plan again")
    level, n = plan.data_sharding, plan.replicas
    whole = whole_sh = 0
    seen: set[str] = set()
    for s in sorted(stages):
        numel, e = _stage_params(plan, s)
        for f, k in numel.items():
            if f not in seen:
                seen.add(f)
                whole += k * e
                whole_sh += k * e if f in plan.shared_params else 0
    slices = owned = master = 0
    for p, e in _sharded(plan, stages):
        sl = -(-p // n)
        slices += sl * 4
        owned += max(0, min(sl, p - replica * sl)) * e
        master += sl * e if level == "full" else 0
    if level == "none" or n <= 1:
        return {"params": whole, "grads": whole, "optimizer": fields * whole}
    state = fields * (whole_sh + owned)
    if peak:
        return {"params": whole + master, "grads": whole + slices, "optimizer": state}
    params = whole_sh + master if level == "full" else whole
    grads = (whole if level == "optimizer" else whole_sh) + slices
    return {"params": params, "grads": grads, "optimizer": state}
