"""Hugging Face models built from configs (no download). Seven types have hand-written specs here, full size as
``hf:<type>`` and small as ``hf:<type>-tiny`` (gpt2, llama, mistral, qwen2, mixtral, bert, t5); every other type the
installed transformers builds with a causal-LM, masked-LM, seq2seq, speech or image-classification head, and any
config file of those types, come from `autopar.zoo.hf_auto` (``hf:<model_type>``, ``hf:path/to/config.json``).

Needs the ``hf`` extra (``pip install autopar[hf]``). Each type maps autopar's option names (layers, hidden, heads,
...) onto its config's field names, so ``--layers`` and friends work the same as for the native zoo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.zoo import hf_auto
from autopar.zoo.config import ModelConfig
from autopar.zoo.hf_fields import dropouts
from autopar.zoo.hf_tasks import transformers_module

_COMMON_KEYS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "seq": "max_position_embeddings",
    "ffn": "intermediate_size",
}


@dataclass(frozen=True, slots=True)
class HFSpec:
    config_class: str
    model_class: str
    full: dict[str, Any]
    tiny: dict[str, Any]
    keys: dict[str, str] = field(default_factory=lambda: dict(_COMMON_KEYS))
    seq: int = 2048  # default sequence length for planning (the position table may be longer)
    dropout: float = 0.0  # the config class's default dropout (every dropout field of it is set to the model's)


def _llama_like(full: dict[str, Any], config: str, model: str, seq: int = 4096, **extra_keys: str) -> HFSpec:
    tiny = {
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
    }
    return HFSpec(config, model, full, tiny, dict(_COMMON_KEYS, **extra_keys), seq)


SPECS: dict[str, HFSpec] = {
    "gpt2": HFSpec(
        "GPT2Config", "GPT2LMHeadModel",
        full={"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
        tiny={"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 128},
        keys={"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size",
              "seq": "n_positions", "ffn": "n_inner"},
        seq=1024, dropout=0.1,
    ),
    "llama": _llama_like(
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
         "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096},
        "LlamaConfig", "LlamaForCausalLM",
    ),
    "mistral": _llama_like(
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768},
        "MistralConfig", "MistralForCausalLM",
    ),
    "qwen2": _llama_like(
        {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
         "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768},
        "Qwen2Config", "Qwen2ForCausalLM",
    ),
    "mixtral": _llama_like(
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
         "num_local_experts": 8, "num_experts_per_tok": 2},
        "MixtralConfig", "MixtralForCausalLM", experts="num_local_experts",
    ),
    "bert": HFSpec(
        "BertConfig", "BertForMaskedLM",
        full={"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
              "vocab_size": 30522, "max_position_embeddings": 512},
        tiny={"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 128},
        keys={k: v for k, v in _COMMON_KEYS.items() if k != "kv_heads"},
        seq=512, dropout=0.1,
    ),
    "t5": HFSpec(
        "T5Config", "T5ForConditionalGeneration",
        full={"num_layers": 12, "num_decoder_layers": 12, "d_model": 768, "num_heads": 12, "d_kv": 64,
              "d_ff": 3072, "vocab_size": 32128},
        tiny={"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128,
              "vocab_size": 256},
        keys={"layers": "num_layers", "decoder_layers": "num_decoder_layers", "hidden": "d_model",
              "heads": "num_heads", "head_dim": "d_kv", "vocab": "vocab_size", "ffn": "d_ff"},
        seq=512, dropout=0.1,
    ),
}
SPECS["mixtral"].tiny.update(num_local_experts=4, num_experts_per_tok=2)


def names() -> list[str]:
    return [f"hf:{t}{suffix}" for t in SPECS for suffix in ("", "-tiny")]


def _hand_written(name: str) -> bool:
    return name.removeprefix("hf:").removesuffix("-tiny") in SPECS


def _split(name: str) -> tuple[str, HFSpec, bool]:
    kind = name.removeprefix("hf:")
    tiny = kind.endswith("-tiny")
    kind = kind.removesuffix("-tiny")
    return kind, SPECS[kind], tiny


def get_config(name: str) -> ModelConfig:
    if not _hand_written(name):
        return hf_auto.get_config(name)
    kind, spec, tiny = _split(name)
    values = spec.tiny if tiny else spec.full
    mapped = {ours: values[theirs] for ours, theirs in spec.keys.items() if theirs in values}
    if kind == "gpt2":
        mapped["ffn"] = 4 * mapped["hidden"]
    mapped.pop("seq", None)  # the position table's size, not the planning default
    if mapped.get("decoder_layers") == mapped["layers"]:
        mapped["decoder_layers"] = 0  # as many as the encoder, so that --layers sets both stacks
    return ModelConfig(family="hf", name=name, hf_type=kind, seq=128 if tiny else spec.seq, dropout=spec.dropout,
                       **mapped)


def exact_seq(cfg: ModelConfig) -> bool:
    """Whether a ``seq`` other than the model's sets its size (an image classifier's side) rather than only raising
    its maximum."""
    return not _hand_written(cfg.name) and hf_auto.images(cfg)


def build(cfg: ModelConfig, *, dtype: torch.dtype, device: str) -> nn.Module:
    if not _hand_written(cfg.name):
        return hf_auto.build(cfg, dtype=dtype, device=device)
    transformers = transformers_module()
    kind, spec, tiny = _split(cfg.name)
    values = dict(spec.tiny if tiny else spec.full)
    for ours, theirs in spec.keys.items():
        value = cfg.decoder_layers or cfg.layers if ours == "decoder_layers" else getattr(cfg, ours)
        if value:
            values[theirs] = value
    if "max_position_embeddings" in values or "n_positions" in values:
        key = "n_positions" if kind == "gpt2" else "max_position_embeddings"
        values[key] = max(values.get(key, 0), cfg.seq)
    config_class = getattr(transformers, spec.config_class)
    values.update(dict.fromkeys(dropouts(config_class()), cfg.dropout))  # `autopar run` turns them all off
    config = hf_auto.made_config(cfg.name, lambda: config_class(**values, use_cache=False))
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = getattr(transformers, spec.model_class)(config)
    return model.to(dtype).train()


def example_inputs(cfg: ModelConfig, *, batch: int, seq: int, device: str) -> dict[str, torch.Tensor]:
    if not _hand_written(cfg.name):
        return hf_auto.example_inputs(cfg, batch=batch, seq=seq, device=device)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if cfg.hf_type == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids.clone(), "labels": ids.clone()}
    return {"input_ids": ids, "labels": ids.clone()}
