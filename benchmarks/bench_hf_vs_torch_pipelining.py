"""An HF causal LM trained by fxpipe with its planned split and by torch.distributed.pipelining
with an equal-layer split, side by side (issue 8, item 7: target >= 1.25x per step).

Model: ``transformers.GPT2LMHeadModel`` with a large vocabulary and few layers (default GPT-2's
own vocabulary of 50 257 tokens, width 512, 8 layers of 8 heads, 64 tokens per sequence, one
sequence per micro-batch, 16 micro-batches per step), seeded, dropout 0, ``use_cache`` off,
**untied** head (``tie_word_embeddings=False``, as Llama-style models and torchtitan have it):
the ``width x vocab`` head and its cross entropy are then a heavy piece that lives on the last
stage whatever the split. Three runs on the same ranks, with the same schedule, micro-batches,
initial weights, data sequence and optimizer (SGD), in one process group:

* ``fx``: fxpipe's plan (``fxpipe.plan`` of the meta-device model, the cost-based split, cuts
  inside blocks allowed), run by :class:`fxpipe.runtime.executor.PipelineExecutor` with the
  model computing its own loss from ``labels`` (``train.loss: model``);
* ``torch``: the equal-layer split torchtitan makes (stage 0 = embeddings + the first ``L/p``
  blocks, last stage = the last ``L/p`` blocks + ``ln_f`` + ``lm_head``; each stage a module
  taking and returning one tensor, the same HF modules), run by
  ``torch.distributed.pipelining.PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` on its
  own gloo group, with the causal-LM cross entropy (transformers' ``ForCausalLMLoss``, what the
  model itself computes) as ``loss_fn`` on the last stage, ``return_outputs=False``;
* ``fx_equal`` (``--no-fx-equal`` skips it): fxpipe's runtime on the same equal-layer split
  (planned with ``fxpipe.annotate`` pins), which separates what the split gains from what the
  runtimes differ by.

fxpipe's plan is the planner's own choice for the spec (pipeline ``p``, the schedule, ``m``
micro-batches, the calibrated cost model): nothing in the model is annotated for the ``fx`` run.

Runs alternate in blocks of ``k`` steps (order reversed every other round), each after a barrier;
a block's step time is its slowest rank's mean, the table gives medians. Every run trains its own
copy from the same initial weights on the same batches, so the losses must agree step by step
(same math; different ranks hold the pieces). After the timed rounds every rank times one
forward + backward of each of its stages on one micro-batch, rank after rank (so nothing else
runs), for the measured stage balance; the predicted balance is fxpipe's cost model for the
planned split and for the equal split (the annotated plan), with ``device_tflops`` calibrated on
this machine (one thread, the head's matmul shape) unless ``--tflops`` is given.

Run: ``python benchmarks/bench_hf_vs_torch_pipelining.py`` (about five minutes on 2 idle
cores, longer on a loaded machine: steps slow down and noisy rounds are run again, at most
``--max-rounds``;
``--tiny`` runs a toy shape in seconds). Writes the ``hf-vs-torch-pipelining`` section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `fxpipe` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402
from benchmarks._runtime_bench import (  # noqa: E402
    REPO_OUT,
    load_average,
    machine_note,
    run_group,
)

SECTION = "hf-vs-torch-pipelining"
#: where the last run's figures are saved (``--report-from`` rewrites the section from them)
RESULT_JSON = REPO_OUT / "hf_vs_torch_pipelining.json"
TARGET = 1.25
#: a timed round is dropped (and run again, within ``--max-rounds``) when other processes used
#: more than this share of the machine's CPU during one of its blocks
MAX_FOREIGN = 0.1
#: the runs, in the order of a round (reversed every other round, so fxpipe's planned run and
#: torch's are always adjacent): fxpipe planned, torch, fxpipe on the equal split
ARMS = ("fx", "torch", "fx_equal")
ARM_NAMES = {"fx": "fxpipe, planned split", "fx_equal": "fxpipe, equal split",
             "torch": "torch, equal split"}
#: a GPT-2 block's parameter-holding parts, in forward order (for describing a split)
BLOCK_PARTS = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")


# ------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class LMShape:
    """GPT-2 causal LM shape: ``vocab`` tokens, ``width`` features, ``layers`` blocks of
    ``heads`` heads, ``seq`` tokens per sequence, ``mbs`` sequences per micro-batch."""

    vocab: int = 50257
    width: int = 512
    layers: int = 8
    heads: int = 8
    seq: int = 64
    mbs: int = 1
    seed: int = 0

    def hf_config(self) -> dict:
        """``GPT2Config`` keyword arguments (also the spec's ``model.config``)."""
        return dict(vocab_size=self.vocab, n_positions=self.seq, n_embd=self.width,
                    n_layer=self.layers, n_head=self.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, tie_word_embeddings=False, use_cache=False,
                    bos_token_id=None, eos_token_id=None)

    def label(self) -> str:
        return (f"GPT2LMHeadModel vocab {self.vocab}, width {self.width}, {self.layers} layers, "
                f"{self.heads} heads, seq {self.seq}, micro-batch {self.mbs}")


#: the ``--tiny`` shape (smoke test: seconds)
TINY = LMShape(vocab=512, width=32, layers=2, heads=2, seq=16, mbs=1)


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def build_model(shape: LMShape) -> nn.Module:
    """The seeded model (on the current default device: use ``torch.device("meta")`` to plan)."""
    tf = _quiet_transformers()
    torch.manual_seed(shape.seed)
    model = tf.GPT2LMHeadModel._from_config(tf.GPT2Config(**shape.hf_config()))
    return model.train()


def batch_source(shape: LMShape, m: int):
    """Global batches of ``m * mbs`` sequences of real text: bytes of the Python standard
    library's sources (:class:`fxpipe.examples.data.ByteBatches`, the same on every rank);
    token ids are bytes (< 256 <= vocab), full length, so every micro-batch weighs the same."""
    from fxpipe.examples.data import ByteBatches, python_source_text

    return ByteBatches(python_source_text(1 << 20), m * shape.mbs, shape.seq, shape.seed)


def batch_ids(source, step: int) -> torch.Tensor:
    """Token ids ``[m * mbs, seq]`` int64 of global batch ``step``; the labels are the ids
    themselves (the model shifts them)."""
    return source.get(step)[0]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss ``GPT2LMHeadModel`` computes from ``labels`` (transformers' ``ForCausalLMLoss``:
    float logits, labels shifted left, mean over the counted tokens)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


# ------------------------------------------------------------------------ equal-layer splits
def layer_split(layers: int, p: int, input_weight: int = 0, output_weight: int = 0
                ) -> list[list[int]]:
    """Blocks per stage, torchtitan's rule (``generate_llm_fqn_per_model_part``): the embedding
    counts as ``input_weight`` layers and ``ln_f`` + head as ``output_weight``, the effective
    layers are dealt out evenly (the first stages take the remainder). Weights 0 give the plain
    equal-layer split; torchtitan's defaults (``pipeline_parallel_first/last_stage_less_layers``)
    are 1 and 1.

    Raises:
        ValueError: a stage would get no effective layer.
    """
    eff = layers + input_weight + output_weight
    per, extra = divmod(eff, p)
    if per == 0 or max(input_weight, output_weight) > per:
        raise ValueError(f"{layers} layers (+{input_weight} +{output_weight}) cannot fill {p} "
                         "stages; use fewer stages or more layers")
    out, nxt = [], 0
    for s in range(p):
        n = per + (s < extra) - (input_weight if s == 0 else 0) \
            - (output_weight if s == p - 1 else 0)
        take = list(range(nxt, min(nxt + max(n, 0), layers)))
        nxt += len(take)
        out.append(take)
    out[-1] += list(range(nxt, layers))  # what is left (none with a consistent rule)
    return out


def describe_layers(split: list[list[int]], s: int) -> str:
    """The modules of stage ``s`` of a layer split, e.g. ``"emb, h0-h1"``."""
    parts = ["emb"] if s == 0 else []
    if split[s]:
        lo, hi = split[s][0], split[s][-1]
        parts.append(f"h{lo}" if lo == hi else f"h{lo}-h{hi}")
    if s == len(split) - 1:
        parts.append("ln_f, head, loss")
    return ", ".join(parts)


def loss_stage(plan) -> int | None:
    """The stage that computes the plan's model output (the loss). A plan folded as repeated
    blocks (``plan.folded``) lists no stage outputs until a worker resolves it: there the loss is
    the last node after the blocks, whose stage is the last of ``folded["epilogue"]``."""
    for st in plan.stages:
        if plan.model_output in st.outputs:
            return st.index
    epilogue = plan.folded.get("epilogue") if plan.folded else None
    return epilogue[-1] if epilogue else None


def describe_plan_stage(plan, s: int, layers: int) -> str:
    """The modules of stage ``s`` of an fxpipe plan from the parameters it holds: whole blocks as
    ``h2``, a block cut inside as ``h2[ln_1..attn.c_proj]`` (the parts this stage holds), and
    ``loss`` when the stage computes the model's loss."""
    params = set(plan.stages[s].params)
    tokens: list[str] = []
    if {"transformer.wte.weight", "transformer.wpe.weight"} & params:
        tokens.append("emb")
    run: list[int] = []

    def flush():
        if run:
            tokens.append(f"h{run[0]}" if len(run) == 1 else f"h{run[0]}-h{run[-1]}")
            run.clear()

    for i in range(layers):
        have = [part for part in BLOCK_PARTS
                if f"transformer.h.{i}.{part}.weight" in params]
        if len(have) == len(BLOCK_PARTS):
            run.append(i)
            continue
        flush()
        if have:
            tokens.append(f"h{i}[{have[0]}..{have[-1]}]" if len(have) > 1 else f"h{i}[{have[0]}]")
    flush()
    if "transformer.ln_f.weight" in params:
        tokens.append("ln_f")
    if "lm_head.weight" in params:
        tokens.append("head")
    if s == loss_stage(plan):
        tokens.append("loss")
    return ", ".join(tokens) or "(no parameters)"


# ------------------------------------------------------------------------------------ planning
def spec_dict(shape: LMShape, p: int, m: int, schedule: str, tflops: float, gbps: float,
              lr: float = 1e-2) -> dict:
    """The fxpipe spec (a dict, as ``tests/real_models.spec_for``): ``p`` stages x 1 replica."""
    return {
        "model": {"hf": "GPT2LMHeadModel", "config": shape.hf_config()},
        "data": {"batch_size": m * shape.mbs, "seq_len": shape.seq},
        "parallel": {"pipeline": p, "data": 1, "microbatches": m, "schedule": schedule},
        "cluster": {"nodes": 1, "devices_per_node": p, "memory_gb": 16,
                    "device_tflops": tflops, "links": {"intra_node_GBps": gbps}},
        "train": {"optimizer": "sgd", "lr": lr, "loss": "model", "steps": 1},
    }


def example_kwargs(shape: LMShape) -> dict:
    """One micro-batch of keyword inputs for planning."""
    ids = batch_ids(batch_source(shape, 1), 0)
    return {"input_ids": ids, "labels": ids}


def plan_pair(shape: LMShape, p: int, m: int, schedule: str, tflops: float, gbps: float,
              split: list[list[int]]):
    """``(planned, pinned)``: fxpipe's own plan, and the plan of ``split`` (embeddings pinned to
    stage 0, block ``i`` to its stage, ``ln_f`` and the head to the last), both priced by the
    same cost model."""
    import fxpipe

    spec = spec_dict(shape, p, m, schedule, tflops, gbps)
    kw = example_kwargs(shape)
    with torch.device("meta"):
        model = build_model(shape)
    planned = fxpipe.plan(model, spec, example_kwargs=kw)
    with torch.device("meta"):
        pinned_model = build_model(shape)
    tr = pinned_model.transformer
    for mod in (tr.wte, tr.wpe, tr.drop):
        fxpipe.annotate(mod, stage=0)
    for s, blocks in enumerate(split):
        for i in blocks:
            fxpipe.annotate(tr.h[i], stage=s)
    fxpipe.annotate(tr.ln_f, stage=p - 1)
    fxpipe.annotate(pinned_model.lm_head, stage=p - 1)
    pinned = fxpipe.plan(pinned_model, spec, example_kwargs=kw)
    return planned, pinned


def calibrate_tflops(shape: LMShape, reps: int = 10) -> float:
    """Single-thread fp32 matmul TFLOP/s of this machine at the head's shape
    (``[mbs * seq, width] x [width, vocab]``), best of ``reps``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(shape.mbs * shape.seq, shape.width)
        w = torch.randn(shape.vocab, shape.width)
        x @ w.t()
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            x @ w.t()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * x.shape[0] * shape.width * shape.vocab / best / 1e12


# ------------------------------------------------------------------------------- torch's side
class TitanStage(nn.Module):
    """One stage of a GPT2LMHeadModel split by whole blocks, as torchtitan builds it (a copy of
    the model keeping only this stage's modules): stage 0 embeds ``input_ids``, the others take
    the hidden states; the last applies ``ln_f`` and the head and returns the logits. The causal
    mask is built the way ``GPT2Model.forward`` builds it (``create_causal_mask``)."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool):
        super().__init__()
        tr = model.transformer
        self.config = model.config
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop
        self.h = nn.ModuleList(tr.h[i] for i in blocks)
        if last:
            self.ln_f, self.lm_head = tr.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        h = self.drop(self.wte(x) + self.wpe(pos)) if self.first else x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=pos)
        for block in self.h:
            h = block(h, None, mask, None, use_cache=False, position_ids=pos)
        if self.last:
            h = self.lm_head(self.ln_f(h))
        return h


# ---------------------------------------------------------------------------------- rank side
@dataclass
class Case:
    """One comparison: ``schedule`` on ``p`` ranks with ``m`` micro-batches; plan dicts of the
    planned and the equal split; the equal split's blocks per stage."""

    schedule: str
    p: int
    m: int
    planned: dict
    equal: dict
    split: list[list[int]]


def _fx_run(plan_dict: dict, model: nn.Module, mesh, lr: float):
    """(plan, executor, stage modules, counter) for this rank, as ``tests/test_real_models``."""
    from fxpipe.partitioner.loss_targets import target_counter
    from fxpipe.partitioner.split import build_stages, trace_for_plan
    from fxpipe.plans.plan import Plan
    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.schedule.lowering import schedule_for_plan
    from fxpipe.specs.loader import load_spec
    from fxpipe.execution.losses import MODEL_LOSS, resolve_loss
    from fxpipe.training.losses import batch_counter

    plan = Plan.from_dict(plan_dict)
    spec = load_spec(plan.spec)
    traced = trace_for_plan(plan, model)  # resolves a plan folded as repeated blocks first:
    schedule = schedule_for_plan(plan)     # its sends come from the resolved stage edges
    stages = build_stages(plan, traced, schedule.stages_of_rank(mesh.pipe_rank))
    count = batch_counter(plan.model_inputs, plan.input_kwargs, spec.train.ignore_index,
                          target_counter(traced.gm), spec.train.loss == MODEL_LOSS)
    params = list({id(q): q for mod in stages.values() for q in mod.parameters()}.values())
    ex = PipelineExecutor(plan, schedule, stages, mesh,
                          resolve_loss(spec.train.loss, spec.train.ignore_index),
                          torch.optim.SGD(params, lr=lr), timeout_s=300, needs_target=False)
    # the modules the executor runs (weight gradients accumulated in place, runtime.grad_fusion)
    return plan, ex, {st: w.module for st, w in ex.work.items()}, count


def _fx_stage_fb(plan, s: int, module: nn.Module, mb: dict[str, torch.Tensor]) -> None:
    """One forward + backward of fxpipe stage ``s`` on one micro-batch: model inputs from ``mb``,
    activations random (the plan's shapes and dtypes); backward from the loss on the loss stage,
    else from all-ones gradients of the float outputs."""
    st = plan.stages[s]
    args = []
    for name in st.inputs:
        if name in mb:
            args.append(mb[name])
            continue
        v = plan.values[name]
        dtype = getattr(torch, v.dtype)
        args.append(torch.randn(v.shape, dtype=dtype).requires_grad_() if v.requires_grad
                    else torch.zeros(v.shape, dtype=dtype))
    out = module(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if plan.model_output in st.outputs:
        outs[st.outputs.index(plan.model_output)].backward()
    else:
        fl = [o for o in outs if o.requires_grad]
        torch.autograd.backward(fl, [torch.ones_like(o) for o in fl])


def _time_ms(fn, reps: int) -> float:
    """Fastest milliseconds of ``fn()`` over ``reps`` calls after one warm-up call (the least
    disturbed by other work on the machine)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent not idle (``/proc/stat``), or None where there
    is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def _foreign_share(busy0: float | None, cpu0: float, wall: float) -> float:
    """Share of the machine's CPU capacity used during the last block (this rank: ``wall``
    seconds since ``busy0`` / ``cpu0``) by processes other than the ranks. Collective over the
    default group: every rank adds its own process CPU time; the machine's busy time and the
    wall time are the ranks' means. Rank 0's value, the same on every rank (0 where a rank has
    no ``/proc/stat``)."""
    busy1 = _busy_cpu_s()
    have = busy0 is not None and busy1 is not None
    t = torch.tensor([time.process_time() - cpu0, (busy1 - busy0) if have else 0.0, wall,
                      1.0 if have else 0.0], dtype=torch.float64)
    n = dist.get_world_size()
    dist.all_reduce(t)
    # clamped to [0, 1]: /proc/stat counts in clock ticks, so a short block can read above 1
    share = (min(1.0, max(0.0, float(t[1]) / n - float(t[0]))
                 / (float(t[2]) / n * (os.cpu_count() or 1))) if t[3] == n else 0.0)
    out = torch.tensor([share], dtype=torch.float64)
    dist.broadcast(out, 0)
    return float(out)


def compare_worker(rank: int, shape: LMShape, cases: list[Case], rounds: int, k: int,
                   warmup: int, arms: tuple[str, ...], lr: float, stage_reps: int,
                   max_rounds: int | None = None, max_foreign: float = 0.1) -> list[dict]:
    """On each rank, for each case: build the runs in ``arms`` from one seeded model (copies of
    the same initial weights), train ``warmup`` steps of each, then ``rounds`` rounds of one
    block of ``k`` steps per run (order reversed in odd rounds), then time each local stage's
    forward + backward alone.

    A round in which, during one of its blocks, other processes used more than
    ``max_foreign`` of the machine's CPU (``/proc/stat`` busy time minus the ranks' own) is
    dropped and run again, up to ``max_rounds`` rounds in all (default ``rounds + rounds // 2``,
    so a loaded machine costs at most half as much time again);
    when the attempts left are only enough for the rounds still needed, rounds are kept anyway.

    Returns per case ``{"times": arm -> [s per step per kept block], "losses": arm -> [loss per
    step] (torch: last rank only, else []), "stage_ms": arm -> {stage: ms}, "foreign": [share of
    the CPU used by others in the worst block of each kept round], "attempts": rounds run}``.
    """
    max_rounds = max_rounds or rounds + rounds // 2
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fxpipe.data.batches import Batch
    from fxpipe.runtime.mesh import Mesh
    from fxpipe.training.losses import microbatch_weights

    _quiet_transformers()
    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    p = cases[0].p
    mesh = Mesh(p, 1, timeout_s=300)
    tgroup = dist.new_group(list(range(p)))  # torch's traffic on its own gloo group
    out = []
    for case in cases:
        m = case.m
        n_steps = warmup + max_rounds * k
        source = batch_source(shape, m)
        ids = [batch_ids(source, i) for i in range(n_steps)]
        base = build_model(shape)
        models = {a: (base if a == "fx" else copy.deepcopy(base)) for a in arms}
        steps: dict = {}
        losses: dict[str, list[float]] = {a: [] for a in arms}
        stage_fb: dict = {}  # arm -> {stage: fn}
        executors = []
        mb0 = ids[0][: shape.mbs]
        for a in arms:
            if a == "torch":
                first, last = rank == 0, rank == p - 1
                mod = TitanStage(models[a], case.split[rank], first, last)
                del models[a]
                t_stage = PipelineStage(mod, rank, p, torch.device("cpu"), group=tgroup)
                t_sched = classes[case.schedule](t_stage, m, loss_fn=causal_lm_loss)
                t_opt = torch.optim.SGD(mod.parameters(), lr=lr)

                def torch_step(i, sched=t_sched, opt=t_opt, first=first, last=last):
                    got: list = []
                    if first:
                        sched.step(ids[i], return_outputs=False)
                    elif last:
                        sched.step(target=ids[i], losses=got, return_outputs=False)
                    else:
                        sched.step(return_outputs=False)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if got:
                        losses["torch"].append(float(torch.stack([v.detach() for v in got]).mean()))

                def torch_fb(mod=mod, first=first, last=last):
                    x = mb0 if first else torch.randn(shape.mbs, shape.seq, shape.width,
                                                      requires_grad=True)
                    y = mod(x)
                    if last:
                        causal_lm_loss(y, mb0).backward()
                    else:
                        y.backward(torch.ones_like(y))

                steps[a] = torch_step
                stage_fb[a] = {rank: torch_fb}
                continue
            plan, ex, stages, count = _fx_run(case.planned if a == "fx" else case.equal,
                                              models[a], mesh, lr)
            executors.append(ex)

            def fx_step(i, a=a, plan=plan, ex=ex, count=count):
                b = Batch((), {"input_ids": ids[i], "labels": ids[i]}, None)
                w = microbatch_weights(b, 0, 1, m, count)
                losses[a].append(ex.step(b.named(plan.model_inputs, plan.input_kwargs), None, w))

            steps[a] = fx_step
            mb = {"input_ids": mb0, "labels": mb0}
            stage_fb[a] = {s: (lambda plan=plan, s=s, mod=mod, mb=mb:
                               _fx_stage_fb(plan, s, mod, mb)) for s, mod in stages.items()}
        done = {a: 0 for a in arms}

        def run(a, n):
            for _ in range(n):
                steps[a](done[a])
                done[a] += 1

        for a in arms:
            dist.barrier()
            run(a, warmup)
        times: dict[str, list[float]] = {a: [] for a in arms}
        foreign: list[float] = []  # per round: the worst block's share of CPU used by others
        attempts = 0
        while len(foreign) < rounds and attempts < max_rounds:
            got, worst = {}, 0.0
            for a in (arms if attempts % 2 == 0 else arms[::-1]):
                dist.barrier()
                busy0, cpu0, t0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
                run(a, k)
                wall = time.perf_counter() - t0
                got[a] = wall / k
                worst = max(worst, _foreign_share(busy0, cpu0, wall))
            for ex in executors:
                ex.reset_stats()  # keep the event list short
            attempts += 1
            keep = worst <= max_foreign or attempts > max_rounds - (rounds - len(foreign))
            if keep:
                foreign.append(worst)  # kept (or kept anyway: no attempts left to spare)
                for a in arms:
                    times[a].append(got[a])
            if rank == 0:  # progress: a run takes minutes
                print(f"  {case.schedule} p={p}: round {attempts}/{max_rounds} "
                      f"{'kept' if keep else 'dropped'} (others' CPU {worst:.0%}), "
                      + ", ".join(f"{a} {got[a] * 1e3:.0f}" for a in arms) + " ms/step",
                      file=sys.stderr, flush=True)
        stage_ms: dict = {a: {} for a in arms}
        for turn in range(p):  # one rank at a time: nothing else competes for the cores
            dist.barrier()
            if turn == rank:
                for a in arms:
                    for s, fn in stage_fb[a].items():
                        stage_ms[a][s] = _time_ms(fn, stage_reps)
        dist.barrier()
        out.append(dict(times=times, stage_ms=stage_ms, foreign=foreign, attempts=attempts,
                        losses={a: (v if a != "torch" or rank == p - 1 else [])
                                for a, v in losses.items()}))
    return out


# ------------------------------------------------------------------------------------ analysis
@dataclass
class Row:
    """One (p, schedule) comparison.

    Attributes:
        step_s: run -> median seconds per step (per block: the slowest rank's mean).
        blocks_s: run -> seconds per step of each block.
        loss_diff: run -> largest |loss - torch's loss| over the steps both ran (not for torch).
        losses: run -> loss per step (``fx`` and ``torch``).
        splits: ``"fx"`` / ``"equal"`` -> description of every stage.
        predicted_ms: ``"fx"`` / ``"equal"`` -> fxpipe's predicted forward + backward ms per
            micro-batch of every stage.
        predicted_step_s: ``"fx"`` / ``"equal"`` -> fxpipe's predicted seconds per step.
        measured_ms: run -> measured forward + backward ms per micro-batch of every stage.
        fx_head_alone: fxpipe's last stage holds no transformer block (only ln_f / head / loss).
        foreign: per kept round, the share of the machine's CPU other processes used in its
            most disturbed block.
        attempts: rounds run (kept and dropped).
    """

    schedule: str
    p: int
    m: int
    step_s: dict[str, float]
    blocks_s: dict[str, list[float]]
    loss_diff: dict[str, float]
    losses: dict[str, list[float]]
    splits: dict[str, list[str]]
    predicted_ms: dict[str, list[float]]
    predicted_step_s: dict[str, float]
    measured_ms: dict[str, list[float]]
    fx_head_alone: bool = False
    foreign: list[float] = field(default_factory=list)
    attempts: int = 0

    def round_ratios(self, num: str, den: str) -> list[float]:
        """Per round: run ``num``'s block time / run ``den``'s."""
        return [a / b for a, b in zip(self.blocks_s[num], self.blocks_s[den])]

    def ratio(self, num: str, den: str) -> float:
        """Median over rounds of :meth:`round_ratios` (blocks of one round run back to back,
        so the machine's load drifting between rounds cancels)."""
        return statistics.median(self.round_ratios(num, den))

    @property
    def speedup(self) -> float:
        """torch's step time / fxpipe's (planned split): median of the per-round ratios."""
        return self.ratio("torch", "fx")

    @property
    def round_speedups(self) -> list[float]:
        return self.round_ratios("torch", "fx")

    @property
    def predicted_speedup(self) -> float:
        return self.predicted_step_s["equal"] / self.predicted_step_s["fx"]


@dataclass
class Result:
    """Everything one run of the benchmark measured."""

    shape: LMShape
    rows: list[Row]
    tflops: float
    gbps: float
    arms: tuple[str, ...]
    rounds: int
    k: int
    params_m: float
    lr: float
    titan: list[dict] = field(default_factory=list)
    predicted_only: list[dict] = field(default_factory=list)
    max_rounds: int = 0
    quiet_wait_s: float = 0.0
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)

    def oversubscribed(self, p: int) -> bool:
        """More single-thread ranks than CPU cores: ranks share cores, so the step time measures
        CPU sharing more than the pipeline's balance."""
        return p > self.cores


def save_result(res: Result, note: str, wall_s: float, path: Path = RESULT_JSON) -> Path:
    """Write ``res`` (with the machine note and wall time) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"result": dataclasses.asdict(res), "note": note,
                                "wall_s": wall_s}, indent=1))
    return path


def load_result(path: Path) -> tuple[Result, str, float]:
    """``(result, machine note, wall seconds)`` saved by :func:`save_result`."""
    d = json.loads(Path(path).read_text())
    r = dict(d["result"])
    r["shape"] = LMShape(**r["shape"])
    r["rows"] = [Row(**row) for row in r["rows"]]
    r["arms"] = tuple(r["arms"])
    r.setdefault("max_rounds", 2 * r["rounds"] + 2)  # saved before the bound was recorded
    return Result(**r), d["note"], d["wall_s"]


def head_alone(plan) -> bool:
    """Whether the plan's last stage holds no transformer block (only ln_f / head / loss)."""
    return not any(q.startswith("transformer.h.") for q in plan.stages[-1].params)


def _stage_ms(plan) -> list[float]:
    return [st.compute_time_s * 1e3 for st in plan.stages]


def measure(shape: LMShape, ps=(2,), schedules=("gpipe", "1f1b"), m: int = 8,
            rounds: int = 8, k: int = 1, warmup: int = 1, arms: tuple[str, ...] = ARMS,
            tflops: float | None = None, gbps: float = 2.0, lr: float = 1e-2,
            stage_reps: int = 3, timeout_s: float = 1800.0, predict_ps=(),
            max_foreign: float = 0.1, max_rounds: int | None = None,
            quiet_wait_s: float = 0.0) -> Result:
    """Plan every case here, run each ``p`` of ``ps`` on its own spawned gloo group (one row
    per (p, schedule)); for each ``p`` of ``predict_ps`` only plan both splits (the predicted
    figures, :attr:`Result.predicted_only`). ``max_foreign``: see :func:`compare_worker` (1.0
    keeps every round). ``quiet_wait_s``: before calibrating and before each group's run, wait
    up to this long for the machine to be less than 30% busy (others' jobs share it).

    Raises:
        RuntimeFailure: a rank failed or the deadline passed.
    """
    from benchmarks.bench_pick import wait_quiet

    def quiet(what: str) -> None:
        if quiet_wait_s > 0:
            wait_quiet(0.3, quiet_wait_s, log=lambda s: print(f"{s} ({what})", file=sys.stderr,
                                                              flush=True))

    if not tflops:
        quiet("calibration")
        tflops = calibrate_tflops(shape)
    rows, titan, predicted_only = [], [], []
    for p in [*ps, *(q for q in predict_ps if q not in ps)]:
        split = layer_split(shape.layers, p)
        cases, plans = [], {}
        for name in schedules:
            planned, pinned = plan_pair(shape, p, m, name, tflops, gbps, split)
            plans[name] = (planned, pinned)
            cases.append(Case(name, p, m, planned.to_dict(), pinned.to_dict(), split))
        try:
            tsplit = layer_split(shape.layers, p, 1, 1)
        except ValueError:
            tsplit = None
        if tsplit is not None and tsplit != split:  # torchtitan's default weights differ
            _, tpinned = plan_pair(shape, p, m, schedules[-1], tflops, gbps, tsplit)
            planned = plans[schedules[-1]][0]
            titan.append(dict(p=p, schedule=schedules[-1],
                              split=[describe_layers(tsplit, s) for s in range(p)],
                              predicted_ms=_stage_ms(tpinned),
                              predicted_speedup=tpinned.predicted.step_time_s
                              / planned.predicted.step_time_s))
        if p not in ps:
            for name, (planned, pinned) in plans.items():
                predicted_only.append(dict(
                    p=p, schedule=name, m=m,
                    splits={"fx": [describe_plan_stage(planned, s, shape.layers)
                                   for s in range(p)],
                            "equal": [describe_layers(split, s) for s in range(p)]},
                    predicted_ms={"fx": _stage_ms(planned), "equal": _stage_ms(pinned)},
                    predicted_step_s={"fx": planned.predicted.step_time_s,
                                      "equal": pinned.predicted.step_time_s}))
            continue
        quiet(f"p={p}")
        res = run_group(compare_worker, p, shape, cases, rounds, k, warmup, tuple(arms), lr,
                        stage_reps, max_rounds, max_foreign, timeout_s=timeout_s)
        for i, case in enumerate(cases):
            per_rank = [res[r][i] for r in range(p)]
            kept = len(per_rank[0]["foreign"])
            blocks = {a: [max(pr["times"][a][j] for pr in per_rank) for j in range(kept)]
                      for a in arms}
            losses = {a: per_rank[p - 1]["losses"][a] for a in arms}
            diff = {}
            for a in arms:
                if a != "torch":
                    n = min(len(losses[a]), len(losses["torch"]))
                    diff[a] = max((abs(x - y) for x, y in zip(losses[a][:n], losses["torch"][:n])),
                                  default=float("nan"))
            measured = {}
            for a in arms:
                got = {s: ms for pr in per_rank for s, ms in pr["stage_ms"][a].items()}
                measured[a] = [got[s] for s in range(p)]
            planned, pinned = plans[case.schedule]
            rows.append(Row(
                case.schedule, p, m, {a: statistics.median(v) for a, v in blocks.items()},
                blocks, diff, {a: losses[a] for a in ("fx", "torch")},
                {"fx": [describe_plan_stage(planned, s, shape.layers) for s in range(p)],
                 "equal": [describe_layers(split, s) for s in range(p)]},
                {"fx": _stage_ms(planned), "equal": _stage_ms(pinned)},
                {"fx": planned.predicted.step_time_s, "equal": pinned.predicted.step_time_s},
                measured, head_alone(planned), per_rank[0]["foreign"],
                per_rank[0]["attempts"]))
    with torch.device("meta"):
        n_params = sum(q.numel() for q in build_model(shape).parameters())
    return Result(shape, rows, tflops, gbps, tuple(arms), rounds, k, n_params / 1e6, lr, titan,
                  predicted_only, max_rounds=max_rounds or rounds + rounds // 2,
                  quiet_wait_s=quiet_wait_s)


# --------------------------------------------------------------------------------------- report
def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def steps_table(res: Result) -> str:
    """Markdown table of the step times and speedups."""
    eq = "fx_equal" in res.arms
    header = ["schedule", "ranks", "m", "fxpipe planned ms/step", "torch equal-layer ms/step",
              "speedup torch / fxpipe", "per-round speedups (min-max)", "predicted speedup"]
    if eq:
        header += ["fxpipe equal-layer ms/step", "split gain", "runtime ratio"]
    header += ["max loss diff", "loss first -> last", "rounds kept / run", "others' CPU"]
    body = []
    for r in res.rows:
        rs = r.round_speedups
        ranks = f"{r.p}*" if res.oversubscribed(r.p) else r.p
        line = [r.schedule, ranks, r.m, _ms(r.step_s["fx"] * 1e3), _ms(r.step_s["torch"] * 1e3),
                f"**{r.speedup:.2f}x**", f"{min(rs):.2f}-{max(rs):.2f}",
                f"{r.predicted_speedup:.2f}x"]
        if eq:
            line += [_ms(r.step_s["fx_equal"] * 1e3),
                     f"{r.ratio('fx_equal', 'fx'):.2f}x",
                     f"{r.ratio('torch', 'fx_equal'):.2f}"]
        line += [f"{max(r.loss_diff.values()):.1e}",
                 f"{r.losses['fx'][0]:.3f} -> {r.losses['fx'][-1]:.3f}",
                 f"{len(r.foreign)} / {r.attempts}",
                 f"<= {max(r.foreign, default=0.0) * 100:.0f}%"]
        body.append(line)
    return markdown_table(header, body)


def balance_table(res: Result) -> str:
    """Markdown table of the splits with predicted and measured forward + backward ms per
    micro-batch of every stage (measured: the fastest over the schedules' rows)."""
    eq = "fx_equal" in res.arms
    header = ["ranks", "stage", "fxpipe planned split", "predicted ms", "measured ms",
              "equal-layer split", "predicted ms", "measured ms (torch)"]
    if eq:
        header.append("measured ms (fxpipe)")
    body = []
    for p in sorted({r.p for r in res.rows}):
        rows = [r for r in res.rows if r.p == p]
        same = all(r.splits == rows[0].splits for r in rows)
        groups = [rows] if same else [[r] for r in rows]
        for g in groups:
            r0 = g[0]
            tag = "" if same else f" ({r0.schedule})"
            for s in range(p):
                def med(arm, s=s, g=g):
                    return _ms(min(r.measured_ms[arm][s] for r in g))
                line = [f"{p}{tag}", s, r0.splits["fx"][s], _ms(r0.predicted_ms["fx"][s]),
                        med("fx"), r0.splits["equal"][s], _ms(r0.predicted_ms["equal"][s]),
                        med("torch")]
                if eq:
                    line.append(med("fx_equal"))
                body.append(line)
    return markdown_table(header, body)


def predicted_table(res: Result) -> str:
    """Markdown table of the cases only planned (not run): both splits, the predicted stage
    times and step times."""
    header = ["schedule", "ranks", "m", "fxpipe planned split (predicted ms per stage)",
              "equal-layer split (predicted ms per stage)", "predicted ms/step fxpipe / equal",
              "predicted speedup"]
    body = []
    for d in res.predicted_only:
        def stages(key, d=d):
            return " \\| ".join(f"{sp} ({_ms(ms)})" for sp, ms in
                                  zip(d["splits"][key], d["predicted_ms"][key]))
        st = d["predicted_step_s"]
        body.append([d["schedule"], d["p"], d["m"], stages("fx"),
                     stages("equal"), f"{_ms(st['fx'] * 1e3)} / {_ms(st['equal'] * 1e3)}",
                     f"{st['equal'] / st['fx']:.2f}x"])
    return markdown_table(header, body)


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _findings(res: Result) -> str:
    """Data-driven paragraphs: target, where the time goes, what the cost model misses."""
    rows = res.rows
    met = [r for r in rows if r.speedup >= TARGET]
    gm = _gmean([r.speedup for r in rows])
    lines = [f"Target speedup >= {TARGET:.2f}x: met in {len(met)} of {len(rows)} rows "
             f"(geometric mean {gm:.2f}x; predicted by fxpipe's cost model: "
             + ", ".join(f"{r.predicted_speedup:.2f}x" for r in rows) + ")."]
    noisy = [x for r in rows for x in r.foreign if x > MAX_FOREIGN]
    if noisy:
        lines.append(
            f"Caution: {len(noisy)} of {sum(len(r.foreign) for r in rows)} kept rounds ran while "
            f"other processes used more than {MAX_FOREIGN:.0%} of the machine's CPU (up to "
            f"{max(noisy):.0%}; they were kept because the reruns allowed ran out): ranks then "
            "wait for cores, so step times and per-round speedups measure the machine's load as "
            "much as the pipeline's balance, and the stage times measured on one rank at a "
            "time and the calibrated device_tflops are inflated too. Rerun on a quiet machine "
            "before reading the speedups as the runtimes' difference.")
    # the bound: the head's stage cannot get faster than the head itself
    for p in sorted({r.p for r in rows}):
        group = [x for x in rows if x.p == p]
        r = group[0]
        fx = [min(x.measured_ms["fx"][s] for x in group) for s in range(p)]
        eq = [min(x.measured_ms["torch"][s] for x in group) for s in range(p)]
        ideal = max(eq) / max(fx)
        text = ((f"p={p} (*: {p} single-thread ranks on {res.cores} cores, so ranks share cores "
                 "and the step time measures CPU sharing more than the pipeline's balance; the "
                 "stage times below were measured one rank at a time): ")
                if res.oversubscribed(p) else f"p={p}: ")
        text += ("measured stages (ms per micro-batch, forward + backward) "
                + " / ".join(_ms(x) for x in fx) + " on fxpipe's split, "
                + " / ".join(_ms(x) for x in eq) + " on the equal split (torch); bottleneck "
                f"ratio {ideal:.2f}x.")
        if max(range(p), key=lambda s: fx[s]) == p - 1 and r.fx_head_alone:
            text += (f" fxpipe's bottleneck is its last stage ({r.splits['fx'][-1]}) with no "
                     "block left on it, which no split can make cheaper: the gain is bounded by "
                     "the blocks the equal split leaves beside the head, and the pipeline's fill "
                     "and drain (a step is about (m - 1) x the bottleneck + the sum of the "
                     "stages) dilute it further.")
        lines.append(text)
    if "fx_equal" in res.arms:
        rt = [r.ratio("torch", "fx_equal") for r in rows]
        sg = [r.ratio("fx_equal", "fx") for r in rows]
        lines.append(
            "Split vs runtime: on the same equal-layer split, torch's step / fxpipe's is "
            f"{min(rt):.2f}-{max(rt):.2f}x (geometric mean {_gmean(rt):.2f}x); fxpipe's planned "
            f"split over the equal one gains {min(sg):.2f}-{max(sg):.2f}x (geometric mean "
            f"{_gmean(sg):.2f}x) on fxpipe's runtime. The speedup is the product of the two. On the "
            "same split the runtimes differ in how weight gradients accumulate: fxpipe's adds "
            "them into `.grad` in place (`fxpipe.execution.grad_fusion`), torch's stages, run by "
            "autograd, allocate a fresh gradient of the head and of the embedding per "
            "micro-batch and add it.")
    # the cost model vs the measured stages
    last = [r.measured_ms["fx"][-1] / r.predicted_ms["fx"][-1] for r in rows
            if r.predicted_ms["fx"][-1] > 0]
    rest = [r.measured_ms["fx"][s] / r.predicted_ms["fx"][s] for r in rows
            for s in range(r.p - 1) if r.predicted_ms["fx"][s] > 0]
    if last and rest:
        a, b = statistics.median(last), statistics.median(rest)
        verdict = (f"the head's stage is under-priced by {(a / b - 1) * 100:.0f}% relative to the "
                   "others" if a > 1.1 * b else
                   f"the head's stage is over-priced by {(b / a - 1) * 100:.0f}% relative to the "
                   "others" if a < b / 1.1 else
                   "the head's stage (the width x vocabulary matmul, log-softmax and cross "
                   "entropy) is priced within 10% of the others, so the planned split is not "
                   "skewed by the cost model here")
        lines.append(
            f"Cost model (the spec's `cluster.costs` default, device_tflops {res.tflops:.3f}): "
            "measured / predicted forward + backward time per micro-batch is "
            f"{a:.2f} on fxpipe's last stage ({rows[0].splits['fx'][-1]}) and {b:.2f} on the "
            f"others (medians over rows): {verdict}.")
    def titan_same(p: int) -> bool:
        try:
            return layer_split(res.shape.layers, p, 1, 1) == layer_split(res.shape.layers, p)
        except ValueError:
            return False

    same = [p for p in sorted({r.p for r in rows}) if titan_same(p)]
    if same:
        lines.append(
            "torchtitan's default weighting (embedding and ln_f + head counted as one layer each, "
            "`pipeline_parallel_first/last_stage_less_layers = 1`) gives the same split as the "
            f"plain equal-layer one for p = {', '.join(map(str, same))} ({res.shape.layers} "
            "layers), so the torch run is exactly torchtitan's split there.")
    for t in res.titan:
        lines.append(
            f"torchtitan's default weighting (embedding and ln_f + head counted as one layer "
            f"each, `pipeline_parallel_first/last_stage_less_layers = 1`) would split p={t['p']} "
            "as " + " | ".join(t["split"]) + "; fxpipe's cost model predicts that split "
            f"{t['predicted_speedup']:.2f}x slower than the planned one ({t['schedule']}), "
            "versus " + ", ".join(
                [f"{r.predicted_speedup:.2f}x" for r in rows
                 if r.p == t["p"] and r.schedule == t["schedule"]]
                + [f"{d['predicted_step_s']['equal'] / d['predicted_step_s']['fx']:.2f}x"
                   for d in res.predicted_only
                   if d["p"] == t["p"] and d["schedule"] == t["schedule"]])
            + " for the plain equal-layer split (torchtitan's weighting itself is not run).")
    return "\n\n".join(lines)


def report(res: Result, note: str, wall_s: float) -> str:
    """The BENCHMARKS.md section body."""
    s = res.shape
    arms = ", ".join(f"`{a}` ({ARM_NAMES[a]})" for a in res.arms)
    lines = [
        "## An HF causal LM: fxpipe's planned split vs torch.distributed.pipelining's "
        "equal-layer split (GPipe, 1F1B; gloo, CPU)",
        "",
        "Written by `python benchmarks/bench_hf_vs_torch_pipelining.py`. Model: "
        f"`transformers.GPT2LMHeadModel`, vocabulary {s.vocab}, width {s.width}, {s.layers} "
        f"layers of {s.heads} heads, {s.seq} tokens per sequence, {res.params_m:.1f} M "
        "parameters, untied head (`tie_word_embeddings=False`), dropout 0, `use_cache` off, "
        f"seed {s.seed}; micro-batches of {s.mbs} sequence(s) of real text (bytes of the Python "
        "standard library's sources, `fxpipe.examples.data.ByteBatches`), labels = ids (the "
        f"model's own shifted cross entropy), SGD (lr {res.lr:g}) after every step, fp32. Runs: "
        f"{arms}. fxpipe: `fxpipe.plan` of the meta-device model with nothing annotated (the "
        "planner's own cost-based split for this pipeline, schedule and micro-batch count; "
        "repeated blocks may be planned as whole blocks), `PipelineExecutor` with "
        "`train.loss: model` (its default fp32 runtime: the weight gradients of `linear`, "
        "`addmm` and `embedding` accumulate into `.grad` in place over the micro-batches, "
        "`fxpipe.execution.grad_fusion`, where autograd makes a new `vocab x width` buffer per "
        "micro-batch for the head and the embedding). torch: the split torchtitan makes "
        "(stage 0 = embeddings + the first L/p blocks, the last stage = the last L/p blocks + "
        "`ln_f` + head; the same HF modules), `PipelineStage` + `ScheduleGPipe` / "
        "`Schedule1F1B` on its own gloo group, transformers' `ForCausalLMLoss` as `loss_fn` on "
        "the last stage, `return_outputs=False`. All runs use the same ranks, schedule, "
        "micro-batches, initial weights and batches, in one process group; timed in blocks of "
        f"{res.k} step(s), {res.rounds} rounds (one block of each run per round, fxpipe's planned "
        "run next to torch's, the order reversed every other round), a barrier before each "
        "block; a block's step time is its slowest rank's mean; ms/step columns are medians "
        "over rounds. *Speedup*: the median over rounds of torch's block time / fxpipe's in the "
        "same round (adjacent blocks, so load drifting between rounds on this shared machine "
        "cancels); *per-round speedups*: their range. *Predicted speedup*: fxpipe's simulated "
        "step of the equal-layer split (the same model pinned with `fxpipe.annotate`) / that of "
        "its planned split. *Split gain*: fxpipe on the equal split / fxpipe on its plan; "
        "*runtime ratio*: torch / fxpipe on the same equal split (medians of per-round ratios "
        "too). *Rounds kept / run*: a round is dropped and run again when, during one of its "
        "blocks, other processes used more than 10% of the machine's CPU (`/proc/stat` busy "
        f"time minus the ranks' own CPU time), up to {res.max_rounds} rounds in all (then kept "
        "anyway); *others' CPU*: the largest such share among the kept rounds. *Max loss diff*: "
        "the "
        "largest difference between a fxpipe run's loss and torch's at the same step (each "
        "trains its own copy from the same weights on the same batches).",
        "",
        f"Machine: {note}. Cost model: device_tflops {res.tflops:.3f} (one thread, calibrated "
        "here unless given), links "
        f"{res.gbps:g} GB/s. Total wall time {wall_s:.0f} s"
        + (f" (before calibrating and before the run, up to {res.quiet_wait_s:.0f} s of waiting "
           "for the machine to be < 30% busy)." if res.quiet_wait_s else "."),
        "",
        steps_table(res),
        "",
        "Splits and stage balance: forward + backward ms of one micro-batch per stage, "
        "predicted by fxpipe's cost model and measured on each rank alone after the timed "
        "rounds (fastest of 3, after a warm-up; random activations of the planned shapes; the "
        "loss stage from the loss; optimizer step excluded). "
        "`h2[ln_1..attn.c_proj]`: a block cut inside, the parts listed on that stage.",
        "",
        balance_table(res),
    ]
    if res.predicted_only:
        ps = sorted({d["p"] for d in res.predicted_only})
        lines += [
            "",
            f"Planned only, not run (p = {', '.join(map(str, ps))}: more single-thread ranks "
            f"than this machine's {res.cores} cores, so ranks would share cores and the step "
            "time would measure CPU sharing rather than the pipeline's balance; `--ps` runs them "
            "anyway): fxpipe's predicted figures for both splits.",
            "",
            predicted_table(res),
        ]
    lines += ["", _findings(res)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None, out: Path | None = BENCHMARKS_MD) -> Result:
    """CLI entry: measure, print the tables, write the section to ``out`` (``None`` or
    ``--no-write``: do not write). Returns the :class:`Result`."""
    d = LMShape()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="toy shape, p=2, 2 micro-batches, few steps (seconds; smoke test)")
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--width", type=int, default=d.width)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--seq", type=int, default=d.seq)
    ap.add_argument("--mbs", type=int, default=d.mbs, help="sequences per micro-batch")
    many = (os.cpu_count() or 1) >= 4
    ap.add_argument("--ps", type=int, nargs="+", default=[2, 4] if many else [2],
                    help="pipeline ranks to run (default 2, and 4 on a machine of >= 4 cores)")
    ap.add_argument("--predict-ps", type=int, nargs="*", default=[] if many else [4],
                    help="pipeline ranks to plan only (predicted figures, no run)")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                    choices=["gpipe", "1f1b"])
    ap.add_argument("--m", type=int, default=16, help="micro-batches per step")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds kept per row")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="rounds run at most per row, dropped ones included (default rounds + "
                         "rounds // 2)")
    ap.add_argument("--k", type=int, default=1, help="steps per timed block")
    ap.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate")
    ap.add_argument("--quiet-wait", type=float, default=60.0, metavar="S",
                    help="before calibrating and before each run of ranks, wait up to S seconds "
                         "for the machine to be < 30%% busy (0: do not wait)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tflops", type=float, default=None,
                    help="cost model device_tflops (default: calibrated on this machine)")
    ap.add_argument("--gbps", type=float, default=2.0, help="cost model link GB/s")
    ap.add_argument("--no-fx-equal", action="store_true",
                    help="skip fxpipe's run on the equal-layer split")
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--report-from", type=Path, default=None, metavar="JSON",
                    help=f"measure nothing: rewrite the section from a saved run ({RESULT_JSON} "
                         "is written by every run that writes the section)")
    args = ap.parse_args(argv)
    if args.report_from is not None:
        res, note, wall = load_result(args.report_from)
        print(steps_table(res))
        if out is not None and not args.no_write:
            write_section(SECTION, report(res, note, wall), out)
            print(f"wrote section '{SECTION}' of {out}")
        return res
    if args.tiny:
        shape, ps, pps, m, rounds, k, warmup, reps = TINY, [2], [], 2, 2, 1, 1, 1
        tflops, max_foreign = args.tflops or 0.05, 1.0  # keep every round: seconds, not accuracy
    else:
        shape = LMShape(args.vocab, args.width, args.layers, args.heads, args.seq, args.mbs)
        ps, pps, m, rounds, k = args.ps, args.predict_ps, args.m, args.rounds, args.k
        warmup, reps, tflops, max_foreign = args.warmup, 3, args.tflops, MAX_FOREIGN
    arms = tuple(a for a in ARMS if not (a == "fx_equal" and args.no_fx_equal))
    load0 = load_average()
    t0 = time.perf_counter()
    if shape.vocab < 256:
        ap.error(f"--vocab {shape.vocab}: the token ids are bytes, so the vocabulary needs >= 256")
    res = measure(shape, tuple(ps), tuple(args.schedules), m, rounds, k, warmup, arms, tflops,
                  args.gbps, args.lr, stage_reps=reps, predict_ps=tuple(pps),
                  max_foreign=max_foreign, max_rounds=args.max_rounds,
                  quiet_wait_s=0.0 if args.tiny else args.quiet_wait)
    wall = time.perf_counter() - t0
    print(steps_table(res))
    print()
    print(balance_table(res))
    print()
    if res.predicted_only:
        print(predicted_table(res))
        print()
    print(_findings(res))
    if out is not None and not args.no_write:
        note = machine_note(load0)
        write_section(SECTION, report(res, note, wall), out)
        print(f"wrote section '{SECTION}' of {out}")
        if out == BENCHMARKS_MD:
            print(f"saved the figures to {save_result(res, note, wall)}")
    return res


if __name__ == "__main__":
    main()
