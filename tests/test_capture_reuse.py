"""Tracing repeated layers once gives the same graph as tracing every layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture.reuse import find_units
from autopar.zoo import load

SMALL = {
    "gpt3-125m": dict(layers=4),
    "llama-7b": dict(layers=4, hidden=256, heads=8, kv_heads=2, ffn=512),
    "t5-base": dict(layers=3),
    "moe-125m-e8": dict(layers=4),
    "bert-base": dict(layers=3),
    "wrn-50-2": dict(hidden=16),
    "hf:llama-tiny": dict(layers=3),
    "hf:t5-tiny": dict(layers=3),
    "hf:mixtral-tiny": dict(layers=3),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_reuse_gives_the_same_graph(name: str) -> None:
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    zoo = load(name, batch=2, seq=64, **SMALL[name])
    replayed = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    full = autopar.trace(zoo.module, example_kwargs=zoo.inputs, reuse=False)
    assert replayed.repeats, "the model has repeated layers"
    assert not full.repeats
    assert replayed.nodes == full.nodes


def test_repeat_groups_cover_each_layer_stack() -> None:
    zoo = load("gpt3-125m", batch=1, seq=32, layers=5)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    (group,) = graph.repeats
    assert group.instances == tuple(f"layers.{i}" for i in range(5))
    sizes = {end - start for start, end in group.spans}
    assert len(sizes) == 1 and sizes.pop() > 10
    for fqn, (start, end) in zip(group.instances, group.spans):
        assert all(n.module.startswith(fqn) for n in graph.nodes[start:end])


def test_moe_alternates_two_kinds_of_layer() -> None:
    zoo = load("moe-125m-e8", batch=1, seq=32, layers=6)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    kinds = sorted(len(g.instances) for g in graph.repeats)
    assert kinds == [3, 3]


def test_layers_with_different_inputs_are_traced_separately() -> None:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            x = self.blocks[1](x[:2])  # a different input shape: not a replay of blocks.0
            return self.blocks[2](x)

    graph = autopar.trace(Stack(), (torch.zeros(4, 8),))
    full = autopar.trace(Stack(), (torch.zeros(4, 8),), reuse=False)
    assert graph.nodes == full.nodes
    mm_batches = [n.inputs[1].shape[0] for n in graph.nodes if n.op == "aten.addmm.default"]
    assert mm_batches == [4, 2, 2]


def test_layer_index_attributes_do_not_break_repetition() -> None:
    class Block(nn.Module):
        def __init__(self, layer_idx: int, width: int = 8) -> None:
            super().__init__()
            self.layer_idx, self.width = layer_idx, width
            self.fc = nn.Linear(width, width)

    model = nn.ModuleList([Block(0), Block(1), Block(2, width=8)])
    assert len(find_units(model)) == 3
    assert len(set(find_units(model).values())) == 1
    model.append(Block(3, width=16))
    units = find_units(model)  # the wider block is a layer of the list too, of its own fingerprint
    assert len(units) == 4 and len(set(units.values())) == 2


def test_layers_of_alternating_kinds_are_each_a_layer() -> None:
    """Gemma 2 alternates sliding-window and full attention: at 2 layers no two are alike, yet each is one of the
    model's layers (an FSDP unit and a pipeline cut for the runtime), not part of one row holding the whole model."""
    from autopar.zoo import load

    built = load("hf:gemma2", batch=1, seq=16, layers=2, hidden=64, heads=4)
    graph = autopar.trace(built.module, example_kwargs=built.inputs)
    assert [group.instances for group in graph.repeats] == [("model.layers.0",), ("model.layers.1",)]
    assert {"model.layers.0", "model.layers.1"} <= {row.name for row in graph.layers()}
    deeper = load("hf:gemma2", batch=1, seq=16, layers=4, hidden=64, heads=4)
    graph = autopar.trace(deeper.module, example_kwargs=deeper.inputs)
    assert sorted(group.instances for group in graph.repeats) == [("model.layers.0", "model.layers.2"),
                                                                   ("model.layers.1", "model.layers.3")]


def test_a_weight_two_modules_share_is_named_as_named_parameters_names_it() -> None:
    """nanoGPT's embedding takes the head's weight (``wte.weight = lm_head.weight``): the trace used to name the
    weight by the head, a name the model's state does not hold, so the head's read of the embedding's weight went
    unseen and a pipeline's sum of it over the two ends was not priced. The embedding has a sibling of its class in
    ``transformer`` (the position table), but holding the head's weight it is no repeated unit: FSDP could not
    shard it apart from the head (ZeRO 3 of nanoGPT was refused so), and the cost model prices it with the
    root's unit, as the runtime shards it."""
    import sys
    from pathlib import Path

    from autopar.capture import trace
    from autopar.cost.layers import analyse

    examples = str(Path(__file__).resolve().parent.parent / "examples")
    sys.path.insert(0, examples)
    try:
        import nanogpt
    finally:
        sys.path.remove(examples)
    model, inputs = nanogpt.build(2)
    graph = trace(model, example_kwargs=inputs)
    named = {s.state for n in graph.nodes for s in n.sources if s.state}
    assert named <= set(graph.state)
    rows = {layer.name: layer for layer in analyse(graph)}
    assert rows["model.transformer.wte"].params == 128 * 512
    assert rows["model.lm_head"].tied == [("model.transformer.wte", 128 * 512)]
    assert not rows["model.transformer.wte"].repeated and rows["model.transformer.wpe"].repeated

    from autopar.runtime.apply import repeated_layers

    units = repeated_layers(model)
    assert model.model.transformer.wte not in units and model.model.transformer.wpe in units
    assert len(units) == 1 + len(model.model.transformer.h)
