"""Repeated blocks: plan a deep model as blocks, from a trace of two of them.

A deep transformer is a few layers around a long run of identical blocks (same module type,
parameter shapes and graph). Tracing and pricing every block costs seconds per dozen blocks and
gives the exact cut solver thousands of units; none of it is needed to plan: every block costs
the same. So, when a model holds a run of at least :data:`MIN_BLOCKS` identical children in one
``nn.ModuleList`` / ``nn.Sequential``:

* :func:`find_block_run` finds the run (the one holding the most parameters);
* :func:`reduced` swaps the run for :data:`KEEP` of its blocks while the model is traced (the
  forward iterates over the shorter list), so tracing and pricing see a small graph;
* :func:`fold` builds the cut problem at block granularity: the nodes before the run
  (*prologue*) and after it (*epilogue*) as node-level units, and one unit per block of the full
  run, priced as the traced representative block, with the values between blocks repeated
  along the chain;
* :func:`resolve_folded` turns a plan made that way into a node-level plan on a worker, once
  the worker has traced the whole model: prologue nodes keep their names (they come first, so
  their names do not depend on the depth), epilogue nodes are matched in order, block nodes by
  their block index (from ``nn_module_stack``).

A model whose run cannot be folded this way (a block's value read two blocks later, nodes of
the root module between blocks, ``pipe_split()`` or ``annotate()`` inside the run) is planned
node by node as before.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.errors import PlanError
from fxpipe.partitioner.annotations import STAGE_ATTR
from fxpipe.partitioner.graph import PricedGraph
from fxpipe.partitioner.problem import Value
from fxpipe.partitioner.trace import COMPUTE_OPS, TracedModel, _stack_paths
from fxpipe.plans.param_blocks import block_of
from fxpipe.plans.values import needs_grad

__all__ = ["MIN_BLOCKS", "KEEP", "BlockRun", "Folding", "UnitTable", "find_block_run", "reduced",
           "fold", "fold_rows", "check_run", "node_groups", "resolve_folded"]

#: fewest identical blocks worth folding
MIN_BLOCKS = 8
#: blocks kept in the reduced model (the second one is the representative: it reads what
#: every later block reads from its predecessor)
KEEP = 2


_INDEX = re.compile(r"^(\d+)(\.|$)")


@dataclass(frozen=True)
class BlockRun:
    """``count`` identical children of the container at ``path``, from index ``start``;
    ``glue``: compute nodes of the parent that follow each block and go with it (the residual
    add of ``for b in blocks: x = x + b(x)``), 0 when the blocks follow each other directly."""

    path: str
    start: int
    count: int
    glue: int = 0

    def to_dict(self) -> dict:
        return {"path": self.path, "start": self.start, "count": self.count, "glue": self.glue}

    @property
    def prefix(self) -> str:
        """What the blocks' names start with: ``"h."`` (``""`` when the model is the run's
        ``Sequential`` itself)."""
        return self.path + "." if self.path else ""

    def block(self, i: int) -> str:
        """Block ``i``'s module path (``h.3``; ``3`` at the top)."""
        return f"{self.prefix}{i}"

    def full_name(self, fqn: str, keep: int = KEEP) -> str:
        """A parameter or buffer name of the :func:`reduced` model as the full model names it:
        children of the run's container after the kept blocks were renumbered when the run
        was shortened (``h.3.w`` of a reduced model whose run ``h.0``..``h.7`` kept 2 blocks is
        ``h.9.w``)."""
        if not fqn.startswith(self.prefix):
            return fqn
        mo = _INDEX.match(fqn[len(self.prefix):])
        if mo is None or int(mo.group(1)) < self.start + keep:
            return fqn
        i = int(mo.group(1)) + self.count - keep
        return f"{self.prefix}{i}{fqn[len(self.prefix) + len(mo.group(1)):]}"


