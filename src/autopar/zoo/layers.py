"""Transformer building blocks shared by the zoo's model families.

Written the Megatron way (fused QKV projection, SDPA attention core) so that every layer exposes the same four
contraction blocks to the planner: QKV + attention core, output projection, FC1 (or gate/up), FC2.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding tables (RoPE), kept as non-persistent buffers of the model, not per layer."""

    def __init__(self, head_dim: int, max_seq: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin(), angles.sin()], dim=-1), persistent=False)

    def forward(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq], self.sin[:seq]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with a fused QKV projection and PyTorch's SDPA core."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = True,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads or heads
        self.head_dim = head_dim or hidden // heads
        self.causal = causal
        self.scale = scale
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = nn.Linear(hidden, qkv_out, bias=bias)
        self.proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.recompute_core = False  # selective recomputation: keep only q, k, v for backward, redo the core

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        core = functools.partial(
            F.scaled_dot_product_attention,
            attn_mask=bias,
            is_causal=self.causal and bias is None,
            scale=self.scale,
            enable_gqa=self.kv_heads != self.heads,
        )
        if self.recompute_core and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(core, q, k, v, use_reentrant=False)
        else:
            out = core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, q_size))


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention (T5): queries from the decoder, fused keys/values from the encoder output."""

    def __init__(self, hidden: int, heads: int, *, head_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.kv = nn.Linear(hidden, 2 * heads * head_dim, bias=bias)
        self.proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        mem_seq = memory.shape[1]
        q = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(memory).view(batch, mem_seq, 2, self.heads, self.head_dim).unbind(2)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=1.0)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class MLP(nn.Module):
    """FC1 -> GELU -> FC2 (GPT, BERT) or, with ``gated``, SwiGLU / gated-GELU: (act(gate) * up) -> down."""

    def __init__(self, hidden: int, ffn: int, *, bias: bool = True, gated: bool = False, act: str = "gelu") -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {act!r}; choose one of {sorted(_ACTIVATIONS)}")
        self.gated = gated
        self.act = act
        if gated:
            self.gate = nn.Linear(hidden, ffn, bias=bias)
            self.up = nn.Linear(hidden, ffn, bias=bias)
            self.down = nn.Linear(ffn, hidden, bias=bias)
        else:
            self.fc1 = nn.Linear(hidden, ffn, bias=bias)
            self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        return _ACTIVATIONS[self.act](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down(self._activation(self.gate(x)) * self.up(x))
        return self.fc2(self._activation(self.fc1(x)))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy over the vocabulary (labels already aligned with logits)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
