"""BERT: post-LayerNorm bidirectional encoder with a tied masked-language-model head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.config import ModelConfig
from autopar.zoo.layers import MLP, Attention, lm_loss


class BertBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg.hidden, cfg.heads, causal=False)
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.drop_attn = nn.Dropout(cfg.dropout)  # one module per branch (see gpt.GPTBlock)
        self.drop_mlp = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop_attn(self.attn(x)))
        return self.ln2(x + self.drop_mlp(self.mlp(x)))


class Bert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.token_type = nn.Embedding(2, cfg.hidden)
        self.embed_ln = nn.LayerNorm(cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.layers))
        self.mlm_dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.mlm_ln = nn.LayerNorm(cfg.hidden)
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos.weight[:seq] + self.token_type.weight[0]
        x = self.drop(self.embed_ln(x))
        for layer in self.layers:
            x = layer(x)
        x = self.mlm_ln(F.gelu(self.mlm_dense(x)))
        return lm_loss(F.linear(x, self.embed.weight, self.mlm_bias), labels)
