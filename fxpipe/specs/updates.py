"""The rules of ``train.updates: async`` (parameter servers), checked when a spec is loaded.

Asynchronous updates keep every stage's parameters and optimizer state on the
``cluster.parameter_servers`` last ranks; the replicas push gradients and pull weights at their
own pace, never using weights more than ``train.max_staleness`` server updates older than those
their gradient is applied to (:mod:`fxpipe.runtime.parameter_server`). Each rule below is a
``(key path, message)`` pair, which the loader turns into ``FILE:LINE``; the message says why the
combination cannot work and what to write instead. Every pipeline schedule is supported: each
replica runs its schedule as in sync mode, only what happens after its last backward differs.
"""

from __future__ import annotations

Problem = tuple[tuple[str, ...], str]


def update_problems(spec) -> list[Problem]:
    """Every rule (``spec``: a :class:`~fxpipe.specs.schema.ParallelSpec`) between
    ``train.updates``, ``train.max_staleness``, ``cluster.parameter_servers`` and the settings
    asynchronous updates cannot serve."""
    t, cl = spec.train, spec.cluster
    servers = cl.parameter_servers
    out: list[Problem] = []
    if servers and servers >= cl.world_size:
        out.append((("cluster", "parameter_servers"),
                    f"parameter_servers={servers} leaves none of the cluster's {cl.world_size} "
                    "devices to train; the servers are part of nodes x devices_per_node, so add "
                    "devices or use fewer servers"))
    if t.updates == "sync":
        if servers:
            out.append((("cluster", "parameter_servers"),
                        f"parameter_servers={servers} serves train.updates: async only; sync "
                        "updates all-reduce the gradients among the replicas. Set "
                        "train.updates: async (with train.max_staleness), or drop "
                        "parameter_servers"))
        if t.max_staleness is not None:
            out.append((("train", "max_staleness"),
                        "max_staleness applies to train.updates: async; sync replicas always "
                        "use the newest weights. Drop it, or set train.updates: async"))
        return out
    if not servers:
        out.append((("train", "updates"),
                    "updates: async keeps the parameters and optimizer state on parameter "
                    "servers, and the spec names none; set cluster.parameter_servers: N (the "
                    "last N devices serve; pipeline x data + N = nodes x devices_per_node)"))
    if t.max_staleness is None:
        out.append((("train", "updates"),
                    "updates: async needs train.max_staleness: S, how many server updates a "
                    "replica's weights may lag behind when its gradient is applied (0: every "
                    "update waits for every replica, the same training as sync; 1 to 4: a "
                    "slow replica holds the others back less)"))
    data = spec.parallel.data
    if data == 1:
        out.append((("parallel", "data"),
                    "updates: async lets replicas train at their own pace; with data: 1 there "
                    "is a single replica and nothing to wait for, so the servers would only add "
                    "a round trip per step. Use updates: sync, or data >= 2"))
    if t.precision == "fp16":
        out.append((("train", "precision"),
                    "fp16 loss scaling skips a step on every rank when any gradient overflows, a "
                    "decision all replicas take together, which async updates do not; use "
                    "precision: bf16 (no loss scaling) or fp32, or updates: sync"))
    if t.grad_compression != "none":
        out.append((("train", "grad_compression"),
                    f"grad_compression: {t.grad_compression} compresses the all-reduce, and "
                    "async updates have none: gradients travel to the parameter servers in fp32. "
                    "Set grad_compression: none, or updates: sync"))
    if t.grad_clip:
        out.append((("train", "grad_clip"),
                    "grad_clip clips the norm of the gradient over every replica, which no rank "
                    "sees under async updates (each replica's gradient is applied on its own); "
                    "set grad_clip: 0, or updates: sync"))
    if t.checkpoint.every:
        out.append((("train", "checkpoint", "every"),
                    "with async updates replicas hold weights of different versions, so only the "
                    "final checkpoint (the servers' weights and optimizer state after the last "
                    "update) is consistent; set checkpoint.every: 0"))
    if t.max_restarts:
        out.append((("train", "max_restarts"),
                    "restarts resume from a periodic checkpoint, which async updates do not "
                    "write; set max_restarts: 0, or updates: sync"))
    return out
