"""Parameter counts and FLOPs from the trace against sum(numel), published sizes and the closed-form GPT count."""

from __future__ import annotations

import pytest

import autopar
from autopar.zoo import CATALOG, load


@pytest.mark.parametrize(
    ("name", "published"), [("gpt3-1.3b", 1.3e9), ("gpt3-6.7b", 6.7e9), ("gpt3-175b", 175e9), ("llama-7b", 6.74e9)]
)
def test_parameter_count_matches_module_and_published_size(name: str, published: float) -> None:
    zoo = load(name, batch=1, seq=128)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    assert graph.num_params == sum(p.numel() for p in zoo.module.parameters())
    # GPT-3's published sizes are rounded to two significant figures: 1.3B is 1.316B for its shape (GPT-Neo 1.3B,
    # the same shape without QKV biases, has 1,315,575,808). The closed form below is exact.
    assert abs(graph.num_params - published) / published < 0.013


@pytest.mark.parametrize("name", ["gpt3-1.3b", "megatron-7.5b", "megatron-145.6b"])
def test_gpt_parameter_count_equals_megatron_closed_form(name: str) -> None:
    cfg = CATALOG[name]
    l, h, v, s = cfg.layers, cfg.hidden, cfg.vocab, cfg.seq
    zoo = load(name, batch=1, seq=64)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    # 12lh^2 (1 + 13/(12h) + (V + s)/(12lh)) plus the final LayerNorm's 2h (Narayanan et al. 2021, section 5.1)
    assert graph.num_params == 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h


@pytest.mark.parametrize(("name", "batch", "seq"), [("gpt3-350m", 4, 1024), ("gpt3-1.3b", 2, 2048), ("gpt3-13b", 1, 2048)])
def test_gpt_flops_match_closed_form(name: str, batch: int, seq: int) -> None:
    zoo = load(name, batch=batch, seq=seq)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    cfg = zoo.config
    l, h, v = cfg.layers, cfg.hidden, cfg.vocab
    expected = 72 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (12 * l * h))
    assert graph.flops_forward + graph.flops_backward == pytest.approx(expected, rel=1e-3)
    assert graph.flops_backward == 2 * graph.flops_forward


def test_backward_flops_skip_operands_without_grad() -> None:
    import torch
    from torch import nn

    model = nn.Linear(16, 8, bias=False)
    model.weight.requires_grad_(False)
    x = torch.zeros(4, 16, requires_grad=True)
    graph = autopar.trace(model, (x,))
    mm = [n for n in graph.nodes if n.flops_forward]
    assert [n.op for n in mm] == ["aten.mm.default"]
    assert mm[0].flops_forward == 2 * 4 * 16 * 8
    assert mm[0].flops_backward == mm[0].flops_forward  # only dX: the weight is frozen


def test_attention_is_counted() -> None:
    zoo = load("gpt3-125m", batch=2, seq=256, layers=1)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    attention = [n for n in graph.nodes if "attention" in n.op]
    assert len(attention) == 1
    b, s, h = 2, 256, 768
    assert attention[0].flops_forward == 4 * b * s * s * h  # QK^T and PV, no causal discount
