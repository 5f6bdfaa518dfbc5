"""T5 (v1.0): encoder-decoder with RMS LayerNorm, ReLU MLP, unscaled attention and relative position biases.

The relative position bias is computed once per stack (as T5 does, from the first layer's table) and passed to every
block, so all blocks of a stack are identical modules and are traced once.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from autopar.zoo.config import ModelConfig
from autopar.zoo.layers import MLP, Attention, CrossAttention, RMSNorm, lm_loss


class RelativeBias(nn.Module):
    def __init__(self, heads: int, *, bidirectional: bool, buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        self.bidirectional, self.buckets, self.max_distance = bidirectional, buckets, max_distance
        self.table = nn.Embedding(buckets, heads)

    def _bucket(self, relative: torch.Tensor) -> torch.Tensor:
        buckets, bucket = self.buckets, torch.zeros_like(relative)
        if self.bidirectional:
            buckets //= 2
            bucket = bucket + (relative > 0).long() * buckets
            relative = relative.abs()
        else:
            relative = -torch.clamp(relative, max=0)
        exact = buckets // 2
        far = exact + (
            torch.log(relative.float().clamp(min=1) / exact) / math.log(self.max_distance / exact) * (buckets - exact)
        ).long()
        far = torch.clamp(far, max=buckets - 1)
        return bucket + torch.where(relative < exact, relative, far)

    def forward(self, seq: int) -> torch.Tensor:
        position = torch.arange(seq, device=self.table.weight.device)
        relative = position[None, :] - position[:, None]
        bias = self.table(self._bucket(relative)).permute(2, 0, 1).unsqueeze(0)  # (1, heads, seq, seq)
        if not self.bidirectional:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=bias.device).triu(1)
            bias = bias.masked_fill(causal, float("-inf"))
        return bias


class T5Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, decoder: bool) -> None:
        super().__init__()
        head_dim = cfg.head_dim or cfg.hidden // cfg.heads
        self.norm1 = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads, head_dim=head_dim, bias=False, causal=False, scale=1.0)
        if decoder:
            self.norm_cross = RMSNorm(cfg.hidden)
            self.cross = CrossAttention(cfg.hidden, cfg.heads, head_dim=head_dim)
        self.norm2 = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn, bias=False, act="relu")
        self.drop_attn = nn.Dropout(cfg.dropout)  # one module per branch (see gpt.GPTBlock)
        if decoder:
            self.drop_cross = nn.Dropout(cfg.dropout)
        self.drop_mlp = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_attn(self.attn(self.norm1(x), bias=bias.to(x.dtype)))
        if memory is not None:
            x = x + self.drop_cross(self.cross(self.norm_cross(x), memory))
        return x + self.drop_mlp(self.mlp(self.norm2(x)))


class T5Stack(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: int, *, decoder: bool) -> None:
        super().__init__()
        self.relative_bias = RelativeBias(cfg.heads, bidirectional=not decoder)
        self.layers = nn.ModuleList(T5Block(cfg, decoder=decoder) for _ in range(layers))
        self.norm = RMSNorm(cfg.hidden)
        self.drop_in = nn.Dropout(cfg.dropout)
        self.drop_out = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.relative_bias(x.shape[1])
        x = self.drop_in(x)
        for layer in self.layers:
            x = layer(x, bias, memory)
        return self.drop_out(self.norm(x))


class T5(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden = cfg.hidden
        self.shared = nn.Embedding(cfg.vocab, cfg.hidden)
        self.decoder_embed = nn.Embedding(cfg.vocab, cfg.hidden)  # its own module, the shared weight
        self.decoder_embed.weight = self.shared.weight
        self.encoder = T5Stack(cfg, cfg.layers, decoder=False)
        self.decoder = T5Stack(cfg, cfg.decoder_layers or cfg.layers, decoder=True)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.shared(input_ids))
        out = self.decoder(self.decoder_embed(decoder_input_ids), memory)
        logits = torch.nn.functional.linear(out * self.hidden**-0.5, self.shared.weight)
        return lm_loss(logits, labels)
