"""What people read at a glance: pictures of a plan and a run, one offline report, progress.

Takes plain data: a :class:`~fxpipe.plans.plan.Plan`, the planner's unit graph read as plain
attributes (each unit's module path, FLOPs, the values on its edges), timeline events
(:mod:`fxpipe.schedule.timeline`: simulated or measured), a run folder's files; gives
matplotlib figures (returned for inspection, written as PNG + SVG by
:func:`~fxpipe.reports.figures.save_figure`) and ``report.html``:

* ``partition_picture``: blocks (units grouped by module path, or a folded plan's repeated
  blocks) in stage columns, coloured by cost, cut edges labelled with bytes per micro-batch,
  each stage's predicted time and memory, the bottleneck marked (``fxpipe plan --out``,
  ``fxpipe run``);
* ``timeline_picture``: one row per rank, F / B / W / send / receive / all-reduce / step /
  optimizer coloured, idle blank, each rank's bubble in the margin; simulated, measured or
  both on one time axis (``fxpipe simulate --out``, ``fxpipe run``);
* ``training_picture``: loss and held-out loss, throughput, against the step (``losses.csv``);
* ``report``: ``fxpipe report RUN_DIR`` -> ``report.html``, self-contained (inline SVG
  images, no script, no network);
* ``progress``: the training progress bar (plain lines off a terminal) and the planning
  spinner.

Imports plans, schedule, errors and units (matplotlib and tqdm inside the functions), never
the partitioner, the runtime or torch: the training side and the CLI call it.
"""
