"""GPT in the GPT-3 / Megatron-LM layout: learned positions, pre-LayerNorm blocks, GELU MLP, tied output head.

With ``experts > 0`` every ``moe_every``-th block's MLP becomes a GShard top-k mixture of experts (`moe.MoE`).
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.zoo.config import ModelConfig
from autopar.zoo.layers import MLP, Attention, lm_loss
from autopar.zoo.moe import MoE


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, *, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        if moe:
            self.mlp: nn.Module = MoE(
                cfg.hidden, cfg.ffn, experts=cfg.experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor
            )
        else:
            self.mlp = MLP(cfg.hidden, cfg.ffn)
        # one dropout module per branch: a module called twice in one forward confuses module-level tools
        # (CommDebugMode's module tracker raises on it)
        self.drop_attn = nn.Dropout(cfg.dropout)
        self.drop_mlp = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_attn(self.attn(self.ln1(x)))
        return x + self.drop_mlp(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            GPTBlock(cfg, moe=cfg.experts > 0 and i % cfg.moe_every == cfg.moe_every - 1) for i in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(input_ids) + self.pos.weight[: input_ids.shape[1]])
        for layer in self.layers:
            x = layer(x)
        return lm_loss(self.head(self.norm(x)), labels)
