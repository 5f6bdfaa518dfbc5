"""Any Hugging Face model type by name (``hf:<model_type>``) or config file (``hf:path/to/config.json``).

The config is the type's own defaults (``AutoConfig.for_model``), or the file's values; the head is the type's
task head (`autopar.zoo.hf_tasks`), or the file's ``architectures[0]`` where that is one of the type's heads. autopar's
options map onto the config's own field names (through its ``attribute_map``), each onto every field that holds it
(an encoder-decoder's ``--layers`` sets both stacks). Derived values follow what they derive from unless given:
key/value heads follow ``--heads`` where the default is multi-head attention (``kv_heads`` 0), the head size
follows ``--hidden``/``--heads`` where the default is ``hidden / heads`` (``head_dim`` 0), decoder layers follow
``--layers`` where the default has as many as the encoder (``decoder_layers`` 0), the rotated part of a head
(``rotary_dim``) keeps its share of the head, and a per-layer list of attention kinds keeps its pattern at the new
depth. A language model whose config has no vocabulary of its own but a ``text_config`` (a multimodal type) takes
the options on that text part and runs on text. Planning sequence (``seq``):
the positions the config has, at most 2,048 for causal LMs and 512 for masked and sequence-to-sequence LMs (those
numbers where it has none), the decoder's positions for speech, the image side for vision.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
from typing import Any

import torch
from torch import nn

from autopar.zoo.config import ModelConfig
from autopar.zoo.hf_fields import FIELDS, dropouts, field_names, read, text_part
from autopar.zoo.hf_tasks import TASK_MAPPINGS, Head, head_of, heads, transformers_module
from autopar.zoo.hf_tasks import example_inputs as task_inputs

DEFAULT_SEQ = {"causal-lm": 2048, "masked-lm": 512, "seq2seq-lm": 512, "speech-seq2seq": 448}


def source(name: str) -> tuple[str, str | None]:
    """``hf:<type>`` or ``hf:<path>.json`` -> (model type, absolute config path or None); ValueError naming the
    input and what would be valid."""
    rest = name.removeprefix("hf:")
    if rest.endswith(".json") or os.sep in rest or rest.startswith("."):
        path = os.path.abspath(os.path.expanduser(rest))
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{name}: no such config file ({path}); give hf:path/to/config.json")
        model_type = _read_json(path).get("model_type")
        if not isinstance(model_type, str) or head_of(model_type) is None:
            raise ValueError(f"{name}: model_type {model_type!r} is not a type autopar can build (see autopar models "
                             "--hf)")
        return model_type, path
    if rest.endswith("-tiny") and head_of(rest.removesuffix("-tiny")) is not None:
        raise ValueError(f"{name}: -tiny names only the seven hand-written specs (autopar models); give "
                         f"hf:{rest.removesuffix('-tiny')} with small options, e.g. --layers 2 --hidden 64 --heads 4")
    if head_of(rest) is None:
        close = difflib.get_close_matches(rest, list(heads()), n=5, cutoff=0.6)
        hint = f"; close: {', '.join('hf:' + c for c in close)}" if close else ""
        raise ValueError(f"unknown Hugging Face model type {rest!r}{hint} (autopar models --hf lists the "
                         f"{len(heads())} causal-LM, masked-LM, seq2seq, speech and image-classification types; "
                         "or give hf:path/to/config.json)")
    return rest, None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"hf:{path}: cannot read the config file: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"hf:{path}: a config file holds one JSON object, got {type(data).__name__}")
    return data


def _file_values(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    return {k: v for k, v in _read_json(path).items() if k not in ("model_type", "transformers_version")}


def head_for(model_type: str, path: str | None) -> Head:
    """The type's task head, or the class the file's ``architectures`` names where it is one of the type's."""
    head = head_of(model_type)
    assert head is not None  # `source` checked it
    architectures = _file_values(path).get("architectures") or []
    if architectures and isinstance(architectures[0], str) and architectures[0] != head.class_name:
        auto = importlib.import_module("transformers.models.auto.modeling_auto")
        for task, mapping in TASK_MAPPINGS:
            names = getattr(auto, mapping, {}).get(model_type)
            if architectures[0] in ((names,) if isinstance(names, str) else tuple(names or ())):
                return Head(model_type=model_type, task=task, class_name=architectures[0])
    return head


