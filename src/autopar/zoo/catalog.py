"""Model names -> `ModelConfig`, and building a model with its example inputs on any device (meta by default)."""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import init

from autopar.zoo import hf, hf_auto, user
from autopar.zoo.config import ModelConfig

# GPT-3 (Brown et al. 2020, Table 2.1); 1.3B uses 16 heads of 128 and 13B a hidden size of 5120, as Megatron-LM does.
_GPT3 = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "175b": (96, 12288, 96),
}
# Megatron-LM weak-scaling GPT sizes (Narayanan et al. 2021, Table 1): vocabulary 51,200, sequence 2,048.
_MEGATRON = {
    "1.7b": (24, 2304, 24),
    "3.6b": (30, 3072, 32),
    "7.5b": (36, 4096, 32),
    "18.4b": (40, 6144, 48),
    "39.1b": (48, 8192, 64),
    "76.1b": (60, 10240, 80),
    "145.6b": (80, 12288, 96),
    "310.1b": (96, 16384, 128),
    "529.6b": (105, 20480, 128),
    "1008b": (128, 25600, 160),
}
# (layers, hidden, heads, kv_heads, ffn, vocab, seq)
_LLAMA = {
    "llama-7b": (32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-13b": (40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-70b": (80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192),
}
# (layers per stack, hidden, heads, head_dim, ffn)
_T5 = {"t5-base": (12, 768, 12, 64, 3072), "t5-large": (24, 1024, 16, 64, 4096), "t5-3b": (24, 1024, 32, 128, 16384)}
_MOE_DEFAULTS = ("moe-125m-e8", "moe-350m-e16", "moe-1.3b-e32", "moe-2.7b-e64", "moe-6.7b-e64")
_WRN_DEFAULTS = ("wrn-50-2", "wrn-101-2", "wrn-101-8", "wrn-152-16")


def _gpt(
    name: str, layers: int, hidden: int, heads: int, *, vocab: int = 50257, family: str = "gpt", experts: int = 0
) -> ModelConfig:
    return ModelConfig(
        family=family, name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=2048,
        ffn=4 * hidden, dropout=0.1, experts=experts,
    )


def _catalog() -> dict[str, ModelConfig]:
    cat: dict[str, ModelConfig] = {}
    for size, (l, h, a) in _GPT3.items():
        cat[f"gpt3-{size}"] = _gpt(f"gpt3-{size}", l, h, a)
    for size, (l, h, a) in _MEGATRON.items():
        cat[f"megatron-{size}"] = _gpt(f"megatron-{size}", l, h, a, vocab=51200)
    for name, (l, h, a, kv, f, v, s) in _LLAMA.items():
        cat[name] = ModelConfig(
            family="llama", name=name, layers=l, hidden=h, heads=a, kv_heads=kv, ffn=f, vocab=v, seq=s
        )
    cat["bert-base"] = ModelConfig(
        family="bert", name="bert-base", layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, seq=512, dropout=0.1
    )
    cat["bert-large"] = ModelConfig(
        family="bert", name="bert-large", layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, seq=512,
        dropout=0.1,
    )
    for name, (l, h, a, d, f) in _T5.items():  # as many decoder layers as encoder ones, --layers setting both
        cat[name] = ModelConfig(
            family="t5", name=name, layers=l, hidden=h, heads=a, head_dim=d, ffn=f, vocab=32128,
            seq=512, dropout=0.1,
        )
    for name in (*_MOE_DEFAULTS, *_WRN_DEFAULTS):
        cat[name] = _parse(name)
    return cat


_MOE_RE = re.compile(r"moe-(?P<size>[0-9.]+[mb])-e(?P<experts>\d+)")
_WRN_RE = re.compile(r"wrn-(?P<depth>\d+)-(?P<width>\d+)")


def _parse(name: str) -> ModelConfig:
    """Parametric names: ``moe-<gpt3 size>-e<experts>`` and ``wrn-<depth>-<width factor>``."""
    m = _MOE_RE.fullmatch(name)
    if m and m["size"] in _GPT3:
        l, h, a = _GPT3[m["size"]]
        return _gpt(name, l, h, a, family="moe", experts=int(m["experts"]))
    m = _WRN_RE.fullmatch(name)
    if m:
        return ModelConfig(
            family="wrn", name=name, layers=int(m["depth"]), hidden=64, width=int(m["width"]), vocab=1000, seq=224
        )
    raise KeyError(name)


CATALOG = _catalog()


def model_names() -> list[str]:
    """Every built-in name (parametric families accept more: any ``moe-<size>-e<N>``, ``wrn-<depth>-<k>``)."""
    return [*CATALOG, *hf.names()]


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a zoo or ``hf:`` name, with overrides (``layers=``, ``hidden=``, ...) applied, or of a
    ``file.py:function`` (``module:function``), which takes none but ``dropout`` (its model is what it builds)."""
    if name.startswith("hf:"):
        base = hf.get_config(name)
    elif user.is_user_name(name):
        given = sorted(k for k, v in overrides.items() if v is not None and k not in ("dropout", "seq"))
        if given:
            raise ValueError(f"{name}: option(s) {', '.join(given)} do not apply to a model your function builds; "
                             "change the model in your code")
        return ModelConfig(family="user", name=user.canonical(name), layers=0, hidden=0, vocab=0, seq=0)
    elif name in CATALOG:
        base = CATALOG[name]
    else:
        try:
            base = _parse(name)
        except KeyError:
            close = difflib.get_close_matches(name, model_names(), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"unknown model {name!r}{hint} (see `autopar models`; parametric: moe-<gpt3 size>-e<experts>, "
                "wrn-<depth>-<width>; hf:<model_type> (autopar models --hf), hf:path/to/config.json, "
                "path/to/file.py:function)"
            ) from None
    return base.with_overrides(**overrides)


def build_model(cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, device: str = "meta") -> nn.Module:
    """Instantiate the model on ``device`` (meta: no memory) in ``dtype``, in training mode."""
    from autopar.zoo.bert import Bert
    from autopar.zoo.gpt import GPT
    from autopar.zoo.llama import Llama
    from autopar.zoo.t5 import T5
    from autopar.zoo.wrn import WideResNet

    if cfg.family == "hf":
        return hf.build(cfg, dtype=dtype, device=device)
    if cfg.family == "user":
        return user.build(cfg.name, batch=1, device=device)[0].to(dtype).train()
    classes: dict[str, type[nn.Module]] = {
        "gpt": GPT, "moe": GPT, "llama": Llama, "bert": Bert, "t5": T5, "wrn": WideResNet
    }
    with torch.device(device), _meta_init_skipped() if device == "meta" else contextlib.nullcontext():
        model = classes[cfg.family](cfg)
    return model.to(dtype).train()


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@contextlib.contextmanager
def _meta_init_skipped() -> Iterator[None]:
    """Inside, ``torch.nn.init``'s functions hand a meta tensor back untouched (any other tensor is initialised as
    before): a meta parameter holds no values, and initialising the layers of a 1,000-layer GPT on meta costs 1 s of
    Python for nothing."""
    saved = {name: getattr(init, name) for name in _INITS if hasattr(init, name)}

    def skipping(original: Any) -> Any:
        @functools.wraps(original)
        def inited(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return tensor if tensor.is_meta else original(tensor, *args, **kwargs)
        return inited

    for name, original in saved.items():
        setattr(init, name, skipping(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(init, name, original)


def example_inputs(
    cfg: ModelConfig, *, batch: int, seq: int | None = None, device: str = "meta"
) -> dict[str, torch.Tensor]:
    """Keyword inputs of one training step (token ids and labels, or images and labels); values are zeros."""
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    if cfg.family == "user":
        return user.build(cfg.name, batch=batch, device=device)[1]
    seq = seq or cfg.seq
    if seq <= 0 or seq > cfg.seq and cfg.family not in ("wrn", "t5", "hf"):
        raise ValueError(
            f"{cfg.name}: sequence length {seq} is outside 1..{cfg.seq}; raise the model's maximum with --seq"
        )
    if cfg.family == "hf":
        return hf.example_inputs(cfg, batch=batch, seq=seq, device=device)
    if cfg.family == "wrn":
        return {
            "images": torch.zeros(batch, 3, seq, seq, device=device),
            "labels": torch.zeros(batch, dtype=torch.long, device=device),
        }
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if cfg.family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids.clone(), "labels": ids.clone()}
    return {"input_ids": ids, "labels": ids.clone()}


def synthetic_batch(cfg: ModelConfig, *, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """One global batch of training data on CPU, the same for every caller with the same ``seed``: token ids
    (and labels) uniform below the vocabulary, floats from a standard normal, from a generator seeded with
    ``seed``; for a user's function, the inputs it returns for ``batch`` under ``torch.manual_seed(seed)``."""
    if cfg.family == "user":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return user.build(cfg.name, batch=batch, device="cpu")[1]
    shapes = example_inputs(cfg, batch=batch, seq=seq, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    return {
        key: torch.randn(value.shape, generator=generator) if value.dtype.is_floating_point
        else torch.randint(0, cfg.vocab, value.shape, generator=generator)
        for key, value in shapes.items()
    }


@dataclass(frozen=True, slots=True)
class ZooModel:
    config: ModelConfig
    module: nn.Module
    inputs: dict[str, torch.Tensor]
    batch: int
    seq: int

    def inputs_at(self, batch: int) -> dict[str, torch.Tensor]:
        """Example inputs of the same model at another batch size (the planner traces several micro-batches)."""
        device = next(iter(self.inputs.values())).device.type if self.inputs else "meta"
        inputs = example_inputs(self.config, batch=batch, seq=self.seq, device=device)
        for key, value in self.inputs.items():
            if key in inputs and value.dtype.is_floating_point:
                inputs[key] = inputs[key].to(value.dtype)
        return inputs


def describe(zoo: ZooModel) -> dict[str, Any]:
    """The full configuration of the model `load` built: its class, the shape options it has (key/value heads, head
    size, FFN, positions, sliding window, experts; for Hugging Face models as its config holds them, with the config
    fields that differ from the config class's defaults under ``set``), and its example inputs."""
    cfg, module = zoo.config, zoo.module
    inputs = {key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
              for key, value in zoo.inputs.items()}
    if cfg.family == "hf":
        return {**hf_auto.describe(module), "inputs": inputs}
    if cfg.family == "user":
        return {"class": type(module).__name__, "built_by": cfg.name, "inputs": inputs}
    if cfg.family == "wrn":
        return {"class": type(module).__name__, "depth": cfg.layers, "width": cfg.width, "stem": cfg.hidden,
                "classes": cfg.vocab, "image": cfg.seq, "inputs": inputs}
    shown = {"layers": cfg.layers, "decoder_layers": cfg.decoder_layers or None, "hidden": cfg.hidden,
             "heads": cfg.heads, "kv_heads": cfg.kv_heads or cfg.heads, "head_dim": cfg.head_dim or cfg.hidden // cfg.heads,
             "ffn": cfg.ffn, "vocab": cfg.vocab, "positions": None if cfg.family == "t5" else cfg.seq,
             "experts": cfg.experts or None, "top_k": cfg.top_k if cfg.experts else None,
             "dropout": cfg.dropout}
    return {"class": type(module).__name__, **{k: v for k, v in shown.items() if v is not None}, "inputs": inputs}


def config_for(name: str, *, seq: int | None = None, **overrides: Any) -> ModelConfig:
    """The configuration `load` builds: a ``seq`` longer than the model's default raises its maximum (a Hugging Face
    image classifier's takes any: it is the side of the images)."""
    cfg = get_config(name, **overrides)
    exact = cfg.family == "hf" and hf.exact_seq(cfg)
    return cfg.with_overrides(seq=seq) if seq is not None and (seq > cfg.seq or exact) else cfg


def load(
    name: str,
    *,
    batch: int = 1,
    seq: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "meta",
    **overrides: Any,
) -> ZooModel:
    """Config, module and example inputs of a zoo model in one call.

    A ``seq`` longer than the model's default raises its maximum (position tables grow with it).
    """
    cfg = config_for(name, seq=seq, **overrides)
    if cfg.family == "user":
        module, inputs = _load_user(cfg, batch=batch, seq=seq, device=device, dropout=overrides.get("dropout"))
        seq = user.sequence(inputs)
    else:
        seq = seq or cfg.seq
        module = build_model(cfg, dtype=dtype, device=device)
        inputs = example_inputs(cfg, batch=batch, seq=seq, device=device)
    if dtype.is_floating_point:  # images, audio features, a user's float inputs: in the model's dtype
        inputs = {key: value.to(dtype) if value.is_floating_point() else value for key, value in inputs.items()}
    return ZooModel(config=cfg, module=module.to(dtype).train(), inputs=inputs, batch=batch, seq=seq)


def _load_user(
    cfg: ModelConfig, *, batch: int, seq: int | None, device: str, dropout: float | None
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A user function's model and inputs; ``seq``, where given, must be the inputs' own; ``dropout`` (the runtime
    turns it off) is set on every ``nn.Dropout`` module (dropout the model applies otherwise is its own)."""
    module, inputs = user.build(cfg.name, batch=batch, device=device)
    if seq is not None and seq != user.sequence(inputs):
        raise ValueError(f"{cfg.name}: sequence length {seq} was asked, but the function's inputs have "
                         f"{user.sequence(inputs)}; the function's inputs set it")
    if dropout is not None:
        for layer in module.modules():
            if isinstance(layer, nn.modules.dropout._DropoutNd):
                layer.p = dropout
    return module, inputs