def _signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                           for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def find_block_run(model: nn.Module, min_blocks: int = MIN_BLOCKS) -> BlockRun | None:
    """The longest run of identical consecutive children (same type, parameter and buffer
    shapes) of one ``ModuleList`` / ``Sequential``, at least ``min_blocks`` long and without
    ``annotate()`` pins; the run holding the most parameters when several qualify."""
    best, best_params = None, 0
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < min_blocks:
            continue
        kids = list(mod)
        sigs = [_signature(k) for k in kids]
        i = 0
        while i < len(kids):
            j = i
            while j + 1 < len(kids) and sigs[j + 1] == sigs[i]:
                j += 1
            count = j - i + 1
            if count >= min_blocks and not any(
                    STAGE_ATTR in m.__dict__ for k in kids[i:j + 1] for m in k.modules()):
                params = count * sum(p.numel() for p in kids[i].parameters())
                if best is None or params > best_params:
                    best, best_params = BlockRun(path, i, count), params
            i = j + 1
    return best


@contextlib.contextmanager
def reduced(model: nn.Module, run: BlockRun, keep: int = KEEP) -> Iterator[nn.Module]:
    """``model`` with the run shortened to ``keep`` blocks for the ``with`` block (restored
    after, also on errors)."""
    if not run.path:  # the model is the Sequential: renumber its own children
        kids = list(model)
        short = kids[:run.start] + kids[run.start:run.start + keep] + kids[run.start + run.count:]
        saved = model._modules
        model._modules = type(saved)((str(i), m) for i, m in enumerate(short))
        try:
            yield model
        finally:
            model._modules = saved
        return
    parent_path, _, attr = run.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, attr)
    kids = list(full)
    short = kids[:run.start] + kids[run.start:run.start + keep] + kids[run.start + run.count:]
    setattr(parent, attr, type(full)(*short) if isinstance(full, nn.Sequential)
            else nn.ModuleList(short))
    try:
        yield model
    finally:
        setattr(parent, attr, full)


def block_index(node: torch.fx.Node, run_path: str) -> int | None:
    """Index (in the container) of the run child whose forward computed ``node``, or None."""
    prefix = run_path + "." if run_path else ""
    for p in _stack_paths(node):
        if p.startswith(prefix):
            mo = _INDEX.match(p[len(prefix):])
            if mo:
                return int(mo.group(1))
    return None


@dataclass
class Folding:
    """How a reduced trace maps onto the full model's units.

    Attributes:
        run: the folded run.
        prologue: unit positions (in the reduced graph) before the run's blocks.
        block_units: per kept block, its unit positions.
        epilogue: unit positions after the run.
        glue: unit positions of the last kept block's glue (the parent's nodes after it).
        n_units: units of the folded problem: ``len(prologue) + run.count + len(epilogue)``.
    """

    run: BlockRun
    prologue: list[int]
    block_units: list[list[int]]
    epilogue: list[int]
    glue: tuple[int, ...] = ()

    @property
    def n_units(self) -> int:
        return len(self.prologue) + self.run.count + len(self.epilogue)

    def folded_pos(self, pos: int) -> int | None:
        """Folded position of a prologue / epilogue unit (None inside a block)."""
        if pos in self._pro:
            return self._pro[pos]
        if pos in self._epi:
            return len(self.prologue) + self.run.count + self._epi[pos]
        return None

    def __post_init__(self) -> None:
        self._pro = {p: i for i, p in enumerate(self.prologue)}
        self._epi = {p: i for i, p in enumerate(self.epilogue)}
        self._block = {p: b for b, units in enumerate(self.block_units) for p in units}


def _glue_ops(pg: PricedGraph, by_name: dict, units: list[int]) -> list | None:
    """The ops of the parent's units between two blocks (what each block's glue must repeat),
    or None when one holds parameters or buffers (they would not be a block's)."""
    g = pg.graph
    ops = []
    for p in units:
        u = g.nodes[pg.order[p]]
        if u["params"] or u["buffers"]:
            return None
        ops += [by_name[m].target for m in u["members"]]
    return ops


