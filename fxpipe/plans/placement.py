"""Placement: which rank holds each stage, which node holds each rank, which link joins them.

The one owner of these rules; the planner prices links with them, the schedule generators place
stages with them, the runtime's mesh builds its groups with them and the views print them.

* Stage -> pipeline rank: one stage per rank, stage ``s`` on rank ``s``. With several stages per
  rank, the loop placement of interleaved 1F1B (Narayanan et al., SC'21): rank ``s % p``; for
  ``zb-v``, ``v-half``, ``v-min`` and ``dualpipev`` the V shape of Zero Bubble Pipeline
  Parallelism (Qi et al., 2024), also DualPipeV's: chunks alternate direction, so rank ``r``
  holds stages ``r`` and ``2p-1-r``.
* (pipeline rank, replica, tensor rank) -> global rank, by the plan's layout: the tensor
  group is innermost (its ``t`` ranks adjacent, inside one node: its collectives run on every
  layer), then ``pipeline-inner`` (default) ``replica * pipeline + pipeline_rank``, so a
  pipeline group is contiguous (fills a node first: stage-to-stage traffic stays inside a node)
  and data-parallel groups stride across nodes; ``data-inner`` ``pipeline_rank * dp +
  replica``, so a stage's replicas share a node (the all-reduce stays inside it) and the
  pipeline strides across nodes. That grid position times ``t`` plus the tensor rank is the
  global rank. Planning the grid on nodes of ``devices_per_node / t`` slots
  (:func:`grid_slots_per_node`) gives every link of it the same answer.
* Global rank -> node: ``rank // devices_per_node``.
* Parameter servers (``train.updates: async``): the last ranks, after the grid
  (:func:`server_ranks`), so they take the last node's last devices.
"""

from __future__ import annotations

import functools

from fxpipe.specs.schema import V_SCHEDULES

#: the two ways of laying the pipeline x data grid onto ranks
LAYOUTS = ("pipeline-inner", "data-inner")


def stage_to_rank(schedule: str, pipeline: int, num_stages: int) -> list[int]:
    """Pipeline rank (``0 .. pipeline-1``) of each of ``num_stages`` stages under ``schedule``."""
    p = max(1, int(pipeline))
    out = []
    for s in range(num_stages):
        chunk, pos = divmod(s, p)
        out.append(p - 1 - pos if schedule in V_SCHEDULES and chunk % 2 == 1 else pos)
    return out


def global_rank(pipe_rank: int, dp_rank: int, pipeline: int, dp: int = 1,
                layout: str = "pipeline-inner", tensor: int = 1, tp_rank: int = 0) -> int:
    """``(pipe_rank, dp_rank, tp_rank)`` -> global rank: the grid position
    ``dp_rank * pipeline + pipe_rank`` (``pipeline-inner``) or ``pipe_rank * dp + dp_rank``
    (``data-inner``), times ``tensor``, plus ``tp_rank``."""
    if layout == "data-inner":
        return (pipe_rank * dp + dp_rank) * tensor + tp_rank
    return (dp_rank * pipeline + pipe_rank) * tensor + tp_rank


def rank_coords(rank: int, pipeline: int, dp: int = 1,
                layout: str = "pipeline-inner", tensor: int = 1) -> tuple[int, int]:
    """Global ``rank`` -> ``(pipe_rank, dp_rank)`` (the inverse of :func:`global_rank`; the
    tensor rank is ``rank % tensor``)."""
    rank //= tensor
    if layout == "data-inner":
        return rank // dp, rank % dp
    return rank % pipeline, rank // pipeline


