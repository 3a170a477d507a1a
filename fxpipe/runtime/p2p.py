"""Point-to-point transfers between pipeline ranks, every one bounded by a timeout.

One ``dist.isend`` / ``dist.irecv`` per tensor (no ``batch_isend_irecv``: reported unstable on
gloo, pytorch/pytorch #132644), and every Work handle is waited on with a timeout, so a peer that
never answers raises :class:`~fxpipe.errors.RuntimeFailure` instead of hanging.

Gloo matches messages by (source, tag); NCCL ignores tags and matches in issue order per pair of
ranks, which the schedules' send/receive order satisfies.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpipe.errors import RuntimeFailure, comm_error_text, failed_how


def tag_for(value_index: int, consumer: int, microbatch: int, backward: bool, num_stages: int,
            microbatches: int) -> int:
    """Message tag unique per (value, consumer stage, micro-batch, direction) within one step."""
    return ((value_index * num_stages + consumer) * microbatches + microbatch) * 2 + int(backward)


@dataclass
class Pending:
    """An in-flight send or receive: its Work, the tensor it reads/writes, and who it talks to."""

    work: object
    tensor: torch.Tensor
    peer: int | list[int]  # a collective: the other ranks taking part
    what: str


def describe_peers(peer: int | list[int]) -> tuple[str, str]:
    """``(who, whose logs)`` for a message about ``peer`` (one rank or the other ranks of a
    collective), e.g. ``("ranks 1, 2", "the logs of ranks 1, 2")``."""
    peers = [peer] if isinstance(peer, int) else list(peer)
    who = (f"rank {peers[0]}" if len(peers) == 1
           else "ranks " + ", ".join(map(str, peers)) if peers else "the other ranks")
    return who, (f"{who}'s log" if len(peers) == 1 else f"the logs of {who}")


def _failure(what: str, peer: int | list[int], context: str, timeout_s: float,
             err: BaseException) -> RuntimeFailure:
    who, logs = describe_peers(peer)
    one = isinstance(peer, int) or len(peer) == 1
    return RuntimeFailure(
        f"{context}: {what} with {who} {failed_how(err, timeout_s)}: "
        f"{comm_error_text(err)}. "
        f"Check {logs} (did {'it' if one else 'one'} crash or fall behind?); raise "
        "train.timeout_s if it is only slow")


def isend(tensor: torch.Tensor, dst: int, tag: int, what: str, context: str,
          timeout_s: float) -> Pending:
    """Start sending ``tensor`` (made contiguous) to global rank ``dst``; wait later with
    :func:`wait`. Raises RuntimeFailure if the send cannot even be posted."""
    t = tensor.detach().contiguous()
    try:
        work = dist.isend(t, dst, tag=tag)
    except Exception as e:
        raise _failure(what, dst, context, timeout_s, e) from None
    return Pending(work, t, dst, what)


def irecv(shape: list[int] | tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int,
          tag: int, what: str, context: str, timeout_s: float) -> Pending:
    """Post a receive of a fresh ``shape``/``dtype`` tensor from global rank ``src``."""
    buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    try:
        work = dist.irecv(buf, src, tag=tag)
    except Exception as e:
        raise _failure(what, src, context, timeout_s, e) from None
    return Pending(work, buf, src, what)


def wait(pending: Pending, context: str, timeout_s: float) -> torch.Tensor:
    """Wait for ``pending`` at most ``timeout_s`` seconds; return its tensor.

    Raises:
        RuntimeFailure: the peer did not answer in time or the connection failed; the message
            names this rank's context (stage, micro-batch, action) and the peer rank.
    """
    t0 = time.monotonic()
    try:
        pending.work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        waited = time.monotonic() - t0
        raise _failure(f"{pending.what} (waited {waited:.1f} s)", pending.peer, context,
                       timeout_s, e) from None
    return pending.tensor
