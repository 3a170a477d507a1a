"""The Plan: where the partitioner and the runtime meet.

A :class:`Plan` is plain data (dataclasses of ints, floats, strings and lists), deterministic for
a given model, example inputs and spec, and round-trips through JSON (``from_dict`` validates the
structure field by field). The partitioner writes it; the schedule, the simulator and the runtime
read it. Its derived views (stage edges, stage -> rank) are computed here once for all of them.

Units throughout: seconds (``*_s``), bytes (``*_bytes``), floating-point operations (``*_flops``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxpipe.errors import PlanError
from fxpipe.plans.dump import dump_plan
from fxpipe.plans.placement import stage_to_rank
from fxpipe.plans.summary import summary_table
from fxpipe.plans.values import MODEL_INPUT, ValueInfo
from fxpipe.specs.schema import ParallelSpec

PLAN_FORMAT_VERSION = 1

Edge = tuple[int, int]


@dataclass
class StagePlan:
    """One pipeline stage: a contiguous run of graph nodes (in topological order).

    Attributes:
        index: stage index ``0 .. num_stages-1`` (virtual stage index when ``virtual_stages > 1``).
        nodes: FX node names computed by this stage, in execution order (placeholders, parameter
            ``get_attr`` nodes and the output node excluded).
        params: original parameter FQNs the stage uses (as in ``model.named_parameters()``).
        buffers: original buffer FQNs the stage uses.
        inputs: names of values the stage reads that it does not compute (see ``Plan.values``),
            in the order of the stage module's positional arguments.
        outputs: names of values the stage computes that a later stage or the loss reads, in the
            order of the stage module's returned tuple.
        fwd_flops / bwd_flops: forward and backward FLOPs for one micro-batch (backward includes
            input- and weight-gradients; ``bwd_weight_flops`` is the weight-gradient part).
        param_bytes: bytes of the parameters the stage holds (a tied parameter counted once).
        shared_bytes: of ``param_bytes``, the bytes of parameters other stages use too (a tied
            embedding): reduced whole over the replicas, never sharded.
        tied_bytes: bytes of parameters charged to another stage's ``param_bytes`` that this
            stage uses too (a tied embedding's later copy); gathered block by block
            (``param_gather: block``) the stage holds them whole with their gradients and
            optimizer state (in ``memory_bytes``).
        expert_bytes: of ``param_bytes``, the bytes of this rank's experts (expert
            parallelism): never sharded, held with their whole training state.
        activation_bytes: bytes of activations kept for backward per micro-batch in flight.
        recv_bytes / send_bytes: bytes received / sent per micro-batch in the forward pass
            (the backward pass moves the same float values the other way).
        compute_time_s: predicted forward+backward compute seconds per micro-batch.
        comm_time_s: predicted seconds per micro-batch spent receiving and sending activations
            and their gradients.
        time_s: ``compute_time_s + comm_time_s``; the planner minimises the largest of these.
        memory_bytes: predicted peak bytes (parameters, gradients, optimizer state, activations
            of the micro-batches the schedule keeps in flight on this stage).
        fwd_time_s / bwd_input_time_s / bwd_weight_time_s: predicted seconds per micro-batch of
            the forward, the input gradients (B) and the weight gradients (W).
        send_time_s: seconds one send action of this stage costs, charged to the sending rank:
            with a measured send cost (gloo on CPU), what the sender staging the bytes and the
            receiver reading them take from busy ranks, one message per tensor.
        grad_send_time_s: the same per gradient send (SEND_B: the input gradients the stage
            sends back, sized by those gradients); None: ``send_time_s``.
        recompute: activation recomputation: the stage keeps only its inputs per micro-batch in
            flight (and, selective, ``keep_ridge``, the outputs of its costly ops) and runs its
            forward again before its backward (priced in ``bwd_input_time_s``).
        keep_ridge: under recomputation, selective: the ops whose FLOPs per output byte reach
            this many keep their outputs, the others are recomputed
            (:mod:`fxpipe.execution.selective`): the device's ridge point, or a threshold above
            it where the stage's rank does not hold what that keeps; None: full recomputation
            (nothing kept).
        recompute_blocks: under full recomputation (``recompute`` and no ``keep_ridge``), the
            stage recomputes only its first this many blocks (:mod:`fxpipe.plans.param_blocks`)
            and keeps the activations of the rest; 0: the whole stage recomputes.
        param_gather: under ``data_sharding: full`` with more than one replica, how the stage's
            sharded parameters come back: ``stage`` (whole, once per step, held through its
            micro-batches) or ``block`` (one block at a time, just before it runs and freed right
            after, in every forward and backward, the next block's all-gather prefetched;
            gradients reduce-scattered per block).
        gather_groups: under ``param_gather: block``, per group of the stage's unshared
            parameters (:func:`fxpipe.plans.param_blocks.param_groups`) in the order its forward
            gathers them, ``[bytes, F, B, W, replay]``: the group's bytes on one rank and the
            seconds of the stage's forward, input gradients (its replayed forward aside),
            weight gradients and replayed forward per micro-batch that run while it is the
            last group gathered, as the planner priced them
            (:func:`fxpipe.schedule.step_price.gather_exposure` prices the gathers from them);
            empty otherwise.
        offload_bytes: activation offload: bytes per micro-batch the stage moves to host
            memory after its forward and fetches back for its backward (the tensors autograd
            saves, parameters and the stage's inputs aside; priced in ``fwd_time_s`` and the
            backward times at ``cluster.links.host_GBps``); 0: none.
        loss_time_s: of the times above, the seconds per micro-batch of the loss
            (``train.loss``) this stage runs on the model's output, forward + backward (the last
            stage; 0 elsewhere and for a model that computes its own loss).
        tensor_collectives: under tensor parallelism, the collectives over the tensor group
            one micro-batch of the stage runs (forward and backward).
        tensor_bytes: their bytes per micro-batch, ``[forward, backward]`` (whole tensors);
            empty without tensor parallelism.
    """

    index: int
    nodes: list[str]
    params: list[str]
    buffers: list[str]
    inputs: list[str]
    outputs: list[str]
    fwd_flops: float
    bwd_flops: float
    bwd_weight_flops: float
    param_bytes: int
    activation_bytes: int
    recv_bytes: int
    send_bytes: int
    compute_time_s: float
    comm_time_s: float
    time_s: float
    memory_bytes: int
    fwd_time_s: float = 0.0
    bwd_input_time_s: float = 0.0
    bwd_weight_time_s: float = 0.0
    send_time_s: float = 0.0
    recompute: bool = False
    keep_ridge: float | None = None
    recompute_blocks: int = 0
    param_gather: str = "stage"
    gather_groups: list[list[float]] = field(default_factory=list)
    offload_bytes: int = 0
    grad_send_time_s: float | None = None
    loss_time_s: float = 0.0
    tensor_collectives: int = 0
    tensor_bytes: list[float] = field(default_factory=list)
    shared_bytes: int = 0
    tied_bytes: int = 0
    expert_bytes: int = 0

    @property
    def recompute_mode(self) -> str:
        """``off``, ``full``, ``partial`` (full, of the first :attr:`recompute_blocks` blocks)
        or ``selective`` (:attr:`recompute`, :attr:`keep_ridge`)."""
        if not self.recompute:
            return "off"
        if self.keep_ridge is not None:
            return "selective"
        return "partial" if self.recompute_blocks > 0 else "full"


@dataclass
class Predicted:
    """Simulator's prediction for one training step (one global batch).

    Attributes:
        step_time_s: seconds per optimizer step.
        bubble_fraction: idle fraction of the step averaged over pipeline ranks, in [0, 1).
        peak_memory_bytes: predicted peak bytes per stage (index = stage).
        peak_inflight: peak number of micro-batches whose activations are held, per stage.
    """

    step_time_s: float
    bubble_fraction: float
    peak_memory_bytes: list[int]
    peak_inflight: list[int] = field(default_factory=list)


@dataclass
class Plan:
    """A partitioned model ready to run: stages, placement and schedule.

    Attributes:
        model: human-readable model name (class or factory).
        num_stages: number of (virtual) stages, ``pipeline * virtual_stages``.
        pipeline: pipeline-parallel degree (ranks per pipeline group).
        dp: data-parallel degree (replicas of every stage).
        microbatches: micro-batches per step per replica.
        schedule: schedule name: one of :data:`fxpipe.specs.schema.SCHEDULES`.
        virtual_stages: stages per pipeline rank (``v``); 1 unless interleaved / V-shaped.
        microbatch_size: samples per micro-batch.
        stages: the stages, in pipeline order.
        values: every value that crosses a stage boundary or feeds the model, by name.
        model_inputs: names of the model's input placeholders, in call order.
        model_output: name of the value the loss reads (the model's output).
        shared_params: parameter FQN -> stages that use it, for parameters used by several stages
            (tied weights). Their gradients are summed across those stages every step.
        param_aliases: alias FQN -> canonical FQN for tied parameters (e.g. ``wte.weight`` ->
            ``head.weight``).
        bottleneck_stage: index of the slowest stage.
        lower_bound_s: total per-micro-batch compute time / num_stages (no plan can beat it).
        predicted: simulator prediction, or None if not simulated.
        explain: free-text lines explaining choices (auto search ranking, annotations honoured).
        spec: the validated, typed spec the plan was made for (the runtime rebuilds the model
            and reads its training options from it; the prediction its cluster and training
            options); None for a plan made by hand (the schema's defaults then).
        input_kwargs: the model inputs passed by keyword (the rest of ``model_inputs`` are
            positional, in order).
        traced_on: the device type the graph was traced on (``cpu``, ``cuda``, ``meta``); a
            worker on another device type checks that its graph is the same.
        recomputed: value name -> stages that recompute it from the model inputs instead of
            receiving it (masks, position ids, rotary tables: cheaper than sending).
        folded: for a model planned as repeated blocks (:mod:`fxpipe.partitioner.blocks`),
            where its nodes go: ``run`` (the block container and range), ``prologue`` (node ->
            stage), ``blocks`` (stage per block), ``epilogue`` (stage per node after the
            blocks, in order), ``cheap`` (values rebuilt per stage), ``edges`` (``[producer,
            consumer, bytes, gradient bytes]`` per stage edge, per micro-batch, as priced).
            Stages then list no nodes until a worker resolves the plan against the full
            graph; empty otherwise.
        placement: how the pipeline x data grid lies on the ranks and nodes
            (:data:`fxpipe.plans.placement.LAYOUTS`): ``pipeline-inner`` keeps each pipeline's
            stages on adjacent ranks, ``data-inner`` each stage's replicas.
        parameter_servers: global ranks of the parameter servers (``train.updates: async``),
            the last ranks after the ``pipeline x dp`` grid; empty for sync updates.
        server_params: canonical parameter FQN -> index of the server holding it (and its
            optimizer state), ``0 .. len(parameter_servers)-1``.
        server_stage_bytes: ``[stage][server]``: bytes of the stage's parameters held by that
            server, which the stage pushes (gradients) and pulls (weights) every step.
        server_links: one dict per (server, pipeline rank pushing to it): ``server``,
            ``pipe_rank``, ``GBps`` and ``inter_node`` (the link between them), ``bytes`` (of one
            push, and of one pull, per step) and ``seconds`` (one of them on that link, with
            its latency); what ``fxpipe plan`` shows.
        server_priced_s: per pipeline rank, the push and pull seconds per step the prediction
            priced (:meth:`~fxpipe.schedule.simulate.Links.push_pull_seconds` over its stages).
        param_shapes: trained parameter FQN -> shape (whole, before tensor parallelism): PowerSGD's
            prediction prices each matrix's low-rank factors, and
            :func:`~fxpipe.plans.state_bytes.held_state_bytes` the state each rank holds.
        param_itemsize: bytes per element of the trained parameters (4: float32).
        tensor: tensor-parallel degree (ranks that split every layer of a stage; innermost in
            the rank layout).
        sequence_parallel: norms, dropout and residual adds run on a slice of the sequence.
        tp_overlap: chunks each tensor-parallel matmul and its collective run in, overlapped
            (:mod:`fxpipe.tensor.overlap`); 1: none.
        expert: expert-parallel degree (data-parallel replicas whose ranks split each MoE
            layer's experts, :mod:`fxpipe.experts`); 1: experts whole. The runtime finds the
            expert layers on each stage's graph by the planner's rule
            (:func:`fxpipe.experts.regions.find_regions`).
        expert_bytes: with ``expert > 1``, the bytes of the token-slot tensors the MoE layers
            all-to-all per micro-batch, forward and backward (whole tensors; each rank sends
            ``(expert - 1) / expert`` of its own).
        context: context-parallel degree (ranks splitting every micro-batch's sequence,
            :mod:`fxpipe.context`); they are replicas of the grid that share samples: the
            grid has ``dp * context`` replicas (:attr:`replicas`), ``dp`` of them apart in data.
        context_bytes: with ``context > 1``, the bytes of the keys and values (and any other
            split values) one replica's stages all-gather along the sequence per micro-batch,
            forward, and reduce-scatter backward (whole tensors; each rank sends
            ``(context - 1) / context`` of them); under ring attention, the bytes each rank
            sends around the ring, forward and backward.
        context_attention: ``all-gather`` or ``ring`` (:mod:`fxpipe.context.ring`): how
            attention reads the other ranks' keys and values.
        tensor_params: canonical parameter FQN -> its placement on the tensor group
            (:class:`fxpipe.tensor.placement.Placement` as text: ``S(0)`` split on dim 0 (a
            column-parallel weight's output features, an embedding's vocabulary), ``S(1)``,
            ``S(0,3)`` each of 3 blocks split); parameters not listed are replicated.
        tensor_replicated: ``[name, why]`` of the layers and ops that run replicated inside
            their tensor group (no sharded form applied); correct, priced, named here.
        data_sharding: what each stage's data-parallel replicas split among themselves
            (``none``, ``optimizer``, ``gradients``, ``full``: :mod:`fxpipe.runtime.
            data_sharding`).
    """

    model: str
    num_stages: int
    pipeline: int
    dp: int
    microbatches: int
    schedule: str
    virtual_stages: int
    microbatch_size: int
    stages: list[StagePlan]
    values: dict[str, ValueInfo]
    model_inputs: list[str]
    model_output: str
    shared_params: dict[str, list[int]] = field(default_factory=dict)
    param_aliases: dict[str, str] = field(default_factory=dict)
    bottleneck_stage: int = 0
    lower_bound_s: float = 0.0
    predicted: Predicted | None = None
    explain: list[str] = field(default_factory=list)
    spec: ParallelSpec | None = None
    input_kwargs: list[str] = field(default_factory=list)
    traced_on: str = "cpu"
    recomputed: dict[str, list[int]] = field(default_factory=dict)
    folded: dict[str, Any] = field(default_factory=dict)
    placement: str = "pipeline-inner"
    parameter_servers: list[int] = field(default_factory=list)
    server_params: dict[str, int] = field(default_factory=dict)
    server_stage_bytes: list[list[int]] = field(default_factory=list)
    server_links: list[dict[str, Any]] = field(default_factory=list)
    server_priced_s: list[float] = field(default_factory=list)
    param_shapes: dict[str, list[int]] = field(default_factory=dict)
    param_itemsize: int = 4
    tensor: int = 1
    sequence_parallel: bool = False
    tp_overlap: int = 1
    expert: int = 1
    expert_bytes: list[float] = field(default_factory=list)
    context: int = 1
    context_bytes: list[float] = field(default_factory=list)
    context_attention: str = "all-gather"
    tensor_params: dict[str, str] = field(default_factory=dict)
    tensor_replicated: list[list[str]] = field(default_factory=list)
    data_sharding: str = "none"

    # ------------------------------------------------------------------ derived views
    @property
    def world_size(self) -> int:
        """Number of ranks: ``pipeline * dp * context * tensor`` plus the parameter servers."""
        return self.pipeline * self.replicas * self.tensor + len(self.parameter_servers)

    @property
    def replicas(self) -> int:
        """Replicas of every stage on the grid: ``dp * context`` (a context group's ranks
        hold the same stage and the same samples, each its part of the sequence)."""
        return self.dp * self.context

    def stage_of_node(self) -> dict[str, int]:
        """Map FX node name -> stage index."""
        return {n: s.index for s in self.stages for n in s.nodes}

    def stage_ranks(self) -> list[int]:
        """Pipeline rank of each stage in ``stages`` order (:func:`~fxpipe.plans.placement.stage_to_rank`
        of the plan's schedule)."""
        ranks = stage_to_rank(self.schedule, self.pipeline, max((s.index for s in self.stages),
                                                               default=-1) + 1)
        return [ranks[s.index] for s in self.stages]

    def stage_edges(self) -> dict[Edge, list[str]]:
        """Values flowing between stages: ``(producer, consumer) -> value names`` (in
        ``values`` order), from every value's producer and consumers; model inputs are not edges.

        Raises:
            PlanError: a value is read by a stage that is not later than its producer (the stages
                are not a pipeline), or a stage reads a value whose consumers do not list it.
        """
        edges: dict[Edge, list[str]] = {}
        for name, info in self.values.items():
            if info.producer == MODEL_INPUT:
                continue
            for c in info.consumers:
                if c == info.producer:
                    continue
                if c < info.producer:
                    raise PlanError(
                        f"stage {c} reads {name!r} produced by stage {info.producer}, which is "
                        f"not an earlier stage; the plan's stages are not a pipeline - {_RECREATE}")
                edges.setdefault((info.producer, c), []).append(name)
        for sp in self.stages:
            for name in sp.inputs:
                info = self.values.get(name)
                if info is None or (info.producer != MODEL_INPUT
                                    and sp.index not in info.consumers):
                    raise PlanError(f"stage {sp.index} reads {name!r}, which plan.values does not "
                                    f"describe as one of its inputs; {_RECREATE}")
        return edges

    def edge_bytes(self) -> tuple[dict[Edge, int], dict[Edge, int]]:
        """Bytes per micro-batch on every stage edge: ``(all values, values with gradients)``,
        the second restricted to edges that carry at least one such value."""
        fwd: dict[Edge, int] = {}
        grad: dict[Edge, int] = {}
        if self.folded.get("edges"):  # blocks not resolved yet: the bytes the planner priced
            for a, b, n, g in self.folded["edges"]:
                fwd[(a, b)] = int(n)
                if g:
                    grad[(a, b)] = int(g)
            return fwd, grad
        for edge, names in self.stage_edges().items():
            fwd[edge] = sum(int(self.values[n].nbytes) for n in names)
            g = [n for n in names if self.values[n].requires_grad]
            if g:
                grad[edge] = sum(int(self.values[n].nbytes) for n in g)
        return fwd, grad

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (JSON-serialisable)."""
        spec, self.spec = self.spec, None  # pydantic, not a dataclass: dumped on its own
        try:
            d = dataclasses.asdict(self)
        finally:
            self.spec = spec
        d["spec"] = spec.model_dump(mode="json") if spec is not None else None
        d["format_version"] = PLAN_FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: the dict is not a plan of this format version, or its structure is wrong:
                a required field is missing, a field is unknown, or a field has the wrong type
                (e.g. ``num_stages: "two"``). The message names the fields, e.g. ``plan.json:
                stage 0 lacks fields ['nodes']; re-create it with `fxpipe plan```.
        """
        if not isinstance(d, dict):
            raise ValueError(f"plan.json: a plan is a JSON object (mapping), got "
                             f"{type(d).__name__}; {_RECREATE}")
        d = dict(d)
        version = d.pop("format_version", None)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"plan format version {version!r} is not supported (expected "
                f"{PLAN_FORMAT_VERSION}); re-create the plan with `fxpipe plan SPEC`"
            )
        _validate(d)
        d["stages"] = [StagePlan(**s) for s in d["stages"]]
        d["values"] = {k: ValueInfo(**v) for k, v in d["values"].items()}
        if d.get("predicted") is not None:
            d["predicted"] = Predicted(**d["predicted"])
        if d.get("spec"):
            from fxpipe.errors import SpecError
            from fxpipe.specs.loader import load_spec

            try:
                d["spec"] = load_spec(d["spec"])
            except SpecError as e:
                raise ValueError(f"plan.json: its spec is not valid ({e}); {_RECREATE}") from None
        else:
            d["spec"] = None
        plan = cls(**d)
        problems = plan.inconsistencies()
        if problems:
            raise ValueError("plan.json: " + "; ".join(problems[:5]) + f"; {_RECREATE}")
        return plan

    def inconsistencies(self) -> list[str]:
        """Fields that contradict each other (each a phrase; empty for a sound plan)."""
        out = []
        if self.num_stages != len(self.stages):
            out.append(f"num_stages is {self.num_stages} but it lists {len(self.stages)} stages")
        if sorted(s.index for s in self.stages) != list(range(len(self.stages))):
            out.append("the stages' indices are not 0 .. num_stages-1")
        if self.data_sharding not in ("none", "optimizer", "gradients", "full"):
            out.append(f"data_sharding is {self.data_sharding!r}, not one of none, optimizer, "
                       "gradients, full")
        for name in ("pipeline", "dp", "tensor", "microbatches", "virtual_stages",
                     "microbatch_size"):
            if getattr(self, name) < 1:
                out.append(f"{name} is {getattr(self, name)}; it must be at least 1")
        if self.pipeline >= 1 and self.virtual_stages >= 1 and \
                self.pipeline * self.virtual_stages != self.num_stages:
            out.append(f"pipeline x virtual_stages = {self.pipeline} x {self.virtual_stages} is "
                       f"not num_stages = {self.num_stages}")
        if self.model_output not in self.values:
            out.append(f"model_output {self.model_output!r} is not among the values")
        missing = [n for n in self.model_inputs if n not in self.values]
        if missing:
            out.append(f"model inputs {missing[:3]} are not among the values")
        for name, v in self.values.items():
            if v.producer >= self.num_stages or any(c >= self.num_stages or c < 0
                                                     for c in v.consumers):
                out.append(f"value {name!r} names a stage outside 0..{self.num_stages - 1}")
                break
        return out

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, 2-space indent)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON to ``path`` (parent folders created). Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: an interrupted save never leaves a half-written plan
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not valid plan JSON.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a plan JSON file ({e})") from None
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply to be a plan JSON file; "
                             f"{_RECREATE}") from None
        if not isinstance(data, dict) or "stages" not in data:
            raise ValueError(f"{path}: not a plan JSON file (no 'stages' key)")
        return cls.from_dict(data)

    @classmethod
    def read(cls, path: str | Path) -> "Plan":
        """:meth:`load` for commands: a file that is not a readable plan is an
        :class:`~fxpipe.errors.FxpipeError` naming it (``PATH: cannot read this plan: ...``).
        A missing file raises FileNotFoundError (callers say what to run instead)."""
        try:
            return cls.load(path)
        except (ValueError, TypeError, KeyError) as e:
            raise PlanError(f"{path}: cannot read this plan: {e}") from None

    def dump(self, out_dir: str | Path, graph: Any = None) -> list[Path]:
        """Write ``plan.json``, ``partition.dot`` (+ ``partition-units.svg`` when Graphviz's
        ``dot`` is installed) and ``summary.txt`` into ``out_dir``. ``graph`` is the priced
        networkx graph (needed for the DOT dump; without it only the stage-level graph is drawn).
        The block-level picture: :func:`fxpipe.reports.partition_picture.write_partition_picture`.

        Returns the paths written.
        """
        return dump_plan(self, Path(out_dir), graph)

    def summary(self) -> str:
        """Readable table of the stages (what ``fxpipe plan`` prints)."""
        return summary_table(self)


# ---------------------------------------------------------------------- plan.json validation
_RECREATE = "re-create it with `fxpipe plan`"


def _type_ok(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits a dataclass field annotation (int excludes bool; a float field
    takes an int; a nested dataclass is a mapping, checked on its own; a ``dict[str, V]``'s keys
    are strings and its values fit ``V``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if origin is list:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            return False
        return not args or all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        args = typing.get_args(tp)
        if not isinstance(value, dict):
            return False
        return not args or all(isinstance(k, str) and _type_ok(v, args[1])
                               for k, v in value.items())
    if tp is dict or dataclasses.is_dataclass(tp) or hasattr(tp, "model_validate"):
        return isinstance(value, dict)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _type_words(tp: Any) -> str:
    """Plain words for a field annotation: ``list[str]`` -> ``"a list of strings"``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        args = typing.get_args(tp)
        item = _type_words(args[0]) if args else "values"
        return "a list of " + {"an integer": "integers", "a string": "strings",
                               "a number": "numbers", "a mapping": "mappings"}.get(item, item)
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp) or \
            hasattr(tp, "model_validate"):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _field_problems(cls: type, d: Any, what: str) -> list[str]:
    """Problems of the mapping ``d`` as the fields of dataclass ``cls``: missing required
    fields, unknown fields, values of the wrong type (each a phrase about ``what``)."""
    if not isinstance(d, dict):
        return [f"{what} must be a mapping, got {type(d).__name__}"]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    out = []
    missing = [n for n in required if n not in d]
    if missing:
        out.append(f"{what} lacks field{'s' if len(missing) > 1 else ''} {missing}")
    unknown = sorted(k for k in d if k not in fields)
    if unknown:
        out.append(f"{what} has unknown field{'s' if len(unknown) > 1 else ''} {unknown}")
    for name, value in d.items():
        if name in fields and not _type_ok(value, hints[name]):
            shown = json.dumps(value) if not isinstance(value, (list, dict)) else \
                type(value).__name__
            if len(shown) > 40:
                shown = shown[:37] + "..."
            where = "" if cls is Plan else f"{what}: "
            out.append(f"{where}{name} must be {_type_words(hints[name])}, got {shown}")
    return out


def _validate(d: dict[str, Any]) -> None:
    """Raise ValueError listing (at most 5) structural problems of a plan dict (format version
    already removed)."""
    problems = _field_problems(Plan, d, "the plan")
    stages = d.get("stages")
    if isinstance(stages, list):
        for i, st in enumerate(stages):
            problems += _field_problems(StagePlan, st, f"stage {i}")
    values = d.get("values")
    if isinstance(values, dict):
        for name, v in values.items():
            problems += _field_problems(ValueInfo, v, f"value {name!r}")
    if isinstance(d.get("predicted"), dict):
        problems += _field_problems(Predicted, d["predicted"], "predicted")
    if problems:
        more = f" (and {len(problems) - 5} more problems)" if len(problems) > 5 else ""
        raise ValueError("plan.json: " + "; ".join(problems[:5]) + more + f"; {_RECREATE}")
