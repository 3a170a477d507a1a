"""Trace an ``nn.Module`` into an FX ``GraphModule`` the partitioner can price and cut.

Two tracers:

* ``"export"`` (default): ``torch.export.export(model, args, kwargs, strict=False).module()``.
  An aten-level graph; every node carries ``meta['val']`` (a fake tensor: shape, dtype) and
  ``meta['nn_module_stack']`` (module path). It handles ``**kwargs`` forwards, shape-dependent
  Python branches (specialised on the example inputs) and ``torch.nn`` modules such as
  ``nn.Transformer`` (traced through). Export runs the model on fake tensors: no real compute.
* ``"fx"``: ``torch.fx.symbolic_trace`` semantics (a ``torch.fx.Tracer``); ``torch.nn`` modules stay
  leaf ``call_module`` nodes. ``meta['val']`` is filled afterwards by running the graph on fake
  tensors (:class:`FakeInterpreter`), so neither tracer computes anything real.

Both work on models built under ``torch.device("meta")`` (no weight memory).

Reference: torch.export (PyTorch 2.x), torch.fx (Reed et al., "torch.fx: Practical Program Capture
and Transformation for Deep Learning in Python", MLSys 2022), and
``torch.distributed.pipelining.pipeline`` (pipe_split markers) for the annotation idea.

Size: over 600 lines because both tracers share the graph's normalisation (names, constants,
parameters' canonical names) kept here."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from fxpipe.errors import TraceError
from fxpipe.execution.rebuild import rebuilt
from fxpipe.partitioner import annotations as ann
from fxpipe.partitioner.in_place import out_of_place
from fxpipe.partitioner.trace_errors import trace_error

__all__ = ["TracedModel", "trace", "FakeInterpreter", "COMPUTE_OPS", "module_path_of"]

#: FX node kinds that compute something (everything else: placeholder, get_attr, output).
COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass
class TracedModel:
    """A traced model plus what the partitioner needs to know about its nodes.

    Attributes:
        gm: the FX GraphModule. For ``tracer="export"`` this is ``ep.module()`` with export's
            ``_guards_fn`` node and its ``_assert_tensor_metadata`` checks removed. ``pipe_split``
            marker nodes are removed in both cases.
            Every node has ``meta['val']`` (FakeTensor, tuple/list of them, a Python scalar, or
            None) describing its output for the example inputs (one micro-batch).
        input_names: placeholder node names in call order (export: flattened args then kwargs).
        output_names: names of the nodes whose values the model returns, flattened in order (a
            single-tensor output gives one name).
        param_fqns: ``get_attr`` target -> canonical FQN, for every parameter and buffer the graph
            reads. Canonical = the name ``model.named_parameters()`` / ``named_buffers()`` reports
            (first registration of a tied tensor).
        param_aliases: alias FQN -> canonical FQN for tied tensors (from
            ``named_parameters(remove_duplicate=False)``), e.g. ``"head.weight" -> "wte.weight"``.
        buffer_fqns: canonical FQNs that are buffers (not trained; no gradient).
        split_after: FX node names after which a ``pipe_split()`` forces a stage boundary, in
            program order.
        pins: FX node name -> stage index, from :func:`fxpipe.annotate` (innermost annotated
            module wins).
        tracer: ``"export"`` or ``"fx"``.
        model_name: the model's class name.
        param_shapes: canonical FQN -> (shape, dtype name, bytes) of each parameter/buffer.
        input_kwargs: the tensor inputs passed by keyword (the rest of ``input_names`` are
            positional).
    """

    gm: torch.fx.GraphModule
    input_names: list[str]
    output_names: list[str]
    param_fqns: dict[str, str]
    param_aliases: dict[str, str]
    split_after: list[str] = field(default_factory=list)
    pins: dict[str, int] = field(default_factory=dict)
    buffer_fqns: set[str] = field(default_factory=set)
    tracer: str = "export"
    model_name: str = ""
    input_kwargs: list[str] = field(default_factory=list)
    param_shapes: dict[str, tuple[list[int], str, int]] = field(default_factory=dict)
    _by_name: dict[str, torch.fx.Node] = field(default_factory=dict, repr=False, compare=False)

    def node(self, name: str) -> torch.fx.Node:
        """The FX node called ``name``. Raises KeyError (naming the node) if there is none."""
        n = self._by_name.get(name)
        if n is None or n.graph is not self.gm.graph:  # (re)index after graph edits
            self._by_name.clear()
            self._by_name.update({m.name: m for m in self.gm.graph.nodes})
            n = self._by_name.get(name)
        if n is None:
            raise KeyError(f"no FX node named {name!r} in the traced graph")
        return n

    def node_params(self, node: torch.fx.Node) -> list[str]:
        """Canonical FQNs of the parameters and buffers ``node`` reads directly.

        ``call_function``/``call_method`` nodes read them through ``get_attr`` arguments;
        ``call_module`` nodes (``tracer="fx"`` leaves) own the submodule's tensors. Order: first
        appearance; duplicates (a tied tensor read twice) removed.
        """
        out: list[str] = []
        if node.op == "call_module":
            sub = self.gm.get_submodule(node.target)
            prefix = f"{node.target}." if node.target else ""
            names = [prefix + k for k, _ in sub.named_parameters(remove_duplicate=False)]
            names += [prefix + k for k, _ in sub.named_buffers(remove_duplicate=False)]
            for k in names:
                fqn = self.param_fqns.get(k, self.param_aliases.get(k, k))
                if fqn not in out:
                    out.append(fqn)
            return out
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a.target in self.param_fqns:
                fqn = self.param_fqns[a.target]
                if fqn not in out:
                    out.append(fqn)
        return out

    def compute_nodes(self) -> list[torch.fx.Node]:
        """The nodes that compute (call_function / call_method / call_module), in graph order."""
        return [n for n in self.gm.graph.nodes if n.op in COMPUTE_OPS]


def module_path_of(node: torch.fx.Node) -> str:
    """Innermost module path of ``node`` (``"h.1.attn"``), ``""`` for the root module.

    Uses ``meta['nn_module_stack']`` (values ``(path, type)``); a ``call_module`` node's own
    target is its path.
    """
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    for v in stack.values():
        p = v[0] if isinstance(v, tuple) else str(v)
        path = p
    return path


def _stack_paths(node: torch.fx.Node) -> list[str]:
    paths = []
    for v in (node.meta.get("nn_module_stack") or {}).values():
        paths.append(v[0] if isinstance(v, tuple) else str(v))
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths


# ---------------------------------------------------------------------------------------------
# fake execution (shared with the cost model)


class FakeInterpreter(torch.fx.Interpreter):
    """Run a GraphModule on fake tensors: shapes and dtypes only, no real compute or memory.

    Parameters and buffers (real or on the meta device) are converted once each to fake tensors
    of ``fake_mode`` (``requires_grad`` kept, a tied tensor converted once). ``call_module`` nodes
    run their submodule with ``torch.func.functional_call`` on those fake tensors.

    Args:
        gm: the graph module.
        fake_mode: the FakeTensorMode to run under (a fresh static-shape one by default).
        enter_fake_mode: enter ``fake_mode`` around each node (default). Pass False when the
            caller holds the mode open itself, e.g. with a ``FlopCounterMode`` stacked above it.
    """

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: FakeTensorMode | None = None,
                 enter_fake_mode: bool = True):
        super().__init__(gm, garbage_collect_values=True)
        self.fake_mode = fake_mode or FakeTensorMode()
        self.enter_fake_mode = enter_fake_mode
        self._fakes: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # keep originals alive so id() stays unique

    def to_fake(self, t: Any) -> Any:
        """Fake copy of tensor ``t`` (memoised by identity); non-tensors returned unchanged."""
        if not isinstance(t, torch.Tensor):
            return t
        key = id(t)
        f = self._fakes.get(key)
        if f is None:
            if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
                with self.fake_mode:
                    f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            else:
                f = self.fake_mode.from_tensor(t)
            if t.requires_grad and not f.requires_grad and f.is_floating_point():
                f.requires_grad_(True)
            self._fakes[key] = f
            self._keep.append(t)
        return f

    def fake_inputs_from_meta(self) -> list[Any]:
        """Fresh fake inputs built from the placeholders' ``meta['val']`` (no example tensors)."""
        out = []
        for n in self.module.graph.nodes:
            if n.op != "placeholder":
                continue
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                with self.fake_mode:
                    out.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                   device=v.device))
            else:
                out.append(v)
        return out

    def get_attr(self, target, args, kwargs):  # noqa: D102 - torch.fx.Interpreter hook
        return self.to_fake(super().get_attr(target, args, kwargs))

    def call_module(self, target, args, kwargs):  # noqa: D102 - torch.fx.Interpreter hook
        sub = self.fetch_attr(target)
        state = {k: self.to_fake(t) for k, t in sub.named_parameters(remove_duplicate=False)}
        state.update({k: self.to_fake(t) for k, t in sub.named_buffers(remove_duplicate=False)})
        return torch.func.functional_call(sub, state, tuple(args), dict(kwargs), strict=False,
                                          tie_weights=False)

    def run_node(self, n: torch.fx.Node) -> Any:  # noqa: D102 - torch.fx.Interpreter hook
        if not self.enter_fake_mode:
            return super().run_node(n)
        with self.fake_mode:
            return super().run_node(n)