def _groups(pg: PricedGraph, run: BlockRun) -> Folding | None:
    """Split the reduced graph's units into prologue, kept blocks and epilogue (graph order),
    or None when block nodes and other nodes interleave. Units of the parent between the two
    kept blocks (a residual add outside the block) go with the first; the same ops right after
    the second go with it (the run's ``glue``)."""
    by_name = {n.name: n for n in pg.traced.gm.graph.nodes}
    kept = range(run.start, run.start + KEEP)
    blocks: list[list[int]] = [[] for _ in kept]
    prologue, between, epilogue = [], [], []
    for pos, u in enumerate(pg.order):
        b = block_index(by_name[u], run.path)
        if b is not None and b in kept:
            k = b - run.start
            if epilogue or any(blocks[k + 1:]) or (k == 0 and between):
                return None  # blocks out of order, or a block after the epilogue started
            if k > 0 and not blocks[k] and not blocks[k - 1]:
                return None
            blocks[k].append(pos)
        elif not any(blocks):
            prologue.append(pos)
        elif not blocks[-1]:
            between.append(pos)
        else:
            epilogue.append(pos)
    if not all(blocks):
        return None
    for units in blocks:  # each block's units contiguous
        if units != list(range(units[0], units[0] + len(units))):
            return None
    glue = 0
    if between:
        ops = _glue_ops(pg, by_name, between)
        after = epilogue[:len(between)]
        if (ops is None or len(after) < len(between)
                or after != list(range(blocks[-1][-1] + 1, blocks[-1][-1] + 1 + len(after)))
                or _glue_ops(pg, by_name, after) != ops):
            return None
        blocks = [blocks[0] + between, blocks[1] + after]
        epilogue = epilogue[len(after):]
        glue = sum(len(pg.graph.nodes[pg.order[p]]["members"]) for p in between)
    return Folding(BlockRun(run.path, run.start, run.count, glue), prologue, blocks, epilogue,
                   tuple(blocks[1][len(blocks[1]) - len(between):]) if between else ())


@dataclass
class UnitTable:
    """Per-unit costs of a cut problem, for one traced micro-batch (scaled per candidate).

    Attributes:
        names: unit labels.
        times: per unit, ``(forward, input-gradient, weight-gradient)`` seconds.
        flops: per unit, ``(forward, backward, weight-gradient part)`` FLOPs.
        params / saved: per unit, parameter bytes and activation bytes saved for backward.
        values: the values that cross cuts (cheap, rebuilt values left out).
        forced_cuts / pins: the user's ``pipe_split()`` and ``annotate()`` constraints.
        folding: how the units map onto a reduced trace's, when folded (else None).
        selective: per unit, under selective recomputation, ``(seconds of its forward that
            run again, bytes it keeps per micro-batch)``.
        blocks: per unit, the block it lies in (:func:`fxpipe.plans.param_blocks.block_of`
            of its module path; a folded block unit: its block), None outside every block
            (what partial recomputation counts blocks by); empty when not worked out.
        value_saved_at: per value (as ``values``), the unit whose ``saved`` bytes count it
            (:attr:`~fxpipe.partitioner.cost.NodeCost.saved_by`), -1 when none; empty when
            not worked out.
    """

    names: list[str]
    times: list[tuple[float, float, float]]
    flops: list[tuple[float, float, float]]
    params: list[float]
    saved: list[float]
    values: list[Value]
    forced_cuts: list[int]
    pins: dict[int, int]
    folding: "Folding | None" = None
    selective: list[tuple[float, float]] = field(default_factory=list)
    blocks: list[str | None] = field(default_factory=list)
    value_saved_at: list[int] = field(default_factory=list)


def saver_positions(pg: PricedGraph, costs: dict | None) -> dict[str, int]:
    """Value (FX node) name -> position of the unit that saves it first (see
    :attr:`UnitTable.value_saved_at`), for the values some unit saves."""
    if not costs:
        return {}
    g = pg.graph
    pos = {m: i for i, u in enumerate(pg.order) for m in g.nodes[u]["members"]}
    out = {}
    for name, c in costs.items():
        p = pos.get(getattr(c, "saved_by", ""))
        if p is not None:
            out[name] = p
    return out