def default_config(model_type: str, path: str | None, **changes: Any) -> Any:
    """The transformers config: the type's defaults (or the file's values) with ``changes`` on top."""
    auto = transformers_module().AutoConfig
    return made_config(f"hf:{model_type}", lambda: auto.for_model(model_type, **{**_file_values(path), **changes}))


def made_config(name: str, make: Any) -> Any:  # noqa: ANN401 - a transformers config, from a callable
    """``make()``; where transformers refuses the values (its configs validate themselves: a hidden size the head
    count does not divide), a ValueError naming the model and transformers' reason in one line, not a traceback."""
    try:
        return make()
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's StrictDataclassClassValidationError, and the like
        text = " ".join(str(exc).split())[:300]
        raise ValueError(f"{name}: transformers refuses this configuration ({type(exc).__name__}: {text})") from exc


def _planning_seq(config: Any, task: str) -> int:
    if task == "image-classification":
        side = getattr(config, "image_size", 224)
        return int(side[0] if isinstance(side, (list, tuple)) else side)
    positions = read(config, "positions")
    return min(positions, DEFAULT_SEQ[task]) if positions > 0 else DEFAULT_SEQ[task]


def options(name: str, config: Any, head: Head) -> dict[str, Any]:
    """autopar's options (`ModelConfig` fields) as ``config`` sets them; derived values are 0 (see the module)."""
    config = text_part(config, head)[0]
    layers, heads_, hidden = read(config, "layers"), read(config, "heads"), read(config, "hidden")
    decoder, kv, head_dim = read(config, "decoder_layers"), read(config, "kv_heads"), read(config, "head_dim")
    image = head.task == "image-classification"
    vocab = read(config, "classes" if image else "vocab")
    if vocab <= 0:
        raise ValueError(f"{name}: its config ({type(config).__name__}) has no vocab_size of its own (a composite of "
                         "several configs?); autopar builds types with one text, speech or vision config")
    return {
        "layers": layers, "decoder_layers": 0 if decoder == layers else decoder, "hidden": hidden, "heads": heads_,
        "kv_heads": 0 if kv == heads_ else kv, "vocab": vocab, "ffn": read(config, "ffn"),
        "head_dim": 0 if heads_ and hidden and head_dim * heads_ == hidden else head_dim,
        "experts": read(config, "experts"), "top_k": read(config, "top_k") or 2,
        "seq": _planning_seq(config, head.task), "dropout": max(dropouts(config).values(), default=0.0),
    }


def images(cfg: ModelConfig) -> bool:
    """Whether the model is an image classifier (its ``seq``, the image side, is the config's ``image_size``)."""
    model_type, path = source(cfg.name)
    return head_for(model_type, path).task == "image-classification"


def get_config(name: str) -> ModelConfig:
    model_type, path = source(name)
    head = head_for(model_type, path)
    config = default_config(model_type, path)
    canonical = f"hf:{path}" if path else name
    return ModelConfig(family="hf", name=canonical, hf_type=model_type, **options(canonical, config, head))