# ---------------------------------------------------------------------------------------------
# error explanation


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's (and transformers') loggers and stderr prints while tracing: export logs
    failed meta kernels and prints partial graphs before raising, and transformers notes its
    defaults (``loss_type=None ... Using the default loss``); the TraceError we raise says what
    matters better."""
    loggers = [logging.getLogger("torch"), logging.getLogger("transformers")] + [
        lg for name, lg in list(logging.Logger.manager.loggerDict.items())
        if name.startswith(("torch", "transformers")) and isinstance(lg, logging.Logger)]
    old = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        # export also print()s a partial graph to stderr before re-raising a failure
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in old:
            lg.setLevel(level)


# ---------------------------------------------------------------------------------------------
# tracers


class _FxTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that also treats the user's ``leaf_modules`` as leaves."""

    def __init__(self, leaf_paths: set[str], leaf_types: tuple[type, ...]):
        super().__init__()
        self._leaf_paths = leaf_paths
        self._leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:  # noqa: D102
        if module_qualified_name in self._leaf_paths:
            return True
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _trace_fx(model: nn.Module, example_inputs: tuple, example_kwargs: dict,
              leaf_modules: Sequence[str | type]) -> torch.fx.GraphModule:
    leaf_paths = {m for m in leaf_modules if isinstance(m, str)}
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
    known = {name for name, _ in model.named_modules()}
    bad = sorted(p for p in leaf_paths if p not in known)
    if bad:
        raise TraceError(
            f"leaf_modules names {bad} that are not submodules of {type(model).__name__}; "
            f"use paths from model.named_modules(), e.g. {sorted(known - {''})[:3]}")
    tracer = _FxTracer(leaf_paths, leaf_types)
    try:
        with ann.fx_tracer_active(tracer):
            graph = tracer.trace(model)
    except Exception as e:
        raise trace_error(e, model, "fx", "symbolic tracing") from e
    name = type(model).__name__
    gm = rebuilt(tracer.root, graph, name)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    named = [p for p in placeholders if not str(p.target).startswith("*")]
    starred = len(named) < len(placeholders)
    flat = list(example_inputs[:len(named)])
    unknown = sorted(set(example_kwargs) - {str(p.target) for p in named})
    if unknown:
        raise TraceError(f"example_kwargs {unknown} are not named arguments of {name}.forward(); "
                         f"pass only its parameter names, or use tracer='export' for **kwargs")
    for p in named[len(flat):]:
        if str(p.target) in example_kwargs:
            flat.append(example_kwargs[str(p.target)])
        elif p.args:  # the argument's default value
            flat.append(p.args[0])
        else:
            raise TraceError(
                f"{name}.forward() takes {len(named)} inputs ({[str(q.target) for q in named]}) "
                f"but example_inputs has {len(example_inputs)} and no example for "
                f"{str(p.target)!r}; pass one example per argument")
    extra = list(example_inputs[len(named):])
    if extra and not starred:
        raise TraceError(
            f"{name}.forward() takes {len(named)} inputs ({[str(q.target) for q in named]}) but "
            f"{len(example_inputs)} example inputs were given; pass one example per argument")
    flat += extra
    interp = FakeInterpreter(gm)
    fake_in = [interp.to_fake(t) for t in flat]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.enable_grad():
                _record_vals(interp, fake_in)
        except Exception as e:
            raise trace_error(e, model, "fx", "shape propagation on fake tensors") from e
    return gm


