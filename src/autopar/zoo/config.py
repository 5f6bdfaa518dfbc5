"""`ModelConfig`: the shape of a zoo model, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

FAMILIES = ("gpt", "llama", "bert", "t5", "moe", "wrn", "hf", "user")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Architecture of one zoo model.

    ``seq`` is the default and maximum sequence length (the image side for Wide-ResNet). Zero means "derived":
    ``kv_heads`` 0 = ``heads``; ``head_dim`` 0 = ``hidden // heads``; ``decoder_layers`` 0 = ``layers``.
    Family ``hf``: ``layers``, ``hidden`` and ``heads`` are 0 where the config has no such field (a convolutional
    network), ``vocab`` is the classes of an image classifier. Family ``user`` (a model your function builds):
    ``name`` says where the function is; the shape fields are 0 (unknown: the function decides them).
    """

    family: str
    name: str
    layers: int
    hidden: int
    heads: int = 0
    vocab: int = 0
    seq: int = 0
    ffn: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    decoder_layers: int = 0
    experts: int = 0
    top_k: int = 2
    moe_every: int = 2
    capacity_factor: float = 1.25
    width: int = 1
    dropout: float = 0.0
    hf_type: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        required = {"hf": ("vocab", "seq"), "user": ()}.get(self.family, ("layers", "hidden", "vocab", "seq"))
        for name in required:
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name} must be positive, got {getattr(self, name)}")
        for name in ("layers", "hidden", "vocab", "seq", "heads", "ffn", "kv_heads", "head_dim", "decoder_layers",
                     "experts", "width"):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.name}: {name} must not be negative, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{self.name}: dropout must be in [0, 1), got {self.dropout}")
        if self.family in ("wrn", "user") or self.family == "hf" and not self.heads:
            return
        if self.heads <= 0:
            raise ValueError(f"{self.name}: heads must be positive, got {self.heads}")
        if not self.head_dim and self.hidden % self.heads and self.family != "hf":  # (a Hugging Face config decides)
            raise ValueError(
                f"{self.name}: hidden ({self.hidden}) must be divisible by heads ({self.heads}); "
                "change --hidden or --heads"
            )
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.family == "moe" and (self.experts < 1 or self.top_k > self.experts):
            raise ValueError(
                f"{self.name}: a mixture of experts needs experts >= top_k >= 1, got experts={self.experts}, "
                f"top_k={self.top_k}"
            )

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        """A copy with the given fields changed; ``None`` values are ignored. Unknown names raise ValueError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown model option(s) {unknown} for {self.name}; known: {sorted(known)}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "hidden" in changes and "ffn" not in changes and self.family in ("gpt", "moe", "bert"):
            changes["ffn"] = 4 * changes["hidden"]
        return replace(self, **changes)

    def summary(self) -> dict[str, int | None]:
        """The fields ``autopar profile --json`` reports under ``config`` (None: a user's function decides them)."""
        if self.family == "user":
            return dict.fromkeys(("layers", "hidden", "heads", "vocab"))
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads, "vocab": self.vocab}
