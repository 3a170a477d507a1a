"""Command line: ``fxpipe plan|run|check|simulate|report|show|specs|profile|export``.

Every user error (a bad spec, an untraceable model, an impossible plan, a failed run) is printed
as one clear message on stderr with exit code 2, never as a traceback. ``FXPIPE_DEBUG=1`` shows
the traceback too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fxpipe.errors import FxpipeError

DEFAULT_SPEC = "gpt-char"


def _add_spec_arg(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "spec", nargs=None if required else "?", default=None if required else DEFAULT_SPEC,
        help=f"YAML spec path or bundled spec name (default: {DEFAULT_SPEC})",
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fxpipe",
        description="Declarative pipeline- and data-parallel compiler for PyTorch.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="trace, price and partition a model; print the stage table")
    _add_spec_arg(p)
    p.add_argument("--out", help="write plan.json, summary.txt, partition.dot and the partition "
                                 "picture (partition.png, partition.svg) here")

    r = sub.add_parser("run", help="plan, then train with torchrun (default: the bundled GPT)")
    _add_spec_arg(r)
    r.add_argument("--out", help="output directory (default: the spec's output.dir)")
    r.add_argument("--steps", type=int, help="override train.steps")
    r.add_argument("--overwrite", action="store_true",
                   help="if the output directory holds an earlier run, move it aside "
                        "(renamed, never deleted) instead of stopping")
    r.add_argument("--nnodes", type=int, default=1, help="torchrun --nnodes (multi-node: e.g. 2)")
    r.add_argument("--rdzv-endpoint", default=None,
                   help="host:port of the rendezvous (multi-node); default: loopback, free port")
    r.add_argument("--rdzv-id", default="fxpipe", help="torchrun --rdzv-id")
    r.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank, 0 .. --nnodes - 1 (torchrun --node-rank; node 0 runs "
                        "where --rdzv-endpoint points; default: node 0 there, the others in the "
                        "order they join)")
    r.add_argument("--bind", default=None, metavar="IFACE|ADDR",
                   help="network interface (or its address) the rendezvous and the "
                        "collectives listen on (multi-node; default: the one routing to the "
                        "rendezvous endpoint; single node: loopback)")
    r.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest checkpoint (under the "
                        "plan this spec gives now: another stage count, replicas or schedule)")
    r.add_argument("--no-report", action="store_true",
                   help="skip the pictures and report.html (a few seconds of drawing); "
                        "`fxpipe report RUN_DIR` writes them later")

    c = sub.add_parser("check", help="train N steps of the planned pipeline and of the same "
                                     "model in one process; compare losses and parameters "
                                     "(exit 0 equivalent, 1 not)")
    _add_spec_arg(c)
    c.add_argument("--steps", type=int, default=None,
                   help="optimizer steps to compare (default: 3, or train.steps if fewer)")

    e = sub.add_parser("export", help="write a run's latest checkpoint as a plain state_dict "
                                      "(torch.save) that the original model loads")
    e.add_argument("run_dir", help="the folder of a `fxpipe run`")
    e.add_argument("out", help="file to write, e.g. model.pt")

    s = sub.add_parser("simulate", help="predicted step time, bubble and memory per schedule")
    _add_spec_arg(s)
    s.add_argument("--out", help="write simulated timelines here: Chrome trace JSON and "
                                 "pictures (PNG, SVG) per schedule, simulated.png/svg for all")

    e = sub.add_parser("report", help="write report.html for a run folder: pictures, stages, "
                                      "spec, predicted vs measured, environment (offline)")
    e.add_argument("run_dir", help="the folder of a run (fxpipe run --out DIR)")
    e.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html)")

    f = sub.add_parser("profile", help="measure every planning unit's times on this machine "
                                       "(for cluster.costs: measured)")
    _add_spec_arg(f)
    f.add_argument("--repeats", type=int, default=5, help="timed runs per node (median)")
    f.add_argument("--no-send", action="store_true", help="skip measuring the send cost")

    d = sub.add_parser("prepare", help="tokenise the spec's data.files / data.hf_dataset once "
                                       "into token files (train.bin, val.bin)")
    _add_spec_arg(d, required=True)
    d.add_argument("--out", required=True, help="the folder for train.bin and val.bin")
    d.add_argument("--workers", type=int, default=None,
                   help="processes tokenising files in parallel (default: the CPUs, at most 8)")

    w = sub.add_parser("show", help="print the summary of a saved plan.json")
    w.add_argument("plan_json", help="path to plan.json (or a folder holding one)")

    sub.add_parser("specs", help="list the bundled example specs")
    return ap


def _cmd_plan(args) -> int:
    from fxpipe.partitioner.driver import plan_from_spec
    from fxpipe.training.launch import holds_run

    if args.out and holds_run(Path(args.out)):
        raise FxpipeError(
            f"{args.out} holds a training run whose plan must stay as it is; write the new plan "
            "to another folder with --out"
        )
    from fxpipe.reports.progress import planning_progress

    with planning_progress():  # a spinner with the planner's phases on a terminal
        plan, graph = plan_from_spec(args.spec)
    print(plan.summary())
    if args.out:
        from fxpipe.reports.partition_picture import write_partition_picture

        for path in plan.dump(args.out, graph) + write_partition_picture(plan, args.out, graph):
            print(f"wrote {path}")
    return 0


def _cmd_simulate(args) -> int:
    from fxpipe.partitioner.compare import simulate_spec
    from fxpipe.reports.progress import planning_progress

    results: dict = {}
    with planning_progress():
        text = simulate_spec(args.spec, out_dir=args.out, results=results)
    print(text)
    if args.out:
        from fxpipe.reports.timeline_picture import simulated_panel, write_timeline_picture

        panels = []
        for name, (plan, res) in results.items():
            panels.append(simulated_panel(plan, res, name, ident=f"timeline-{name}"))
            write_timeline_picture(panels[-1:], args.out, stem=f"simulated_{name}")
        if panels:
            write_timeline_picture(panels, args.out, stem="simulated",
                                   title=f"{plan.model}: every schedule, one time axis")
        print(f"wrote simulated timelines to {args.out}: simulated_<schedule>.json (Chrome "
              "trace), simulated_<schedule>.png/.svg, simulated.png/.svg (all schedules)")
    return 0


def _cmd_report(args) -> int:
    from fxpipe.reports.report import write_report

    print(f"wrote {write_report(args.run_dir, args.out)}")
    return 0


def _cmd_profile(args) -> int:
    from fxpipe.training.profiling import profile_spec

    if args.repeats < 1:
        raise FxpipeError(f"--repeats must be at least 1 (got {args.repeats})")
    print(profile_spec(args.spec, repeats=args.repeats, send=not args.no_send))
    return 0


def _cmd_prepare(args) -> int:
    from fxpipe.data.prepare import prepare
    from fxpipe.specs.loader import load_spec

    if args.workers is not None and args.workers < 1:
        raise FxpipeError(f"--workers must be at least 1 (got {args.workers})")
    res = prepare(load_spec(args.spec), Path(args.out), args.workers)
    print(f"wrote {res['train']} ({res['train_tokens']:,} tokens) and {res['val']} "
          f"({res['val_tokens']:,} tokens), {res['dtype']}, in {res['seconds']:.1f} s; train on "
          f"them with\n  data: {{tokens: {res['train']}, val_tokens: {res['val']}, "
          f"dtype: {res['dtype']}}}")
    return 0


def _cmd_show(args) -> int:
    from fxpipe.plans.plan import Plan

    path = Path(args.plan_json)
    if path.is_dir():
        path = path / "plan.json"
    if not path.exists():
        raise FxpipeError(f"{path}: no such plan file; create one with `fxpipe plan SPEC --out DIR`")
    plan = Plan.read(path)
    print(plan.summary())
    return 0


def _cmd_run(args) -> int:
    from fxpipe.training.launch import run

    return run(args)


def _cmd_check(args) -> int:
    from fxpipe.training.check import check

    return check(args.spec, args.steps)


def _cmd_export(args) -> int:
    from fxpipe.training.export import export_run

    path, n, step = export_run(args.run_dir, args.out)
    print(f"wrote {path}: {n} tensors (the model after step {step}); load it with "
          f"model.load_state_dict(torch.load({str(path)!r}))")
    return 0


def _cmd_specs(args) -> int:
    from fxpipe.specs.loader import list_bundled_specs

    print("\n".join(list_bundled_specs()))
    return 0


COMMANDS = {"plan": _cmd_plan, "run": _cmd_run, "simulate": _cmd_simulate, "show": _cmd_show,
            "specs": _cmd_specs, "profile": _cmd_profile, "report": _cmd_report,
            "export": _cmd_export, "prepare": _cmd_prepare, "check": _cmd_check}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fxpipe`` console script. Returns the process exit code."""
    args = _parser().parse_args(argv)
    # torch's C++ warnings (with stack frames) stay out of the user's terminal; set before torch
    # loads (commands import it lazily), inherited by the workers
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
    try:
        return COMMANDS[args.command](args)
    except FxpipeError as e:
        if os.environ.get("FXPIPE_DEBUG"):
            raise
        print(f"fxpipe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fxpipe: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a path the user gave cannot be read or written
        if os.environ.get("FXPIPE_DEBUG"):
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"fxpipe: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2


def console() -> None:
    """The ``fxpipe`` console script and ``python -m fxpipe``: :func:`main`, then exit with its
    code. The objects alive at the end are frozen out of the garbage collector first: the
    interpreter's final collections over torch's modules would otherwise take most of a
    second of CPU per command (each ``fxpipe`` and each planning process pays it)."""
    code = main()
    import gc

    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    console()