def _record_vals(interp: FakeInterpreter, fake_in: list[Any]) -> None:
    """Run ``interp`` and store each node's fake output in ``node.meta['val']``."""
    orig = interp.run_node

    def run_node(n):
        out = orig(n)
        if n.op != "output":
            n.meta["val"] = pytree.tree_map(
                lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)
        return out

    interp.run_node = run_node  # type: ignore[method-assign]
    interp.run(*fake_in, enable_io_processing=False)


def _trace_export(model: nn.Module, example_inputs: tuple,
                  example_kwargs: dict) -> torch.fx.GraphModule:
    try:
        with warnings.catch_warnings(), _quiet_torch_logs():
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, example_inputs, example_kwargs or None, strict=False)
    except Exception as e:
        raise trace_error(e, model, "export", "torch.export.export(strict=False)") from e
    gm = ep.module()
    for n in list(gm.graph.nodes):
        # export's dtype/device checks of traced values (e.g. of GPT-2's logits before its loss
        # casts them to float): only checks, and wrong under autocast, where a stage computes
        # in 16 bits what the fp32 trace saw as float32
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
            continue
        if n.op == "call_module" and str(n.target).startswith("_guards_fn"):
            if n.users:  # pragma: no cover - export never uses its result
                continue
            target = str(n.target)
            gm.graph.erase_node(n)
            if hasattr(gm, target):
                delattr(gm, target)
    return gm  # trace() lints and recompiles it once, after its own edits


