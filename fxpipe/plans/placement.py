"""Placement: which rank holds each stage, which node holds each rank, which link joins them.

The one owner of these rules; the planner prices links with them, the schedule generators place
stages with them, the runtime's mesh builds its groups with them and the views print them.

* Stage -> pipeline rank: one stage per rank, stage ``s`` on rank ``s``. With several stages per
  rank, the loop placement of interleaved 1F1B (Narayanan et al., SC'21): rank ``s % p``; for
  ``zb-v`` the V shape of Zero Bubble Pipeline Parallelism (Qi et al., 2024): chunks alternate
  direction, so rank ``r`` holds stages ``r`` and ``2p-1-r``.
* (pipeline rank, replica) -> global rank: ``replica * pipeline + pipeline_rank``, so a pipeline
  group is contiguous (fills a node first) and data-parallel groups stride across nodes.
* Global rank -> node: ``rank // devices_per_node``.
"""

from __future__ import annotations


def stage_to_rank(schedule: str, pipeline: int, num_stages: int) -> list[int]:
    """Pipeline rank (``0 .. pipeline-1``) of each of ``num_stages`` stages under ``schedule``."""
    p = max(1, int(pipeline))
    out = []
    for s in range(num_stages):
        chunk, pos = divmod(s, p)
        out.append(p - 1 - pos if schedule == "zb-v" and chunk % 2 == 1 else pos)
    return out


def global_rank(pipe_rank: int, dp_rank: int, pipeline: int) -> int:
    """``(pipe_rank, dp_rank)`` -> global rank ``dp_rank * pipeline + pipe_rank``."""
    return dp_rank * pipeline + pipe_rank


def rank_coords(rank: int, pipeline: int) -> tuple[int, int]:
    """Global ``rank`` -> ``(pipe_rank, dp_rank)`` for ``pipeline`` ranks per pipeline group."""
    return rank % pipeline, rank // pipeline


def node_of(rank: int, devices_per_node: int) -> int:
    """The node that holds global ``rank``."""
    return rank // max(1, int(devices_per_node))


def pair_crosses_nodes(a: int, b: int, pipeline: int, dp: int, devices_per_node: int) -> bool:
    """Whether pipeline ranks ``a`` and ``b`` sit on different nodes in any replica (the slowest
    replica's link bounds the step)."""
    return any(node_of(global_rank(a, d, pipeline), devices_per_node)
               != node_of(global_rank(b, d, pipeline), devices_per_node) for d in range(dp))


def ring_crosses_nodes(pipe_rank: int, pipeline: int, dp: int, devices_per_node: int) -> bool:
    """Whether the data-parallel group of pipeline rank ``pipe_rank`` spans several nodes."""
    return len({node_of(global_rank(pipe_rank, d, pipeline), devices_per_node)
                for d in range(dp)}) > 1
