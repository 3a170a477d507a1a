"""Diagnosis of a failed trace: what construct failed, where in the user's model, and the fix.

Takes the exception torch.export or torch.fx raised, the model and the tracer's name; gives one
:class:`~fxpipe.errors.TraceError` whose message names the construct (data-dependent control
flow, a non-tensor output, an unsupported op, ...), the innermost ``forward`` of the model's
submodules on the stack and the user's source line, and a workaround that applies.
"""

from __future__ import annotations

import linecache
import os
import traceback

import torch
import torch.nn as nn

from fxpipe.errors import TraceError

__all__ = ["trace_error"]


def _first_lines(text: str, limit: int = 600) -> str:
    text = " ".join(line.strip() for line in str(text).strip().splitlines()[:6] if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _user_location(exc: BaseException, model: nn.Module) -> tuple[str, str]:
    """Where tracing failed: the innermost ``forward`` of a submodule of ``model`` on the stack
    (its path and class) and the innermost source line outside torch itself.

    Returns:
        (readable location or "", module path or "").
    """
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    module = line = None
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            code = frame.f_code
            obj = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if obj is not None and id(obj) in paths and code.co_name == "forward":
                module = (paths[id(obj)], type(obj).__name__)
            fn = frame.f_code.co_filename
            if not fn.startswith(_TORCH_DIR) and not fn.startswith(os.path.dirname(__file__)):
                line = (fn, lineno)
        if module:
            break
        e = e.__cause__ or e.__context__
    parts = []
    if module:
        parts.append(f"module {module[0] or '<root>'!r} ({module[1]})")
    if line:
        src = linecache.getline(line[0], line[1]).strip()
        parts.append(f"{line[0]}:{line[1]}" + (f": `{src}`" if src else ""))
    return ", ".join(parts), (module[0] if module else "")


def _chain_text(exc: BaseException) -> str:
    parts, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def _classify(exc: BaseException, tracer: str, path: str = "") -> tuple[str, str]:
    """(construct, what to do) for a tracing failure inside module ``path`` (if known)."""
    leaf = f"leaf_modules=[{path!r}]" if path else "leaf_modules=['<module path>']"
    text = _chain_text(exc)
    low = text.lower()
    other = "export" if tracer == "fx" else "fx"
    if ("cannot be used as inputs to control flow" in low or "data-dependent" in low
            or "data dependent" in low or "guardondatadependent" in low
            or "could not guard on" in low or "unbacked" in low or "datadependent" in low):
        if tracer == "fx":
            return ("data-dependent control flow (a Python `if`/`while` on a traced value)",
                    "use tracer='export' (the default), which specialises shape-dependent "
                    "branches on the example inputs; if the branch depends on tensor VALUES, "
                    "rewrite it with torch.where or torch.cond")
        return ("data-dependent control flow (a Python branch on a tensor's values)",
                "rewrite the branch with torch.where or torch.cond (both branches traced), or "
                "move the value-dependent decision out of forward(); branches on shapes are "
                "fine. Passing example inputs of the real shapes also avoids shape guards.")
    if "co_varnames" in low or "**kwargs" in low or "var_keyword" in low or "varkw" in low:
        return ("a forward() with *args/**kwargs",
                "use tracer='export' (the default), which handles **kwargs forwards, or wrap the "
                "model in a module whose forward() takes explicit arguments")
    if "proxy object cannot be iterated" in low or "cannot be iterated" in low:
        return ("iteration over / unpacking of a traced value",
                "use tracer='export' (the default), or keep that submodule whole as one node "
                f"with trace(..., tracer='fx', {leaf})")
    if any(s in low for s in ("cannot be multiplied", "reduction dim", "size of tensor",
                              "shapes", "expected size", "size mismatch", "shape mismatch",
                              "must match the size", "expected input", "invalid for input of size",
                              "dimension out of range", "expected scalar type",
                              "expected all tensors to be on the same device",
                              "is not broadcastable", "positional argument", "takes ",
                              "missing", "unexpected keyword")):
        return ("the example inputs do not fit forward()",
                "pass example_inputs as a tuple of tensors with the shapes, dtypes and device "
                "forward() expects for ONE micro-batch, e.g. (torch.zeros(4, 128, dtype=torch."
                "long),)")
    if (isinstance(exc, NotImplementedError) or "could not run" in low or "no fake" in low
            or "meta tensor" in low or "unsupported" in low or "not supported" in low
            or "not implemented" in low):
        return ("an unsupported operator or Python construct",
                f"try tracer='{other}'; if an operator lacks a meta/fake kernel, register one with "
                "torch.library.register_fake, or build the model on CPU instead of the meta "
                "device")
    return ("an untraceable construct",
            f"try tracer='{other}', check example_inputs (a tuple with the shapes forward() "
            "expects for one micro-batch), or keep the failing submodule whole as one node with "
            f"trace(..., tracer='fx', {leaf})")


def trace_error(exc: BaseException, model: nn.Module, tracer: str, phase: str) -> TraceError:
    where, path = _user_location(exc, model)
    construct, fix = _classify(exc, tracer, path)
    msg = (f"could not trace {type(model).__name__} with tracer='{tracer}' ({phase}): {construct}"
           + (f"\n  where: {where}" if where else "")
           + f"\n  error: {type(exc).__name__}: {_first_lines(str(exc))}"
           + f"\n  what to do: {fix}")
    return TraceError(msg)