# ---------------------------------------------------------------------------------------------
# post-processing shared by both tracers


def _tensor_names(model: nn.Module) -> tuple[dict[int, str], dict[str, str], set[str],
                                               dict[str, tuple[list[int], str, int]]]:
    """(id -> canonical FQN, any FQN (aliases too) -> canonical, buffer FQNs, shapes)."""
    by_id: dict[int, str] = {}
    by_name: dict[str, str] = {}
    buffers: set[str] = set()
    shapes: dict[str, tuple[list[int], str, int]] = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t is None:
                continue
            canon = by_id.setdefault(id(t), name)
            by_name[name] = canon
            if canon == name:
                shapes[name] = (list(t.shape), str(t.dtype).replace("torch.", ""),
                                t.numel() * t.element_size())
                if kind == "buffer":
                    buffers.add(name)
    return by_id, by_name, buffers, shapes


def _remove_pipe_splits(gm: torch.fx.GraphModule) -> list[str]:
    split_after: list[str] = []
    last_compute: torch.fx.Node | None = None
    for n in list(gm.graph.nodes):
        if ann.is_pipe_split(n):
            if last_compute is None:
                warnings.warn("fxpipe.pipe_split() before any computation is ignored "
                              "(a stage boundary there would leave stage 0 empty)", stacklevel=3)
            elif last_compute.name not in split_after:
                split_after.append(last_compute.name)
            gm.graph.erase_node(n)
        elif n.op in COMPUTE_OPS:
            last_compute = n
    return split_after


def _pins(model: nn.Module, gm: torch.fx.GraphModule) -> dict[str, int]:
    pinned = {name: m.__dict__[ann.STAGE_ATTR]
              for name, m in model.named_modules(remove_duplicate=False)
              if ann.STAGE_ATTR in m.__dict__}
    if not pinned:
        return {}
    root_stage = pinned.get("")
    pins: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            continue
        stage = root_stage
        for p in _stack_paths(n):  # outermost first: the innermost annotated module wins
            if p in pinned:
                stage = pinned[p]
        if stage is not None:
            pins[n.name] = stage
    return pins


