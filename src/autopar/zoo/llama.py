"""LLaMA: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, untied output head."""

from __future__ import annotations

import torch
from torch import nn

from autopar.zoo.config import ModelConfig
from autopar.zoo.layers import MLP, Attention, RMSNorm, Rotary, lm_loss


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads, kv_heads=cfg.kv_heads, bias=False)
        self.norm2 = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn, bias=False, gated=True, act="silu")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), (cos, sin))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.rotary = Rotary(cfg.hidden // cfg.heads, cfg.seq)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary(input_ids.shape[1])
        for layer in self.layers:
            x = layer(x, cos, sin)
        return lm_loss(self.head(self.norm(x)), labels)