def changes(cfg: ModelConfig, config: Any, head: Head) -> dict[str, Any]:
    """The config fields (the config's own names) that ``cfg`` sets differently from ``config``, the defaults (of
    its text part: `text_part`)."""
    base = options(cfg.name, config, head)
    config = text_part(config, head)[0]
    out: dict[str, Any] = {}

    def put(option: str, value: Any, was: Any) -> None:
        if value == was:
            return
        names = field_names(config, option)
        if not names:
            raise ValueError(f"{cfg.name}: option {option} does not apply: {type(config).__name__} has no "
                             f"{FIELDS[option][0]}")
        out.update(dict.fromkeys(names, value))

    for option in ("layers", "hidden", "heads", "ffn", "experts"):
        put(option, getattr(cfg, option), base[option])
    if cfg.top_k != base["top_k"] and field_names(config, "top_k"):
        put("top_k", cfg.top_k, base["top_k"])
    if field_names(config, "decoder_layers"):
        put("decoder_layers", cfg.decoder_layers or cfg.layers, base["decoder_layers"] or base["layers"])
    if field_names(config, "kv_heads") or cfg.kv_heads:
        put("kv_heads", cfg.kv_heads or cfg.heads, base["kv_heads"] or base["heads"])
    if cfg.heads and base["heads"]:
        size, was = cfg.head_dim or cfg.hidden // cfg.heads, base["head_dim"] or base["hidden"] // base["heads"]
        if field_names(config, "head_dim"):
            put("head_dim", size, was)
        rotary = getattr(config, "rotary_dim", None)  # the rotated part of each head: the same share of it
        if isinstance(rotary, int) and rotary and size != was and field_names(config, "rotary_dim"):
            out["rotary_dim"] = max(2, rotary * size // was // 2 * 2)
    out.update(_sized(cfg, config, head, base))
    return out


def _sized(cfg: ModelConfig, config: Any, head: Head, base: dict[str, Any]) -> dict[str, Any]:
    """Vocabulary (classes), positions (image side), dropout and per-layer lists, as ``cfg`` sets them."""
    out: dict[str, Any] = {}
    if cfg.vocab != base["vocab"]:
        out["num_labels" if head.task == "image-classification" else "vocab_size"] = cfg.vocab
    if head.task == "image-classification":
        if cfg.seq != base["seq"]:
            out["image_size"] = cfg.seq
    else:
        positions = read(config, "positions")
        if 0 < positions < cfg.seq:
            out.update(dict.fromkeys(field_names(config, "positions")[:1], cfg.seq))
    if cfg.dropout != base["dropout"]:
        out.update(dict.fromkeys(dropouts(config), cfg.dropout))
    if cfg.layers != base["layers"] and cfg.layers and base["layers"] > 1:
        out.update(_per_layer(config, base["layers"], cfg.layers))
    return out


def _per_layer(config: Any, was: int, layers: int) -> dict[str, list[Any]]:
    """The config's lists with one entry per layer (attention kinds; a vision model's depths and widths per stage)
    at the new depth, their pattern kept (cycled from the first entry)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == was and field_names(config, key) == [key]:
            out[key] = [value[k % was] for k in range(layers)]
    return out


def built_config(cfg: ModelConfig) -> tuple[Any, Head]:
    """The transformers config ``cfg`` describes, and the head to build it with."""
    model_type, path = source(cfg.name)
    head = head_for(model_type, path)
    defaults = default_config(model_type, path)
    delta = changes(cfg, defaults, head)
    part, key = text_part(defaults, head)
    if key is not None and delta:  # the text part's own settings (those of the file, or the type's), then ours
        delta = {key: {**(_file_values(path).get(key) or {} if path else part.to_diff_dict()), **delta}}
    extra = {"use_cache": False} if hasattr(defaults, "use_cache") else {}
    return default_config(model_type, path, **delta, **extra), head


def build(cfg: ModelConfig, *, dtype: torch.dtype, device: str) -> nn.Module:
    """The model on ``device`` in ``dtype``, training mode; SDPA attention where the class has it."""
    config, head = built_config(cfg)
    cls = getattr(transformers_module(), head.class_name, None)
    if cls is None:
        raise ValueError(f"{cfg.name}: transformers has no class {head.class_name}")
    part = getattr(config, "text_config", None)
    wanted = getattr(cls, "config_class", None)
    if isinstance(wanted, type) and not isinstance(config, wanted) and isinstance(part, wanted):
        config = part  # a text-only class of a multimodal type: it takes the text part
    config._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    try:
        model = _construct(cfg.name, cls, config, device)
    except ValueError as exc:  # a submodule without SDPA: every attention in its own way
        if "attention implementation" not in str(exc) or config._attn_implementation == "eager":
            raise
        config._attn_implementation = "eager"
        model = _construct(cfg.name, cls, config, device)
    return model.to(dtype).train()


def _construct(name: str, cls: type, config: Any, device: str) -> nn.Module:  # noqa: ANN401 - a transformers config
    """``cls(config)`` on ``device``; where transformers' own code fails on the config (DBRX's default config lacks a
    field its attention reads), a ValueError naming the model and transformers' reason, not a traceback."""
    try:
        with torch.device(device):
            return cls(config)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers raised, in one line
        text = " ".join(str(exc).split())[:300]
        raise ValueError(f"{name}: transformers cannot build {cls.__name__} from this config ({type(exc).__name__}: "
                         f"{text}); give a config transformers builds (hf:path/config.json)") from exc


