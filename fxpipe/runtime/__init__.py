"""The runtime: mesh -> schedules (action lists, :mod:`~fxpipe.runtime.actions`) -> validate /
simulate / execute, with data-parallel all-reduce and Chrome-trace timelines.

It reads a :class:`fxpipe.plan_data.Plan` and stage modules; it never imports the partitioner.
"""
