"""MAP memory categories read off the graph, checked by hand on small modules."""

from __future__ import annotations

import torch
from torch import nn

import autopar


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = MLPBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(x)).sum()


def test_module_memory_categories_by_hand() -> None:
    tokens = 32
    graph = autopar.trace(Net(), (torch.zeros(tokens, 8),))
    mem = graph.module_memory("block")
    f32 = 4
    # fc1 saves its input (32x16); GELU saves its input, fc1's output (32x64); fc2 saves GELU's output (32x64).
    assert mem.fwd_in == tokens * (16 + 64 + 64) * f32
    assert mem.fwd_out == tokens * 16 * f32
    assert mem.bwd_out == tokens * 16 * f32  # the gradient of the block's input
    assert mem.fwd_tmp == 0  # every intermediate is saved or is the output
    assert mem.bwd_tmp == tokens * 64 * f32


def test_nodes_know_their_parameters_and_modules() -> None:
    graph = autopar.trace(Net(), (torch.zeros(4, 8),))
    addmm = [n for n in graph.nodes if n.op == "aten.addmm.default"]
    assert [n.module for n in addmm] == ["embed", "block.fc1", "block.fc2"]
    assert all(n.reads_params for n in addmm)
    assert "block.fc1.weight" in addmm[1].params and "block.fc1.bias" in addmm[1].params
    # fc2 consumes GELU's output: the edge is recorded
    gelu = next(n for n in graph.nodes if n.op == "aten.gelu.default")
    assert any(s.node == gelu.id for s in addmm[2].sources)
    assert gelu.module == "block.act" and gelu.flops_forward == 0 and gelu.bytes_written == 4 * 64 * 4


def test_graph_inputs_are_referenced() -> None:
    graph = autopar.trace(Net(), (torch.zeros(4, 8),))
    first = next(n for n in graph.nodes if n.op == "aten.addmm.default")
    assert any(s.node == -1 and s.state is None for s in first.sources)
    assert graph.inputs[0].shape == (4, 8)
