"""A stage's expert regions on this rank's experts (expert parallelism of degree ``N``).

:func:`shard_experts` replaces every expert weight of the stage's regions
(:func:`fxpipe.experts.regions.find_regions`) by this rank's ``E/N`` experts (a new parameter
under the same name; shared between stages of the rank that read the same weight), and rewrites
the graph: each region entry is :func:`~fxpipe.experts.all_to_all.dispatch`-ed before the region
reads it, each exit :func:`~fxpipe.experts.all_to_all.combine`-d before anything outside reads
it. The region's ops keep dimension 0 as the expert and act per expert, so they run unchanged on
``[E/N, N C, ...]``. The stage keeps its inputs and outputs: every schedule runs it as before.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.execution.rebuild import rebuilt
from fxpipe.experts import all_to_all
from fxpipe.experts.regions import Region, find_regions
from fxpipe.tensor.rewrite import named


def local_experts(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s experts (of ``n`` ranks) of a weight with a leading expert dimension
    (a copy)."""
    return t.detach().chunk(n, dim=0)[rank].clone()


def shard_experts(gm: fx.GraphModule, group, rank: int, n: int,
                  done: dict[int, nn.Parameter] | None = None,
                  regions: list[Region] | None = None) -> tuple[fx.GraphModule, list[str]]:
    """The stage ``gm`` on this rank's experts (module doc); returns it and the names of its
    expert parameters. ``gm`` is not changed; ``done`` maps an original parameter's id to its
    slice (ties across the stages of a rank)."""
    done = {} if done is None else done
    regions = find_regions(gm) if regions is None else regions
    out = rebuilt(gm, gm.graph)
    weights = {w for r in regions for w in r.weights}
    for r in regions:
        if r.experts % n:
            raise ValueError(f"{r.experts} experts do not split over {n} ranks")
    names = []
    for name, old in list(out.named_parameters(remove_duplicate=False)):
        if name not in weights:
            continue
        if id(old) not in done:
            done[id(old)] = nn.Parameter(local_experts(old, rank, n),
                                         requires_grad=old.requires_grad)
            # the data-parallel reducer reduces it over the replicas holding the same experts
            done[id(old)].fxpipe_expert = True
        *prefix, leaf = name.split(".")
        mod = out
        for item in prefix:
            mod = getattr(mod, item)
        mod._parameters[leaf] = done[id(old)]
        names.append(name)
    send = named(lambda x: all_to_all.dispatch(x, group), "ep_dispatch")
    back = named(lambda y: all_to_all.combine(y, group), "ep_combine")
    rows_in = named(lambda x, offs, st, e: all_to_all.rows_dispatch(x, offs, st, e, group),
                     "ep_rows_dispatch")
    rows_out = named(lambda y, st: all_to_all.rows_combine(y, st, group), "ep_rows_combine")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inside = {name: r for r in regions for name in r.nodes}
    entry = {name for r in regions for name in r.entries}
    exits = {name: r for r in regions for name in r.exits}
    sent: dict[str, fx.Node] = {}
    combined: dict[str, fx.Node] = {}
    states: dict[int, fx.Node] = {}  # a dropless region's exchange, per call
    local_offsets: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        region = inside.get(node.name)
        in_region = region is not None

        def read(a: fx.Node) -> fx.Node:
            if in_region and region.kind == "dropless" and a.name == region.offsets:
                return local_offsets[id(region)]
            if in_region and a.name in entry:
                if a.name not in sent:
                    if region.kind == "dropless":
                        st = states.setdefault(id(region), graph.call_function(
                            all_to_all.rows_state, ()))
                        sent[a.name] = graph.call_function(
                            rows_in, (env[a.name], env[region.offsets], st, region.experts))
                        local_offsets.setdefault(id(region), graph.call_function(
                            all_to_all.rows_offsets, (sent[a.name], st)))
                    else:
                        sent[a.name] = graph.call_function(send, (env[a.name],))
                return sent[a.name]
            if not in_region and a.name in exits:
                if a.name not in combined:
                    r = exits[a.name]
                    combined[a.name] = graph.call_function(
                        rows_out, (env[a.name], states[id(r)])) if r.kind == "dropless" \
                        else graph.call_function(back, (env[a.name],))
                return combined[a.name]
            return env[a.name]

        if node.op == "placeholder":
            env[node.name] = graph.placeholder(node.name, type_expr=node.type)
        elif node.op == "get_attr":
            env[node.name] = graph.get_attr(node.target)
        elif node.op == "output":
            graph.output(fx.map_arg(node.args[0], read))
            continue
        else:
            args, kwargs = fx.map_arg((node.args, node.kwargs), read)
            env[node.name] = graph.create_node(node.op, node.target, args, kwargs, node.name)
        env[node.name].meta = dict(node.meta)
    graph.lint()
    return rebuilt(out, graph, class_name=type(gm).__name__), names
