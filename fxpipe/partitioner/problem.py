"""The cut problem: units in a fixed order, the values between them, and the one cost function.

A :class:`CutProblem` is what the planner partitions: ``n`` units (graph nodes or blocks of
nodes) in a fixed topological order, positions ``0 .. n-1``, cut into ``num_stages`` contiguous,
non-empty pipeline stages ``[s_0=0, s_1), [s_1, s_2), ..., [s_{k-1}, n)``. This is the
chains-on-chains partitioning problem (Pinar & Aykanat, "Fast optimal load balancing algorithms
for 1D partitioning", JPDC 2004) extended with communication and memory terms.

Cost of stage ``j`` covering ``[a, b)`` (seconds per micro-batch, forward + backward)::

    compute(a, b) = sum(compute_s[a:b])
    comm_j(a, b)  = sum over DISTINCT values received (producer < a, some user in [a, b))
                        w * (nbytes / bw_in(j) + latency_s)
                  + sum over DISTINCT values sent (producer in [a, b), some user >= b)
                        w * (nbytes / bw_out(j) + latency_s)
    cost_j(a, b)  = compute(a, b) + comm_j(a, b)

where ``w = 2`` for a value with ``grad=True`` (its gradient travels back in the backward pass)
and ``w = 1`` otherwise. A value is sent once however many later stages read it, and received
once per stage however many of the stage's units read it. Model inputs (producer ``-1``) are
loaded from data by every stage that reads them and cost nothing.

Links. ``bw_in(j)`` is the bandwidth of the boundary between stages ``j-1`` and ``j``,
``bw_out(j)`` that of the boundary between ``j`` and ``j+1``: every stage pays for the traffic on
its own two links. A skip value from stage ``s`` to stage ``t > s+1`` is therefore priced on
``s -> s+1`` at the sender and ``t-1 -> t`` at the receiver. This keeps ``cost_j`` a function of
``(a, b, j)`` only, which is what makes the dynamic program exact; a true per-pair link cost
would make a stage's cost depend on where earlier and later cuts fall.

Memory of stage ``j`` (bytes)::

    memory_j(a, b) = param_multiplier * sum(param_bytes[a:b]) + inflight[j] * sum(saved_bytes[a:b])

which must not exceed ``capacity_bytes[j]``. ``param_multiplier`` 4 counts weights, gradients and
two Adam moments; ``inflight[j]`` is the number of micro-batches whose activations the schedule
keeps alive on stage ``j`` (1F1B: ``p - j``; GPipe: ``m``; see :func:`inflight_1f1b`).

:func:`evaluate` prices any cut set with this cost function. The planner's dynamic programs
(:mod:`fxpipe.partitioner.solvers`) use the same :func:`comm_seconds` and :func:`stage_memory`
formulas on the same prefix sums, so their optimum and ``evaluate`` agree up to float rounding
(memory feasibility agrees exactly).

Pure Python + numpy; no torch.

Size: over 600 lines because the one cost function and the vectorised tables the solvers read are
kept with the problem they price."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fxpipe.errors import PlanError
from fxpipe.specs.schema import OPTIMIZER_STATE_FACTOR
from fxpipe.units import human_bytes

__all__ = [
    "Value",
    "ValueTable",
    "CutProblem",
    "PartitionResult",
    "evaluate",
    "comm_seconds",
    "stage_memory",
    "inflight_1f1b",
    "inflight_gpipe",
    "node_boundary_bandwidths",
]


# ---------------------------------------------------------------------------------------------
# The shared cost formulas (scalars or numpy arrays; used by evaluate and by every solver)
# ---------------------------------------------------------------------------------------------


def comm_seconds(recv_wbytes, recv_msgs, send_wbytes, send_msgs, inv_bw_in, inv_bw_out, latency_s):
    """Communication seconds of a stage per micro-batch (scalars or broadcastable arrays).

    Args:
        recv_wbytes / send_wbytes: sum of ``w * nbytes`` over the distinct values received / sent
            (``w`` = 2 for values whose gradient travels back, else 1), bytes.
        recv_msgs / send_msgs: sum of ``w`` over the same values (messages).
        inv_bw_in / inv_bw_out: 1 / bandwidth (seconds per byte) of the stage's incoming and
            outgoing boundary link.
        latency_s: seconds per message.

    Returns:
        ``recv_wbytes * inv_bw_in + send_wbytes * inv_bw_out + latency_s * (recv_msgs + send_msgs)``.
    """
    return recv_wbytes * inv_bw_in + send_wbytes * inv_bw_out + latency_s * (recv_msgs + send_msgs)


def stage_memory(param_multiplier, param_bytes, inflight, saved_bytes):
    """Peak bytes of a stage: ``param_multiplier * param_bytes + inflight * saved_bytes``.

    Args:
        param_multiplier: copies of each parameter byte (4 = weight, gradient, two Adam moments).
        param_bytes: bytes of the stage's parameters.
        inflight: micro-batches whose activations the schedule keeps alive on the stage.
        saved_bytes: activation bytes saved for backward per micro-batch.
    """
    return param_multiplier * param_bytes + inflight * saved_bytes


def inflight_1f1b(num_stages: int, microbatches: int | None = None) -> list[int]:
    """Micro-batches in flight per stage under 1F1B (PipeDream-Flush): ``min(p - j, m)``.

    Source: Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-2BW /
    1F1B flush): stage ``j`` of ``p`` runs ``p - j`` warm-up forwards before its first backward.
    """
    m = num_stages if microbatches is None else microbatches
    return [max(1, min(num_stages - j, m)) for j in range(num_stages)]


def inflight_gpipe(num_stages: int, microbatches: int) -> list[int]:
    """Micro-batches in flight per stage under GPipe (all forwards before any backward): ``m``."""
    return [int(microbatches)] * num_stages


def node_boundary_bandwidths(
    num_stages: int, stages_per_node: int, intra_node_Bps: float, inter_node_Bps: float
) -> list[float]:
    """Per-boundary bandwidths (bytes/s, length ``num_stages - 1``) when consecutive stages are
    packed ``stages_per_node`` to a node: boundary ``j`` (between stage ``j`` and ``j+1``) uses the
    inter-node link (e.g. InfiniBand) when it crosses nodes, the intra-node link (e.g. NVLink)
    otherwise."""
    if stages_per_node < 1:
        raise PlanError(f"stages_per_node is {stages_per_node}; use a positive number of stages per node")
    return [
        inter_node_Bps if (j + 1) % stages_per_node == 0 else intra_node_Bps
        for j in range(num_stages - 1)
    ]


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    """A tensor produced by one unit and read by later units.

    Attributes:
        producer: position of the producing unit, or ``-1`` for a model input (loaded from data by
            every stage that reads it; never communicated).
        users: positions of the units that read it, each ``> producer``.
        nbytes: size per micro-batch, bytes.
        grad: True when its gradient travels back in the backward pass (floating-point values);
            the value then costs twice (forward value + backward gradient, two messages).
        name: optional label for messages.
    """

    producer: int
    users: tuple[int, ...]
    nbytes: float
    grad: bool = True
    name: str = ""


@dataclass(frozen=True, eq=False)
class ValueTable:
    """Values in array form (fast construction for large problems).

    Attributes:
        producer: int64 ``(V,)`` producer positions (``-1`` = model input).
        nbytes: float64 ``(V,)`` bytes per micro-batch.
        grad: bool ``(V,)`` gradient flag (see :class:`Value`).
        user_ptr: int64 ``(V+1,)`` CSR offsets into ``users``.
        users: int64 ``(U,)`` user positions, sorted and distinct within each value.
    """

    producer: np.ndarray
    nbytes: np.ndarray
    grad: np.ndarray
    user_ptr: np.ndarray
    users: np.ndarray

    @classmethod
    def from_values(cls, values: Sequence[Value]) -> "ValueTable":
        """Build from :class:`Value` objects (users sorted and de-duplicated)."""
        prod, nb, gr, ptr, us = [], [], [], [0], []
        for v in values:
            u = sorted(set(int(x) for x in v.users))
            prod.append(int(v.producer))
            nb.append(float(v.nbytes))
            gr.append(bool(v.grad))
            us.extend(u)
            ptr.append(len(us))
        return cls(
            np.asarray(prod, dtype=np.int64),
            np.asarray(nb, dtype=np.float64),
            np.asarray(gr, dtype=bool),
            np.asarray(ptr, dtype=np.int64),
            np.asarray(us, dtype=np.int64),
        )

    @classmethod
    def chain(cls, boundary_bytes: Sequence[float], grad: bool | Sequence[bool] = True) -> "ValueTable":
        """Values of a chain: value ``i`` is produced by unit ``i`` and read only by unit ``i+1``.

        Args:
            boundary_bytes: ``(n-1,)`` bytes crossing the boundary after each unit.
            grad: gradient flag for all values, or one per value.
        """
        b = np.asarray(boundary_bytes, dtype=np.float64).reshape(-1)
        m = b.shape[0]
        g = np.broadcast_to(np.asarray(grad, dtype=bool), (m,)).copy()
        return cls(
            np.arange(m, dtype=np.int64),
            b,
            g,
            np.arange(m + 1, dtype=np.int64),
            np.arange(1, m + 1, dtype=np.int64),
        )

    def __len__(self) -> int:
        return int(self.producer.shape[0])

    def to_values(self) -> list[Value]:
        """Inverse of :meth:`from_values` (for small problems and debugging)."""
        return [
            Value(
                int(self.producer[i]),
                tuple(int(u) for u in self.users[self.user_ptr[i] : self.user_ptr[i + 1]]),
                float(self.nbytes[i]),
                bool(self.grad[i]),
            )
            for i in range(len(self))
        ]


# ---------------------------------------------------------------------------------------------
# The problem
# ---------------------------------------------------------------------------------------------


def _per_stage(name: str, x: Any, k: int, *, allow_none: bool = False, positive: bool = False) -> np.ndarray | None:
    """Broadcast a scalar or length-``k`` sequence to a float64 ``(k,)`` array, with checks."""
    if x is None:
        if allow_none:
            return None
        raise PlanError(f"{name} is missing; give a number or one number per stage")
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(k, float(arr))
    elif arr.shape != (k,):
        raise PlanError(
            f"{name} has {arr.size} entries but there are {k} stages; give one number or one per stage"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr < 0) or (positive and np.any(arr <= 0)):
        raise PlanError(f"{name} = {arr.tolist()} must be finite and {'positive' if positive else 'non-negative'}")
    return arr


def _unit_array(name: str, x: Any, n: int | None) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if n is not None and arr.shape[0] != n:
        raise PlanError(f"{name} has {arr.shape[0]} entries but compute_s has {n}; give one per unit")
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(f"{name}[{i}] = {float(arr[i])!r}; per-unit costs must be finite and non-negative")
    return arr


@dataclass(frozen=True, eq=False)
class CutProblem:
    """A pipeline cut problem: units in a fixed topological order and what crosses between them.

    Attributes:
        compute_s: ``(n,)`` forward + backward compute seconds per micro-batch of each unit.
        param_bytes: ``(n,)`` parameter bytes held by each unit (a shared parameter counted once,
            on one unit).
        saved_bytes: ``(n,)`` activation bytes each unit saves for backward per micro-batch.
        values: the values between units (:class:`Value` list or a :class:`ValueTable`).
        num_stages: ``k``, the number of pipeline stages (each non-empty).
        bandwidth_Bps: link bandwidth in bytes/s: one number for every boundary, ``k-1`` numbers
            (boundary ``j`` joins stage ``j`` and ``j+1``; see :func:`node_boundary_bandwidths`), or
            a ``k x k`` matrix read at ``[j][j+1]``. ``math.inf`` makes communication free.
        latency_s: seconds per message (each value costs ``w`` messages, see :class:`Value`).
        capacity_bytes: device memory per stage (one number or ``k``), or None for no limit.
        param_multiplier: bytes of state per parameter byte (4 = weight + gradient + 2 Adam moments).
        inflight: micro-batches in flight per stage (one number or ``k``), e.g.
            :func:`inflight_1f1b` or :func:`inflight_gpipe`.
        forced_cuts: unit positions ``i`` after which a stage boundary MUST fall (``pipe_split()``).
        pins: ``{unit position: stage index}``: the unit must be in that stage (``annotate``).
        unit_names: optional ``(n,)`` labels used in error messages.
        slowdown: per stage (one number or ``k``), the factor its device's compute takes
            compared with ``compute_s`` (a node half as fast: 2); its compute costs
            ``slowdown[j] x sum(compute_s[a:b])``, so slower devices get less work.
        reserved: per stage, what ``capacity_bytes`` already leaves out of its device, for
            messages: ``(what, bytes)`` pairs (the device holds ``capacity_bytes`` plus their
            sum); empty: nothing said.

    Raises:
        PlanError: malformed input (wrong lengths, negative or non-finite costs, users not after
            their producer, positions out of range, bad pins or forced cuts).
    """

    compute_s: Sequence[float]
    param_bytes: Sequence[float]
    saved_bytes: Sequence[float]
    values: Sequence[Value] | ValueTable
    num_stages: int
    bandwidth_Bps: float | Sequence[float] | Sequence[Sequence[float]]
    latency_s: float = 0.0
    capacity_bytes: float | Sequence[float] | None = None
    param_multiplier: float = OPTIMIZER_STATE_FACTOR["adamw"]
    inflight: int | Sequence[int] = 1
    forced_cuts: Sequence[int] = ()
    pins: Mapping[int, int] = field(default_factory=dict)
    unit_names: Sequence[str] | None = None
    slowdown: float | Sequence[float] = 1.0
    reserved: Sequence[Sequence[tuple[str, float]]] = ()
    derived: Derived = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the derived arrays are built once, by a function, and held in one field; every field
        # of :class:`Derived` (``n``, ``T``, ``P``, ``A``, ``table``, ...) reads through
        object.__setattr__(self, "derived", derive(self))

    def reserved_at(self, j: int) -> list[tuple[str, float]]:
        """Stage ``j``'s :attr:`reserved` terms, ``(what, bytes)``, those above 0."""
        if j >= len(self.reserved):
            return []
        return [(what, float(b)) for what, b in self.reserved[j] if b > 0]

    def unit_label(self, i: int) -> str:
        """``unit 7 ('h.1.mlp')`` or ``unit 7``."""
        if self.unit_names is not None:
            return f"unit {i} ({self.unit_names[i]!r})"
        return f"unit {i}"

    @property
    def lower_bound_s(self) -> float:
        """No partition's bottleneck is below it: the total compute shared by the stages in
        proportion to their speeds (``total / num_stages`` when all are alike)."""
        return float(self.T[-1]) / float(np.sum(1.0 / self.slow))

    def boundary_comm(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a chain (see ``is_chain``): per boundary position ``x`` in ``0..n`` (between unit
        ``x-1`` and ``x``), the sums of ``w * nbytes``, ``w`` and ``nbytes`` of the values crossing
        it, each float64 ``(n+1,)``."""
        vt = self.table
        pos = vt.producer + 1
        w = 1.0 + vt.grad
        wb = np.bincount(pos, weights=w * vt.nbytes, minlength=self.n + 1)
        wc = np.bincount(pos, weights=w, minlength=self.n + 1)
        rb = np.bincount(pos, weights=vt.nbytes, minlength=self.n + 1)
        return wb, wc, rb

    @classmethod
    def chain(
        cls,
        compute_s: Sequence[float],
        param_bytes: Sequence[float],
        saved_bytes: Sequence[float],
        boundary_bytes: Sequence[float],
        num_stages: int,
        bandwidth_Bps: float | Sequence[float],
        grad: bool | Sequence[bool] = True,
        **kwargs: Any,
    ) -> "CutProblem":
        """A chain problem: the only value after unit ``i`` is ``boundary_bytes[i]`` read by ``i+1``.

        Args:
            boundary_bytes: ``(n-1,)`` bytes between consecutive units.
            grad: gradient flag (all values, or one per value).
            **kwargs: the remaining :class:`CutProblem` fields.
        """
        return cls(
            compute_s, param_bytes, saved_bytes, ValueTable.chain(boundary_bytes, grad),
            num_stages, bandwidth_Bps, **kwargs,
        )


@dataclass(frozen=True, eq=False)
class Derived:
    """Arrays derived from a :class:`CutProblem`'s inputs, checked (built by :func:`derive`).

    Attributes:
        n: number of units.
        T / P / A: ``(n+1,)`` prefix sums of compute seconds, parameter bytes, saved bytes.
        slow: ``(k,)`` compute slowdown of each stage's device.
        table: the communicated values only (producer >= 0, at least one user).
        is_chain: every value is read only by the unit right after its producer.
        inv_bw_in / inv_bw_out: ``(k,)`` seconds per byte of stage j's incoming / outgoing link.
        cap: ``(k,)`` device bytes, or None for no limit.
        inflight_arr: ``(k,)`` micro-batches in flight.
        forced: sorted unique forced cut positions; pin_units / pin_stages: the pins, sorted.
    """

    n: int
    T: np.ndarray
    slow: np.ndarray
    P: np.ndarray
    A: np.ndarray
    table: ValueTable
    is_chain: bool
    inv_bw_in: np.ndarray
    inv_bw_out: np.ndarray
    cap: np.ndarray | None
    inflight_arr: np.ndarray
    forced: np.ndarray
    pin_units: np.ndarray
    pin_stages: np.ndarray


def _communicated(vt: ValueTable) -> ValueTable:
    """The values of ``vt`` that cross units (producer >= 0, at least one user)."""
    counts = np.diff(vt.user_ptr)
    keep = (vt.producer >= 0) & (counts > 0)
    if keep.all():
        return vt
    idx = np.flatnonzero(keep)
    kc = counts[idx]
    starts = vt.user_ptr[idx]
    ptr = np.concatenate([[0], np.cumsum(kc)]).astype(np.int64)
    gather = np.repeat(starts - ptr[:-1], kc) + np.arange(ptr[-1])  # each kept value's users
    return ValueTable(vt.producer[idx], vt.nbytes[idx], vt.grad[idx], ptr, vt.users[gather])


def _check_values(vt: ValueTable, n: int) -> None:
    m = len(vt)
    if not (vt.nbytes.shape == (m,) and vt.grad.shape == (m,) and vt.user_ptr.shape == (m + 1,)):
        raise PlanError("value table arrays have inconsistent lengths; build it with ValueTable.from_values")
    if m == 0:
        return
    bad = ~np.isfinite(vt.nbytes) | (vt.nbytes < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(f"value {i} has nbytes = {float(vt.nbytes[i])!r}; sizes must be finite and non-negative")
    if vt.producer.min() < -1 or vt.producer.max() > n - 1:
        i = int(np.flatnonzero((vt.producer < -1) | (vt.producer > n - 1))[0])
        raise PlanError(
            f"value {i} has producer {int(vt.producer[i])}; producers are unit positions 0..{n - 1} "
            f"or -1 for a model input"
        )
    if vt.users.size:
        owner = np.repeat(np.arange(m), np.diff(vt.user_ptr))
        bad = (vt.users <= vt.producer[owner]) | (vt.users > n - 1)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            i = int(owner[j])
            raise PlanError(
                f"value {i} (producer {int(vt.producer[i])}) has user {int(vt.users[j])}; users must "
                f"come after their producer in the unit order and be < {n} (give a topological order)"
            )
        same = np.diff(vt.users) <= 0
        same &= owner[1:] == owner[:-1]
        if same.any():
            raise PlanError(
                f"value {int(owner[1:][same][0])} has unsorted or repeated users; "
                f"build the table with ValueTable.from_values"
            )


def _boundary_inverse_bandwidths(bw: Any, k: int) -> np.ndarray:
    arr = np.asarray(bw, dtype=np.float64)
    if arr.ndim == 0:
        b = np.full(k - 1, float(arr))
    elif arr.ndim == 1:
        if arr.shape[0] != k - 1:
            raise PlanError(
                f"bandwidth_Bps has {arr.shape[0]} entries but {k} stages have {k - 1} boundaries; "
                f"give one bandwidth, one per boundary, or a {k}x{k} matrix"
            )
        b = arr
    elif arr.ndim == 2 and arr.shape == (k, k):
        b = np.asarray([arr[j, j + 1] for j in range(k - 1)], dtype=np.float64)
    else:
        raise PlanError(
            f"bandwidth_Bps has shape {arr.shape}; give one bandwidth, {k - 1} (one per boundary) "
            f"or a {k}x{k} matrix"
        )
    if np.any(np.isnan(b)) or np.any(b <= 0):
        raise PlanError(f"bandwidth_Bps = {b.tolist()} must be positive bytes/s (inf for free links)")
    return 1.0 / b


def _pins(problem: "CutProblem", n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    items = sorted((int(u), int(st)) for u, st in dict(problem.pins).items())
    for u, st in items:
        if not 0 <= u < n:
            raise PlanError(f"pin on unit {u} is out of range (units are 0..{n - 1}); remove or fix the pin")
        if not 0 <= st < k:
            label = f"unit {u} ({problem.unit_names[u]!r})" if problem.unit_names is not None else f"unit {u}"
            raise PlanError(
                f"{label} is pinned to stage {st} but there are only {k} stages "
                f"(0..{k - 1}); pin it to an existing stage or use more pipeline stages"
            )
    return (np.asarray([u for u, _ in items], dtype=np.int64),
            np.asarray([st for _, st in items], dtype=np.int64))


def derive(problem: "CutProblem") -> Derived:
    """Check a problem's inputs and build its derived arrays.

    Raises:
        PlanError: malformed input (see :class:`CutProblem`).
    """
    t = _unit_array("compute_s", problem.compute_s, None)
    n = int(t.shape[0])
    if n < 1:
        raise PlanError("the problem has no units; give at least one unit to place")
    p = _unit_array("param_bytes", problem.param_bytes, n)
    a = _unit_array("saved_bytes", problem.saved_bytes, n)
    k = problem.num_stages
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise PlanError(f"num_stages is {k!r}; use a positive whole number of pipeline stages")
    k = int(k)
    vt = problem.values if isinstance(problem.values, ValueTable) else ValueTable.from_values(problem.values)
    _check_values(vt, n)
    vt = _communicated(vt)
    is_chain = bool(np.all(np.diff(vt.user_ptr) == 1) and np.array_equal(vt.users, vt.producer + 1))
    inv_boundary = _boundary_inverse_bandwidths(problem.bandwidth_Bps, k)
    inv_in, inv_out = np.zeros(k), np.zeros(k)
    inv_in[1:] = inv_boundary
    inv_out[:-1] = inv_boundary
    lat = float(problem.latency_s)
    if not math.isfinite(lat) or lat < 0:
        raise PlanError(f"latency_s = {problem.latency_s!r}; use a finite, non-negative number of seconds")
    mult = float(problem.param_multiplier)
    if not math.isfinite(mult) or mult < 0:
        raise PlanError(f"param_multiplier = {problem.param_multiplier!r}; use a non-negative number (4 for Adam)")
    forced = np.unique(np.asarray(list(problem.forced_cuts), dtype=np.int64))
    if forced.size and (forced[0] < 0 or forced[-1] > n - 2):
        bad = int(forced[0] if forced[0] < 0 else forced[-1])
        raise PlanError(
            f"forced cut after unit {bad} is out of range: cuts fall after units 0..{n - 2} "
            f"(a cut after the last unit is the end of the pipeline); remove it"
        )
    pin_units, pin_stages = _pins(problem, n, k)
    if problem.unit_names is not None and len(problem.unit_names) != n:
        raise PlanError(f"unit_names has {len(problem.unit_names)} entries for {n} units; give one name per unit")
    zero = np.zeros(1)
    return Derived(
        n=n, T=np.concatenate([zero, np.cumsum(t)]),
        slow=_per_stage("slowdown", problem.slowdown, k, positive=True),
        P=np.concatenate([zero, np.cumsum(p)]),
        A=np.concatenate([zero, np.cumsum(a)]), table=vt, is_chain=is_chain,
        inv_bw_in=inv_in, inv_bw_out=inv_out,
        cap=_per_stage("capacity_bytes", problem.capacity_bytes, k, allow_none=True, positive=True),
        inflight_arr=_per_stage("inflight", problem.inflight, k),
        forced=forced, pin_units=pin_units, pin_stages=pin_stages,
    )


for _f in dataclasses.fields(Derived):  # CutProblem.T is CutProblem.derived.T, and so on
    setattr(CutProblem, _f.name, property(operator.attrgetter(f"derived.{_f.name}")))
del _f


# ---------------------------------------------------------------------------------------------
# The result and evaluate()
# ---------------------------------------------------------------------------------------------


@dataclass
class PartitionResult:
    """A partition and its price under the problem's cost model.

    Attributes:
        cuts: start position of each stage; ``cuts[0] == 0``, strictly increasing, last ``< n``.
        num_units: ``n``.
        stage_costs_s: ``compute_s[j] + comm_s[j]`` per stage, seconds per micro-batch.
        compute_s: compute seconds per stage (forward + backward).
        comm_s: communication seconds per stage (receive + send, values + gradients, latency).
        recv_bytes / send_bytes: forward bytes of the distinct values each stage receives / sends
            per micro-batch (gradients not included).
        param_bytes: parameter bytes per stage.
        saved_bytes: activation bytes saved per micro-batch per stage.
        memory_bytes: ``param_multiplier * param_bytes + inflight * saved_bytes`` per stage.
        capacity_bytes: device memory per stage, or None when unlimited.
        bottleneck: index of the slowest stage (first one on ties).
        bottleneck_s: its cost, seconds.
        lower_bound_s: total compute / number of stages (no partition can beat it).
        violations: constraint breaches (memory, pins, forced cuts); empty when feasible.
        method: what produced the cuts (``dp``, ``chain``, ``brute_force``, ``equal_layers``,
            ``param_balanced``, ``given``).
    """

    cuts: list[int]
    num_units: int
    stage_costs_s: list[float]
    compute_s: list[float]
    comm_s: list[float]
    recv_bytes: list[float]
    send_bytes: list[float]
    param_bytes: list[float]
    saved_bytes: list[float]
    memory_bytes: list[float]
    capacity_bytes: list[float] | None
    bottleneck: int
    bottleneck_s: float
    lower_bound_s: float
    violations: list[str] = field(default_factory=list)
    method: str = "given"

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.cuts)

    @property
    def stage_ranges(self) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` with ``end`` exclusive."""
        ends = list(self.cuts[1:]) + [self.num_units]
        return list(zip(self.cuts, ends))

    @property
    def feasible(self) -> bool:
        """True when no constraint is violated."""
        return not self.violations

    def stage_of(self) -> list[int]:
        """Stage index of every unit position, ``(n,)``."""
        out: list[int] = []
        for j, (a, b) in enumerate(self.stage_ranges):
            out.extend([j] * (b - a))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (JSON-serialisable)."""
        return dataclasses.asdict(self)


def _check_cuts(problem: CutProblem, cuts: Sequence[int]) -> np.ndarray:
    c = np.asarray([int(x) for x in cuts], dtype=np.int64)
    k = problem.num_stages
    if c.shape[0] != k:
        raise PlanError(
            f"{c.shape[0]} cut positions given for a {k}-stage problem; give one start position per stage"
        )
    if c[0] != 0 or np.any(np.diff(c) <= 0) or c[-1] >= problem.n:
        raise PlanError(
            f"cuts {c.tolist()} are not stage starts: they must begin at 0, strictly increase and stay "
            f"below {problem.n} (every stage non-empty)"
        )
    return c


def stage_comm_sums(problem: CutProblem, cuts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per stage: received ``(w*bytes, w, bytes)`` and sent ``(w*bytes, w, bytes)`` sums over the
    DISTINCT values crossing its boundaries. Six float64 ``(k,)`` arrays."""
    k, n = problem.num_stages, problem.n
    ends = np.append(cuts[1:], n)
    stage_of = np.repeat(np.arange(k), ends - cuts)
    vt = problem.table
    z = [np.zeros(k) for _ in range(6)]
    if len(vt) == 0:
        return tuple(z)
    w = 1.0 + vt.grad
    sp = stage_of[vt.producer]
    us = stage_of[vt.users]
    owner = np.repeat(np.arange(len(vt)), np.diff(vt.user_ptr))
    cross = us > sp[owner]
    key = np.unique(owner[cross] * k + us[cross])  # distinct (value, receiving stage)
    rv, rs = key // k, key % k
    recv = (
        np.bincount(rs, weights=w[rv] * vt.nbytes[rv], minlength=k),
        np.bincount(rs, weights=w[rv], minlength=k),
        np.bincount(rs, weights=vt.nbytes[rv], minlength=k),
    )
    last_user_stage = us[vt.user_ptr[1:] - 1]  # users sorted -> last user is in the latest stage
    sent = last_user_stage > sp
    ss = sp[sent]
    send = (
        np.bincount(ss, weights=w[sent] * vt.nbytes[sent], minlength=k),
        np.bincount(ss, weights=w[sent], minlength=k),
        np.bincount(ss, weights=vt.nbytes[sent], minlength=k),
    )
    return (*recv, *send)


def evaluate(problem: CutProblem, cuts: Sequence[int], method: str = "given") -> PartitionResult:
    """Price a cut set with the problem's cost function (see the module docstring).

    Args:
        problem: the cut problem.
        cuts: start position of each of the ``problem.num_stages`` stages (``cuts[0] == 0``).
        method: label stored in the result.

    Returns:
        The :class:`PartitionResult`. Constraint breaches (memory over capacity, a pinned unit in
        another stage, a forced cut not honoured) are listed in ``violations``, not raised, so
        baselines that ignore constraints can still be priced.

    Raises:
        PlanError: ``cuts`` is not a valid list of stage starts.
    """
    c = _check_cuts(problem, cuts)
    k, n = problem.num_stages, problem.n
    ends = np.append(c[1:], n)
    rwb, rw, rb, swb, sw, sb = stage_comm_sums(problem, c)
    comm = comm_seconds(rwb, rw, swb, sw, problem.inv_bw_in, problem.inv_bw_out, float(problem.latency_s))
    compute = problem.slow * (problem.T[ends] - problem.T[c])
    dP = problem.P[ends] - problem.P[c]
    dA = problem.A[ends] - problem.A[c]
    mem = stage_memory(float(problem.param_multiplier), dP, problem.inflight_arr, dA)
    cost = compute + comm
    violations: list[str] = []
    if problem.cap is not None:
        for j in np.flatnonzero(mem > problem.cap):
            violations.append(
                f"stage {j} needs {human_bytes(mem[j], decimal=True)} but its device has {human_bytes(problem.cap[j], decimal=True)}"
            )
    stage_of = np.repeat(np.arange(k), ends - c)
    for u, st in zip(problem.pin_units.tolist(), problem.pin_stages.tolist()):
        if stage_of[u] != st:
            violations.append(f"{problem.unit_label(u)} is pinned to stage {st} but placed in stage {stage_of[u]}")
    for i in problem.forced.tolist():
        if stage_of[i] == stage_of[i + 1]:
            violations.append(f"forced cut after {problem.unit_label(i)} is not a stage boundary")
    b = int(np.argmax(cost))
    return PartitionResult(
        cuts=c.tolist(),
        num_units=n,
        stage_costs_s=cost.tolist(),
        compute_s=compute.tolist(),
        comm_s=comm.tolist(),
        recv_bytes=rb.tolist(),
        send_bytes=sb.tolist(),
        param_bytes=dP.tolist(),
        saved_bytes=dA.tolist(),
        memory_bytes=mem.tolist(),
        capacity_bytes=None if problem.cap is None else problem.cap.tolist(),
        bottleneck=b,
        bottleneck_s=float(cost[b]),
        lower_bound_s=problem.lower_bound_s,
        violations=violations,
        method=method,
    )
