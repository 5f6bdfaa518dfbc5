"""autopar's model options (layers, hidden, heads, ...) as fields of a Hugging Face config: which fields hold each,
reading them, and which can be set.

Each option maps onto the config's own names through its ``attribute_map`` (``hidden_size`` is GPT-2's ``n_embd``,
Whisper's ``d_model``); an option held by several fields (an encoder-decoder's layers, heads and FFN) is set on each.
A read-only property is read but never set (the config computes it from other fields).
"""

from __future__ import annotations

from typing import Any

from autopar.zoo.hf_tasks import Head

# autopar option -> the config fields that hold it (before the config's attribute_map), every present one is set
FIELDS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers",),
    "decoder_layers": ("num_decoder_layers", "decoder_layers"),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads", "decoder_attention_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "ffn": ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "ffn_hidden_size", "encoder_ffn_dim",
            "decoder_ffn_dim"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk"),
    "positions": ("max_position_embeddings", "max_target_positions"),
    "vocab": ("vocab_size",),
    "classes": ("num_labels",),
    "sliding_window": ("sliding_window",),
}
def _names(config: Any, option: str) -> list[str]:
    """The config's own names of ``option``'s fields that it has, resolved through its attribute_map, once each."""
    mapped = getattr(type(config), "attribute_map", {}) or {}
    names: list[str] = []
    for name in FIELDS.get(option, (option,)):
        real = mapped.get(name, name)
        if real not in names and (real in config.__dict__ or _has(config, real)):
            names.append(real)
    return names


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - a per-layer field that refuses one value for all layers: it is there
        return True


def field_names(config: Any, option: str) -> list[str]:
    """The fields of ``option`` that can be set (a read-only property is computed from others)."""
    names = []
    for name in _names(config, option):
        derived = getattr(type(config), name, None)
        if not (isinstance(derived, property) and derived.fset is None):
            names.append(name)
    if option == "kv_heads":  # a config that maps key/value heads onto the heads field has none of its own
        names = [n for n in names if n not in _names(config, "heads")]
    return names


def read(config: Any, option: str) -> int:
    """The config's value of ``option`` (an integer), 0 where it has none."""
    names = _names(config, option)
    if option == "kv_heads":
        names = [n for n in names if n not in _names(config, "heads")]
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - a config that refuses one value for all layers (per-layer configs)
            value = None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def dropouts(config: Any) -> dict[str, float]:
    """The config's dropout probabilities by field name."""
    return {k: v for k, v in config.to_dict().items()
            if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and 0.0 <= v < 1.0}


def text_part(config: Any, head: Head) -> tuple[Any, str | None]:
    """The config holding the model's shape, and its key: the config itself (key None), or, for a language model
    whose config has no vocabulary of its own, its ``text_config`` (a multimodal model run on text)."""
    sub = getattr(config, "text_config", None)
    if head.task != "image-classification" and not read(config, "vocab") and hasattr(sub, "to_dict"):
        return sub, "text_config"
    return config, None
