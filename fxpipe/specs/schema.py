"""Typed parallelism spec (``ParallelSpec``): the YAML file's sections as pydantic models.

Sections: ``model``, ``data``, ``parallel``, ``cluster``, ``train``, ``output``. Unknown keys are
rejected (``extra="forbid"``); sizes must be positive. Cross-section rules (pipeline x data ==
world size, batch splits into micro-batches) live in :func:`cross_section_problems`, which
:class:`ParallelSpec`'s validator runs; it raises :class:`CrossSectionError` carrying the key path
of every problem so :func:`fxpipe.specs.loader.load_spec` can point at the YAML line.

Size: over 600 lines because it is the spec's reference: one model per section and the rules across
sections, read together."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

Auto = Literal["auto"]
#: a finite positive number (no inf, no NaN)
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: a rate (FLOP/s, bytes/s): finite and not vanishingly small, so seconds stay finite
Rate = Annotated[float, Field(ge=1e-6, allow_inf_nan=False)]

#: ``train.timeout_s`` at most (a week): torch's stores and waits take at most this.
MAX_TIMEOUT_S = 7 * 24 * 3600.0

#: The pipeline schedules, spelled as in ``parallel.schedule`` (the one list every module uses).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipev")

#: The schedules on the V placement (rank ``r`` holds stages ``r`` and ``2p-1-r``): always 2 stages
#: per rank, backward split into B and W.
V_SCHEDULES = ("zb-v", "v-half", "v-min", "dualpipev")

#: Bytes of training state per parameter byte for each ``train.optimizer``: weights and
#: gradients, plus AdamW's two moments (SGD here has no momentum buffer).
OPTIMIZER_STATE_FACTOR = {"sgd": 2.0, "adamw": 4.0}

#: ``parallel.data_sharding`` levels, in order: what a stage's replicas split among them
DATA_SHARDING = ("none", "optimizer", "gradients", "full", "auto")


def state_factor(optimizer: str, sharding: str = "none", dp: int = 1, gather: str = "stage",
                 split: bool = False) -> float:
    """Peak bytes of training state per parameter byte on a rank during a step.

    Unsharded: weights, gradients and the optimizer's state (``k`` bytes per parameter byte:
    AdamW's two moments), ``2 + k``. Sharded over ``dp`` replicas
    (:mod:`fxpipe.runtime.data_sharding`): weights and gradients stay whole while a stage's
    micro-batches run, at every level; the optimizer state and the accumulated gradient slice
    are ``1/dp`` of the whole, and ``full`` adds its separate master slice:
    ``2 + (1 + k) / dp`` (``optimizer``, ``gradients``) or ``2 + (2 + k) / dp`` (``full``).
    ``auto`` and a single replica shard nothing.

    ``gather="block"`` (``full`` only, ``parallel.param_gather``): the parameters come back one
    block at a time (:mod:`fxpipe.runtime.block_gather`), so only the shards are held per
    parameter byte, ``(3 + k) / dp`` (the master slice, the float32 gradient slice kept across
    steps and this step's, the optimizer state), plus, under a split backward (``split``: W
    computes all the stage's weight gradients at once), its whole gradients, 1; the gathered
    blocks are a per-stage amount on top, not a factor."""
    extra = OPTIMIZER_STATE_FACTOR[optimizer] - 2.0
    if sharding in ("none", "auto") or dp <= 1:
        return 2.0 + extra
    if gather == "block" and sharding == "full":
        return (extra + 3.0) / dp + (1.0 if split else 0.0)
    return 2.0 + (extra + (2.0 if sharding == "full" else 1.0)) / dp


#: Link defaults of ``cluster.links``: NVLink 4 about 450 GB/s each way inside a node, NDR
#: InfiniBand about 50 GB/s between nodes, 5 us per message.
DEFAULT_INTRA_NODE_GBPS = 450.0
DEFAULT_INTER_NODE_GBPS = 50.0
DEFAULT_LATENCY_S = 5e-6


#: Stages per rank that ``interleaved`` gets when the search or ``fxpipe simulate`` picks it.
AUTO_VIRTUAL_STAGES = 2

#: ``train.grad_compression``: how data-parallel gradients travel. ``none`` is exact; ``fp16`` /
#: ``bf16`` cast the payload; ``powersgd`` (low rank) and ``topk`` (sparse) keep error feedback
#: and take their settings from ``train.compression``.
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")


def low_rank_view(shape) -> tuple[int, int] | None:
    """The matrix PowerSGD compresses a gradient of ``shape`` as: ``(shape[0], product of the
    rest)`` for 2 or more dimensions (as torch's PowerSGD hook views it); None for scalars and
    vectors, which are all-reduced exactly."""
    dims = [int(d) for d in shape]
    if len(dims) < 2:
        return None
    cols = 1
    for d in dims[1:]:
        cols *= d
    return dims[0], cols


def stages_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """(Virtual) stages each pipeline rank holds under ``schedule``: the V schedules
    (:data:`V_SCHEDULES`: ``zb-v``, ``v-half``, ``v-min``, ``dualpipev``) always 2 (the V
    shape), ``interleaved`` ``virtual_stages``, every other schedule 1."""
    if schedule in V_SCHEDULES:
        return 2
    return virtual_stages if schedule == "interleaved" else 1


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would read true as 1; YAML 1.1 also reads yes/no/on/off as booleans
        annotation = cls.model_fields[info.field_name].annotation
        items = value if isinstance(value, (list, tuple)) else [value]
        flag = next((v for v in items if isinstance(v, bool)), None)
        if flag is not None and "bool" not in str(annotation):
            raise ValueError(f"got {str(flag).lower()} (a boolean); YAML reads true/false/yes/no/"
                             "on/off as booleans: write the value itself, quoted if it is text")
        return value


class ModelSpec(_Section):
    """The model, named one of two ways:

    * ``factory``: ``"package.module:Callable"`` returning an ``nn.Module``; ``args``: its
      keyword arguments;
    * ``hf``: a Hugging Face transformers class, ``"GPT2LMHeadModel"`` or
      ``"transformers:GPT2LMHeadModel"``, built from ``config`` (the keyword arguments of its
      config class) with random weights, or from a local ``pretrained`` folder
      (``from_pretrained``; nothing is downloaded).

    ``output``: which output of the model the loss reads when it returns several (a ModelOutput
    or dict key such as ``logits`` or ``loss``, or a tuple index); default: ``loss`` when
    ``train.loss`` is ``model``, else ``logits`` when present, else the only output.
    ``tracer``: ``export`` (``torch.export``, default) or ``fx`` (``torch.fx.symbolic_trace``)."""

    factory: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    hf: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    pretrained: str | None = None
    output: Union[str, int, None] = None
    tracer: Literal["export", "fx"] = "export"

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if (self.factory is None) == (self.hf is None):
            raise ValueError("name the model with exactly one of model.factory "
                             "('package.module:Callable') or model.hf (a transformers class "
                             "such as GPT2LMHeadModel)")
        if self.factory is not None and (self.config or self.pretrained):
            raise ValueError("model.config and model.pretrained go with model.hf; a factory "
                             "takes its arguments in model.args")
        if self.hf is not None and self.args:
            raise ValueError("model.args goes with model.factory; give a transformers model's "
                             "settings in model.config")
        return self

    @property
    def name(self) -> str:
        """The factory or transformers class named."""
        return self.factory if self.factory is not None else self.hf


#: ``data.dtype`` of a token file: numpy dtype names
TOKEN_DTYPES = ("uint16", "uint32")
#: ``data.dataset`` when the spec names no data: the Python standard library's own sources
DEFAULT_DATASET = "fxpipe.examples.data:python_source_text"
#: where the data comes from: the keys of ``data`` that name a source (at most one)
DATA_SOURCES = ("dataset", "files", "hf_dataset", "tokens")


class HFDatasetSpec(_Section):
    """A ``datasets`` builder read from local files: ``path`` (``json``, ``csv``, ``parquet``,
    ``text``) and its ``data_files`` (a path, a glob or a list of them)."""

    path: str
    data_files: Union[str, list[str], dict[str, Union[str, list[str]]]]


class DataSpec(_Section):
    """Where the training text or tokens come from (at most one source) and the batch shape.

    Sources: ``dataset``: ``"package.module:callable"`` returning the corpus (when no source
    is named: :data:`DEFAULT_DATASET`, the Python standard library's sources as bytes); ``files``: a glob (or list of globs) of
    ``.txt``, ``.jsonl`` / ``.json`` (one JSON object per line, its ``text_field``) or
    ``.parquet`` (column ``text_field``) files; ``hf_dataset``: a ``datasets`` dataset saved with
    ``save_to_disk`` (a folder) or :class:`HFDatasetSpec` (``split``, ``text_field``); ``tokens``:
    a token file (``dtype`` ``uint16`` / ``uint32``, nanoGPT's ``train.bin``), memory-mapped.
    Validation: ``val_files`` / ``val_tokens`` / ``val_split``, else the last ``val_fraction``
    of the corpus. ``tokenizer``: ``bytes`` (UTF-8 bytes, 256 ids), a local Hugging Face
    tokenizer folder, or ``tiktoken:NAME``. ``batch_size``: the GLOBAL batch (samples per
    optimizer step over all data-parallel replicas); ``seq_len``: tokens per sample (language
    models). Relative paths are relative to the spec file's folder."""

    dataset: str | None = None
    files: Union[str, list[str], None] = None
    val_files: Union[str, list[str], None] = None
    text_field: str = "text"
    hf_dataset: Union[str, HFDatasetSpec, None] = None
    split: str = "train"
    val_split: str | None = None
    tokens: str | None = None
    val_tokens: str | None = None
    dtype: Literal[TOKEN_DTYPES] = "uint16"  # type: ignore[valid-type]
    val_fraction: float = Field(default=0.05, gt=0, lt=1, allow_inf_nan=False)
    tokenizer: str = "bytes"
    batch_size: PositiveInt = 32
    seq_len: PositiveInt = 128

    @property
    def dataset_ref(self) -> str:
        """The ``dataset`` callable: the one given, else :data:`DEFAULT_DATASET`."""
        return self.dataset or DEFAULT_DATASET

    @property
    def source(self) -> str:
        """The key that names the data: ``files``, ``hf_dataset``, ``tokens`` or ``dataset``."""
        return next((k for k in DATA_SOURCES[1:] if getattr(self, k) is not None), "dataset")

    @property
    def vocabulary_known(self) -> bool:
        """Whether ``tokenizer`` says which ids the data holds: always for text (it tokenises
        it), for a token file only when a tokenizer other than ``bytes`` is named."""
        return self.source in ("files", "hf_dataset") or (
            self.source == "tokens" and self.tokenizer != "bytes")

    @model_validator(mode="after")
    def _one_source(self) -> "DataSpec":
        # a key counts as given when it differs from its default (a plan's saved spec repeats
        # every default)
        def given_(k: str) -> bool:
            return getattr(self, k) != type(self).model_fields[k].default

        given = [k for k in DATA_SOURCES if given_(k)]
        if len(given) > 1:
            raise ValueError(f"data names {len(given)} sources ({', '.join(given)}); keep one: "
                             "dataset (a callable), files, hf_dataset or tokens")
        src = self.source
        wrong = {"val_files": "files", "val_tokens": "tokens", "val_split": "hf_dataset",
                 "split": "hf_dataset", "dtype": "tokens",
                 "text_field": ("files", "hf_dataset")}
        for key, owner in wrong.items():
            owners = owner if isinstance(owner, tuple) else (owner,)
            if given_(key) and src not in owners:
                raise ValueError(f"data.{key} goes with data.{' or data.'.join(owners)}, and "
                                 f"this spec's data comes from data.{src}; remove data.{key}")
        if given_("tokenizer") and src == "dataset":
            raise ValueError("data.tokenizer goes with data.files, data.hf_dataset or "
                             "data.tokens (a data.dataset callable returns bytes or batches); "
                             "remove it or name the data with files/hf_dataset/tokens")
        return self


class ParallelSpec_(_Section):
    """``pipeline``: stages per pipeline (p); ``data``: replicas (dp); ``tensor``: ranks that
    split every layer of a stage (t, tensor parallelism: :mod:`fxpipe.tensor`; a tensor group
    stays inside one node); ``microbatches``: per replica per step (m); ``schedule``;
    ``virtual_stages``: stages per rank (v) of the ``interleaved`` schedule (``auto``, and
    under ``schedule: auto``: the planner weighs 2, 3, 4, 6, 8, ... up to the model's units:
    deeper interleaving shortens the bubble and adds point-to-point messages). Any of them may
    be ``auto`` (the planner searches).
    ``sequence_parallel``: with ``tensor > 1``, norms, dropout and residual adds run on a slice of
    the sequence (reduce-scatter / all-gather instead of all-reduce; less activation memory).
    ``tp_overlap``: with ``tensor > 1``, the number of chunks each tensor-parallel matmul and
    its collective are split into along the tokens, so that one chunk's all-reduce / all-gather
    / reduce-scatter runs while another chunk computes (async tensor parallelism:
    :mod:`fxpipe.tensor.overlap`); 1 (default): no overlap; ``auto``: the planner picks 1, 2,
    4 or 8, whichever it prices fastest (more chunks hide more but add launches, copies and
    per-message latency).
    ``expert``: expert parallelism: the experts of each mixture-of-experts layer split over
    groups of that many data-parallel replicas (each holds ``1/expert`` of them; tokens reach
    their experts by all-to-all: :mod:`fxpipe.experts`); 1 (default): experts whole on every
    rank. Divides ``data``. ``auto``: the planner plans each degree that can work (1, 2, 4...
    dividing the devices) and keeps the fastest (:mod:`fxpipe.partitioner.degree_search`).
    ``context``: context parallelism: every micro-batch's sequence split over that many ranks
    (each holds two chunks of ``1/(2 context)``, a head and the mirrored tail, which balances
    causal attention; attention all-gathers keys and values along the sequence, everything else
    runs on the rank's tokens: :mod:`fxpipe.context`); the ranks of a context group hold the same
    stage and the same samples, so the devices are ``pipeline x data x context x tensor``. 1
    (default): whole sequences. ``auto``: the planner plans 1 and each degree whose groups fit
    a node, and keeps the fastest.
    ``context_attention``: how attention reads the other ranks' keys and values under context
    parallelism: ``all-gather`` (gathered whole before attention: one collective each way,
    not overlapped, the whole kept for the backward), ``ring`` (ring attention, passed rank to
    rank while each block computes; only the rank's own kept: :mod:`fxpipe.context.ring`) or
    ``auto`` (default: the planner plans both and keeps the faster).
    ``data_sharding``: what each stage's data-parallel replicas split among themselves instead
    of each holding it whole (ZeRO style, :mod:`fxpipe.runtime.data_sharding`): ``none``,
    ``optimizer`` (the optimizer state), ``gradients`` (and the gradients between steps),
    ``full`` (and the parameters between steps), or ``auto`` (the planner chooses).
    ``param_gather``: under ``data_sharding: full``, how a stage's sharded parameters come back
    for its micro-batches: ``stage`` (gathered whole once per step and held through it),
    ``block`` (FSDP / ZeRO-3 style: one block of the model at a time, gathered just before it
    runs and freed right after, in every forward and backward, the next block's all-gather
    overlapping the current block's compute, gradients reduce-scattered per block) or ``auto``
    (default: the planner weighs both)."""

    pipeline: Union[PositiveInt, Auto] = 1
    data: Union[PositiveInt, Auto] = 1
    tensor: Union[PositiveInt, Auto] = 1
    microbatches: Union[PositiveInt, Auto] = 1
    schedule: Union[Literal[SCHEDULES], Auto] = "1f1b"  # type: ignore[valid-type]
    virtual_stages: Union[PositiveInt, Auto] = 1
    sequence_parallel: bool = False
    tp_overlap: Union[PositiveInt, Auto] = 1
    expert: Union[PositiveInt, Auto] = 1
    context: Union[PositiveInt, Auto] = 1
    context_attention: Literal["auto", "all-gather", "ring"] = "auto"
    data_sharding: Literal[DATA_SHARDING] = "none"  # type: ignore[valid-type]
    param_gather: Literal["auto", "stage", "block"] = "auto"


class LinksSpec(_Section):
    """Link bandwidths in GB/s (10^9 bytes per second, one direction) and latency in seconds.
    ``intra_node_GBps``: e.g. NVLink 4 about 450 each way; ``inter_node_GBps``: e.g. NDR
    InfiniBand about 50; ``host_GBps``: between one device and its node's host memory, each
    way, with every device of the node copying (activation offload; default: a GPU profile's,
    the memory bandwidth on CPU, 12.5 on CUDA otherwise)."""

    intra_node_GBps: Rate = DEFAULT_INTRA_NODE_GBPS
    inter_node_GBps: Rate = DEFAULT_INTER_NODE_GBPS
    host_GBps: Rate | None = None
    latency_s: float = Field(default=DEFAULT_LATENCY_S, ge=0, allow_inf_nan=False)


#: Device memory bandwidth (GB/s) when ``cluster.memory_GBps`` is not given: one CPU core's
#: share of DRAM, an H100/H200's HBM3.
DEFAULT_MEMORY_GBPS = {"cpu": 20.0, "cuda": 3000.0}
#: Fixed cost of one eager op (dispatch on the host, a kernel launch on a GPU) when
#: ``cluster.op_overhead_us`` is not given.
DEFAULT_OP_OVERHEAD_US = {"cpu": 4.0, "cuda": 6.0}


class ClusterSpec(_Section):
    """``nodes`` x ``devices_per_node`` devices (one rank each). ``device``: ``cpu`` (gloo) or
    ``cuda`` (NCCL). ``gpu``: ``A100-80GB``, ``H100-80GB`` or ``H200``
    (:mod:`fxpipe.specs.gpus`): implies ``device: cuda`` and fills ``device_tflops`` (dense
    16-bit peak), ``memory_GBps`` (HBM), ``memory_gb`` and ``links`` (NCCL bus bandwidths of
    NVLink and of one GPU's NIC) where they are not given; values given by hand win. On CUDA the
    analytic costs come from the GPU model (:mod:`fxpipe.partitioner.gpu_model`: achievable
    matmul and HBM rates, attention, message-size-dependent collectives); ``device: cuda``
    without ``gpu`` applies the H100-80GB curves to the numbers given. ``attention``: the
    attention kernel the GPU model prices, ``flash`` (PyTorch's SDPA on 16-bit inputs) or
    ``math`` (unfused: the score matrix goes through memory). ``memory_gb``: per device, 10^9 bytes. ``device_tflops``: sustained
    10^12 FLOP/s per device used to turn FLOPs into seconds; ``memory_GBps``: the device's
    memory bandwidth (10^9 bytes/s; default 20 on CPU, 3000 on CUDA), which prices the ops that
    move bytes rather than compute (roofline: the slower of the two); ``op_overhead_us``: the
    fixed cost of launching one op (default 4 on CPU, 6 on CUDA). ``node_tflops``: a speed
    per node when nodes differ (overrides ``device_tflops`` node by node). ``costs``:
    ``analytic`` (FLOPs and bytes, default) or ``measured`` (``fxpipe profile`` times every
    planning unit on the device; cached). ``measure_stages`` (with ``costs: measured``,
    default true): also time the planned cut's stages whole and move the cut where they
    disagree with the per-node sums (:mod:`fxpipe.partitioner.refine`; cached). ``parameter_servers``: with ``train.updates: async``,
    how many devices hold the parameters and optimizer state instead of training: the last
    ranks (the last node's last devices), so ``pipeline x data + parameter_servers`` equals
    ``nodes x devices_per_node``; the parameters are sharded over them."""

    nodes: PositiveInt = 1
    devices_per_node: PositiveInt = 1
    device: Literal["cpu", "cuda"] = "cpu"
    gpu: str | None = None
    attention: Literal["flash", "math"] = "flash"
    memory_gb: PositiveFloat = 16.0
    host_memory_gb: PositiveFloat | None = None
    device_tflops: Rate = 0.05
    memory_GBps: Rate | None = None
    op_overhead_us: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    node_tflops: list[Rate] | None = None
    costs: Literal["analytic", "measured"] = "analytic"
    measure_stages: bool = True
    links: LinksSpec = Field(default_factory=LinksSpec)
    parameter_servers: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _gpu_defaults(cls, data: Any) -> Any:
        """``gpu``: check the name, fill the keys not given from its profile."""
        if not isinstance(data, dict) or data.get("gpu") is None:
            return data
        from fxpipe.specs.gpus import GPU_NAMES, PROFILES

        name = data["gpu"]
        if not isinstance(name, str) or name not in PROFILES:
            raise ValueError(f"gpu={name!r} is not a known GPU; use one of "
                             f"{', '.join(GPU_NAMES)}, or leave gpu out and give "
                             "device: cuda with device_tflops, memory_GBps and links by hand")
        if data.get("device", "cuda") != "cuda":
            raise ValueError(f"gpu={name!r} with device={data['device']!r}: a GPU profile "
                             "needs device: cuda (or leave device out)")
        out = dict(data)
        for key, value in PROFILES[name].cluster_defaults().items():
            if key == "links":
                given = out.get("links") or {}
                if isinstance(given, LinksSpec):
                    given = given.model_dump(exclude_unset=True)
                out["links"] = {**value, **dict(given)}
            elif out.get(key) is None:
                out[key] = value
        return out

    @property
    def world_size(self) -> int:
        """Devices (= ranks): ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    @property
    def trainers(self) -> int:
        """Devices that train (the pipeline x data grid): all but the parameter servers."""
        return self.world_size - self.parameter_servers

    @property
    def op_overhead_s(self) -> float:
        """Seconds per op launch (``op_overhead_us`` or the device's default)."""
        us = self.op_overhead_us
        return (DEFAULT_OP_OVERHEAD_US[self.device] if us is None else us) * 1e-6

    @property
    def memory_Bps(self) -> float:
        """Memory bandwidth in bytes/s (``memory_GBps`` or the device's default)."""
        return (self.memory_GBps or DEFAULT_MEMORY_GBPS[self.device]) * 1e9

    @property
    def host_Bps(self) -> float:
        """Bytes/s between one device and host memory, each way (``links.host_GBps``; on CPU
        the memory bandwidth, on CUDA without a GPU profile 12.5 GB/s: PCIe Gen4 x16 shared
        by two GPUs)."""
        if self.links.host_GBps is not None:
            return self.links.host_GBps * 1e9
        return self.memory_Bps if self.device == "cpu" else 12.5e9

    @property
    def host_bytes_per_device(self) -> float | None:
        """Host memory a device's offloaded activations may use: ``host_memory_gb`` of its
        node shared by the node's devices (None when not given)."""
        if self.host_memory_gb is None:
            return None
        return self.host_memory_gb * 1e9 / self.devices_per_node


class CheckpointSpec(_Section):
    """``dir``: checkpoint folder (relative to ``output.dir``); ``every``: steps between saves
    (0: only the final one)."""

    dir: str = "checkpoint"
    every: int = Field(default=0, ge=0)

    @field_validator("dir")
    @classmethod
    def _inside_run(cls, v: str) -> str:
        from pathlib import PurePath

        p = PurePath(v)
        if not v.strip() or p.is_absolute() or v.startswith("~") or ".." in p.parts \
                or p.parts in ((), (".",)):
            raise ValueError(f"{v!r} must be a folder name inside the run folder (relative, no "
                             "'..', not the run folder itself), e.g. 'checkpoint'")
        return v


class LRScheduleSpec(_Section):
    """``train.lr_schedule``: the learning rate per optimizer step, ``warmup_steps`` of linear
    warm-up (from ``lr / warmup_steps`` up to ``train.lr``), then ``decay``: ``constant``
    (``train.lr``, default) or ``cosine`` (down to ``min_lr`` at the last of ``train.steps``)."""

    warmup_steps: int = Field(default=0, ge=0)
    decay: Literal["constant", "cosine"] = "constant"
    min_lr: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class CompressionSpec(_Section):
    """``train.compression``: settings of the lossy gradient compressions with error feedback.
    ``rank`` (``powersgd``): rank of the low-rank approximation of every gradient matrix (at most
    the smaller side of each matrix parameter); ``ratio`` (``topk``): fraction of each bucket's
    entries sent, in (0, 1]; ``warmup_steps`` (both): global batches all-reduced exactly before
    compression starts (Vogels et al. 2019 warm up PowerSGD this way)."""

    rank: PositiveInt = 4
    ratio: float = Field(default=0.01, allow_inf_nan=False)
    warmup_steps: int = Field(default=10, ge=0)

    @field_validator("ratio")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"ratio={v:g} is not in (0, 1]: it is the fraction of each "
                             "bucket's gradient entries that topk sends (e.g. 0.01)")
        return v


class TrainSpec(_Section):
    """Training loop settings. ``precision``: ``fp32`` | ``bf16`` | ``fp16`` (16-bit compute with
    fp32 master weights; activations and their gradients travel between stages in 16 bits) |
    ``fp8`` (bf16, and the weight matmuls in float8 through torchao on FP8 tensor cores:
    H100 / H200; scaled per tensor or per row, ``fp8_scaling``: ``tensorwise`` | ``rowwise``;
    :mod:`fxpipe.execution.fp8`).
    ``grad_compression``: ``none`` (exact) | ``fp16`` | ``bf16`` (all-reduce in 16 bits) |
    ``powersgd`` | ``topk`` (low-rank / sparse with error feedback, settings in ``compression``:
    :class:`CompressionSpec`). ``updates``: ``sync`` (all-reduce, every replica steps together;
    exact) or ``async`` (parameter servers, ``cluster.parameter_servers``: replicas push gradients
    and pull weights at their own pace and never use weights more than ``max_staleness`` server
    updates older than those their gradient is applied to; 0 equals sync). ``timeout_s``: a peer silent for this long
    is an error, not a hang. ``eval_batches``: held-out batches on which ``fxpipe run`` measures the
    loss of the initial and the final model (0: skip). ``loss``: ``cross_entropy``, ``mse``,
    ``"package.module:function"``, or ``model`` (the model computes its own loss, e.g. a
    transformers model given ``labels``). ``ignore_index``: target value that does not count
    (padding, unmasked tokens); the loss is the mean over the targets that count in the whole
    batch, as in single-process training. ``lr_schedule``: warm-up and decay of ``lr``
    (:class:`LRScheduleSpec`; default a constant ``lr``). ``grad_clip``: clip the gradient norm
    (over all stages and replicas) to this value before each optimizer step (0, the default:
    no clipping). ``grad_accumulation``: global batches whose gradients are accumulated per
    optimizer step (``steps`` counts optimizer steps; each step's loss weighs ``1/k``).
    ``fuse_grad_accumulation``: the weight gradients of fp32 stages' ``linear`` / ``addmm`` /
    ``embedding`` nodes go into ``.grad`` in place over the micro-batches (default true;
    :mod:`fxpipe.execution.grad_fusion`); false keeps autograd's fresh buffer per micro-batch.
    ``activation_recompute``: a recomputing stage keeps only its inputs per micro-batch in
    flight and runs its forward again before its backward (``full``, or ``on``), or keeps its
    inputs and the outputs of its matmul-like ops whose FLOPs per output byte reach the
    device's ridge point (``device_tflops`` over ``memory_GBps``) and runs only its other ops
    again (``selective``: element-wise ops, norms, softmax, dropout, low-intensity matmuls such
    as attention scores; :mod:`fxpipe.execution.selective`); every stage so, never (``off``),
    or per stage where the activations would not fit otherwise, the least recomputation that
    fits (``auto``, default: none, then selective, then full); exact either way.
    ``recompute_layers``: with full recomputation (``full`` / ``on``, or a stage ``auto``
    recomputes fully), each recomputing stage recomputes only its first N blocks (the model's
    repeated layers on that stage) and keeps the activations of the others (Megatron-LM's
    ``--recompute-num-layers``); unset (default): the whole stage, or under ``auto`` the
    planner weighs partial recomputation per stage.
    ``activation_offload``: a stage moves the tensors its backward reads to host memory after
    the forward and back before its backward (priced at ``cluster.links.host_GBps``, held in
    ``cluster.host_memory_gb``): ``off`` (default), ``on`` (every stage), ``auto`` (weighed
    per candidate against recomputation where the activations would not fit otherwise).
    ``nan_policy``: on a non-finite loss, ``stop`` the run with a message (default) or ``skip``
    that step's update. ``max_restarts``: torchrun elastic restarts after a failed worker (a
    killed rank); the workers resume from the latest checkpoint (``checkpoint.every``).
    ``log``: where rank 0 writes its metrics: ``[csv]`` (``losses.csv``, always) or
    ``[csv, tensorboard]`` (and TensorBoard event files under the run folder's ``tensorboard/``;
    the optional ``tensorboard`` package).
    ``compile``: each stage's forward and backward run through ``torch.compile`` (inductor),
    compiled once per stage on its first micro-batch (``stages``), eagerly op by op
    (``none``), or compiled on CUDA and eager on CPU (``auto``, default);
    :mod:`fxpipe.execution.compiled_stage` says what composes. ``cuda_graphs``: compiled stages
    replay CUDA graphs (CUDA, ``compile`` on; shapes are static per stage)."""

    steps: int = Field(default=200, gt=0, le=10**12)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: PositiveFloat = 3e-4
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    seed: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    loss: str = "cross_entropy"
    grad_compression: Literal[GRAD_COMPRESSIONS] = "none"  # type: ignore[valid-type]
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    ignore_index: int = -100
    activation_recompute: Literal["auto", "on", "off", "full", "selective"] = "auto"
    activation_offload: Literal["off", "on", "auto"] = "off"
    recompute_layers: PositiveInt | None = None
    updates: Literal["sync", "async"] = "sync"
    max_staleness: int | None = None
    log_every: PositiveInt = 10
    timeout_s: float = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    eval_batches: int = Field(default=4, ge=0)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    grad_clip: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    grad_accumulation: PositiveInt = 1
    fuse_grad_accumulation: bool = True
    nan_policy: Literal["stop", "skip"] = "stop"
    max_restarts: int = Field(default=0, ge=0, le=100)
    log: list[Literal["csv", "tensorboard"]] = Field(default_factory=lambda: ["csv"])
    compile: Literal["none", "stages", "auto"] = "auto"
    cuda_graphs: bool = False

    @field_validator("log")
    @classmethod
    def _csv_logged(cls, v: list[str]) -> list[str]:
        if "csv" not in v or len(set(v)) != len(v):
            raise ValueError(f"got {v}; list each writer once, csv always (losses.csv feeds the "
                             "report and --resume): [csv] or [csv, tensorboard]")
        return v

    @field_validator("activation_recompute", "activation_offload", mode="before")
    @classmethod
    def _recompute_from_bool(cls, v: object) -> object:
        # YAML 1.1 reads unquoted on / off as booleans
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("max_staleness")
    @classmethod
    def _staleness_not_negative(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"{v} is negative; max_staleness counts server updates a replica's "
                             "weights may lag behind: 0 (lockstep, the same training as sync) "
                             "or more")
        return v


def _train_problems(t: TrainSpec) -> list[tuple[tuple[str, ...], str]]:
    """``train.lr_schedule`` against ``train.steps`` and ``train.lr``."""
    out: list[tuple[tuple[str, ...], str]] = []
    sched = t.lr_schedule
    if sched.warmup_steps >= t.steps:
        out.append((("train", "lr_schedule", "warmup_steps"),
                    f"warmup_steps={sched.warmup_steps} is not below train.steps={t.steps}, so "
                    "the warm-up never ends; choose fewer warm-up steps (e.g. "
                    f"{max(0, t.steps // 10)})"))
    if sched.decay == "cosine" and sched.min_lr > t.lr:
        out.append((("train", "lr_schedule", "min_lr"),
                    f"min_lr={sched.min_lr:g} is above train.lr={t.lr:g}, so the cosine decay "
                    "would raise the learning rate; choose a min_lr at most train.lr"))
    if sched.decay == "constant" and sched.min_lr:
        out.append((("train", "lr_schedule", "min_lr"),
                    "min_lr applies to decay: cosine only; drop it or set decay: cosine"))
    return out


class OutputSpec(_Section):
    """``dir``: where plan dumps, losses, checkpoints and traces go."""

    dir: str = "runs/default"


class ParallelSpec(_Section):
    """The whole validated spec. Build it with :func:`fxpipe.load_spec` (YAML) or directly."""

    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    parallel: ParallelSpec_ = Field(default_factory=ParallelSpec_)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)

    @property
    def loss_output(self) -> str | int | None:
        """The model output the loss reads: ``model.output``, else ``loss`` when the model
        computes its own loss (``train.loss: model``), else None (``logits`` when the model
        returns several outputs, or its only output)."""
        if self.model.output is not None:
            return self.model.output
        return "loss" if self.train.loss == "model" else None

    @model_validator(mode="after")
    def _cross_section(self) -> "ParallelSpec":
        problems = cross_section_problems(self)
        if problems:
            raise CrossSectionError(problems)
        return self


class CrossSectionError(ValueError):
    """Rules between sections that :class:`ParallelSpec` violates.

    ``problems``: list of ``(key_path, message)``; ``key_path`` is a tuple such as
    ``("parallel", "pipeline")`` naming the key the message is about (the loader turns it into a
    ``FILE:LINE``). The ``str()`` lists them one per line.
    """

    def __init__(self, problems: list[tuple[tuple[str, ...], str]]):
        self.problems = list(problems)
        super().__init__("\n".join(f"{'.'.join(p)}: {m}" for p, m in self.problems))


def cross_section_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """Every cross-section rule ``spec`` breaks, as ``(key_path, message)`` pairs (empty: valid).

    Rules: pipeline x data == world size (``cluster.nodes x cluster.devices_per_node``; with one
    side ``auto`` the other must divide it); the global ``data.batch_size`` splits into
    ``data x microbatches`` equal micro-batches (with ``microbatches: auto``, at least into
    ``data`` replicas); ``virtual_stages > 1`` only with the ``interleaved`` schedule; the
    schedule's own constraints on concrete values (``interleaved``: microbatches a multiple of
    pipeline; ``interleaved`` / the V schedules: pipeline >= 2; ``dualpipev``: microbatches >=
    2 x pipeline - 1).
    """
    out: list[tuple[tuple[str, ...], str]] = []
    par, world = spec.parallel, spec.cluster.trainers
    servers = spec.cluster.parameter_servers
    p, d, m = par.pipeline, par.data, par.microbatches
    out += _tensor_problems(spec)
    out += _sharding_problems(spec)
    out += _expert_problems(spec)
    out += _context_problems(spec)
    t = par.tensor
    if isinstance(t, int) and t > 1 and world % t == 0:
        world //= t  # the pipeline x data grid: positions of t ranks each
    if isinstance(par.context, int) and par.context > 1 and world % par.context == 0:
        world //= par.context  # and of a context group each
    speeds = spec.cluster.node_tflops
    if speeds is not None and len(speeds) != spec.cluster.nodes:
        out.append((("cluster", "node_tflops"),
                    f"node_tflops gives {len(speeds)} speeds for cluster.nodes={spec.cluster.nodes}; "
                    "give one TFLOP/s figure per node, or drop it to use device_tflops everywhere"))
    fixed = lambda x: isinstance(x, int)  # noqa: E731  (not 'auto')
    tp = f" x {t}" if isinstance(t, int) and t > 1 else ""
    if t == "auto" and fixed(p) and fixed(d):
        if world % (p * d) or spec.cluster.devices_per_node % (world // (p * d) or 1):
            out.append((("parallel", "tensor"),
                        f"pipeline x data = {p} x {d} leaves no tensor degree for the {world} "
                        "devices (it must divide the devices of a node); change "
                        "parallel.pipeline or parallel.data"))
    elif fixed(p) and fixed(d) and par.context == "auto" and world % (p * d):
        out.append((("parallel", "context"),
                    f"pipeline x data = {p} x {d} does not divide the {world} devices, so no "
                    "context degree fills them; change parallel.pipeline or parallel.data"))
    elif fixed(p) and fixed(d) and par.context != "auto" and p * d != world:
        c = par.context if isinstance(par.context, int) else 1
        ranks = p * d * (t if tp else 1) * c
        cp = f" x {c}" if c > 1 else ""
        out.append((("parallel", "pipeline"),
                    f"pipeline x data{' x context' if cp else ''}{' x tensor' if tp else ''} = "
                    f"{p} x {d}{cp}{tp} = {ranks} "
                    f"ranks, but the cluster has {spec.cluster.trainers} "
                    f"devices (cluster.nodes x cluster.devices_per_node = "
                    f"{spec.cluster.nodes} x {spec.cluster.devices_per_node}"
                    + (f", minus {servers} parameter servers" if servers else "") + "); make "
                    f"parallel.pipeline x parallel.data{' x parallel.context' if cp else ''}"
                    f"{' x parallel.tensor' if tp else ''} "
                    "equal the device count, or set one of them to 'auto'"))
    for name, k in (("pipeline", p), ("data", d)):
        other = "data" if name == "pipeline" else "pipeline"
        if fixed(k) and not fixed(getattr(par, other)) and world % k:
            out.append((("parallel", name),
                        f"{name}={k} does not divide the {world} devices of the cluster "
                        f"(cluster.nodes x cluster.devices_per_node"
                        + (" minus cluster.parameter_servers" if servers else "")
                        + (f", over parallel.tensor={t}" if tp else "")
                        + f"), so no parallel.{other} "
                        f"fits; choose a divisor of {world}"))
    b = spec.data.batch_size
    if fixed(d) and fixed(m) and b % (d * m):
        out.append((("data", "batch_size"),
                    f"batch_size={b} (the global batch) does not split into parallel.data x "
                    f"parallel.microbatches = {d} x {m} = {d * m} equal micro-batches; choose a "
                    f"batch size divisible by {d * m} (e.g. {d * m * max(1, round(b / (d * m)))})"))
    elif fixed(d) and b % d:
        out.append((("data", "batch_size"),
                    f"batch_size={b} (the global batch) does not split over parallel.data={d} "
                    f"replicas; choose a batch size divisible by {d}"))
    v = par.virtual_stages
    if v != "auto" and v > 1 and par.schedule not in ("interleaved", "auto"):
        out.append((("parallel", "virtual_stages"),
                    f"virtual_stages={v} needs schedule 'interleaved' (schedule is "
                    f"{par.schedule!r}); set parallel.schedule: interleaved, or virtual_stages: 1 "
                    "(zb-v, v-half, v-min and dualpipev always use 2 stages per rank by themselves)"))
    out += _schedule_problems(par)
    out += _train_problems(spec.train)
    out += _fast_stage_problems(spec)
    out += _offload_problems(spec)
    out += _compression_problems(spec.train)
    from fxpipe.specs.updates import update_problems

    out += update_problems(spec)
    return out


def _fast_stage_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """``train.precision: fp8`` where the cluster has no FP8 tensor cores; ``train.cuda_graphs``
    off CUDA or without compiled stages."""
    cl, t = spec.cluster, spec.train
    if t.cuda_graphs and cl.device != "cuda":
        return [(("train", "cuda_graphs"),
                 f"CUDA graphs need CUDA devices; cluster.device is {cl.device}: set "
                 "cuda_graphs: false")]
    if t.cuda_graphs and t.compile == "none":
        return [(("train", "cuda_graphs"),
                 "CUDA graphs capture the compiled stages' kernels, but train.compile is none: "
                 "set compile: stages (or auto)")]
    if spec.train.precision != "fp8":
        return []
    if cl.device != "cuda":
        return [(("train", "precision"),
                 f"fp8 runs the matmuls on FP8 tensor cores (CUDA, compute capability 8.9+: "
                 f"H100, H200, L40S); cluster.device is {cl.device}: use bf16")]
    from fxpipe.specs.gpus import profile

    gpu = getattr(cl, "gpu", None)
    if gpu is not None and profile(gpu).fp8_tflops is None:
        return [(("train", "precision"),
                 f"fp8 needs FP8 tensor cores, which the {gpu} has none of (H100 and H200 "
                 "do): use bf16")]
    return []


def _offload_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """``train.activation_offload`` against host memory and ``activation_recompute``."""
    t, out = spec.train, []
    if t.recompute_layers is not None and (t.activation_recompute in ("off", "selective")
                                           or t.activation_offload == "on"):
        why = (f"activation_recompute is {t.activation_recompute}"
               if t.activation_recompute in ("off", "selective")
               else "activation_offload: on offloads every stage instead")
        out.append((("train", "recompute_layers"),
                    f"{t.recompute_layers} recomputes the first blocks of stages that recompute "
                    f"fully, but {why}; set activation_recompute: full (or auto), or drop "
                    "recompute_layers"))
    if t.activation_offload == "off":
        return out
    if spec.cluster.host_memory_gb is None:
        out.append((("train", "activation_offload"),
                    f"{t.activation_offload} needs cluster.host_memory_gb "
                    "(the host memory of one node, 10^9 bytes, shared by its devices), which "
                    "holds the offloaded activations; give it, or set activation_offload: off"))
    if t.activation_offload == "on" and t.activation_recompute in ("on", "full", "selective"):
        out.append((("train", "activation_offload"),
                    f"on with activation_recompute: {t.activation_recompute}: both ask every stage to give up its activations "
                    "(a stage either offloads them or recomputes them); choose one, or set "
                    "one of them to auto"))
    return out


#: ``train.compression`` keys -> the ``grad_compression`` methods that read them
_COMPRESSION_KEYS = {"rank": ("powersgd",), "ratio": ("topk",),
                     "warmup_steps": ("powersgd", "topk")}


def _compression_problems(t: TrainSpec) -> list[tuple[tuple[str, ...], str]]:
    """``train.compression`` keys set to other than their defaults that the chosen
    ``train.grad_compression`` does not read (a plan's saved spec repeats the defaults)."""
    out: list[tuple[tuple[str, ...], str]] = []
    default = CompressionSpec()
    for key, users in _COMPRESSION_KEYS.items():
        if getattr(t.compression, key) != getattr(default, key) \
                and t.grad_compression not in users:
            out.append((("train", "compression", key),
                        f"compression.{key} applies to grad_compression: {' or '.join(users)}, "
                        f"but grad_compression is {t.grad_compression!r}; drop it or set "
                        f"train.grad_compression: {users[0]}"))
    return out


def compression_rank_problems(spec: ParallelSpec, shapes: dict[str, tuple[int, ...]]
                              ) -> list[tuple[tuple[str, ...], str]]:
    """With ``grad_compression: powersgd``, the parameters (name -> shape, the trained ones)
    whose matrix (:func:`low_rank_view`) has a side shorter than ``train.compression.rank``: a
    rank-r approximation of such a matrix does not exist. Checked when planning, where the
    model's shapes are known."""
    t = spec.train
    if t.grad_compression != "powersgd":
        return []
    rank = t.compression.rank
    small = [(n, v) for n, s in shapes.items() if (v := low_rank_view(s)) and min(v) < rank]
    if not small:
        return []
    name, (rows, cols) = min(small, key=lambda x: (min(x[1]), x[0]))
    more = f" ({len(small) - 1} more parameters are too small too)" if len(small) > 1 else ""
    return [(("train", "compression", "rank"),
             f"rank={rank} is larger than the smaller side of parameter {name!r}, a {rows} x "
             f"{cols} matrix{more}; choose a rank of at most {min(rows, cols)}")]


def _sharding_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """``parallel.data_sharding`` with what it cannot combine with, named as pairs."""
    level, t = spec.parallel.data_sharding, spec.train
    out: list[tuple[tuple[str, ...], str]] = []
    if spec.parallel.param_gather == "block":
        if level not in ("full", "auto"):
            out.append((("parallel", "param_gather"),
                        f"block gathers sharded parameters, which only data_sharding: full "
                        f"shards (it is {level}); set data_sharding: full (or auto), or "
                        "param_gather: stage"))
        elif spec.parallel.data == 1:
            out.append((("parallel", "param_gather"),
                        "block needs data_sharding: full over more than one replica, but "
                        "parallel.data is 1 (nothing to shard); give data: 2 or more (or auto), "
                        "or param_gather: stage"))
    if level == "none":
        return out
    if t.updates == "async":
        out.append((("parallel", "data_sharding"),
                    f"data_sharding: {level} with train.updates: async: the parameter servers "
                    "already hold the optimizer state (sharded over the servers); use updates: "
                    "sync, or data_sharding: none"))
    if t.grad_compression in ("powersgd", "topk"):
        out.append((("parallel", "data_sharding"),
                    f"data_sharding: {level} with train.grad_compression: {t.grad_compression}: "
                    "a sharded replica receives its slice of the summed gradient through a "
                    "reduce-scatter, which a low-rank or sparse compression (error feedback "
                    "over the whole gradient, all-reduced or all-gathered) cannot serve; use "
                    "fp16 or bf16 compression, or data_sharding: none"))
    return out


#: the most chunks ``parallel.tp_overlap`` takes
MAX_TP_OVERLAP = 64


def _tensor_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """``parallel.tensor`` against the nodes (a tensor group inside one node), the devices and
    what it cannot combine with; ``sequence_parallel`` needs tensor parallelism."""
    out: list[tuple[tuple[str, ...], str]] = []
    par, cl = spec.parallel, spec.cluster
    t = par.tensor
    if par.sequence_parallel and t == 1:
        out.append((("parallel", "sequence_parallel"),
                    "sequence_parallel splits the sequence over a tensor-parallel group, but "
                    "parallel.tensor is 1; set parallel.tensor (e.g. 2, or 'auto') or drop "
                    "sequence_parallel"))
    k = par.tp_overlap
    if isinstance(k, int) and k > MAX_TP_OVERLAP:
        out.append((("parallel", "tp_overlap"),
                    f"tp_overlap={k} chunks: at most {MAX_TP_OVERLAP} (each chunk adds launches "
                    "and a message of its own; 2 to 8 is the useful range, or 'auto')"))
    if isinstance(k, int) and k > 1 and t == 1:
        out.append((("parallel", "tp_overlap"),
                    "tp_overlap overlaps tensor-parallel collectives with compute, but "
                    "parallel.tensor is 1; set parallel.tensor (e.g. 2, or 'auto') or drop "
                    "tp_overlap"))
    if not isinstance(t, int) or t == 1:
        return out
    dpn = cl.devices_per_node
    if t > dpn:
        out.append((("parallel", "tensor"),
                    f"tensor={t} is larger than the {dpn} devices of a node "
                    "(cluster.devices_per_node): a tensor group communicates in every layer and "
                    f"stays inside one node (NVLink); use a tensor degree of at most {dpn}"))
    elif dpn % t:
        fits = [k for k in range(1, dpn + 1) if dpn % k == 0]
        out.append((("parallel", "tensor"),
                    f"tensor={t} does not divide the {dpn} devices of a node, so some tensor "
                    f"group would span two nodes; use one of {fits}"))
    elif cl.trainers % t:
        out.append((("parallel", "tensor"),
                    f"tensor={t} does not divide the {cl.trainers} training devices"))
    if spec.train.updates == "async":
        out.append((("parallel", "tensor"),
                    "train.updates: async (parameter servers) with parallel.tensor > 1 is not "
                    "supported: a server would hold whole parameters that the replicas hold as "
                    "shards; use updates: sync, or tensor: 1"))
    return out


def _expert_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """``parallel.expert`` against the data-parallel degree it splits and what it cannot
    combine with yet."""
    par, n = spec.parallel, spec.parallel.expert
    if n == 1 or n == "auto":
        return []  # (auto tries only the degrees that can work)
    out: list[tuple[tuple[str, ...], str]] = []
    if isinstance(par.data, int) and par.data % n:
        out.append((("parallel", "expert"),
                    f"expert={n} splits the experts over groups of {n} data-parallel replicas, "
                    f"but parallel.data={par.data} does not divide into them; use an expert "
                    f"degree that divides data (e.g. {max(k for k in range(1, par.data + 1) if par.data % k == 0 and k <= n)})"))
    if par.param_gather == "block":
        out.append((("parallel", "param_gather"),
                    "gathering block by block with parallel.expert > 1 is not supported yet: "
                    "the experts are left whole by the sharding; use param_gather: stage or "
                    "auto"))
    if spec.train.updates == "async":
        out.append((("parallel", "expert"),
                    "train.updates: async (parameter servers) with parallel.expert > 1 is not "
                    "supported: a server would hold whole experts that the replicas split; use "
                    "updates: sync"))
    return out


def _context_problems(spec: ParallelSpec) -> list[tuple[tuple[str, ...], str]]:
    """``parallel.context`` against the devices and what it cannot combine with yet (whether
    it divides the sequence is known once the model is traced: the planner says)."""
    par, c = spec.parallel, spec.parallel.context
    if c == 1 or c == "auto":
        return []  # (auto tries only the degrees that can work)
    out: list[tuple[tuple[str, ...], str]] = []
    t = par.tensor if isinstance(par.tensor, int) else 1
    if spec.cluster.trainers % (c * t):
        out.append((("parallel", "context"),
                    f"context={c}{f' x tensor={t}' if t > 1 else ''} does not divide the "
                    f"{spec.cluster.trainers} training devices"))
    others = [(k, why) for k, on, why in (
        ("tensor", par.tensor != 1, "parallel.tensor: 1"),
        ("expert", par.expert not in (1, "auto"), "parallel.expert: 1"),
    ) if on]
    for k, why in others:
        out.append((("parallel", k),
                    f"parallel.context > 1 with parallel.{k} is not supported yet; use {why} or "
                    "context: 1"))
    if spec.train.updates == "async":
        out.append((("parallel", "context"),
                    "train.updates: async (parameter servers) with parallel.context > 1 is not "
                    "supported: the ranks of a context group hold parts of the same samples; "
                    "use updates: sync"))
    return out


def _schedule_problems(par: ParallelSpec_) -> list[tuple[tuple[str, ...], str]]:
    """The constraints the schedule generators (``fxpipe.schedule.generators.compute_schedule``)
    enforce, checked here with plain arithmetic (no schedule is built) when the values involved
    are concrete (not ``auto``), so the user gets them with ``FILE:LINE`` at load time:
    ``interleaved`` and the V schedules place several stages per rank and need ``pipeline >= 2``;
    ``dualpipev`` needs ``microbatches >= 2 x pipeline - 1`` (its phases, DeepSeek-V3's);
    ``interleaved`` runs micro-batches in groups of ``pipeline`` (Megatron-LM), so
    ``microbatches % pipeline == 0``. (``virtual_stages`` vs schedule is checked above.)"""
    out: list[tuple[tuple[str, ...], str]] = []
    s, p, m = par.schedule, par.pipeline, par.microbatches
    if stages_per_rank(s, 2) > 1 and p == 1:
        out.append((("parallel", "pipeline"),
                    f"schedule {s!r} spreads several stages over the ranks of a pipeline, but "
                    "pipeline=1; use pipeline >= 2 (or 'auto'), or schedule '1f1b' for a single "
                    "stage"))
    elif s == "interleaved" and isinstance(p, int) and isinstance(m, int) and m % p:
        lo = (m // p) * p
        hint = f"{lo} or {lo + p}" if lo else f"{p}"
        out.append((("parallel", "microbatches"),
                    f"schedule 'interleaved' runs micro-batches in groups of pipeline={p} "
                    f"through each virtual stage, so microbatches must be a multiple of {p}, got "
                    f"{m}; set parallel.microbatches to {hint} (keeping data.batch_size "
                    "divisible by data x microbatches), or use schedule '1f1b'"))
    elif s == "dualpipev" and isinstance(p, int) and isinstance(m, int) and m < 2 * p - 1:
        out.append((("parallel", "microbatches"),
                    f"schedule 'dualpipev' needs at least 2 x pipeline - 1 = {2 * p - 1} "
                    f"micro-batches (its warm-up runs 2 x (pipeline - 1) forwards of the first "
                    f"stage on rank 0), got {m}; set parallel.microbatches >= {2 * p - 1} "
                    "(keeping data.batch_size divisible by data x microbatches), or use "
                    "schedule 'zb-v'"))
    return out
