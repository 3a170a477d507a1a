"""The partitioner: trace -> cost -> graph -> planner (chain + planner) -> split.

Each module has one job; they meet the runtime only through :class:`fxpipe.plan_data.Plan`
(assembled by :mod:`fxpipe.api`).
"""
