"""The rehearsal a plan gets when it is planned runs one layer of each kind (`autopar.runtime.thin`): which layers
stand for the others, the plan rewritten to match, and refusals that still name the real module."""

import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar.cli.main import main
from autopar.plan import Plan
from autopar.runtime.source import ModelSource
from autopar.runtime.thin import thin, thins
from autopar.runtime.train import Workload
from autopar.runtime.validate import check_runnable, rehearsal

WIDTH, VOCAB, SEQ = 32, 64, 8


class Block(nn.Module):
    """A residual MLP block as users write them, counting its own place (as Hugging Face's ``layer_idx`` does)."""

    def __init__(self, index: int, ffn: int) -> None:
        super().__init__()
        self.index = index
        self.strict = False
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, ffn), nn.Linear(ffn, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strict:  # a step that needs the values: fake tensors cannot take it
            x = x * float(x.detach().sum())
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    calls = 0  # forwards run, by every copy

    def __init__(self, layers: int, wide: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(i, 4 * WIDTH if i in wide else 2 * WIDTH) for i in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        Net.calls += 1
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _plan(model: nn.Module, search: str = "dp") -> Plan:
    return autopar.plan(model, _batch(), cluster="cpu", gpus=2, batch=4, search=search, budget_s=5)


def test_one_layer_of_each_kind_and_each_pair_of_neighbours_is_kept() -> None:
    """Twelve blocks, the eighth wider: the first two, the wide one with the blocks either side of it, and the
    last two stand for all twelve. Each block's own index does not make it a kind of its own."""
    model = Net(12, wide=(7,))
    plan = _plan(model)
    before = list(model.blocks)
    thinned = thin(model, plan)
    kept = [before.index(block) for block in model.blocks]
    assert kept == [0, 1, 6, 7, 8, 10, 11]
    assert [m.up.out_features for m in model.blocks] == [64, 64, 64, 128, 64, 64, 64]
    # every block is a layer of the chain, the wider one too (of a kind of its own)
    assert [name for name in thinned.stages[0].layers if name.startswith("blocks")] == [f"blocks.{i}" for i in range(7)]
    names = {p.name for entry in thinned.modules for p in entry.params}
    assert "blocks.6.up.weight" in names and "blocks.7.up.weight" not in names
    assert dict(model.named_parameters())["blocks.3.up.weight"].shape == (128, WIDTH)
    assert thins(plan, Net(12)) and not thins(_plan(Net(2)), Net(2))


def test_the_plan_treating_layers_differently_makes_them_different_kinds(tmp_path) -> None:
    """A GPT of 16 layers (each a row of the chain), one recomputed and a checkpointed run of six: the layers
    around the recomputed one, and the run's ends with the second of its like pairs, are kept."""
    path = tmp_path / "gpt.json"
    assert main(["estimate", "gpt3-125m", "--layers", "16", "--hidden", "64", "--heads", "4", "--vocab", "128",
                 "--seq", "16", "--cluster", "cpu", "--gpus", "2", "--batch", "4", "--out", str(path)]) == 0
    plan = Plan.load(path)
    stage = dataclasses.replace(plan.stages[0], recompute=(("layers.5", "full"),),
                                segments=(("layers.9", "layers.14"),))
    plan = dataclasses.replace(plan, stages=(stage,))
    model = ModelSource.of_workload(Workload.of(plan)).meta()
    before = list(model.layers)
    thinned = thin(model, plan)
    kept = [before.index(layer) for layer in model.layers]
    assert kept == [0, 1, 4, 5, 6, 8, 9, 10, 13, 14, 15]
    assert [name for name in thinned.stages[0].layers if name.startswith("layers.")] == [
        f"layers.{i}" for i in range(len(kept))]
    new = {i: j for j, i in enumerate(kept)}
    assert dict(thinned.stages[0].recompute) == {f"layers.{new[5]}": "full"}
    assert thinned.stages[0].segments == ((f"layers.{new[9]}", f"layers.{new[14]}"),)
    rehearsal(plan, whole=False)


def test_a_deep_model_is_rehearsed_as_a_shallow_one_and_passes_as_a_whole_one_does() -> None:
    model = Net(40, wide=(20,))
    plan = _plan(model, search="fsdp")
    source = ModelSource.of_module(model, _batch())
    rehearsal(plan, source=source, whole=False)
    rehearsal(plan, source=source)
    check_runnable(plan, source=source)


def test_a_whole_rehearsal_runs_every_micro_batch_and_a_thinned_one_the_first_and_last() -> None:
    model = Net(6)
    plan = dataclasses.replace(_plan(model), micro_batch_size=2, micro_batches=4)  # rows: 2 x 4, dp 2
    source = ModelSource.of_module(model, _batch())
    for whole, forwards in ((True, 4), (False, 2)):
        Net.calls = 0
        rehearsal(plan, source=source, whole=whole)
        assert Net.calls == forwards


def test_a_refusal_names_the_layer_of_the_whole_model() -> None:
    """Block 9 of 12 cannot run on fake tensors: the layer left standing for it in the thinned model is block 5
    there, but the refusal comes from the whole model's rehearsal and names block 9."""
    model = Net(12)
    plan = _plan(model)
    graph = ModelSource.of_module(model, _batch()).chain()  # the trace it was planned on
    model.blocks[9].strict = True
    source = ModelSource.of_module(model, _batch(), graph=graph)
    with pytest.raises(ValueError, match=r"in module 'blocks.9'"):
        check_runnable(plan, source=source)


def _estimate_plan(name: str, tp: int, dp: int, **size: int) -> Plan:
    """The plan `autopar estimate NAME --tp TP --dp DP --out` writes for a small copy of a zoo model."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost import ParallelConfig
    from autopar.cost.megatron import pipeline_config
    from autopar.cost.pipeline import PipelineModel
    from autopar.plan import Workload as Planned
    from autopar.search.pipeline import Found, pipeline_plan
    from autopar.zoo import load

    zoo = load(name, batch=1, seq=16, dtype=torch.float32, **size)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs_at(1)),
                          load_cluster("cpu").with_devices(tp * dp), traced_batch=1)
    config = pipeline_config(model, ParallelConfig(tp=tp, dp=dp, mbs=1))
    batch = 4 * dp
    found = Found(config, model.estimate(config, global_batch=batch), 1)
    work = Planned(model=name, overrides=tuple(size.items()), seq=zoo.seq, batch=batch, dtype="fp32")
    return pipeline_plan(model, found, name=name, kind="estimate", global_batch=batch, workload=work)


def test_a_plan_communicating_other_than_priced_is_refused_when_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whisper's cross-attention reads the encoder's output in k and v. Handed to them as two inputs instead of one
    shared replicated one, tp trains the same model but reduces that input's gradient twice, which the estimate
    does not price: the plan-time rehearsal, on one layer of each kind of a 6-layer model and 2 of its 4
    micro-batches, counts the extra all-reduces and refuses the plan with the difference."""
    import autopar.runtime.apply as apply

    pytest.importorskip("transformers")
    plan = _estimate_plan("hf:whisper", 2, 1, layers=6, hidden=64, heads=4)
    assert plan.micro_batches == 4
    check_runnable(plan)
    monkeypatch.setattr(apply, "_share_other_inputs", lambda *args: None)
    with pytest.raises(ValueError, match=r"other collectives than priced \(all_reduce on tp: (\d+) calls .*one layer "
                                         r"of each kind, 2 micro-batches\)"):
        check_runnable(plan)


class Wide(nn.Module):
    """A table and a head of 8M weights each (32 MB of fp32 gradient, more than a DDP bucket) around small
    layers: DDP all-reduces the head's gradient in one bucket and the layers' with the table's in another."""

    def __init__(self, vocab: int = 250_000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = nn.ModuleList(Block(i, 2 * WIDTH) for i in range(2))
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_the_rehearsal_all_reduces_in_ddp_s_buckets() -> None:
    """The rehearsal cannot wrap the model in DDP (its constructor reads weight values) and all-reduces by hand in
    the buckets DDP makes, in the order the backward makes the gradients: 2 calls here, as priced, not the 3
    slices of 25 MiB one flat buffer of all gradients would take."""
    with torch.device("meta"):
        model = Wide()
    plan = _plan(model)
    assert plan.grid == (2, 1) and plan.zero == 0
    source = ModelSource.of_module(model, _batch())
    counted = rehearsal(plan, source=source, count=True)
    gradients = sum(p.numel() for p in model.parameters()) * 4
    assert counted == [{"kind": "all_reduce", "axis": "dp", "count": 2, "bytes": gradients}]
    check_runnable(plan, source=source)


def test_a_pipeline_is_rehearsed_stage_by_stage_when_planned(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPT of 16 layers in 2 stages over tp 2, its head tied to the embedding: each stage is thinned on its own,
    keeping its first two and last two layers (the pairs of neighbours), and every pipeline device is rehearsed
    running the plan's schedule. Where the two ends stop summing the tied weight's gradient, which the estimate
    prices on the pp axis and which only a pipeline's stages do (not its tensor parallelism rehearsed as one
    stage), the plan is refused when planned, naming the rank and its stage."""
    from autopar.runtime.pipeline import Pipeline

    path = tmp_path / "gpt.json"
    assert main(["estimate", "gpt3-125m", "--layers", "16", "--hidden", "64", "--heads", "4", "--vocab", "128",
                 "--seq", "16", "--cluster", "cpu", "--gpus", "4", "--pp", "2", "--tp", "2", "--batch", "8",
                 "--mbs", "2", "--out", str(path)]) == 0
    plan = Plan.load(path)
    model = ModelSource.of_workload(Workload.of(plan)).meta()
    thinned = thin(model, plan)
    assert [[n for n in stage.layers if n.startswith("layers.")] for stage in thinned.stages] == [
        [f"layers.{i}" for i in range(4)], [f"layers.{i}" for i in range(4, 8)]]  # layers 0, 1, 6, 7 | 8, 9, 14, 15
    check_runnable(plan)
    monkeypatch.setattr(Pipeline, "sync_tied", lambda self: None)
    with pytest.raises(ValueError, match=r"its pipeline, applied on a fake process group, has rank 0 \(stage 0\) "
                                         r"issue other collectives than priced \(all_reduce on pp: 0 calls .*each "
                                         r"stage with one layer of each kind, 2 micro-batches\)"):
        check_runnable(plan)


def test_a_middle_stage_under_zero_3_gathers_each_layer_twice_a_micro_batch_as_priced(tmp_path) -> None:
    """1F1B runs forwards between a middle stage's backwards. FSDP2 left to prefetch by itself gathers, in a
    backward, the unit whose forward ran before, of another micro-batch: a forward then reshards it and it is
    gathered again, one gather a step more than priced (17 for 16 here). Each layer prefetching the one before it
    in its own micro-batch issues what the plan prices, and the plan is written and passes `autopar dryrun`."""
    from autopar.runtime.dryrun import dryrun

    path = tmp_path / "gpt.json"
    assert main(["estimate", "gpt3-125m", "--layers", "8", "--hidden", "64", "--heads", "4", "--vocab", "128",
                 "--seq", "16", "--cluster", "cpu", "--gpus", "8", "--pp", "4", "--dp", "2", "--zero", "3",
                 "--batch", "16", "--mbs", "2", "--out", str(path)]) == 0
    result = dryrun(Plan.load(path), checked=True)
    assert result["ok"], result["message"]
    assert [r["rank"] for r in result["ranks"]] == [0, 2, 4, 6]
