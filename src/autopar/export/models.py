"""Which model of each target a plan's model is, and the target's names for its modules.

torchtitan 0.3 trains its own model definitions, picked by ``--module`` and ``--config`` (a config function of the
module's ``config_registry``): here the LLaMA family (autopar's zoo ``llama-*``, ``llama3-*``, and Hugging Face
LLaMA) maps to its ``llama3`` module, whose configs of 8B and 70B shape are listed with their shapes as torchtitan
0.3 defines them (``tests/test_export.py`` checks them against torchtitan's own where it is installed). Megatron-LM
builds GPT and LLaMA-style decoders from flags: `megatron_model_arguments` writes them for autopar's two decoder
families.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.export.result import Approximation
from autopar.zoo import ModelConfig

TITAN_MODULE = "llama3"


@dataclass(frozen=True, slots=True, kw_only=True)
class TitanConfig:
    """A config function of torchtitan's llama3 module and the model shape it trains."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def shape(self) -> dict[str, int]:
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads, "kv_heads": self.kv_heads,
                "ffn": self.ffn, "vocab": self.vocab}


TITAN_LLAMA3 = (
    TitanConfig(name="llama3_8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    TitanConfig(name="llama3_70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
)

# autopar's row -> torchtitan's module; None: no module of torchtitan's (RoPE is computed inside its attention,
# the loss on its last stage, the Hugging Face wrapper's own ops run where its children run)
_TITAN_NAMES = (
    (re.compile(r"(?:model\.)?(?:embed|embed_tokens)"), "tok_embeddings"),
    (re.compile(r"(?:model\.)?layers\.(\d+)"), r"layers.\1"),
    (re.compile(r"(?:model\.)?norm"), "norm"),
    (re.compile(r"head|lm_head"), "lm_head"),
    (re.compile(r"(?:model\.)?(?:rotary|rotary_emb)|model|"), None),
)


def is_llama(model: ModelConfig | None) -> bool:
    return model is not None and (model.family == "llama" or (model.family == "hf" and model.hf_type == "llama"))


def titan_name(row: str) -> tuple[bool, str | None]:
    """(known, torchtitan's FQN or None) of one of autopar's LLaMA rows."""
    for pattern, name in _TITAN_NAMES:
        found = pattern.fullmatch(row)
        if found:
            return True, (found.expand(name) if name else None)
    return False, None


def _shape(model: ModelConfig) -> dict[str, int]:
    return {"layers": model.layers, "hidden": model.hidden, "heads": model.heads,
            "kv_heads": model.kv_heads or model.heads, "ffn": model.ffn, "vocab": model.vocab}


def titan_config(model: ModelConfig | None, label: str) -> tuple[TitanConfig | None, list[Approximation]]:
    """torchtitan's llama3 config of the plan's model: the one of its shape, or of its depth and width with the
    differences listed, or none (the user names a config function of the model's shape)."""
    if not is_llama(model):
        family = "no model" if model is None else f"the {model.family} family"
        what = label if model is None else f"{label} ({family}{'' if model.family != 'hf' else ' ' + model.hf_type})"
        return None, [Approximation(
            feature="model", plan=f"the model {what}",
            closest="torchtitan 0.3 has no definition of it here (only its llama3 module maps to autopar's LLaMA "
            "models): no --module/--config and no module_fqns_per_model_part are written; give --module/--config "
            "of your own port, whose stage split is then torchtitan's even one")]
    mine = _shape(model)
    for config in TITAN_LLAMA3:
        if (config.layers, config.hidden) != (mine["layers"], mine["hidden"]):
            continue
        differ = {k: (mine[k], v) for k, v in config.shape().items() if mine[k] != v}
        if not differ:
            return config, []
        text = ", ".join(f"{k} {ours} (torchtitan {theirs})" for k, (ours, theirs) in differ.items())
        return config, [Approximation(
            feature="model", plan=f"{label}: {text}",
            closest=f"--config {config.name}, of the same depth and width, trains torchtitan's shape; for the "
            "plan's, add a config function of that shape to the llama3 config_registry")]
    sizes = ", ".join(f"{c.name} ({c.layers} x {c.hidden})" for c in TITAN_LLAMA3)
    return None, [Approximation(
        feature="model", plan=f"{label}: {mine['layers']} layers x {mine['hidden']}",
        closest=f"torchtitan's llama3 module has configs {sizes} only: no --module/--config is written (the module "
        "lists are in its llama3 names); add a config function of this shape to its config_registry and pass "
        "--module llama3 --config <it>")]


def megatron_model_arguments(model: ModelConfig | None, layers: int, seq: int,
                             label: str) -> tuple[list[str], list[Approximation]]:
    """The model's shape as Megatron-LM's flags (GPT: learned positions, LayerNorm, GELU, biases and a tied head,
    Megatron-LM's defaults; LLaMA: RoPE, RMSNorm, SwiGLU, no biases, an untied head, no dropout)."""
    args = ["--num-layers", str(layers), "--seq-length", str(seq)]
    if model is None or not (model.family == "gpt" or is_llama(model)):
        what = "no model" if model is None else f"the {model.family} family"
        return args, [Approximation(
            feature="model", plan=f"the model {label} ({what})",
            closest="Megatron-LM's GPT path builds decoders of the GPT and LLaMA families here: only --num-layers "
            "and --seq-length are written; the model's own flags are yours to add")]
    args += ["--hidden-size", str(model.hidden), "--ffn-hidden-size", str(model.ffn), "--num-attention-heads",
             str(model.heads), "--max-position-embeddings", str(max(model.seq, seq))]
    if model.kv_heads and model.kv_heads != model.heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if is_llama(model):
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
                 "--hidden-dropout", "0"]
    return args, []
