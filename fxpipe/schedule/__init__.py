"""The model of one training step that the planner and the runtime share.

Takes a schedule name, pipeline size, micro-batches and the stage graph's edges (from a Plan);
gives per-rank action lists (``actions``: the one IR, with a parser for its text form ``1F3``),
built by the ``generators`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, V-Half, V-Min,
DualPipeV) and ``lowering``
(sends, receives, all-reduce, step), checked by ``validate``, priced by ``simulate`` (timeline,
bubble, memory) and written as Chrome traces by ``timeline`` (which also reads them back, names
each event's kind and cuts a measured timeline into steps, for :mod:`fxpipe.reports`). The
executor runs the same lists.
"""