def fold_rows(fo: Folding, rows: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """Per-unit figures of the reduced graph (``rows``, one tuple per unit) as the folded
    units': the prologue's and epilogue's as they are, each block's the sum over the last kept
    block's units (as :func:`fold` folds times, FLOPs and bytes)."""
    rep = fo.block_units[-1]
    width = len(rows[rep[0]]) if rep else 0
    block = tuple(sum(rows[p][i] for p in rep) for i in range(width))
    return ([rows[p] for p in fo.prologue] + [block] * fo.run.count
            + [rows[p] for p in fo.epilogue])


def fold(pg: PricedGraph, run: BlockRun, unit_times: list[tuple[float, float, float]],
         cheap: set[str], unit_selective: list[tuple[float, float]],
         costs: dict | None = None) -> UnitTable | None:
    """The folded cut problem (see the module doc), or None when the reduced graph does not
    fold.

    Args:
        unit_times: ``(fwd, B, W)`` seconds of every unit of the reduced graph.
        unit_selective: its :attr:`UnitTable.selective` figures.
        cheap: values rebuilt in each stage (they cross cuts for free).
        costs: the nodes' costs (where each value is saved: :attr:`UnitTable.value_saved_at`).
    """
    fo = _groups(pg, run)
    if fo is None or pg.forced_cuts or pg.pins:
        return None
    if any(u in fo.glue for users in pg.input_users.values() for u in users):
        return None  # the parent reads a model input after block 1 too: maybe a skip
    g = pg.graph
    rep = fo.block_units[-1]  # the last kept block reads from a block, like every later one
    n_pro, L = len(fo.prologue), run.count

    def unit(p: int, key: str) -> float:
        return g.nodes[pg.order[p]][key]

    block_time = tuple(sum(unit_times[p][i] for p in rep) for i in range(3))
    times = ([unit_times[p] for p in fo.prologue] + [block_time] * L
             + [unit_times[p] for p in fo.epilogue])
    fl = [(unit(p, "fwd_flops"), unit(p, "bwd_flops"), unit(p, "bwd_weight_flops"))
          for p in range(len(pg.order))]
    block_flops = tuple(sum(fl[p][i] for p in rep) for i in range(3))
    flops = ([fl[p] for p in fo.prologue] + [block_flops] * L + [fl[p] for p in fo.epilogue])
    params = ([unit(p, "param_bytes") for p in fo.prologue]
              + [sum(unit(p, "param_bytes") for p in rep)] * L
              + [unit(p, "param_bytes") for p in fo.epilogue])
    saved = ([unit(p, "saved_bytes") for p in fo.prologue]
             + [sum(unit(p, "saved_bytes") for p in rep)] * L
             + [unit(p, "saved_bytes") for p in fo.epilogue])
    selective = fold_rows(fo, unit_selective)
    prefix = run.prefix
    names = ([pg.order[p] for p in fo.prologue]
             + [f"{prefix}{run.start + b}" for b in range(L)]
             + [pg.order[p] for p in fo.epilogue])
    n_total = len(pg.order)
    values: list[Value] = []
    first_block, last_block = n_pro, n_pro + L - 1
    saver = saver_positions(pg, costs)
    saved_at: list[int] = []

    def at(row, src: int, dst: list[int]) -> int:  # where the folded value is saved
        sp = saver.get(row.name)
        if sp is None:
            return -1
        if sp == row.producer_pos:
            return src
        if sp in fo._block:
            return min((d for d in dst if first_block <= d <= last_block), default=-1)
        fp = fo.folded_pos(sp)
        return fp if fp is not None else -1

    for row in pg.values:
        if row.name in cheap:
            continue
        users = [u for u in row.user_positions if u < n_total]
        grad = needs_grad(pg.value_info(row.name)[1])
        pb = fo._block.get(row.producer_pos)
        ub = {fo._block[u] for u in users if u in fo._block}
        other = [fo.folded_pos(u) for u in users if u not in fo._block]
        if pb is None:  # a prologue or epilogue value
            if any(u in fo.glue for u in users):
                return None  # the parent reads it after block 1 too: maybe a skip over blocks
            src = fo.folded_pos(row.producer_pos)
            to_blocks = (list(range(first_block, last_block + 1)) if ub == {0, 1}
                         else [first_block] if ub == {0} else None)
            if to_blocks is None and ub:
                return None  # read by the later kept block only: not a repeated pattern
            dst = sorted(set(other + (to_blocks or [])))
            if dst:
                values.append(Value(src, tuple(dst), row.nbytes, grad, row.name))
                saved_at.append(at(row, src, dst))
        elif pb == 0:  # a value of the first kept block
            if ub - {0} == {1} and not other:  # block -> next block: along the whole chain
                for j in range(first_block, last_block):
                    values.append(Value(j, (j + 1,), row.nbytes, grad, row.name))
                    saved_at.append(at(row, j, [j + 1]))
            elif ub - {0} or other:
                return None
        else:  # a value of the last kept block
            if ub - {1}:
                return None
            if other:
                values.append(Value(last_block, tuple(sorted(other)), row.nbytes, grad,
                                    row.name))
                saved_at.append(at(row, last_block, sorted(other)))
    blocks = ([block_of(g.nodes[pg.order[p]].get("module") or "") for p in fo.prologue]
              + [run.block(run.start + b) for b in range(L)]
              + [block_of(g.nodes[pg.order[p]].get("module") or "") for p in fo.epilogue])
    return UnitTable(names, times, flops, params, saved, values, [], {}, fo, selective, blocks,
                     saved_at if costs else [])


def node_groups(traced: TracedModel, run: BlockRun) -> tuple[list[str], dict[int, list[str]],
                                                              list[str]]:
    """Compute nodes of a full trace as ``(prologue, {block index: nodes}, epilogue)``.

    Raises:
        PlanError: block nodes and other nodes interleave (this graph does not fold).
    """
    pro: list[str] = []
    blocks: dict[int, list[str]] = {}
    epi: list[str] = []
    run_ix = range(run.start, run.start + run.count)
    last, glued = None, 0  # the block the parent's nodes now follow, and how many it took
    for n in traced.gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            continue
        b = block_index(n, run.path)
        if b is not None and b in run_ix:
            if epi or (b != last and last is not None and glued != run.glue):
                raise PlanError(f"node {n.name} of block {b} comes after nodes outside the "
                                f"blocks of {run.path}; re-plan with a spec that does not fold")
            if b != last:
                last, glued = b, 0
            blocks.setdefault(b, []).append(n.name)
        elif not blocks:
            pro.append(n.name)
        elif glued < run.glue and not epi:
            blocks[last].append(n.name)  # the block's glue (a residual add in the parent)
            glued += 1
        else:
            epi.append(n.name)
    return pro, blocks, epi


def resolve_folded(folded: dict, traced: TracedModel) -> dict[str, int]:
    """Node -> stage of a full trace, from a folded plan's ``folded`` record.

    Raises:
        PlanError: the trace does not have the planned prologue, blocks or epilogue.
    """
    run = BlockRun(**folded["run"])
    pro, blocks, epi = node_groups(traced, run)
    stage: dict[str, int] = {}
    if set(pro) != set(folded["prologue"]):
        raise PlanError("the model's nodes before its repeated blocks differ from the plan's; "
                        "re-create the plan with `fxpipe plan`")
    stage.update({n: folded["prologue"][n] for n in pro})
    if sorted(blocks) != list(range(run.start, run.start + run.count)):
        raise PlanError(f"the model has blocks {sorted(blocks)[:3]}... of {run.path} but the "
                        f"plan has {run.count} from {run.start}; re-create the plan")
    for b, names in blocks.items():
        s = folded["blocks"][b - run.start]
        stage.update({n: s for n in names})
    if len(epi) != len(folded["epilogue"]):
        raise PlanError(f"the model has {len(epi)} nodes after its repeated blocks, the plan "
                        f"{len(folded['epilogue'])}; re-create the plan with `fxpipe plan`")
    stage.update(dict(zip(epi, folded["epilogue"])))
    return stage


class _RunWatch(TorchDispatchMode):
    """Records, while the full model runs eagerly, which region every op ran in (the prologue,
    block ``i``, the parent's ops after block ``i``, the epilogue) and which regions its
    tensor inputs came from; :func:`check_run` reads it."""

    def __init__(self, run: BlockRun):
        super().__init__()
        self.run = run
        self.region: tuple[str, int] = ("pro", -1)
        self.made: dict[int, tuple[str, int]] = {}
        self.kept: list[torch.Tensor] = []  # keeps ids unique while the run lasts
        self.ops: dict[tuple[str, int], list] = {}
        self.problem: str | None = None

    def fail(self, why: str) -> None:
        if self.problem is None:
            self.problem = why

    def enter(self, i: int) -> None:
        expected = ("pro", -1) if i == 0 else ("g", i - 1)
        if self.region != expected:
            self.fail(f"block {self.run.block(self.run.start + i)} ran out of turn")
        self.region = ("b", i)

    def leave(self, i: int) -> None:
        self.region = ("g", i)

    def _where(self) -> tuple[str, int]:
        kind, i = self.region
        if kind == "g" and i == self.run.count - 1:  # after the run: its glue, then the rest
            first = self.ops.get(("g", 0), [])
            if len(self.ops.get(self.region, [])) >= len(first):
                return ("epi", -1)
        return self.region

    def _may_read(self, at: tuple[str, int], src: tuple[str, int]) -> bool:
        kind, i = at
        skind, j = src
        if kind == "epi":  # after the run: nothing of a block before the last
            return skind in ("pro", "in", "epi") or j == self.run.count - 1
        if kind in ("b", "g"):
            if skind in ("b", "g"):
                return j in (i, i - 1)
            # a value from before the run: every block may read it (a mask); the parent's
            # ops between blocks only after block 0 (else it may be a skip over blocks)
            return kind == "b" or i == 0
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = self._where()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                src = self.made.get(id(t))
                if src is not None and not self._may_read(at, src):
                    self.fail(f"{func} in {self._name(at)} reads a value of {self._name(src)}")
        out = func(*args, **kwargs)
        self.ops.setdefault(at, []).append(func)
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.made[id(o)] = at
                self.kept.append(o)
        return out

    def _name(self, region: tuple[str, int]) -> str:
        kind, i = region
        return {"pro": "the code before the blocks", "in": "the model's inputs",
                "epi": "the code after the blocks"}.get(kind) or (
            f"block {self.run.block(self.run.start + i)}" if kind == "b"
            else f"the parent's code after block {self.run.block(self.run.start + i)}")


def check_run(model: nn.Module, run: BlockRun, args: tuple, kwargs: dict) -> str | None:
    """Run ``model`` once, eagerly, and check that its full graph repeats as the shortened
    trace's fold assumed: the blocks run in order, the parent's ops after every block are the
    same, and no op reads a value from more than one block back (nor, after the run, from a
    block before the last). Returns what does not hold, or None, also when the model cannot run
    eagerly here (e.g. a meta model whose forward reads a value: ``.item()``; the trace could,
    so the fold stands unchecked). The model's buffers and the random number generators are
    as before afterwards (no gradients are recorded)."""
    parent = model.get_submodule(run.path) if run.path else model
    watch = _RunWatch(run)
    hooks = []
    for i in range(run.count):
        block = parent[run.start + i]
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: watch.enter(i)))
        hooks.append(block.register_forward_hook(lambda m, a, o, i=i: watch.leave(i)))
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            watch.made[id(t)] = ("in", -1)
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), watch:
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the user's forward cannot run eagerly here: unchecked
        return None
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    if watch.problem is not None:
        return watch.problem
    first = watch.ops.get(("g", 0), [])
    for i in range(1, run.count):
        ops = watch.ops.get(("g", i), [])
        if ops != first:
            return (f"the parent's code after block {run.block(run.start + i)} differs from "
                    f"the code after block {run.block(run.start)} ({len(ops)} ops, not "
                    f"{len(first)})")
    return None