def example_inputs(cfg: ModelConfig, *, batch: int, seq: int, device: str) -> dict[str, torch.Tensor]:
    """`hf_tasks.example_inputs` for the model's task; speech: ``2 x max_source_positions`` frames (Whisper's 30 s,
    3,000 where the config has none) of ``num_mel_bins`` (the config's or an encoder sub-config's, else 80)."""
    config, head = built_config(cfg)
    return task_inputs(head.task, batch=batch, seq=seq, frames=2 * _setting(config, "max_source_positions", 1500),
                       mel_bins=_setting(config, "num_mel_bins", 80), channels=_setting(config, "num_channels", 3),
                       dtype=torch.float32, device=device)


def _setting(config: Any, name: str, default: int) -> int:
    """An integer setting of the config, or of the first of its sub-configs that has it."""
    for part in (config, *(v for v in vars(config).values() if hasattr(v, "to_dict"))):
        value = getattr(part, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def describe(module: nn.Module) -> dict[str, Any]:
    """What a built Hugging Face model is: its class, config class, autopar's options as the config holds them
    (absent where it has no such field) and the fields that differ from the config class's defaults."""
    config = getattr(module, "config", None)
    if config is None:
        return {"class": type(module).__name__}
    outer, sub = config, getattr(config, "text_config", None)
    if not read(config, "vocab") and hasattr(sub, "to_dict"):
        config = sub  # a multimodal model run on text: its text part
    shown: dict[str, Any] = {}
    labels = "classes" if "ImageClassification" in type(module).__name__ else "vocab"
    for option in ("layers", "decoder_layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", labels, "experts",
                   "top_k", "positions", "sliding_window"):
        names = field_names(config, option)
        value = getattr(config, names[0], None) if names else None
        if value is not None:
            shown[option] = value
    if getattr(config, "use_sliding_window", True) is False and "sliding_window" in shown:
        shown["sliding_window"] = None  # the field is set but not in effect
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and len(set(kinds)) > 1:
        shown["layer_types"] = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a config class that needs arguments: no defaults to compare with
        defaults = {}
    ignore = ("transformers_version", "architectures", "_name_or_path", "dtype", "use_cache", "id2label", "label2id")
    differs = {k: v for k, v in config.to_dict().items() if k not in ignore and defaults.get(k, v) != v}
    return {"class": type(module).__name__, "config_class": type(outer).__name__ + (
        f".text_config ({type(config).__name__})" if config is not outer else ""), **shown, "set": differs}


def build_failure(model_type: str) -> str | None:
    """Why ``hf:<model_type>`` does not build at its default config on the meta device, in one line, or None."""
    try:
        build(get_config(f"hf:{model_type}"), dtype=torch.bfloat16, device="meta")
    except Exception as exc:  # noqa: BLE001 - whatever transformers raised is the reason
        exc = exc.__cause__ or exc  # transformers' own error, where `_construct` named the model around it
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
    return None
