"""Exceptions raised by fxpipe. Every message names the problem and the fix.

The CLI catches :class:`FxpipeError` and prints its message without a traceback (exit code 2).
"""

import re


class FxpipeError(Exception):
    """Base class of all user-facing fxpipe errors."""


class SpecError(FxpipeError, ValueError):
    """The YAML spec is malformed or impossible (message gives file:line and the key path)."""


class TraceError(FxpipeError):
    """The model could not be traced (message names the construct that failed and what to do)."""


class PlanError(FxpipeError):
    """No valid partition exists (e.g. a stage cannot fit its device memory) or a plan file is bad."""


class RuntimeFailure(FxpipeError):
    """A pipeline run failed: a peer timed out, shapes disagreed with the plan, a rank died."""


class UsageError(FxpipeError):
    """A training script uses ``fxpipe.compile``'s pipeline in a way that cannot work (an
    optimizer over another rank's parameters, a batch that does not split, no process group);
    the message says how to fix the script."""


class SplitError(PlanError, ValueError):
    """A stage assignment cannot be split into stage modules (a tuple or non-tensor value crosses a
    boundary, stages do not follow data dependencies, shape metadata is missing)."""


class ScheduleError(PlanError):
    """A pipeline schedule is invalid or cannot be built for the given parameters.

    The message names the violated rule, the ranks/actions involved and the fix.
    """


class TrainingStopped(RuntimeFailure):
    """Training stopped for a reason that a restart would meet again (a non-finite loss, a
    dataset that fails); ``fxpipe run`` does not retry it."""


_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|c|h|hpp):\d+\]\s*")
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Connection was likely closed", "Socket closed")


#: what :func:`comm_error_text` says of a peer that closed its connection
PEER_GONE_TEXT = "the peer closed the connection (it stopped or failed)"


def peer_gone(e: BaseException) -> bool:
    """Whether ``e`` says that another process closed its connection (it ended first)."""
    return any(p in str(e) for p in (*_PEER_GONE, PEER_GONE_TEXT))


def failed_how(e: BaseException, timeout_s: float) -> str:
    """How a communication with a peer failed, for a message: ``failed`` when the peer closed
    its connection (that is immediate, no timeout involved), else ``failed or timed out after
    N s``."""
    return "failed" if peer_gone(e) else f"failed or timed out after {timeout_s:g} s"


def comm_error_text(e: BaseException) -> str:
    """What a gloo / NCCL / c10d exception says, in one short line: no C++ source locations
    (``[/__w/pytorch/.../pair.cc:537]``), no advice paragraphs, no stack frames; a peer that
    closed its connection is named as such."""
    text = " ".join(ln.strip() for ln in str(e).splitlines()[:3] if ln.strip()
                    and not ln.startswith(("Traceback", "Exception raised from", "frame #")))
    text = _SOURCE_LOCATION.sub("", text).strip()
    if any(p in text for p in _PEER_GONE):
        return PEER_GONE_TEXT
    end = text.find(". ")
    if 0 < end < 200:
        text = text[:end]
    return (text[:200].rstrip() or type(e).__name__)


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (DCP and c10d messages carry whole tracebacks and C++
    frames after it; their C++ source locations are dropped)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    head = lines[0][:300] if lines and not lines[0].startswith("Traceback") else ""
    if _SOURCE_LOCATION.search(head) or any(p in head for p in _PEER_GONE):
        head = comm_error_text(e)
    return f"{type(e).__name__}: {head}" if head else type(e).__name__
