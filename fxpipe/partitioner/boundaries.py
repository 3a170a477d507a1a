"""Stage boundaries: what each stage of a traced graph computes, receives, sends and holds.

Takes a traced :class:`torch.fx.GraphModule` (``torch.export.export(...).module()``, or
``torch.fx.symbolic_trace`` followed by shape propagation) and an assignment ``node_stage`` of
every compute node (``call_function`` / ``call_method`` / ``call_module``) to a stage index
``0 .. num_stages-1`` that follows the data dependencies (a node never reads a value computed by a
later stage; contiguous stages in a topological order satisfy this). Gives
:func:`stage_boundaries` -> :class:`Boundaries`: per stage the nodes, the values it receives
(``inputs``) and sends (``outputs``), the parameters / buffers it holds (original FQNs), plus a
:class:`~fxpipe.plans.values.ValueInfo` (producer, consumers, shape, dtype, bytes) for every value
that feeds the model or crosses a stage boundary. Plain data: :mod:`fxpipe.partitioner.split`
builds the stage modules from it.

A value read by several later stages (a skip connection) is sent by its producer directly to each
of them, not relayed through the stages in between (as in torch.distributed.pipelining's
``pipeline()`` split and PipeDream's stage graph). A parameter used by several stages (tied
weights, Press & Wolf 2017; Megatron-LM's "embedding group") is present in every such stage; the
runtime sums its gradients over those stages (``Boundaries.shared_params``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxpipe.errors import SplitError
from fxpipe.partitioner.trace import COMPUTE_OPS
from fxpipe.plans.values import MODEL_INPUT, ValueInfo
from fxpipe.units import plural

__all__ = ["Boundaries", "StageBoundary", "compute_nodes", "stage_boundaries", "GUARDS_FN"]

#: torch.export's guard-check module call (follows the placeholders); dropped from every stage.
GUARDS_FN = "_guards_fn"


@dataclass
class StageBoundary:
    """What one stage computes, receives, sends and holds. Plain data (names only).

    Attributes:
        index: stage index ``0 .. num_stages-1``.
        nodes: FX node names computed by the stage, in graph order.
        inputs: value names the stage reads but does not compute (outputs of earlier stages and
            model-input placeholders), ordered by the producer's position in the graph. These are
            the stage module's positional arguments, in this order.
        outputs: value names computed by the stage and read by a later stage or returned by the
            model, in graph order. The stage module returns them as a tuple, in this order.
        params: canonical FQNs of the parameters the stage uses (first-use order).
        buffers: canonical FQNs of the registered buffers the stage uses (first-use order).
        constants: names of other tensor attributes the stage reads (e.g. export's
            ``lifted_tensor_0``); held in the stage module as non-persistent buffers.
        state_fqns: stage-module state name (as in ``stage_mod.named_parameters()`` /
            ``named_buffers()`` with ``remove_duplicate=False``) -> canonical FQN. The identity
            for ``get_attr`` parameters (export graphs); differs only for a tied parameter reached
            through a ``call_module`` under an alias name (``symbolic_trace`` graphs).
    """

    index: int
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    params: list[str]
    buffers: list[str]
    constants: list[str] = field(default_factory=list)
    state_fqns: dict[str, str] = field(default_factory=dict)


@dataclass
class Boundaries:
    """The stage boundaries of a split graph (input of :func:`build_stage_module`).

    Attributes:
        num_stages: number of stages.
        stages: one :class:`StageBoundary` per stage, in pipeline order.
        values: value name -> :class:`~fxpipe.plans.values.ValueInfo` (producer stage or
            ``MODEL_INPUT`` (-1), consumer stages sorted with the producer excluded, shape and
            dtype as traced, ``nbytes`` = numel x element size for the traced example inputs), for
            every tensor model input (consumers ``[]`` when unused) and every value a stage sends
            (boundary values and model outputs), in graph order.
        model_inputs: placeholder names in call order (the model's flattened inputs).
        model_outputs: names of the values the model returns, flattened, in order (each is among
            the ``outputs`` of the stage that computes it).
        param_aliases: alias FQN -> canonical FQN for tensors reachable under several names (tied
            weights, e.g. ``{'wte.weight': 'head.weight'}`` for an exported CharGPT).
        shared_params: canonical parameter FQN -> stages using it, for parameters used by more
            than one stage (their gradients must be summed across those stages).
        unused_params: canonical FQNs of parameters no stage reads (they get no gradient).
    """

    num_stages: int
    stages: list[StageBoundary]
    values: dict[str, ValueInfo]
    model_inputs: list[str]
    model_outputs: list[str]
    param_aliases: dict[str, str] = field(default_factory=dict)
    shared_params: dict[str, list[int]] = field(default_factory=dict)
    unused_params: list[str] = field(default_factory=list)


def _is_guard(node: fx.Node) -> bool:
    return node.op == "call_module" and node.target == GUARDS_FN


def compute_nodes(gm: fx.GraphModule) -> list[str]:
    """Names of the nodes a stage assignment must cover, in graph order.

    These are the ``call_function``, ``call_method`` and ``call_module`` nodes, without export's
    ``_guards_fn`` guard check. Placeholders, ``get_attr`` and ``output`` nodes are not assigned.
    """
    return [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS and not _is_guard(n)]


def resolve_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _shape_dtype(node: fx.Node):
    """(shape list, dtype, is_tensor, has_meta) of a node's value from its metadata."""
    meta = node.meta
    val = meta.get("val", None)
    if isinstance(val, torch.Tensor):
        return list(val.shape), val.dtype, True, True
    tm = meta.get("tensor_meta", None)
    if tm is not None and hasattr(tm, "shape") and hasattr(tm, "dtype"):
        return list(tm.shape), tm.dtype, True, True
    has_meta = "val" in meta or "tensor_meta" in meta or "type" in meta
    return None, None, False, has_meta


def _concrete(dim, name: str) -> int:
    if isinstance(dim, int):
        return dim
    hint = getattr(getattr(dim, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    try:
        return int(dim)
    except Exception:  # noqa: BLE001 - any failure means "not concrete"
        raise SplitError(
            f"value {name!r} has a data-dependent dimension ({dim}); its size cannot be priced "
            "or preallocated for sending. Trace with example inputs whose sizes are fixed, or "
            "keep this value inside one stage."
        ) from None


def _value_info(node: fx.Node, producer: int, consumers: list[int], why: str) -> ValueInfo:
    shape, dtype, is_tensor, has_meta = _shape_dtype(node)
    if not has_meta:
        raise SplitError(
            f"value {node.name!r} ({why}) has no shape metadata (node.meta['val'] or "
            "['tensor_meta']). Graphs from torch.fx.symbolic_trace need shape propagation first: "
            "torch.fx.passes.shape_prop.ShapeProp(gm).propagate(*example_inputs); graphs from "
            "torch.export carry it already."
        )
    if not is_tensor:
        typ = node.meta.get("type") or type(node.meta.get("val")).__name__
        raise SplitError(
            f"value {node.name!r} ({why}) is not a tensor ({typ}): only tensors can be sent "
            "between pipeline stages. Move the stage boundary so that the node computing it "
            "and all its users are in the same stage."
        )
    shape = [_concrete(d, node.name) for d in shape]
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    return ValueInfo(
        name=node.name,
        producer=producer,
        consumers=consumers,
        shape=shape,
        dtype=str(dtype).removeprefix("torch."),
        nbytes=numel * itemsize,
    )


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    """Nodes written in place by ``node`` (aten schemas with ``a!`` args; ``x.op_()`` methods)."""
    out: list[fx.Node] = []
    target = node.target
    schema = getattr(target, "_schema", None)
    if node.op == "call_function" and schema is not None and schema.is_mutable:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            v = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(v, fx.Node):
                out.append(v)
    elif (node.op == "call_method" and isinstance(target, str) and target.endswith("_")
          and not target.startswith("__") and node.args and isinstance(node.args[0], fx.Node)):
        out.append(node.args[0])
    return out


def _check_assignment(gm: fx.GraphModule, node_stage: dict[str, int], num_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise SplitError(f"num_stages must be a positive integer, got {num_stages!r}")
    names = compute_nodes(gm)
    expected = set(names)
    given = set(node_stage) - {GUARDS_FN}
    missing = [n for n in names if n not in given]
    if missing:
        raise SplitError(
            f"the stage assignment misses {plural(len(missing), 'compute node')}, e.g. "
            f"{missing[:5]}; "
            "assign every call_function/call_method/call_module node "
            "(fxpipe.partitioner.boundaries.compute_nodes(gm) lists them) to a stage."
        )
    extra = sorted(given - expected)
    if extra:
        raise SplitError(
            f"the stage assignment names {plural(len(extra), 'node')} that are not compute nodes "
            f"of this "
            f"graph, e.g. {extra[:5]}; assign only the names from compute_nodes(gm) "
            "(placeholders, get_attr and output nodes are placed automatically)."
        )
    used = set()
    for n in names:
        s = node_stage[n]
        try:
            s = operator.index(s)
        except TypeError:
            s = None
        if s is None or isinstance(node_stage[n], bool) or not 0 <= s < num_stages:
            raise SplitError(
                f"node {n!r} is assigned to stage {node_stage[n]!r}, outside "
                f"0..{num_stages - 1}; use integer stage indices below num_stages."
            )
        used.add(s)
    empty = [s for s in range(num_stages) if s not in used]
    if empty:
        raise SplitError(
            f"stage(s) {empty} have no nodes; every stage must compute something. Use fewer "
            "stages or move the cut points."
        )


def stage_boundaries(gm: fx.GraphModule, node_stage: dict[str, int],
                     num_stages: int) -> Boundaries:
    """Compute what each stage computes, receives, sends and holds.

    Args:
        gm: traced graph (torch.export ``.module()`` or ``symbolic_trace`` + ``ShapeProp``).
        node_stage: compute-node name -> stage index (see :func:`compute_nodes`); a node may only
            read values computed in its own or an earlier stage. An entry for export's
            ``_guards_fn`` is allowed and ignored (that node is dropped).
        num_stages: number of stages ``k``; every index ``0..k-1`` must be used.

    Returns:
        :class:`Boundaries`. Shapes, dtypes and byte counts (bytes) are those of the traced
        example inputs (one micro-batch when traced with a micro-batch).

    Raises:
        SplitError (a ValueError and PlanError): incomplete or out-of-range assignment, an empty
        stage, a node reading a value from a later stage, a tuple-valued node separated from its
        ``getitem`` users, any other non-tensor value crossing a boundary, missing shape
        metadata on a boundary value (run ShapeProp for symbolic_trace graphs), a stage mutating
        in place a value it receives, or a model output that is a model input or attribute.
    """
    _check_assignment(gm, node_stage, num_stages)
    graph_nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(graph_nodes)}
    stage_of = {n: operator.index(node_stage[n.name]) for n in graph_nodes
                if n.op in COMPUTE_OPS and not _is_guard(n)}
    uses = _scan_uses(graph_nodes, stage_of, num_stages)
    _check_in_place(stage_of, uses.consumers)
    model_outputs = _model_outputs(graph_nodes, stage_of)
    values, inputs, outputs = _values_and_ports(graph_nodes, stage_of, uses.consumers,
                                                set(model_outputs), num_stages)
    canonical = _canonical_names(gm, graph_nodes, stage_of)
    held = ({id(p) for _, p in gm.named_parameters(remove_duplicate=False)},
            {id(b) for _, b in gm.named_buffers(remove_duplicate=False)})
    stages = [StageBoundary(
        index=s,
        nodes=uses.stage_nodes[s],
        inputs=[n.name for n in sorted(inputs[s], key=pos.__getitem__)],
        outputs=[n.name for n in sorted(outputs[s], key=pos.__getitem__)],
        **_stage_state(gm, uses.module_uses[s], uses.attr_uses[s], canonical, *held),
    ) for s in range(num_stages)]
    aliases, shared, unused = _sharing(gm, stages, canonical)
    return Boundaries(
        num_stages=num_stages,
        stages=stages,
        values=values,
        model_inputs=[n.name for n in graph_nodes if n.op == "placeholder" and n.name in values],
        model_outputs=[m.name for m in model_outputs],
        param_aliases=aliases,
        shared_params=shared,
        unused_params=unused,
    )


# ---------------------------------------------------------------- the sections of stage_boundaries
@dataclass
class _Uses:
    """What every stage reads: its nodes, the stages reading each value, its attributes and
    submodules (first-use order)."""

    stage_nodes: list[list[str]]
    consumers: dict[fx.Node, set[int]]      # placeholder/compute value -> reader stages
    attr_uses: list[list[fx.Node]]          # get_attr nodes per stage
    module_uses: list[list[str]]            # call_module targets per stage


def _scan_uses(graph_nodes: list[fx.Node], stage_of: dict[fx.Node, int], k: int) -> _Uses:
    """Who reads what; raises SplitError where a stage reads a later stage's value or a tuple
    crosses a boundary."""
    uses = _Uses([[] for _ in range(k)], {}, [[] for _ in range(k)], [[] for _ in range(k)])
    for n in graph_nodes:
        if n not in stage_of:
            continue
        s = stage_of[n]
        uses.stage_nodes[s].append(n.name)
        if n.op == "call_module":
            uses.module_uses[s].append(n.target)
        for m in n.all_input_nodes:
            if m.op == "get_attr":
                if m not in uses.attr_uses[s]:
                    uses.attr_uses[s].append(m)
            elif m.op == "placeholder":
                uses.consumers.setdefault(m, set()).add(s)
            elif _is_guard(m):
                raise SplitError(f"node {n.name!r} reads export's guard check {m.name!r}; "
                                 "this graph is not supported, re-export the model.")
            else:
                p = stage_of[m]
                if p > s:
                    raise SplitError(
                        f"node {n.name!r} (stage {s}) reads {m.name!r}, computed by the later "
                        f"stage {p}; stages must follow the data dependencies (contiguous in a "
                        "topological order). Fix the stage assignment."
                    )
                if p < s:
                    if (n.op == "call_function" and n.target is operator.getitem
                            and not _shape_dtype(m)[2]):
                        raise SplitError(
                            f"tuple-valued node {m.name!r} (stage {p}) is separated from its "
                            f"getitem user {n.name!r} (stage {s}); a tuple cannot cross a stage "
                            "boundary. Put a multi-output node and its getitem users in the "
                            "same stage."
                        )
                    uses.consumers.setdefault(m, set()).add(s)
    return uses


def _check_in_place(stage_of: dict[fx.Node, int], consumers: dict[fx.Node, set[int]]) -> None:
    """In-place writes to a value the stage did not compute: the producer (or another reader)
    would not see the write once the stages run on different ranks."""
    for n, s in stage_of.items():
        for m in _mutated_args(n):
            if m.op == "get_attr":
                continue
            readers = consumers.get(m, set())
            foreign = m.op == "placeholder" and len(readers) > 1
            foreign = foreign or (m in stage_of and stage_of[m] != s)
            if foreign:
                raise SplitError(
                    f"node {n.name!r} (stage {s}) modifies {m.name!r} in place, but that value is "
                    "shared with another stage, which would not see the change. Keep the "
                    "in-place op in the stage that computes the value, or make it out of place "
                    "(e.g. inplace=False)."
                )


def _model_outputs(graph_nodes: list[fx.Node], stage_of: dict[fx.Node, int]) -> list[fx.Node]:
    """The flattened nodes of the output node's arguments (each computed by a stage)."""
    out_node = next(n for n in reversed(graph_nodes) if n.op == "output")
    outs: list[fx.Node] = []
    for m in out_node.all_input_nodes:
        if m not in stage_of:
            raise SplitError(
                f"the model returns {m.name!r} ({m.op}) directly; a model output must be computed "
                "by a stage. Return a computed value (e.g. x.clone()) instead."
            )
        outs.append(m)
    return outs


def _values_and_ports(graph_nodes: list[fx.Node], stage_of: dict[fx.Node, int],
                      consumers: dict[fx.Node, set[int]], output_values: set[fx.Node], k: int
                      ) -> tuple[dict[str, ValueInfo], list[list[fx.Node]], list[list[fx.Node]]]:
    """Every model input and boundary value with its shape and bytes, and each stage's inputs
    and outputs (unsorted)."""
    values: dict[str, ValueInfo] = {}
    inputs: list[list[fx.Node]] = [[] for _ in range(k)]
    outputs: list[list[fx.Node]] = [[] for _ in range(k)]
    for ph in (n for n in graph_nodes if n.op == "placeholder"):
        readers = sorted(consumers.get(ph, ()))
        if readers or _shape_dtype(ph)[2]:
            values[ph.name] = _value_info(ph, MODEL_INPUT, readers, "a model input")
        for s in readers:
            inputs[s].append(ph)
    for n in graph_nodes:
        if n not in stage_of or (n not in consumers and n not in output_values):
            continue
        p = stage_of[n]
        readers = sorted(consumers.get(n, ()))
        why = (f"sent from stage {p} to {'stages' if len(readers) > 1 else 'stage'} {readers}"
               if readers
               else f"a model output computed by stage {p}")
        values[n.name] = _value_info(n, p, readers, why)
        outputs[p].append(n)
        for s in readers:
            inputs[s].append(n)
    return values, inputs, outputs


def _canonical_names(gm: fx.GraphModule, graph_nodes: list[fx.Node],
                     stage_of: dict[fx.Node, int]) -> dict[int, str]:
    """Tensor id -> canonical FQN of parameters, buffers and constants: the first name a compute
    node uses."""
    canonical: dict[int, str] = {}
    for n in graph_nodes:
        if n not in stage_of:
            continue
        if n.op == "call_module":
            sub = gm.get_submodule(n.target)
            for name, t in list(sub.named_parameters(prefix=n.target, remove_duplicate=False)) + \
                    list(sub.named_buffers(prefix=n.target, remove_duplicate=False)):
                canonical.setdefault(id(t), name)
        for m in n.all_input_nodes:
            if m.op == "get_attr":
                canonical.setdefault(id(resolve_attr(gm, m.target)), m.target)
    return canonical


def _stage_state(gm: fx.GraphModule, module_uses: list[str], attr_uses: list[fx.Node],
                 canonical: dict[int, str], param_ids: set[int], buffer_ids: set[int]) -> dict:
    """One stage's ``params``, ``buffers``, ``constants`` (canonical FQNs) and ``state_fqns``."""
    params: list[str] = []
    buffers: list[str] = []
    constants: list[str] = []
    state: dict[str, str] = {}

    def hold(name: str, c: str, into: list[str]) -> None:
        state[name] = c
        if c not in into:
            into.append(c)

    for target in module_uses:
        sub = gm.get_submodule(target)
        for name, p in sub.named_parameters(prefix=target, remove_duplicate=False):
            hold(name, canonical[id(p)], params)
        for name, b in sub.named_buffers(prefix=target, remove_duplicate=False):
            hold(name, canonical[id(b)], buffers)
    for m in attr_uses:
        obj = resolve_attr(gm, m.target)
        c = canonical[id(obj)]
        if id(obj) in param_ids:
            hold(c, c, params)
        elif id(obj) in buffer_ids:
            hold(c, c, buffers)
        elif isinstance(obj, torch.Tensor) and c not in constants:
            constants.append(c)
    return {"params": params, "buffers": buffers, "constants": constants, "state_fqns": state}


def _sharing(gm: fx.GraphModule, stages: list[StageBoundary], canonical: dict[int, str]
             ) -> tuple[dict[str, str], dict[str, list[int]], list[str]]:
    """Alias FQN -> canonical FQN, parameters held by several stages, unused parameters."""
    aliases: dict[str, str] = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + \
            list(gm.named_buffers(remove_duplicate=False)):
        c = canonical.get(id(t))
        if c is not None and c != name:
            aliases[name] = c
    users: dict[str, list[int]] = {}
    for st in stages:
        for c in st.params:
            users.setdefault(c, []).append(st.index)
    shared = {c: ss for c, ss in users.items() if len(ss) > 1}
    unused = [name for name, p in gm.named_parameters() if id(p) not in canonical]
    return aliases, shared, unused
