"""Real models for tests: tiny transformers configs (random weights, nothing downloaded),
``nn.Transformer`` itself and a ResNet-style CNN with BatchNorm, each with a deterministic
batch in the form users feed it (dict batches with ``-100`` labels for the transformers models).

Dropout is 0 in every config: random masks cannot match between a pipeline and one process.
Attention and every other setting are the library defaults (``sdpa``, ``use_cache`` on).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

B, T, V = 8, 16, 96  # global batch, sequence length, vocabulary
NAMES = ("gpt2", "bert", "llama", "t5", "vit", "transformer", "resnet", "gpt2_deep")


def _tf():
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def hf_spec(name: str) -> dict | None:
    """``model:`` section of the spec for a transformers model (None for the others)."""
    return {
        "gpt2": {"hf": "GPT2LMHeadModel", "config": dict(
            vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)},
        "gpt2_deep": {"hf": "GPT2LMHeadModel", "config": dict(  # 8 blocks: planned as blocks
            vocab_size=V, n_positions=T, n_embd=16, n_layer=8, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)},
        "bert": {"hf": "BertForMaskedLM", "config": dict(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=T, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)},
        "llama": {"hf": "LlamaForCausalLM", "config": dict(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=T)},
        "gemma2": {"hf": "Gemma2ForCausalLM", "config": dict(  # not in NAMES: tensor tests
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=64, sliding_window=8,
            query_pre_attn_scalar=8, max_position_embeddings=T)},
        # mixture of experts (not in NAMES: tests/test_moe_example.py), transformers' dropless
        # experts (sorted rows, grouped matmul); Qwen2-MoE with a shared expert besides
        "mixtral": {"hf": "MixtralForCausalLM", "config": dict(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=T)},
        "qwen2_moe": {"hf": "Qwen2MoeForCausalLM", "config": dict(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=T)},
        "t5": {"hf": "T5ForConditionalGeneration", "config": dict(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)},
        "vit": {"hf": "ViTForImageClassification", "config": dict(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)},
    }.get(name)


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    """ResNet-style: stem conv + BN, 3 residual blocks, pooled linear head; ``[B,3,16,16]`` ->
    logits ``[B,5]``."""

    def __init__(self, c: int = 8, blocks: int = 3, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def build(name: str) -> nn.Module:
    """The seeded model ``name`` (the same initial weights everywhere)."""
    torch.manual_seed(0)
    spec = hf_spec(name)
    if spec is not None:
        tf = _tf()
        cls = getattr(tf, spec["hf"])
        return cls._from_config(cls.config_class(**spec["config"]))
    if name == "transformer":
        return nn.Transformer(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                              dim_feedforward=32, dropout=0.0, batch_first=True)
    return ResNet()


_PLANS: dict[tuple, dict] = {}  # configuration -> plan.to_dict()


def plan(name: str, pipeline: int, data: int, microbatches: int, schedule: str = "1f1b",
         **over):
    """``fxpipe.plan`` of ``name`` built on the meta device, from :func:`spec_for` with the
    fields ``over`` (``section__field=value``) changed and the first sample of batch 0 as the
    example inputs.

    The planner is deterministic, so each configuration is planned once per test process
    (test_real_models and test_real_model_inputs ask for several of the same): the first call
    returns the plan itself, later ones a copy through its JSON form (what plan.json and the
    workers get)."""
    import copy

    import fxpipe
    from fxpipe.plans.plan import Plan

    key = (name, pipeline, data, microbatches, schedule, tuple(sorted(over.items())))
    if key in _PLANS:
        return Plan.from_dict(_PLANS[key])
    spec = spec_for(name, pipeline, data, microbatches, schedule)
    for k, value in over.items():
        section, field = k.split("__")
        spec[section][field] = value
    with torch.device("meta"):
        model = build(name)
    args, kwargs, _ = batch(name, 0)
    made = fxpipe.plan(model, spec, tuple(a[:1] for a in args),
                       {k: v[:1] for k, v in kwargs.items()})
    _PLANS[key] = copy.deepcopy(made.to_dict())
    return made


def spec_for(name: str, pipeline: int, data: int, microbatches: int, schedule: str) -> dict:
    """A spec dict for ``name`` (transformers models by ``model.hf``; the others by factory)."""
    model = hf_spec(name) or {"factory": f"real_models:{name}"}
    loss = "model" if hf_spec(name) else ("mse" if name == "transformer" else "cross_entropy")
    return {
        "model": model,
        "data": {"batch_size": B, "seq_len": T},
        "parallel": {"pipeline": pipeline, "data": data, "microbatches": microbatches,
                     "schedule": schedule},
        "cluster": {"nodes": 1, "devices_per_node": pipeline * data, "memory_gb": 4,
                    "device_tflops": 0.02, "links": {"intra_node_GBps": 5}},
        "train": {"optimizer": "sgd", "lr": 0.05, "loss": loss, "steps": 3},
    }


def batch(name: str, step: int):
    """Global batch ``step`` of ``name`` as ``(args, kwargs, target)``: transformers models take
    a dict with ``labels`` (masked LM and padding positions ``-100``, unevenly spread so that
    micro-batches count different numbers of tokens)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, V, (B, T), generator=g)
    lengths = torch.tensor([T, T // 2, T - 3, 5, T, 9, T - 1, 3])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    if name in ("gpt2", "llama", "gpt2_deep", "gemma2", "mixtral", "qwen2_moe"):
        return (), {"input_ids": ids * mask, "attention_mask": mask,
                    "labels": (ids * mask).masked_fill(mask == 0, -100)}, None
    if name == "bert":
        masked = torch.rand(B, T, generator=g) < 0.3
        labels = ids.masked_fill(~masked | (mask == 0), -100)
        return (), {"input_ids": ids.masked_fill(masked, 3) * mask, "attention_mask": mask,
                    "labels": labels}, None
    if name == "t5":
        labels = torch.randint(1, V, (B, 8), generator=g)
        labels[1, 4:] = -100
        labels[6, 2:] = -100
        return (), {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}, None
    if name == "vit":
        return (), {"pixel_values": torch.randn(B, 3, 16, 16, generator=g),
                    "labels": torch.randint(0, 5, (B,), generator=g)}, None
    if name == "transformer":
        src, tgt = torch.randn(B, 10, 16, generator=g), torch.randn(B, 6, 16, generator=g)
        return (src, tgt), {}, torch.randn(B, 6, 16, generator=g)
    return (torch.randn(B, 3, 16, 16, generator=g),), {}, torch.randint(0, 5, (B,), generator=g)


def transformer():
    return build("transformer")


def resnet():
    return build("resnet")
