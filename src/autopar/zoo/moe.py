"""GShard-style mixture of experts: top-k gating with a fixed expert capacity, dispatched by dense einsums.

Every shape is static (capacity = ceil(top_k * tokens * capacity_factor / experts) per group, one group per
sequence), so the layer traces on fake tensors and its expert weights carry an explicit expert dimension E that the
planner can shard (expert parallelism). Tokens past an expert's capacity are dropped, as in GShard.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, *, experts: int, top_k: int = 2, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(self.top_k * tokens * self.capacity_factor / self.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups, tokens, _ = x.shape
        experts, k, cap = self.experts, self.top_k, self.capacity(tokens)
        probs = F.softmax(self.router(x).float(), dim=-1)  # (G, S, E)
        top_p, top_i = probs.topk(k, dim=-1)  # (G, S, k)
        chosen = (top_i.unsqueeze(-1) == torch.arange(experts, device=x.device)).float()  # (G, S, k, E)
        # Slot of each (token, choice) in its expert's buffer: first choices of all tokens take slots first.
        by_choice = chosen.transpose(1, 2).reshape(groups, k * tokens, experts)
        slot = (by_choice.cumsum(dim=1) - 1.0) * by_choice
        kept = by_choice * (slot < cap).float()
        slot = slot.reshape(groups, k, tokens, experts).transpose(1, 2)
        kept = kept.reshape(groups, k, tokens, experts).transpose(1, 2)
        one_hot = (slot.unsqueeze(-1) == torch.arange(cap, device=x.device)).float() * kept.unsqueeze(-1)
        combine = (one_hot * top_p[..., None, None]).sum(dim=2).to(x.dtype)  # (G, S, E, C)
        dispatch = one_hot.sum(dim=2).to(x.dtype)
        expert_in = torch.einsum("gsec,gsh->gech", dispatch, x)
        hidden = F.gelu(torch.einsum("gech,ehf->gecf", expert_in, self.w1))
        expert_out = torch.einsum("gecf,efh->gech", hidden, self.w2)
        return torch.einsum("gsec,gech->gsh", combine, expert_out)