def grid_slots_per_node(devices_per_node: int, tensor: int = 1) -> int:
    """Positions of the pipeline x data grid one node holds: its devices over the tensor
    degree (a tensor group never spans nodes)."""
    return max(1, int(devices_per_node) // max(1, int(tensor)))


def replicas_fit_node(nodes: int, devices_per_node: int, replicas: int, tensor: int = 1
                      ) -> bool:
    """Whether groups of ``replicas`` consecutive replicas (of ``tensor`` ranks each: a
    context or expert group) lie inside one node: one node, or groups dividing a node's
    devices, with a stage's replicas on adjacent ranks (``data-inner``, or one pipeline
    rank)."""
    k = replicas * max(1, int(tensor))
    return nodes == 1 or devices_per_node % k == 0


def node_of(rank: int, devices_per_node: int) -> int:
    """The node that holds global ``rank``."""
    return rank // max(1, int(devices_per_node))


def pair_crosses_nodes(a: int, b: int, pipeline: int, dp: int, devices_per_node: int,
                       layout: str = "pipeline-inner") -> bool:
    """Whether pipeline ranks ``a`` and ``b`` sit on different nodes in any replica (the slowest
    replica's link bounds the step).

    Only the first ``devices_per_node`` replicas are looked at: replica ``d + devices_per_node``
    sits exactly ``pipeline`` nodes (pipeline-inner) or one node (data-inner) after replica ``d``
    for both ranks, so it answers the same (O(devices per node), not O(dp))."""
    return any(node_of(global_rank(a, d, pipeline, dp, layout), devices_per_node)
               != node_of(global_rank(b, d, pipeline, dp, layout), devices_per_node)
               for d in range(min(dp, replica_period(devices_per_node))))


def replica_period(devices_per_node: int) -> int:
    """Replicas ``d`` and ``d + devices_per_node`` of a pipeline rank pair are laid out alike
    (shifted by whole nodes) under both layouts: which pairs cross nodes repeats with this
    period over the replicas."""
    return max(1, int(devices_per_node))


def ring_crosses_nodes(pipe_rank: int, pipeline: int, dp: int, devices_per_node: int,
                       layout: str = "pipeline-inner") -> bool:
    """Whether the data-parallel group of pipeline rank ``pipe_rank`` spans several nodes.

    A rank's node does not decrease with the replica under either layout, so the group spans
    several nodes exactly when its first and last replicas sit on different ones."""
    return (node_of(global_rank(pipe_rank, 0, pipeline, dp, layout), devices_per_node)
            != node_of(global_rank(pipe_rank, max(0, dp - 1), pipeline, dp, layout),
                       devices_per_node))


@functools.lru_cache(maxsize=4096)
def ring_members_per_node(pipeline: int, dp: int, devices_per_node: int,
                          layout: str = "pipeline-inner") -> tuple[int, ...]:
    """Per pipeline rank, the fewest members its data-parallel group has on any node it spans
    (``dp`` when it stays in one node). On rail-optimised GPU nodes each member has its own
    NIC, so a ring that crosses nodes runs that many NICs in parallel."""
    import numpy as np

    r = np.arange(pipeline)[:, None]
    d = np.arange(dp)[None, :]
    pos = r * dp + d if layout == "data-inner" else d * pipeline + r
    nodes = pos // max(1, int(devices_per_node))
    out = []
    for row in nodes:  # nodes do not decrease along a row: run lengths are the counts
        edges = np.flatnonzero(np.diff(row)) + 1
        runs = np.diff(np.concatenate(([0], edges, [row.size])))
        out.append(int(runs.min()))
    return tuple(out)


def nodes_of_stage_rank(pipe_rank: int, pipeline: int, dp: int, devices_per_node: int,
                        layout: str = "pipeline-inner") -> set[int]:
    """The nodes holding pipeline rank ``pipe_rank`` in some replica."""
    return {node_of(global_rank(pipe_rank, d, pipeline, dp, layout), devices_per_node)
            for d in range(dp)}


def server_ranks(pipeline: int, dp: int, servers: int) -> list[int]:
    """Global ranks of ``servers`` parameter servers: the ones after the ``pipeline x dp`` grid."""
    return list(range(pipeline * dp, pipeline * dp + servers))


def server_link_crosses_nodes(pipe_rank: int, server_rank: int, pipeline: int, dp: int,
                              devices_per_node: int, layout: str = "pipeline-inner") -> bool:
    """Whether pipeline rank ``pipe_rank`` sits on another node than global rank ``server_rank``
    in any replica (the slowest replica's link bounds the step)."""
    home = node_of(server_rank, devices_per_node)
    # the rank's node does not decrease with the replica: all replicas are on ``home`` exactly
    # when the first and the last are
    return any(node_of(global_rank(pipe_rank, d, pipeline, dp, layout), devices_per_node) != home
               for d in {0, max(0, dp - 1)})
