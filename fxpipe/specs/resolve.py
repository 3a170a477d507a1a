"""Resolve ``"package.module:attr"`` strings of a spec and build its model.

Used for ``model.factory``, ``data.dataset`` and ``train.loss`` (when it is not a built-in name).
The form is the one of setuptools entry points: a module import path, a colon, then an attribute
path inside the module (``"fxpipe.examples.gpt:CharGPT"``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from typing import Any, Callable

from fxpipe.errors import SpecError
from fxpipe.specs.source import location

_IDENT = r"[A-Za-z_]\w*"
_REF = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")


def _prefix(spec: Any, what: str) -> str:
    where = location(spec, what) if spec is not None else ""
    return f"{where}: {what}" if where else what


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters (the type name when the
    message is empty)."""
    text = " ".join(str(err).split()) or "(no message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_callable(ref: str, what: str, *, spec: Any = None) -> Callable:
    """Import the callable that ``ref`` names.

    Args:
        ref: ``"package.module:attr"`` (``attr`` may be dotted: ``"mod:Class.create"``).
        what: the spec key it came from, e.g. ``"model.factory"`` (used in messages).
        spec: optional: the :class:`~fxpipe.specs.schema.ParallelSpec` it came from; when it was
            loaded from a file, messages start with that file's ``FILE:LINE``.

    Returns:
        The callable object.

    Raises:
        SpecError: ``ref`` is not of the form ``package.module:attr``, the module cannot be
        imported (not found, or it raised while importing), it has no such attribute (with a
        "did you mean"), or the attribute is not callable.
    """
    head = _prefix(spec, what)
    if not isinstance(ref, str) or not _REF.match(ref):
        guess = ""
        if isinstance(ref, str) and ":" not in ref and "." in ref:
            mod, _, attr = ref.rpartition(".")
            guess = f" (did you mean {mod + ':' + attr!r}?)"
        raise SpecError(f"{head}: {ref!r} is not of the form 'package.module:attr'{guess}; write "
                        "the module path, a colon, then the name, e.g. "
                        "'fxpipe.examples.gpt:CharGPT'")
    mod_name, _, attr_path = ref.partition(":")
    argv = sys.argv
    sys.argv = [mod_name]  # a module that parses the command line at import sees no fxpipe flags
    try:
        obj: Any = importlib.import_module(mod_name)
    except SystemExit as err:  # sys.exit() or argparse at import time
        raise SpecError(f"{head}: importing module {mod_name!r} called sys.exit({err.code!r}) "
                        "(parsing the command line or exiting at import); move that code under "
                        "`if __name__ == \"__main__\":`") from None
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing == mod_name or mod_name.startswith(missing + "."):
            raise SpecError(f"{head}: module {mod_name!r} not found (no module named "
                            f"{missing!r}); check the spelling in {ref!r} and that the package is "
                            "installed or on PYTHONPATH") from None
        raise SpecError(f"{head}: importing module {mod_name!r} failed because the module it "
                        f"imports, {missing!r}, is not installed; install it") from None
    except Exception as err:  # the user's module raised while importing
        raise SpecError(f"{head}: importing module {mod_name!r} raised "
                        f"{type(err).__name__}: {_one_line(err)}; fix that module") from None
    finally:
        sys.argv = argv
    parts = attr_path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            owner = f"{mod_name}:{'.'.join(parts[:i])}" if i else f"module {mod_name!r}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            near = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise SpecError(f"{head}: {owner} has no attribute {part!r}{hint} (from {ref!r}); "
                            "name an attribute that exists, as 'package.module:attr'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{head}: {ref!r} is a {type(obj).__name__}, not a callable; name a "
                        "function or class")
    return obj


def build_model(spec: Any, load_weights: bool = True):
    """Instantiate the spec's model: seeds torch with ``train.seed`` (so every rank builds the
    same initial weights), then calls ``model.factory(**model.args)``, or builds the
    transformers class ``model.hf`` from ``model.config`` (:mod:`fxpipe.specs.hf`).

    Args:
        spec: a :class:`~fxpipe.specs.schema.ParallelSpec`.
        load_weights: read ``model.pretrained`` weights (False when planning: the config is
            enough).

    Returns:
        The ``torch.nn.Module`` (on the current default device; wrap the call in
        ``with torch.device("meta"):`` to build it without weight memory).

    Raises:
        SpecError: the factory cannot be resolved (see :func:`resolve_callable`); ``model.args``
        does not fit its signature, or the factory rejects them (``TypeError``/``ValueError``);
        the factory raises any other exception (the message names ``model.factory``, the
        exception type and its message, at the spec's ``FILE:LINE``); the factory does not
        return an ``nn.Module``.
    """
    import torch

    if spec.model.hf is not None:
        from fxpipe.specs.hf import build_transformers_model

        torch.manual_seed(spec.train.seed)
        return build_transformers_model(spec, load_weights)
    factory = resolve_callable(spec.model.factory, "model.factory", spec=spec)
    args = dict(spec.model.args)
    head = _prefix(spec, "model.args")
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: just call it
        sig = None
    if sig is not None:
        try:
            sig.bind(**args)
        except TypeError as err:
            accepted = [n for n, p in sig.parameters.items()
                        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            bad = [k for k in args if k not in sig.parameters]
            hints = [f"{k!r} -> {m[0]!r}" for k in bad
                     for m in [difflib.get_close_matches(k, accepted, n=1, cutoff=0.6)] if m]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise SpecError(f"{head}: {spec.model.factory} does not accept these arguments: "
                            f"{err}{hint}. Fix model.args; the factory takes: "
                            f"{', '.join(accepted) or 'no keyword arguments'}") from None
    torch.manual_seed(spec.train.seed)
    try:
        model = factory(**args)
    except SpecError:
        raise
    except (TypeError, ValueError) as err:
        raise SpecError(f"{head}: {spec.model.factory}(**model.args) raised "
                        f"{type(err).__name__}: {_one_line(err)}; fix the values in model.args"
                        ) from err
    except SystemExit as err:
        raise SpecError(f"{_prefix(spec, 'model.factory')}: {spec.model.factory}(**model.args) "
                        f"called sys.exit({err.code!r}); a model factory must return the model"
                        ) from None
    except Exception as err:  # the user's factory failed: a clean message, not a traceback
        raise SpecError(f"{_prefix(spec, 'model.factory')}: building the model with "
                        f"{spec.model.factory}(**model.args) raised {type(err).__name__}: "
                        f"{_one_line(err)}; fix the factory named in model.factory (or its "
                        "model.args); set FXPIPE_DEBUG=1 to see the traceback") from err
    if not isinstance(model, torch.nn.Module):
        raise SpecError(f"{_prefix(spec, 'model.factory')}: {spec.model.factory} returned "
                        f"{type(model).__name__}, not a torch.nn.Module; name a factory that "
                        "builds the model")
    return model
