"""Values every layer uses (masks, position ids, rotary tables, position bias): recompute or send.

Transformer graphs build some values once near the inputs and read them in every block: the
causal mask ``[B,1,T,T]``, position ids, Llama's rotary cos/sin, T5's relative position bias.
Cut into stages, each of them would cross every cut (a ``[B,1,T,T]`` mask is a third of the
bytes per cut for GPT-2 at T=512). A value whose *cone* (the compute nodes it is built from,
back to the model inputs, parameters, buffers and constants) is small and deterministic can be
rebuilt by each stage that reads it instead.

* :func:`recompute_cones` finds, for every node, its cone when it has one (at most
  :data:`MAX_CONE_NODES` nodes, no random or in-place op).
* :func:`cheaper_to_recompute` decides per value: rebuilding costs the cone's FLOPs (forward,
  and backward when a parameter is inside) on the device; sending costs its bytes over the
  fastest link (twice for a value with a gradient) plus the message latency. The planner prices
  a value to be recomputed as free to cross a cut.
* :func:`apply_recompute` rewrites the graph after the cut: every stage that reads such a value
  from an earlier stage gets its own copy of the cone (nodes named ``<node>__r<stage>``) and
  reads that. A parameter in the cone (T5's bias table) is then held by several stages, whose
  gradients the runtime sums like tied weights. The Plan records the choice
  (``Plan.recomputed``); workers apply the same rewrite, so their graphs match the plan's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.fx as fx

from fxpipe.partitioner.trace import COMPUTE_OPS

__all__ = ["MAX_CONE_NODES", "recompute_cones", "cheaper_to_recompute", "cheap_values",
           "apply_recompute", "is_clone", "clone_name"]

#: largest cone (compute nodes) worth rebuilding in another stage
MAX_CONE_NODES = 64

_CLONE = re.compile(r"__r\d+$")


def clone_name(node: str, stage: int) -> str:
    """Name of stage ``stage``'s copy of node ``node``."""
    return f"{node}__r{stage}"


def is_clone(name: str) -> bool:
    """Whether ``name`` is a recompute copy made by :func:`apply_recompute`."""
    return bool(_CLONE.search(name))


def _replayable(n: fx.Node) -> bool:
    """A node whose copy computes the same value: no randomness, no in-place writes."""
    if n.op != "call_function":
        return n.op == "call_method" and not str(n.target).endswith("_")
    tags = getattr(n.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    schema = getattr(n.target, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def recompute_cones(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Node name -> its cone (compute node names in graph order, the node last) for every node
    that can be rebuilt from model inputs, parameters, buffers and constants alone by at most
    :data:`MAX_CONE_NODES` replayable nodes."""
    cones: dict[str, frozenset[str]] = {}
    order: dict[str, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        order[n.name] = i
        if n.op not in COMPUTE_OPS or not _replayable(n):
            continue
        members: set[str] = {n.name}
        ok = True
        for m in n.all_input_nodes:
            if m.op in ("placeholder", "get_attr"):
                continue
            sub = cones.get(m.name)
            if sub is None:
                ok = False
                break
            members |= sub
            if len(members) > MAX_CONE_NODES:
                ok = False
                break
        if ok:
            cones[n.name] = frozenset(members)
    return {k: sorted(v, key=order.__getitem__) for k, v in cones.items()}


def cheaper_to_recompute(cone_flops: float, has_params: bool, nbytes: float, grad: bool,
                         flops_per_s: float, link_Bps: float, latency_s: float) -> bool:
    """Whether rebuilding a value (its cone's forward FLOPs) costs less than sending it
    (``nbytes`` over the link, again backward for a value with a gradient, plus the latency per
    message). A cone that holds parameters is rebuilt only when it does no matmul or
    convolution work (an embedding lookup such as T5's bias table): a copy of a layer's weights
    would cost their gradient exchange and memory in every stage."""
    if has_params and cone_flops > 0:
        return False
    rebuild = cone_flops / flops_per_s
    send = (2 if grad else 1) * (nbytes / link_Bps + latency_s)
    return rebuild < send


def apply_recompute(gm: fx.GraphModule, recomputed: Mapping[str, list[int]],
                    node_stage: dict[str, int]) -> dict[str, int]:
    """Give every stage in ``recomputed[value]`` its own copy of ``value``'s cone and make that
    stage's nodes read it. Deterministic: the planner and every worker get the same graph.

    Args:
        gm: the traced graph (edited in place, recompiled).
        recomputed: value name -> stages that rebuild it (the Plan's ``recomputed``).
        node_stage: FX node name -> stage for the original nodes.

    Returns:
        ``node_stage`` extended with the copies (``clone_name(node, stage) -> stage``).

    Raises:
        KeyError: a value has no cone in this graph (the graph is not the planned one).
    """
    if not recomputed:
        return dict(node_stage)
    cones = recompute_cones(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    anchor: dict[int, fx.Node] = {}  # first node of each stage: copies go right before it
    for n in gm.graph.nodes:
        s = node_stage.get(n.name)
        if s is not None and s not in anchor:
            anchor[s] = n
    out = dict(node_stage)
    # a copy -> the node it copies: a value rebuilt in one stage rewires its readers there to
    # the stage's copy, and a cone copied for another stage later must read that stage's own
    # copies, not the first stage's (which would then cross the cut after all)
    original: dict[fx.Node, fx.Node] = {}
    for value in sorted(recomputed):
        if value not in cones:
            raise KeyError(f"{value!r} cannot be recomputed in this graph")
        for s in sorted(recomputed[value]):
            users = [u for u in nodes[value].users if node_stage.get(u.name) == s]
            if not users:
                continue
            env: dict[fx.Node, fx.Node] = {}
            for name in cones[value]:
                src, cname = nodes[name], clone_name(name, s)
                if cname not in nodes:  # else already rebuilt for another value of this stage
                    with gm.graph.inserting_before(anchor[s]):
                        copy = gm.graph.node_copy(
                            src, lambda a: env.get(original.get(a, a), a))
                    copy._rename(cname)
                    if copy.name != cname:
                        raise KeyError(f"cannot name the copy of {name!r} {cname!r} "
                                       f"(got {copy.name!r})")
                    copy.meta = dict(src.meta)
                    nodes[cname] = copy
                    original[copy] = src
                    out[cname] = s
                env[src] = nodes[cname]
            for u in users:
                u.replace_input_with(nodes[value], env[nodes[value]])
    gm.graph.lint()
    gm.recompile()
    return out


def cheap_values(gm: fx.GraphModule, cone_flops: Mapping[str, float], param_targets: set[str],
                 value_bytes: Mapping[str, tuple[int, bool]], flops_per_s: float,
                 link_Bps: float, latency_s: float) -> set[str]:
    """The values cheaper to rebuild than to send (see :func:`cheaper_to_recompute`).

    Args:
        cone_flops: node name -> forward FLOPs of that node.
        param_targets: ``get_attr`` targets that are parameters (a cone reading one recomputes
            through it and sums its gradient).
        value_bytes: node name -> (bytes per micro-batch, whether a gradient flows back).
    """
    out = set()
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, cone in recompute_cones(gm).items():
        if name not in value_bytes:
            continue
        flops = sum(cone_flops.get(c, 0.0) for c in cone)
        params = any(m.op == "get_attr" and m.target in param_targets
                     for c in cone for m in nodes[c].all_input_nodes)
        nbytes, grad = value_bytes[name]
        if cheaper_to_recompute(flops, params, nbytes, grad, flops_per_s, link_Bps, latency_s):
            out.add(name)
    return out
