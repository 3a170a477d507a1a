"""Hugging Face transformers models named in a spec (``model.hf``), built from a config.

``model: {hf: "GPT2LMHeadModel", config: {n_layer: 4, n_embd: 128}}`` builds
``transformers.GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128))`` with random weights;
``pretrained: PATH`` loads a local ``from_pretrained`` folder instead (``local_files_only``:
nothing is downloaded). ``config`` may also hold ``attn_implementation`` (``sdpa``, the
transformers default, or ``eager``). The KV cache is switched off (``use_cache=False``): training
does not use it and torch.export cannot return its cache object.

transformers is an optional dependency (``pip install 'fxpipe[hf]'``); it is imported only here.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from fxpipe.errors import SpecError
from fxpipe.specs.source import location

#: config keys every transformers config accepts beyond its own signature
_GENERAL_KEYS = {"attn_implementation", "num_labels", "id2label", "label2id", "pad_token_id",
                 "bos_token_id", "eos_token_id", "tie_word_embeddings", "torch_dtype",
                 "is_decoder", "problem_type", "output_hidden_states", "return_dict"}


def _head(spec: Any, key: str) -> str:
    where = location(spec, key)
    return f"{where}: {key}" if where else key


def transformers_class(spec: Any) -> type:
    """The transformers model class that ``model.hf`` names (``"GPT2LMHeadModel"`` or
    ``"transformers:GPT2LMHeadModel"``).

    Raises:
        SpecError: transformers is not installed, or it has no such model class (with the
            closest names).
    """
    name = spec.model.hf.split(":", 1)[-1].strip()
    try:
        import transformers
    except ImportError:
        raise SpecError(f"{_head(spec, 'model.hf')}: {name} needs the transformers package; "
                        "install it with pip install 'fxpipe[hf]' (or pip install transformers "
                        "next to torch==2.13.0)") from None
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and hasattr(cls, "config_class")):
        known = [n for n in dir(transformers) if n[:1].isupper() and ("Model" in n or "For" in n)]
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise SpecError(f"{_head(spec, 'model.hf')}: transformers has no model class {name!r}"
                        f"{hint}; name one such as GPT2LMHeadModel, BertForMaskedLM, "
                        "LlamaForCausalLM, T5ForConditionalGeneration")
    return cls


def _check_config_keys(spec: Any, config_class: type, keys: list[str]) -> None:
    """Reject keys that are likely typos of a config field (transformers would accept them
    silently as extra attributes and ignore them)."""
    try:
        params = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    except (TypeError, ValueError):
        return
    known = params | set(getattr(config_class, "attribute_map", {})) | _GENERAL_KEYS
    for k in keys:
        if k in known:
            continue
        close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.75)
        if close:
            raise SpecError(f"{_head(spec, f'model.config.{k}')}: {config_class.__name__} has no "
                            f"setting {k!r} (did you mean {close[0]!r}?); fix model.config")


def build_transformers_model(spec: Any, load_weights: bool = True):
    """Build the ``model.hf`` model (the caller seeds torch and picks the default device).

    With ``model.pretrained`` and ``load_weights``, ``from_pretrained(PATH, local_files_only)``;
    with ``pretrained`` and not ``load_weights`` (planning), only its config is read and the
    model is built from it (weights are not needed to plan).

    Raises:
        SpecError: see :func:`transformers_class`; the config rejects ``model.config``; the
            pretrained folder cannot be read.
    """
    cls = transformers_class(spec)
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # config notes (token ids of a tiny vocabulary)
    try:
        return _build(spec, cls, load_weights)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _build(spec: Any, cls: type, load_weights: bool):
    config = dict(spec.model.config)
    attn = config.pop("attn_implementation", None)
    extra = {"attn_implementation": attn} if attn else {}
    name = cls.__name__
    try:
        if spec.model.pretrained is not None:
            if load_weights:
                model = cls.from_pretrained(spec.model.pretrained, local_files_only=True,
                                            **config, **extra)
            else:
                cfg = cls.config_class.from_pretrained(spec.model.pretrained,
                                                       local_files_only=True, **config)
                model = cls._from_config(cfg, **extra)
        else:
            _check_config_keys(spec, cls.config_class, list(config))
            model = cls._from_config(cls.config_class(**config), **extra)
    except SpecError:
        raise
    except (OSError, EnvironmentError) as err:
        raise SpecError(f"{_head(spec, 'model.pretrained')}: cannot load {name} from "
                        f"{spec.model.pretrained!r}: {' '.join(str(err).split())[:300]}; give a "
                        "local folder written by save_pretrained (nothing is downloaded)") from None
    except Exception as err:  # the config or the model rejected the settings
        raise SpecError(f"{_head(spec, 'model.config')}: building {name} raised "
                        f"{type(err).__name__}: {' '.join(str(err).split())[:300]}; fix "
                        "model.config") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model
