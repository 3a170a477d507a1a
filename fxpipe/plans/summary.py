"""The plan's text table: what ``fxpipe plan`` prints and ``summary.txt`` holds.

Takes a :class:`~fxpipe.plans.plan.Plan` (read through its attributes; this module does not
import the class, which imports it); gives plain fixed-width text, one row per stage plus footer
lines (bottleneck, lower bound, world size, schedule, prediction, tied parameters, explanations).
Units: seconds in the plan, shown as milliseconds; bytes with binary prefixes (KiB = 1024 B);
FLOPs with SI prefixes (G = 10^9).
"""

from __future__ import annotations

from fxpipe.units import human_bytes, human_flops, ms, plural

__all__ = ["summary_table", "bottleneck_position"]


def bottleneck_position(plan: "Plan") -> int:
    """Position in ``plan.stages`` of the bottleneck stage (plan's choice; argmax as fallback)."""
    for pos, st in enumerate(plan.stages):
        if st.index == plan.bottleneck_stage:
            return pos
    if not plan.stages:
        return -1
    return max(range(len(plan.stages)), key=lambda i: plan.stages[i].time_s)


# ---------------------------------------------------------------------------- summary table
def summary_table(plan: "Plan") -> str:
    """Readable fixed-width table of the plan's stages, followed by footer lines.

    Columns (one row per stage): stage index, pipeline rank holding it (see :meth:`Plan.stage_ranks`),
    number of FX nodes, parameters (FQN count / bytes), forward and backward FLOPs per
    micro-batch, bytes received and sent per micro-batch (forward direction), compute, comm and
    total (``time_s``) milliseconds per micro-batch, predicted peak memory, and ``*`` in the
    ``slowest`` column on the bottleneck stage. Footer: bottleneck and its time, lower bound
    (``plan.lower_bound_s``) and the ratio bottleneck / lower bound, ``pipeline x dp = world
    size``, micro-batches, schedule,
    the simulator's prediction when ``plan.predicted`` is set, tied parameters and the stages that
    hold them, and ``plan.explain``.

    Args:
        plan: any :class:`Plan` (an empty stage list gives a table with no rows).

    Returns:
        Plain text (no colour codes, no trailing newline), safe to write to ``summary.txt``.
    """
    ranks = plan.stage_ranks()
    bpos = bottleneck_position(plan)
    headers = [
        "stage", "rank", "nodes", "params", "fwd FLOPs", "bwd FLOPs",
        "recv/mb", "send/mb", "compute ms", "comm ms", "sends ms", "total ms", "memory",
        "slowest",
    ]
    rows: list[list[str]] = []
    for pos, st in enumerate(plan.stages):
        rows.append([
            str(st.index),
            str(ranks[pos]),
            str(len(st.nodes)) if st.nodes or not plan.folded else "blocks",
            f"{len(st.params)} / {human_bytes(st.param_bytes)}",
            human_flops(st.fwd_flops),
            human_flops(st.bwd_flops),
            human_bytes(st.recv_bytes),
            human_bytes(st.send_bytes),
            ms(st.compute_time_s),
            ms(st.comm_time_s),
            ms(st.send_time_s + (st.grad_send_time_s or 0.0)),
            ms(st.time_s),
            human_bytes(st.memory_bytes),
            "*" if pos == bpos else "",
        ])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    left = {0, 1, 2, 3}  # left-aligned columns: stage/rank/nodes/params read better that way

    def fmt(cells: list[str]) -> str:
        out = [c.ljust(w) if i in left or i == len(cells) - 1 else c.rjust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    v = plan.virtual_stages
    title = (f"fxpipe plan: {plan.model}  |  {plural(plan.num_stages, 'stage')} on "
             f"{plural(plan.pipeline, 'pipeline rank')}" + (f" x {v} virtual" if v > 1 else "")
             + f"  |  schedule {plan.schedule}")
    lines = [title, fmt(headers), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    if any(st.send_time_s or st.grad_send_time_s for st in plan.stages):
        lines.append("sends ms: one forward send and one gradient send of the stage, what they "
                     "cost its rank (gloo on CPU: the bytes copied on both sides); the predicted "
                     "step charges them, total ms does not")
    lines.append("")

    if bpos >= 0:
        b = plan.stages[bpos]
        lines.append(f"bottleneck:   stage {b.index} (rank {ranks[bpos]}), {ms(b.time_s)} ms per "
                     f"micro-batch (compute {ms(b.compute_time_s)} + comm {ms(b.comm_time_s)})")
        if plan.lower_bound_s > 0:
            ratio = b.time_s / plan.lower_bound_s
            lines.append(f"lower bound:  {ms(plan.lower_bound_s)} ms (total compute / "
                         f"{plural(plan.num_stages, 'stage')}); bottleneck / lower bound = "
                         f"{ratio:.3f}x")
        else:
            lines.append(f"lower bound:  {ms(plan.lower_bound_s)} ms (not computed); "
                         "bottleneck / lower bound = n/a")
    lines += _loss_lines(plan)
    if v > 1 and plan.stages:
        per_rank = [0.0] * max(1, plan.pipeline)
        for pos, st in enumerate(plan.stages):
            per_rank[ranks[pos]] += st.time_s
        lines.append("per rank:     " + ", ".join(
            f"rank {r} {ms(t)} ms" for r, t in enumerate(per_rank)))
    ps = len(plan.parameter_servers)
    t = getattr(plan, "tensor", 1)
    c = getattr(plan, "context", 1)
    lines.append(f"parallelism:  pipeline {plan.pipeline} x dp {plan.dp}"
                 + (f" x context {c} ({plan.context_attention} attention)" if c > 1 else "")
                 + (f" x tensor {t}" if t > 1 else "")
                 + (f" + {plural(ps, 'parameter server')}" if ps else "")
                 + f" = world size {plan.world_size}")
    if t > 1:
        lines += tensor_lines(plan)
    if ps:
        lines += _server_lines(plan)
    lines.append(f"micro-batches: {plan.microbatches} per step per replica, "
                 f"{plural(plan.microbatch_size, 'sample')} each")
    lines.append(f"schedule:     {plan.schedule}" + (f" ({v} virtual stages per rank)" if v > 1
                                                      else ""))
    pred = plan.predicted
    if pred is not None:
        lines.append(f"predicted:    step {ms(pred.step_time_s)} ms, bubble "
                     f"{100.0 * pred.bubble_fraction:.1f} %")
        if pred.peak_memory_bytes:
            peak = max(range(len(pred.peak_memory_bytes)), key=lambda i: pred.peak_memory_bytes[i])
            per = ", ".join(human_bytes(m) for m in pred.peak_memory_bytes)
            lines.append(f"peak memory:  {human_bytes(pred.peak_memory_bytes[peak])} "
                         f"(stage {peak}); per stage: {per}")
        if pred.peak_inflight:
            lines.append("in flight:    micro-batches held per stage: "
                         + ", ".join(str(k) for k in pred.peak_inflight))
    if plan.shared_params:
        aliases: dict[str, list[str]] = {}
        for alias, canon in sorted(plan.param_aliases.items()):
            aliases.setdefault(canon, []).append(alias)
        lines.append("shared (tied) parameters, gradients summed across their stages:")
        for fqn, stages in sorted(plan.shared_params.items()):
            extra = f" (alias {', '.join(aliases[fqn])})" if fqn in aliases else ""
            lines.append(f"  {fqn}{extra}: stages {', '.join(str(s) for s in stages)}")
    if plan.explain:
        lines.append("explain:")
        lines += [f"  {e}" for e in plan.explain]
    return "\n".join(lines)


def _loss_lines(plan) -> list[str]:
    """The stage that runs the loss on the model's output, and what its times include for it."""
    spec = getattr(plan, "spec", None)
    name = spec.train.loss if spec is not None else "loss"
    return [f"loss:         {name} on stage {st.index}, {ms(st.loss_time_s)} ms per micro-batch "
            "forward + backward (included in its compute ms)"
            for st in plan.stages if getattr(st, "loss_time_s", 0.0) > 0]


def _server_lines(plan: "Plan") -> list[str]:
    """``train.updates: async``: per parameter server, its rank, and per pipeline rank pushing
    to it the link (intra-/inter-node, GB/s), the bytes of one push (gradients) and one pull
    (weights) per step and their time on that link (``plan.server_links``), then the push and
    pull seconds per step the prediction priced per rank (``plan.server_priced_s``)."""
    table = plan.server_stage_bytes or []
    servers = len(plan.parameter_servers)
    loads = [sum(row[j] for row in table if j < len(row)) for j in range(servers)]
    out = ["parameter servers (per step each pipeline rank pushes its gradients and pulls its "
           "weights, the same bytes each way):"]
    for j, srank in enumerate(plan.parameter_servers):
        out.append(f"  server {j}: rank {srank}, {human_bytes(loads[j])} per replica each "
                   f"way, x {plan.dp} replicas")
        mine = [ln for ln in plan.server_links if ln.get("server") == j]
        for ln in mine:
            where = "inter-node" if ln["inter_node"] else "intra-node"
            b = human_bytes(ln["bytes"])
            out.append(f"    pipeline rank {ln['pipe_rank']}: {where} link {ln['GBps']:g} GB/s; "
                       f"push {b} and pull {b}, {ms(ln['seconds'])} ms each")
        if not mine and not plan.server_links:
            out.append("    links not recorded (re-create the plan with `fxpipe plan`)")
        elif not mine:
            out.append("    no parameter traffic (holds nothing)")
    if plan.server_priced_s:
        out.append("  priced in the predicted step (per stage the longer of the rank's round "
                   "trip and the server link carrying every replica's traffic, + 2 latencies): "
                   + ", ".join(f"rank {r} {ms(t)} ms" for r, t in enumerate(plan.server_priced_s)))
    return out


# ---------------------------------------------------------------------------- DOT


# ---------------------------------------------------------------------------- dump


def tensor_lines(plan: "Plan", shown: int = 12) -> list[str]:
    """Each parameter's sharding on the tensor group (the repeated blocks of a run collapsed
    to ``*``: ``h.*.attn.qkv.weight``), and what runs replicated inside its group."""
    import re

    groups: dict[tuple[str, str], int] = {}
    for name, text in plan.tensor_params.items():
        key = (re.sub(r"\.\d+\.", ".*.", name), text)
        groups[key] = groups.get(key, 0) + 1
    seq = " with sequence parallelism" if plan.sequence_parallel else ""
    if plan.tp_overlap > 1:
        seq += f", collectives overlapped in {plan.tp_overlap} chunks"
    out = [f"tensor parallelism {plan.tensor}{seq}: each rank of a tensor group holds its slice "
           "of these parameters (S(d): split on dim d; S(d,k): each of k blocks split), the "
           "others whole:"]
    rows = sorted(groups.items())
    for (pattern, text), n in rows[:shown]:
        out.append(f"  {pattern}: {text}" + (f" ({n} layers)" if n > 1 else ""))
    if len(rows) > shown:
        out.append(f"  ... {len(rows) - shown} more (plan.json: tensor_params)")
    if plan.tensor_replicated:
        out.append(f"replicated in their tensor group ({len(plan.tensor_replicated)}; correct, "
                   "priced as whole work on every rank):")
        for name, why in plan.tensor_replicated[:shown // 2]:
            out.append(f"  {name}: {why}")
        if len(plan.tensor_replicated) > shown // 2:
            out.append(f"  ... {len(plan.tensor_replicated) - shown // 2} more (plan.json: "
                       "tensor_replicated)")
    return out
