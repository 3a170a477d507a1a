"""Exceptions raised by fxpipe. Every message names the problem and the fix.

The CLI catches :class:`FxpipeError` and prints its message without a traceback (exit code 2).
"""


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


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (DCP and c10d messages carry whole tracebacks and C++
    frames after it)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    head = lines[0][:300] if lines and not lines[0].startswith("Traceback") else ""
    return f"{type(e).__name__}: {head}" if head else type(e).__name__