def fake_on_device(model: nn.Module, args: tuple, kwargs: dict, device: str
                   ) -> tuple[nn.Module, tuple, dict]:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device`` (no
    memory, no compute), and fake inputs of the same shapes there.

    Tracing this copy gives the graph that tracing the real model on ``device`` gives (some
    kernels, e.g. CPU attention, differ from their meta-device versions by a ``contiguous``), so
    a plan made here matches what the workers trace. A model on the meta device is not copied
    weight by weight: ``to_empty`` gives every tensor a fake storage.
    """
    import copy

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = copy.deepcopy(model)
    tied: dict[int, list[tuple[dict, str]]] = {}  # to_empty unties tied tensors: re-tie them
    for mod in fake.modules():
        for slots in (mod._parameters, mod._buffers):
            for name, t in slots.items():
                if t is not None:
                    tied.setdefault(id(t), []).append((slots, name))
    with mode:
        fake = fake.to_empty(device=device)
    for refs in tied.values():
        first_slots, first_name = refs[0]
        for slots, name in refs[1:]:
            slots[name] = first_slots[first_name]
    with mode:

        def conv(x):
            return (torch.empty(x.shape, dtype=x.dtype, device=device)
                    if isinstance(x, torch.Tensor) else x)

        return fake, tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def _forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def trace_kwargs(model: nn.Module, example_kwargs: dict | None) -> dict:
    """The keyword inputs a model is traced with: the given ones, plus ``use_cache=False`` for a
    forward() that takes ``use_cache`` (transformers models: a KV cache object cannot leave an
    exported graph and training does not use it). The planner and every worker apply the same
    rule, so their graphs agree."""
    kwargs = dict(example_kwargs or {})
    if "use_cache" in _forward_params(model) and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def output_index(out_spec: Any, key: str | int | None, model_name: str) -> int | None:
    """Position among the flattened outputs of the one the loss reads.

    ``key``: a ModelOutput / dict key (``"logits"``, ``"loss"``) or a tuple index; None picks
    ``logits`` when the output has it, and needs a single output otherwise. Returns None when
    the model returns one tensor and no key is asked for.

    Raises:
        TraceError: the key is not an output (the message lists the outputs), or the model
            returns several values and none is named.
    """
    n = out_spec.num_leaves
    if n == 1 and key is None:
        return None
    obj = pytree.tree_unflatten(list(range(n)), out_spec)
    if isinstance(obj, dict) or hasattr(obj, "keys"):
        keys = list(obj.keys())
    elif isinstance(obj, (tuple, list)):
        keys = list(range(len(obj)))
    else:
        keys = []
    if key is None:
        key = "logits" if "logits" in keys else None
    if key is None or key not in keys:
        shown = ", ".join(map(repr, keys)) or f"{n} values"
        asked = (f"model.output {key!r} is not one of them" if key is not None else
                 "name the one the loss reads with model.output")
        raise TraceError(f"{model_name}.forward() returns {type(obj).__name__} with outputs "
                         f"{shown}; {asked} (e.g. model.output: logits, or loss with train.loss: "
                         "model)")
    picked = obj[key]
    if not isinstance(picked, int):
        raise TraceError(f"{model_name}.forward() output {key!r} is a "
                         f"{type(picked).__name__} of several tensors; the loss reads one "
                         "tensor: name it with model.output")
    return picked


def pick_output(out: Any, key: str | int | None, model_name: str) -> torch.Tensor:
    """The output the loss reads from what a real forward() returned (the rule of
    :func:`output_index`, applied to a value instead of a graph)."""
    leaves, spec = pytree.tree_flatten(out)
    i = output_index(spec, key, model_name)
    return leaves[0 if i is None else i]


def _keep_output(gm: torch.fx.GraphModule, key: str | int | None, model_name: str) -> None:
    """Make ``gm`` return only the output the loss reads; drop what only the others needed."""
    out_spec = getattr(gm, "_out_spec", None)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if out_spec is None:  # torch.fx: no pytree spec; the output is the args' structure
        out_spec = pytree.tree_flatten(out_node.args[0])[1]
    i = output_index(out_spec, key, model_name)
    if i is None:
        return
    leaves = pytree.tree_leaves(out_node.args[0])
    out_node.args = ((leaves[i],),)
    leaf = pytree.tree_structure(0)
    if getattr(gm, "_out_spec", None) is not None:
        gm._out_spec = leaf
        codegen = gm.graph._codegen
        if getattr(codegen, "pytree_info", None) is not None:
            codegen.pytree_info = codegen.pytree_info._replace(out_spec=leaf)
    gm.graph.eliminate_dead_code()


def trace(model: nn.Module, example_inputs: tuple, tracer: str = "export", *,
          example_kwargs: dict | None = None, output: str | int | None = None,
          leaf_modules: Iterable[str | type] = ()) -> TracedModel:
    """Trace ``model`` into an FX graph with parameter names, pipe_split cuts and stage pins.

    Args:
        model: the ``nn.Module`` (may live on the meta device: nothing real is computed).
        example_inputs: positional inputs for ONE micro-batch, a tuple (e.g.
            ``(torch.zeros(8, 128, dtype=torch.long),)``). Shapes are specialised to these.
        tracer: ``"export"`` (``torch.export.export(strict=False)``, default) or ``"fx"``
            (``torch.fx`` symbolic tracing + fake-tensor shape propagation).
        example_kwargs: keyword inputs of forward(), if any (see :func:`trace_kwargs`).
        output: when forward() returns several values (a ModelOutput, dict or tuple), the key or
            index of the one the loss reads (:func:`output_index`); the graph keeps only it.
        leaf_modules: (``tracer="fx"`` only) module paths or classes to keep as single
            ``call_module`` nodes instead of tracing through them.

    Returns:
        A :class:`TracedModel`.

    Raises:
        TraceError: the model cannot be traced (the message names the construct, the module
            and source line, the original error, and what to do), or the arguments are wrong
            (unknown tracer, example_inputs not a tuple, model not an nn.Module).
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace(model, ...): model must be a torch.nn.Module, got "
                         f"{type(model).__name__}; pass the model object")
    if tracer not in ("export", "fx"):
        raise TraceError(f"tracer={tracer!r} is not known; use 'export' (default, "
                         f"torch.export strict=False) or 'fx' (torch.fx symbolic tracing)")
    if isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise TraceError(f"example_inputs must be a tuple of forward()'s positional arguments, "
                         f"got {type(example_inputs).__name__}; wrap a single tensor as (x,)")
    example_kwargs = trace_kwargs(model, example_kwargs)
    leaf_modules = list(leaf_modules)
    if leaf_modules and tracer != "fx":
        raise TraceError("leaf_modules only applies to tracer='fx' (torch.export traces through "
                         "every module); pass tracer='fx' or drop leaf_modules")

    with torch.enable_grad():  # grad mode keeps fused inference fast paths out of the graph
        if tracer == "export":
            gm = _trace_export(model, example_inputs, example_kwargs)
        else:
            gm = _trace_fx(model, example_inputs, example_kwargs, leaf_modules)

    _keep_output(gm, output, type(model).__name__)
    out_of_place(gm)  # in-place writes of fresh values: no cut can separate them
    split_after = _remove_pipe_splits(gm)
    gm.graph.lint()
    gm.recompile()  # once, after every edit above
    by_id, by_name, buffers, shapes = _tensor_names(model)
    param_fqns: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        try:
            t = gm.get_parameter(n.target)
        except AttributeError:
            try:
                t = gm.get_buffer(n.target)
            except AttributeError:
                t = None
        if t is not None and id(t) in by_id:
            param_fqns[n.target] = by_id[id(t)]
        elif n.target in by_name:
            param_fqns[n.target] = by_name[n.target]
    aliases = {k: v for k, v in by_name.items() if k != v}

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"
                    and isinstance(n.meta.get("val"), torch.Tensor)]  # not use_cache=False
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = [a.name for a in pytree.tree_leaves(out_node.args[0]) if isinstance(a, torch.fx.Node)]
    if not outputs:
        raise TraceError(f"{type(model).__name__}.forward() returns no tensor computed from its "
                         f"inputs; the last pipeline stage needs an output for the loss")
    return TracedModel(
        gm=gm,
        input_names=[n.name for n in placeholders],
        output_names=outputs,
        param_fqns=param_fqns,
        param_aliases=aliases,
        split_after=split_after,
        pins=_pins(model, gm),
        buffer_fqns=buffers,
        tracer=tracer,
        model_name=type(model).__name__,
        param_shapes=shapes,
        input_kwargs=[k for k, v in example_kwargs.items() if isinstance(v, torch.Tensor)],
    )

