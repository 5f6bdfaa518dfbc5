"""ParallelBlocks, candidates and segments on zoo models (CFP §3-4)."""

import pytest
import torch
from torch import nn

from autopar.analysis import Split, build_blocks, find_segments, op_dims
from autopar.capture import trace
from autopar.cluster import build_mesh, load_cluster
from autopar.cost.intra import IntraCost
from autopar.zoo import load


def _space(name: str, *, gpus: int = 8, mesh: tuple[int, ...] | None = None, **overrides):
    zoo = load(name, batch=8, seq=64, **overrides)
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    blocks = build_blocks(graph)
    cluster = load_cluster("a100-80g-sxm").with_devices(gpus)
    shape = mesh or (gpus,)
    cost = IntraCost(blocks, build_mesh(cluster, {f"x{i}": n for i, n in enumerate(shape)}), cluster)
    return graph, blocks, cost


def test_gpt_layer_is_four_blocks_of_four_candidates() -> None:
    graph, blocks, cost = _space("gpt3-125m", layers=3)
    layer = [b for b in blocks.blocks if b.layer == "layers.1"]
    modules = [graph.nodes[b.leader].module for b in layer]
    assert modules == ["layers.1.attn.qkv", "layers.1.attn.proj", "layers.1.mlp.fc1", "layers.1.mlp.fc2"]
    ops = {graph.nodes[i].op for i in layer[0].nodes}
    assert any("scaled_dot_product" in op for op in ops)  # the attention core joins the QKV block
    for block in layer:
        assert sorted(cost.describe(block, c) for c in cost.candidates(block)) == ["R", "k", "m", "n"]
    combos = 1
    for block in layer:
        combos *= len(cost.candidates(block))
    assert combos == 4**4


def test_every_node_is_in_exactly_one_block() -> None:
    graph, blocks, _ = _space("llama-7b", layers=2, hidden=256, heads=8, kv_heads=8, ffn=512, vocab=512)
    seen = [i for b in blocks.blocks for i in b.nodes]
    assert sorted(seen) == list(range(len(graph.nodes)))
    assert all(blocks.owner[i] == b.id for b in blocks.blocks for i in b.nodes)


@pytest.mark.parametrize("name", ["gpt3-125m", "llama-7b", "hf:bert"])
def test_blocks_that_keep_the_layers_edges_hold_each_layer_whole(name: str) -> None:
    """With ``layers``, every op of a repeated layer sits in a block of that layer (a pre-norm opens its layer's
    first block, before the leading op; BERT's per-projection views of the stream open their own projection's), so
    a layer's blocks are exactly its ops; without, the pre-norm joins the block before it, of the layer before."""
    zoo = load(name, batch=2, seq=32, layers=3, hidden=64, heads=4, vocab=256,
               **({"kv_heads": 4, "ffn": 128} if name == "llama-7b" else {}))
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    repeated = frozenset(fqn for group in graph.repeats for fqn in group.instances)
    kept = build_blocks(graph, layers=repeated)
    assert sorted(i for b in kept.blocks for i in b.nodes) == list(range(len(graph.nodes)))
    for block in kept.blocks:
        for i in block.nodes:
            row = graph.layer_of(graph.nodes[i].module)
            if row in repeated:
                assert block.layer == row, (block.layer, graph.nodes[i].op, graph.nodes[i].module)
    crossing = [i for b in build_blocks(graph).blocks for i in b.nodes
                if graph.layer_of(graph.nodes[i].module) in repeated and b.layer != graph.layer_of(graph.nodes[i].module)]
    if name != "hf:bert":  # a pre-norm model: its norms ride in the block before them
        assert crossing


