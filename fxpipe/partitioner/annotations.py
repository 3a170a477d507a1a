"""User annotations that steer the partitioner: forced stage boundaries and pinned submodules.

    class Net(nn.Module):
        def forward(self, x):
            x = self.encoder(x)
            fxpipe.pipe_split()          # a stage boundary right here
            return self.decoder(x)

    fxpipe.annotate(net.decoder, stage=1)  # every node of net.decoder runs on stage 1

``pipe_split()`` is the custom operator ``torch.ops.fxpipe.pipe_split`` (schema ``() -> ()``, no
effect in eager mode). ``torch.export.export(..., strict=False)`` keeps it as a ``call_function``
node (an operator that returns nothing is kept because it may have side effects); under
``torch.fx`` symbolic tracing (fxpipe's ``tracer="fx"`` or a plain ``torch.fx.symbolic_trace``) it
records itself with the active tracer, since a call without Proxy arguments is otherwise invisible. ``fxpipe.partitioner.trace``
turns it into a forced cut and removes the node. The idea follows
``torch.distributed.pipelining.pipe_split`` (whose ``torch.ops.pippy._pipe_split`` marker is also
recognised by the tracer).

``annotate(module, stage=k)`` only sets an attribute on the module; the tracer maps it to every
graph node whose ``nn_module_stack`` contains that module's path (innermost annotation wins).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Any, Iterator

import torch
import torch.nn as nn

__all__ = ["pipe_split", "annotate", "PIPE_SPLIT_OPS", "STAGE_ATTR", "is_pipe_split"]

#: attribute set on a module by :func:`annotate` (value: the stage index, an ``int``).
STAGE_ATTR = "_fxpipe_stage"


def _register_op() -> Any:
    """Define ``fxpipe::pipe_split() -> ()`` once per process (idempotent on module reload)."""
    try:
        return torch.ops.fxpipe.pipe_split.default
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("fxpipe", "FRAGMENT")
    lib.define("pipe_split() -> ()")

    def _noop() -> None:
        return None

    # One CompositeExplicitAutograd kernel serves every backend (CPU, CUDA, Meta) and fake tensors.
    lib.impl("pipe_split", _noop, "CompositeExplicitAutograd")
    _register_op.lib = lib  # keep the Library alive: dropping it would unregister the op
    return torch.ops.fxpipe.pipe_split.default


_PIPE_SPLIT = _register_op()


def _known_split_ops() -> tuple[Any, ...]:
    ops = [_PIPE_SPLIT]
    try:  # torch.distributed.pipelining's marker, if that module was imported
        ops.append(torch.ops.pippy._pipe_split.default)
    except (AttributeError, RuntimeError):
        pass
    return tuple(ops)


#: operator targets that mark a forced stage boundary in a traced graph.
PIPE_SPLIT_OPS = _known_split_ops()

#: The ``torch.fx.Tracer`` of fxpipe's ``tracer="fx"`` while it traces (per thread and task);
#: :func:`pipe_split` records itself with it. Set through :func:`fx_tracer_active`.
_ACTIVE_FX_TRACER: contextvars.ContextVar[Any] = contextvars.ContextVar("fxpipe_fx_tracer",
                                                                          default=None)


@contextlib.contextmanager
def fx_tracer_active(tracer: Any) -> Iterator[None]:
    """Make ``tracer`` the one :func:`pipe_split` records with, for the ``with`` block."""
    token = _ACTIVE_FX_TRACER.set(tracer)
    try:
        yield
    finally:
        _ACTIVE_FX_TRACER.reset(token)


def is_pipe_split(node: torch.fx.Node) -> bool:
    """True when ``node`` is a pipe_split marker (fxpipe's or torch.distributed.pipelining's)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in PIPE_SPLIT_OPS:
        return True
    name = getattr(target, "name", None)
    return callable(name) and name() in ("fxpipe::pipe_split", "pippy::_pipe_split")


def _fx_symbolic_tracing() -> bool:
    """True inside ``torch.fx`` symbolic tracing (not torch.export / torch.compile)."""
    from torch.fx import _symbolic_trace as st

    fn = getattr(st, "is_fx_symbolic_tracing", None)
    if fn is not None:
        return bool(fn())
    return bool(getattr(st, "_is_fx_tracing_flag", False)) and not torch.compiler.is_compiling()


def _find_fx_tracer() -> Any:
    """The ``torch.fx.Tracer`` running a plain ``torch.fx.symbolic_trace`` (found on the stack:
    a call with no Proxy arguments is otherwise invisible to symbolic tracing)."""
    frame = sys._getframe(2)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, torch.fx.Tracer):
            return obj
        frame = frame.f_back
    return None


def pipe_split() -> None:
    """Force a pipeline stage boundary at this point of ``forward()``.

    Everything computed before the call (in program order) lands in an earlier stage than
    everything after it. In eager mode it does nothing (it costs one no-op operator call).

    Returns:
        None.
    """
    tracer = _ACTIVE_FX_TRACER.get()
    if tracer is None and _fx_symbolic_tracing():
        tracer = _find_fx_tracer()
    if tracer is not None:
        tracer.create_proxy("call_function", _PIPE_SPLIT, (), {})
        return None
    torch.ops.fxpipe.pipe_split()
    return None


def annotate(module: nn.Module, stage: int) -> nn.Module:
    """Pin ``module`` (and every graph node it computes) to pipeline stage ``stage``.

    Model-parallel placement by hand: the planner keeps all nodes of the module on that stage
    (the innermost annotated module wins when annotations nest). Annotating again replaces the
    previous stage.

    Args:
        module: a submodule of the model to be traced (or the model itself).
        stage: stage index, ``0 <= stage < num_stages`` (the upper bound is checked by the planner).

    Returns:
        ``module`` itself, so ``self.head = fxpipe.annotate(nn.Linear(...), stage=3)`` works.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``stage`` is not an int.
        ValueError: ``stage`` is negative.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"annotate(module, stage): module must be a torch.nn.Module, got "
            f"{type(module).__name__}; pass the submodule object, e.g. "
            f"annotate(model.h[3], stage=1)"
        )
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(
            f"annotate(module, stage): stage must be an int, got {stage!r} "
            f"({type(stage).__name__}); pass a stage index such as stage=0"
        )
    if stage < 0:
        raise ValueError(
            f"annotate(module, stage={stage}): stage must be >= 0; stages are numbered "
            f"0 .. num_stages-1 from the first (input) stage"
        )
    object.__setattr__(module, STAGE_ATTR, stage)
    return module
