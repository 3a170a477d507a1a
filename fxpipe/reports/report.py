"""``fxpipe report RUN_DIR``: one offline HTML page for a training run.

Takes a run folder (``plan.json``, ``losses.csv``, ``eval.json``, ``timeline.json``,
``environment.json``, the pictures) and gives ``report.html``: the pictures (partition,
predicted and measured timeline on one time axis, training), predicted vs measured step time
and bubble, the plan's stage table (every stage named) and its text summary, the planner's
explanation (the auto-search ranking when the layout was searched), the spec used and the
environment (torch version, world size, backend, devices). The timeline and training pictures
are drawn again from the run's files (and written next to them); the partition picture is the
run's own (drawn at block granularity from the planner's graph) or, when missing, drawn from
the plan.

The page is self-contained: pictures are inline ``data:`` SVG images, styles are inline, there
is no script, font, stylesheet or link to load, and a Content-Security-Policy forbids any
network load, so it opens from disk anywhere.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import statistics
from pathlib import Path
from typing import Any

from fxpipe.errors import FxpipeError
from fxpipe.plans.plan import Plan
from fxpipe.plans.summary import bottleneck_position
from fxpipe.units import human_bytes, human_flops, ms, plural

__all__ = ["write_report", "write_run_pictures", "REPORT_FILE", "RUN_PICTURES"]

#: the report's file name inside the run folder
REPORT_FILE = "report.html"
#: the picture stems a run folder holds (each as .png and .svg)
RUN_PICTURES = ("partition", "timeline", "training")

_CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; font-src 'none'; "
        "script-src 'none'; connect-src 'none'")

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;
margin:24px auto;max-width:1180px;color:#1d1d1f;padding:0 16px;line-height:1.45}
h1{font-size:1.55em;margin:0 0 4px} h2{font-size:1.2em;margin:28px 0 8px;border-bottom:1px solid
#ddd;padding-bottom:3px} .sub{color:#555;margin:0 0 14px}
table{border-collapse:collapse;font-size:.88em;margin:6px 0} th,td{border:1px solid #ddd;
padding:3px 8px;text-align:right} th{background:#f3f3f5} td.l,th.l{text-align:left}
tr.bottleneck td{background:#fde8e8;font-weight:600}
pre{background:#f7f7f9;border:1px solid #e3e3e8;padding:8px 10px;overflow-x:auto;font-size:.8em}
img{max-width:100%;height:auto;border:1px solid #eee;background:#fff} figure{margin:8px 0 18px}
figcaption{color:#555;font-size:.85em} .kv td:first-child{text-align:left;color:#444}
.grid{display:flex;gap:28px;flex-wrap:wrap} .note{color:#666;font-size:.85em}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _img(svg: str, alt: str, ident: str) -> str:
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f'<img id="{ident}" alt="{_esc(alt)}" src="data:image/svg+xml;base64,{data}">'


def _table(headers: list[str], rows: list[list[str]], left: int = 1,
           row_class: dict[int, str] | None = None, ident: str = "") -> str:
    row_class = row_class or {}
    head = "".join(f'<th class="l">{_esc(h)}</th>' if i < left else f"<th>{_esc(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for k, r in enumerate(rows):
        cls = f' class="{row_class[k]}"' if k in row_class else ""
        cells = "".join(f'<td class="l">{_esc(c)}</td>' if i < left else f"<td>{_esc(c)}</td>"
                        for i, c in enumerate(r))
        body.append(f"<tr{cls}>{cells}</tr>")
    idattr = f' id="{ident}"' if ident else ""
    return f"<table{idattr}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _is_ours(svg_path: Path) -> bool:
    try:
        return "stage-column-" in svg_path.read_text(errors="replace")
    except OSError:
        return False


def write_run_pictures(run_dir: str | Path, plan: Plan | None = None, graph: Any = None,
                       partition: bool = False) -> dict[str, list[Path]]:
    """Draw the run folder's pictures from its files: ``timeline`` (the plan's simulated step
    over one measured step of ``timeline.json``, one time axis) and ``training`` (from
    ``losses.csv`` and ``eval.json``), each where its input exists; ``partition`` too when
    asked, or when the folder has none of ours (from ``graph`` when given, else from the plan).

    Returns:
        picture stem -> paths written.
    """
    from fxpipe.reports.partition_picture import write_partition_picture
    from fxpipe.reports.timeline_picture import (measured_panel, simulated_panel,
                                                 write_timeline_picture)
    from fxpipe.reports.training_picture import write_training_picture
    from fxpipe.schedule.timeline import read_chrome_trace

    run = Path(run_dir)
    plan = plan or Plan.load(run / "plan.json")
    out: dict[str, list[Path]] = {}
    if partition or not _is_ours(run / "partition.svg"):
        out["partition"] = write_partition_picture(plan, run, graph)
    panels = []
    try:
        panels.append(simulated_panel(plan))
    except FxpipeError:
        pass
    if (run / "timeline.json").exists():
        events = read_chrome_trace(run / "timeline.json")
        if events:
            panels.append(measured_panel(events, plan))
    if panels:
        out["timeline"] = write_timeline_picture(
            panels, run, title=f"{plan.model}: predicted (simulated) and measured step, "
                               "one time axis")
    if (run / "losses.csv").exists():
        out["training"] = write_training_picture(run, title=f"{plan.model}: training")
    return out


def _measured(run: Path, plan: Plan) -> dict[str, Any]:
    from fxpipe.reports.timeline_picture import measured_steps_summary
    from fxpipe.reports.training_picture import read_training_log
    from fxpipe.schedule.timeline import read_chrome_trace

    m: dict[str, Any] = {}
    if (run / "timeline.json").exists():
        try:
            m["timeline"] = measured_steps_summary(read_chrome_trace(run / "timeline.json"),
                                                   range(plan.world_size))
        except ValueError:
            m["timeline"] = None
    if (run / "losses.csv").exists():
        log = read_training_log(run)
        m["log"] = log
    return m


def _overview(plan: Plan, measured: dict[str, Any]) -> str:
    pred = plan.predicted
    tl = measured.get("timeline")
    log = measured.get("log")
    k = plan.spec.train.grad_accumulation if plan.spec is not None else 1
    rows = []
    rows.append(["step time: one global batch through the schedule",
                 f"{ms(pred.step_time_s)} ms" if pred else "n/a",
                 (f"{ms(tl['step_time_s'])} ms (median of {int(tl['steps']) - 1 or 1} "
                  f"steps, timeline.json)") if tl else "n/a"])
    rows.append(["bubble: mean idle share of the step per rank (busy = F/B/W)",
                 f"{100 * pred.bubble_fraction:.1f} %" if pred else "n/a",
                 f"{100 * tl['bubble_fraction']:.1f} % (median)" if tl else "n/a"])
    if log is not None and log.step_times_s:
        body = log.step_times_s[1:] if len(log.step_times_s) > 1 else log.step_times_s
        rows.append([f"optimizer step: {plural(k, 'global batch')} + clipping and the optimizer",
                     f"{ms(k * pred.step_time_s)} ms (batches only)" if pred else "n/a",
                     f"{ms(statistics.median(body))} ms (median, losses.csv)"])
        rates = [v for v in log.throughput[1:] or log.throughput if v == v]
        if rates:
            rows.append([f"throughput ({log.unit}/s)", "",
                         f"{statistics.median(rates):,.0f} (median)"])
    if log is not None and log.losses:
        rows.append(["training loss: first step -> last step", "",
                     f"{log.losses[0]:.4f} -> {log.losses[-1]:.4f}"])
        if len(log.heldout) == 2:
            rows.append(["held-out loss: initial -> trained", "",
                         f"{log.heldout[0][1]:.4f} -> {log.heldout[1][1]:.4f}"])
    return _table(["", "predicted", "measured"], rows, ident="predicted-vs-measured")


def _stage_table(plan: Plan) -> str:
    ranks = plan.stage_ranks()
    bpos = bottleneck_position(plan)
    peaks = plan.predicted.peak_memory_bytes if plan.predicted else []
    rows = []
    for pos, st in enumerate(plan.stages):
        nodes = str(len(st.nodes)) if st.nodes or not plan.folded else \
            plural(sum(1 for s in plan.folded.get("blocks", []) if s == st.index), "block")
        rows.append([f"stage {st.index}", str(ranks[pos]), nodes,
                     f"{len(st.params)} / {human_bytes(st.param_bytes)}",
                     human_flops(st.fwd_flops), human_flops(st.bwd_flops),
                     human_bytes(st.recv_bytes), human_bytes(st.send_bytes),
                     ms(st.compute_time_s), ms(st.comm_time_s), ms(st.time_s),
                     human_bytes(peaks[st.index] if st.index < len(peaks) else st.memory_bytes),
                     "bottleneck" if pos == bpos else ""])
    return _table(["stage", "rank", "nodes", "params", "fwd FLOPs", "bwd FLOPs", "recv / mb",
                   "send / mb", "compute ms", "comm ms", "total ms", "peak memory", ""],
                  rows, left=3, row_class={bpos: "bottleneck"}, ident="stages")


def _environment(run: Path, plan: Plan) -> str:
    env = _read_json(run / "environment.json")
    rows: list[list[str]] = []
    if isinstance(env, dict):
        for key, label in (("torch", "torch"), ("python", "Python"), ("platform", "platform"),
                           ("world_size", "world size"), ("backend", "backend"),
                           ("nnodes", "nodes"), ("cuda", "CUDA"), ("started", "started")):
            if env.get(key) not in (None, ""):
                rows.append([label, str(env[key])])
        devices = env.get("devices") or []
        hosts = env.get("hosts") or []
        per_rank = [f"rank {r}: {d}" + (f" on {hosts[r]}" if r < len(hosts) else "")
                    for r, d in enumerate(devices)]
        if per_rank:
            rows.append(["devices", "; ".join(per_rank)])
    else:
        device = plan.spec.cluster.device if plan.spec is not None else "?"
        rows = [["world size", str(plan.world_size)], ["device", device],
                ["recorded", "no environment.json in the run folder (the run predates it)"]]
    from fxpipe import __version__

    rows.append(["fxpipe", __version__])
    return _table(["", ""], rows, ident="environment")


def write_report(run_dir: str | Path, out: str | Path | None = None,
                 pictures: bool = True) -> Path:
    """Write ``report.html`` for the run folder ``run_dir`` (or to ``out``).

    Args:
        run_dir: a folder written by ``fxpipe run`` (it must hold ``plan.json``).
        out: the HTML file to write; default ``RUN_DIR/report.html``.
        pictures: draw the timeline and training pictures again from the run's files first
            (:func:`write_run_pictures`); False uses the pictures in the folder as they are.

    Returns:
        The path written.

    Raises:
        FxpipeError: ``run_dir`` is not a run folder, or ``plan.json`` cannot be read.
    """
    import yaml

    run = Path(run_dir)
    if not (run / "plan.json").exists():
        raise FxpipeError(f"{run}: no plan.json here; pass the folder of a run "
                          "(`fxpipe run --out DIR` writes one)")
    plan = Plan.read(run / "plan.json")
    if pictures:
        write_run_pictures(run, plan)
    spec = plan.spec.model_dump(mode="json") if plan.spec is not None else {}
    measured = _measured(run, plan)
    parts = []
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    parts.append(f"<h1>fxpipe run report: {_esc(plan.model)}</h1>")
    parts.append(f'<p class="sub">{_esc(run.resolve())} &middot; {plural(plan.num_stages, "stage")}'
                 f" on {plural(plan.pipeline, 'pipeline rank')} x dp {plan.dp}"
                 + (f" x tensor {plan.tensor}" + (" (sequence parallel)" if plan.sequence_parallel
                                                  else "") if plan.tensor > 1 else "")
                 + f" (world size {plan.world_size}), schedule {_esc(plan.schedule)}, "
                 f"{plan.microbatches} micro-batch{'' if plan.microbatches == 1 else 'es'} of "
                 f"{plural(plan.microbatch_size, 'sample')}"
                 f" &middot; report written {when}</p>")
    parts.append("<h2>Predicted vs measured</h2>")
    parts.append(_overview(plan, measured))
    parts.append('<p class="note">Predicted: the simulator on the plan\'s cost model. Measured: '
                 "wall-clock per rank (timeline.json), the first step excluded (start-up). "
                 "A blocking receive counts as idle in both.</p>")
    captions = {
        "partition": "Partition: blocks (grouped by module path) in stage columns, coloured by "
                     "FLOPs; red arrows are the bytes per micro-batch that cross a cut; under "
                     "each column its predicted time and memory; the bottleneck is outlined.",
        "timeline": "Schedule timeline: predicted (top, pipeline ranks) and one measured step "
                    "(bottom, every rank) on the same time axis; idle time is blank, thin lines "
                    "are waits; each rank's bubble on the right.",
        "training": "Training: loss and held-out loss, and throughput, per optimizer step.",
    }
    for stem in RUN_PICTURES:
        svg = run / f"{stem}.svg"
        parts.append(f"<h2>{stem.capitalize()}</h2>")
        if svg.exists():
            parts.append(f"<figure>{_img(svg.read_text(), captions[stem], 'picture-' + stem)}"
                         f"<figcaption>{_esc(captions[stem])}</figcaption></figure>")
        else:
            parts.append(f'<p class="note">no {stem} picture (its input is not in the run '
                         "folder)</p>")
    parts.append("<h2>Stages</h2>")
    parts.append(_stage_table(plan))
    parts.append(f"<details><summary>the plan's summary (summary.txt)</summary><pre>"
                 f"{_esc(plan.summary())}</pre></details>")
    searched = plan.spec is not None and any(
        str(v) == "auto" for v in plan.spec.parallel.model_dump().values())
    parts.append("<h2>" + ("Auto-search ranking" if searched else "Planner's notes") + "</h2>")
    if plan.explain:
        parts.append(f'<pre id="explain">{_esc(chr(10).join(plan.explain))}</pre>')
    if not searched:
        parts.append('<p class="note">no search: the spec fixes pipeline, data, micro-batches '
                     "and schedule" + ("" if plan.explain else "; the planner added no notes")
                     + "</p>")
    parts.append("<h2>Spec</h2>")
    parts.append(f'<pre id="spec">{_esc(yaml.safe_dump(spec, sort_keys=False))}</pre>')
    parts.append("<h2>Environment</h2>")
    parts.append(_environment(run, plan))
    files = sorted(p for p in run.iterdir() if p.is_file() and not p.name.startswith("."))
    parts.append("<h2>Files</h2>")
    parts.append(_table(["file", "size"], [[p.name, human_bytes(p.stat().st_size)]
                                           for p in files if p.name != REPORT_FILE]))
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>fxpipe report: {_esc(plan.model)} ({_esc(run.name)})</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
    target = Path(out) if out else run / REPORT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(target)
    return target