def test_moe_expert_block_has_the_expert_dim() -> None:
    graph, blocks, cost = _space("moe-125m-e8", layers=2)
    expert = [b for b in blocks.blocks if graph.nodes[b.leader].op == "aten.bmm.default"]
    assert expert, "the expert matmuls lead blocks"
    for block in expert:
        names = sorted(cost.describe(block, c) for c in cost.candidates(block))
        assert names == ["R", "b", "k", "m", "n"]  # b is the expert dim: one more candidate than a dense layer
        dims = op_dims(graph.nodes[block.leader]).dims
        assert dims[0].size == 8 and dims[0].split is Split.FREE


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("gpt3-125m", {"layers": 2}),
        ("gpt3-125m", {"layers": 12}),
        ("gpt3-125m", {"layers": 48}),
        ("llama-7b", {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn": 512, "vocab": 512}),
        ("llama-7b", {"layers": 40, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn": 512, "vocab": 512}),
    ],
)
def test_gpt_and_llama_reduce_to_three_unique_segments(name: str, overrides: dict) -> None:
    _, blocks, _ = _space(name, **overrides)
    segments = find_segments(blocks.blocks)
    assert len({s.fingerprint for s in segments}) <= 3
    layers = overrides["layers"]
    assert max(s.count for s in segments) == layers  # one segment per layer, repeated back to back
    assert sum(s.length * s.count for s in segments) == len(blocks.blocks)


def test_t5_decoder_layers_match_despite_cross_attention() -> None:
    _, blocks, _ = _space("t5-base")
    segments = find_segments(blocks.blocks)
    repeated = sorted(s.count for s in segments if s.count > 1)
    assert repeated == [10, 11]  # encoder and decoder layers after the first of each


def test_a_chunk_cuts_the_dim_its_third_argument_names() -> None:
    """``chunk(x, 3, dim=-1)`` (a fused QKV cut as nanoGPT does) cuts the last dim into pieces, like ``split``: its
    second argument is the number of pieces, not a dim."""
    from autopar.analysis.dims import split_axis
    from autopar.capture.graph import Node, TensorInfo

    whole, piece = TensorInfo((4, 8, 96), "fp32"), TensorInfo((4, 8, 32), "fp32")
    node = Node(id=0, op="aten.chunk.default", module="m", module_type="M", inputs=(whole,), sources=(),
                outputs=(piece,) * 3, args=(None, 3, -1))
    assert split_axis(node) == 2
    dims = op_dims(node).dims
    assert dims[2].split is Split.FREE and dims[2].outputs == (2, 2, 2)
    assert dims[1].outputs == (1, 1, 1)


class _Sliced(nn.Module):
    """A fused projection cut by slices, as Phi-3 cuts its q, k and v (``cuts``: (start, stop) of each)."""

    def __init__(self, cuts: list[tuple[int | None, int | None]]) -> None:
        super().__init__()
        self.proj, self.cuts = nn.Linear(16, 48), cuts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return sum((y[..., a:b].sum() for a, b in self.cuts), torch.zeros(()))


@pytest.mark.parametrize(("cuts", "pieces"), [
    ([(None, 16), (16, 32), (32, None)], True),  # q, k and v: together the whole dim, each part once
    ([(0, 32), (32, 40), (40, 48)], True),  # pieces of unequal widths (grouped-query attention's)
    ([(None, 16), (16, 32)], False),  # the last 16 features never read
    ([(None, 24), (16, None)], False),  # overlapping
    ([(None, 16), (-32, None)], True),  # negative bounds, as Python slices take them
])
def test_slices_that_cut_a_dim_in_pieces_split_it_freely_as_a_split_does(cuts: list, pieces: bool) -> None:
    """Slices of one tensor along one dim that together hold all of it, each part once, are pieces: the dim splits
    freely (each rank its share of every piece, as the runtime lays a fused projection out); a slice that leaves
    part of the dim out, or overlaps another, keeps its dim whole."""
    graph = trace(_Sliced(cuts), (torch.randn(2, 4, 16),))
    slices = [n for n in graph.nodes if n.op == "aten.slice.Tensor" and n.inputs[0].shape[-1] == 48]
    assert len(slices) == len(cuts)
    for node in slices:
        assert (op_dims(node).dims[2].split is Split.FREE) == pieces, node.args
