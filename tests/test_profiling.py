"""The profile database (`autopar.profiling`): files refused whole when they cannot be trusted, layers keyed by
what they compute, measured times used by the cost model, and `autopar profile-segments` on live ranks."""

from __future__ import annotations

import json
import re

import pytest
import torch

from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.cost.pipeline import PipelineModel
from autopar.profiling import Entry, ProfileDB, ProfileError, UnitEntry, unit_fingerprint
from autopar.profiling.segments import row_fingerprints
from autopar.zoo import load
from tests.test_cli import run_cli

DEVICE = "cpu: test processor, 1 thread(s) per rank"
GPT = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16"]


def _entry(**kw) -> Entry:  # noqa: ANN003
    base = dict(layer="abc", name="layers.0", tp=1, sp=False, recompute="none", zero=0, samples=1, ranks=2,
                dtype="fp32", forward=0.01, backward=0.02, repeats=3)
    return Entry(**{**base, **kw})


def _unit(**kw) -> UnitEntry:  # noqa: ANN003
    base = dict(unit="abc", name="root", dp=2, ranks=2, dtype="fp32", gather=0.004, reduce_scatter=0.006, repeats=3)
    return UnitEntry(**{**base, **kw})


def _model(layers: int, *, batch: int = 1, profile: ProfileDB | None = None, devices: int = 2) -> PipelineModel:
    zoo = load("gpt3-125m", batch=batch, seq=16, dtype=torch.float32, layers=layers, hidden=64, heads=4, vocab=128)
    return PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(devices),
                         traced_batch=batch, dtype="fp32", profile=profile)


def test_a_database_reads_back_what_was_saved(tmp_path) -> None:
    db = ProfileDB(device=DEVICE)
    db.add(_entry())
    db.add(_entry(tp=2, sp=True, recompute="full", samples=2))
    db.add(_entry(forward=0.5))  # the same key measured again: replaced
    path = tmp_path / "db.json"
    db.save(path)
    again = ProfileDB.load(path, device=DEVICE)
    assert again.device == DEVICE and len(again.entries) == 2
    assert again.get("abc", tp=1, sp=False, recompute="none", samples=1, ranks=2, dtype="fp32").forward == 0.5
    assert again.get("abc", tp=1, sp=False, recompute="none", samples=1, ranks=4, dtype="fp32") is None
    # a ZeRO 1 entry keeps its step's edges; others are written without them, as files before them were
    db.add(_entry(zero=1, step_forward=0.03, step_backward=0.04))
    db.save(path)
    assert '"step_forward": 0.03' in path.read_text() and path.read_text().count("step_forward") == 1
    edges = ProfileDB.load(path).get("abc", tp=1, sp=False, recompute="none", samples=1, ranks=2, dtype="fp32",
                                     zero=1)
    assert (edges.step_forward, edges.step_backward) == (0.03, 0.04)
    # FSDP units measured apart (a model's root unit), keyed by their parameters' shapes in any order
    assert "units" not in json.loads(path.read_text())
    key = unit_fingerprint([(8, 4), (4,)])
    assert key == unit_fingerprint([(4,), (8, 4)]) != unit_fingerprint([(8, 4), (8,)])
    db.add_unit(_unit(unit=key))
    db.save(path)
    unit = ProfileDB.load(path).unit(key, dp=2, ranks=2, dtype="fp32")
    assert (unit.gather, unit.reduce_scatter) == (0.004, 0.006)
    assert ProfileDB.load(path).unit(key, dp=2, ranks=4, dtype="fp32") is None


@pytest.mark.parametrize("mutate, message", [
    (lambda text: text[: len(text) // 2], "not JSON"),
    (lambda text: "[]", "no autopar_profile field"),
    (lambda text: text.replace('"autopar_profile": 1', '"autopar_profile": 99'), "version 99"),
    (lambda text: text.replace(torch.__version__, "1.0.0"), "torch 1.0.0"),
    (lambda text: text.replace('"forward": 0.01', '"forward": -1'), "entries[0].forward"),
    (lambda text: text.replace('"forward": 0.01', '"forward": NaN'), "entries[0].forward"),
    (lambda text: text.replace('"repeats": 3', '"repeats": 3, "extra": 1'), "unknown extra"),
    (lambda text: text.replace('"tp": 1,', ''), "missing tp"),
    (lambda text: text.replace('"recompute": "none"', '"recompute": "half"'), "entries[0].recompute"),
    # a step's edges are measured under ZeRO 1 only, and are times
    (lambda text: text.replace('"repeats": 3', '"repeats": 3, "step_forward": 0.1, "step_backward": 0.2'),
     "belong to ZeRO 1 entries"),
    (lambda text: text.replace('"reduce_scatter": 0.006', '"reduce_scatter": -1'), "units[0].reduce_scatter"),
    (lambda text: text.replace('"dp": 2', '"dp": 1'), "units[0].dp"),
    (lambda text: text.replace('"gather": 0.004,', ''), "units[0]: missing gather"),
    (lambda text: text.replace('"units": [', '"units": {"a": ').replace(']\n}', '}\n}'), "units must be a list"),
    (lambda text: text.replace('"zero": 0', '"zero": 1').replace(
        '"repeats": 3', '"repeats": 3, "step_forward": 0.1, "step_backward": -0.2'), "entries[0].step_backward"),
])
def test_a_corrupt_or_foreign_database_is_refused_naming_the_file(tmp_path, mutate, message) -> None:
    db = ProfileDB(device=DEVICE)
    db.add(_entry())
    db.add_unit(_unit())
    path = tmp_path / "db.json"
    path.write_text(mutate(db.to_json()))
    with pytest.raises(ProfileError, match=re.escape(message)) as info:
        ProfileDB.load(path)
    assert str(path) in str(info.value)


def test_a_database_of_another_device_is_refused(tmp_path) -> None:
    db = ProfileDB(device=DEVICE)
    path = tmp_path / "db.json"
    db.save(path)
    with pytest.raises(ProfileError, match="measured on 'cpu: test processor"):
        ProfileDB.load(path, device="cuda: NVIDIA H100 80GB HBM3")
    with pytest.raises(ProfileError, match="no such profile database"):
        ProfileDB.load(tmp_path / "absent.json")


def test_layers_are_keyed_by_what_they_compute_not_where_they_sit() -> None:
    shallow, deep, wide_batch = _model(2), _model(6), _model(2, batch=3)
    keys = {layer.name: key for layer, key in zip(shallow.layers, row_fingerprints(shallow))}
    deep_keys = {layer.name: key for layer, key in zip(deep.layers, row_fingerprints(deep))}
    batch_keys = {layer.name: key for layer, key in zip(wide_batch.layers, row_fingerprints(wide_batch))}
    assert keys["layers.0"] == keys["layers.1"] == deep_keys["layers.5"] == batch_keys["layers.1"]
    assert keys["layers.0"] != keys["head"] and keys[""] is None
    other = load("gpt3-125m", batch=1, seq=32, dtype=torch.float32, layers=2, hidden=64, heads=4, vocab=128)
    longer = PipelineModel(trace(other.module, example_kwargs=other.inputs), load_cluster("cpu").with_devices(2),
                           traced_batch=1, dtype="fp32")
    assert row_fingerprints(longer)[[layer.name for layer in longer.layers].index("layers.0")] != keys["layers.0"]


def test_the_cost_model_prices_measured_layers_by_their_times() -> None:
    from autopar.cost import ParallelConfig
    from autopar.cost.megatron import pipeline_config

    plain = _model(2)
    key = dict(zip((layer.name for layer in plain.layers), row_fingerprints(plain)))["layers.0"]
    db = ProfileDB(device=DEVICE)
    db.add(_entry(layer=key, forward=0.25, backward=0.5, ranks=2))
    profiled = _model(2, profile=db)
    config = pipeline_config(profiled, ParallelConfig(tp=1, pp=1, dp=2, mbs=1, recompute="none", zero=0, sp=False,
                                                      schedule="1f1b", chunks=1))
    row = [layer.name for layer in profiled.layers].index("layers.1")
    mesh = profiled._mesh(1, 2, 1)
    price = profiled.price(row, tp=1, samples=1, recompute="none", sp=False, mesh=mesh)
    assert (price.forward, price.backward, price.measured) == (0.25, 0.5, True)
    assert not profiled.price(row, tp=1, samples=2, recompute="none", sp=False, mesh=mesh).measured  # not profiled
    # the two measured layers hold most of the time; the rest is the roofline's, the same as without a database
    share = profiled.measured_share(config, global_batch=4)
    assert 0.9 < share < 1
    assert plain.measured_share(config, global_batch=4) == 0
    slower = profiled.estimate(config, global_batch=4).estimate.iteration_seconds
    assert slower > 2 * 0.75 * 2  # two micro-batches per rank, two layers of 0.75 s each
    assert plain.estimate(config, global_batch=4).estimate.iteration_seconds < 0.1
    # ZeRO 3: the layers' times as FSDP units hold their gathers and reduce-scatters, which cost nothing apart;
    # their calls are still counted (what `run --check-comm` compares)
    zero3 = pipeline_config(profiled, ParallelConfig(tp=1, pp=1, dp=2, mbs=1, recompute="none", zero=3, sp=False,
                                                     schedule="1f1b", chunks=1))
    before = profiled.estimate(zero3, global_batch=4, simulate=False).estimate
    db.add(_entry(layer=key, zero=3, forward=0.5, backward=1.0, ranks=2))
    after = _model(2, profile=db).estimate(zero3, global_batch=4, simulate=False).estimate
    assert after.collectives == before.collectives
    gathers = before.iteration_seconds - 2 * 2 * 0.75  # what the units' collectives and the rest cost
    assert after.iteration_seconds == pytest.approx(2 * 2 * 1.5 + gathers, rel=0.2)
    assert after.iteration_seconds < 2 * 2 * 1.5 + gathers  # the units' collectives are not priced again
    # ZeRO 1: the layers measured between a step's edges leave the once-a-step gathers and reduce-scatters to the
    # links; measured at the edges too, each layer carries its extra, spread over the micro-batches, and its
    # unit's collectives cost nothing apart (still counted)
    zero1 = pipeline_config(profiled, ParallelConfig(tp=1, pp=1, dp=2, mbs=1, recompute="none", zero=1, sp=False,
                                                     schedule="1f1b", chunks=1))
    db.add(_entry(layer=key, zero=1, forward=0.25, backward=0.5, ranks=2))
    between = _model(2, profile=db).estimate(zero1, global_batch=4, simulate=False).estimate
    db.add(_entry(layer=key, zero=1, forward=0.25, backward=0.5, ranks=2, step_forward=0.35, step_backward=0.75))
    edges = _model(2, profile=db)
    view = edges.stage_view(zero1, 0, global_batch=4)
    assert view.steps_measured
    price = view.price(row, "none")
    assert (price.forward, price.backward) == pytest.approx((0.25 + 0.1 / 2, 0.5 + 0.25 / 2))
    at_edges = edges.estimate(zero1, global_batch=4, simulate=False).estimate
    assert at_edges.collectives == between.collectives
    links = between.iteration_seconds - 2 * 2 * 0.75  # the units' collectives priced by the links, and the rest
    assert at_edges.iteration_seconds - 2 * (0.1 + 0.25) == pytest.approx(2 * 2 * 0.75 + links, rel=0.2)
    assert at_edges.iteration_seconds < 2 * 2 * 0.75 + 2 * (0.1 + 0.25) + links  # not priced twice
    # the root unit (embedding, final norm, head) measured apart: its gathers and reduce-scatters are its times
    shapes = [info.tensor.shape for row, layer in enumerate(edges.layers) if not layer.repeated
              for info in edges._row_params[row]]
    assert edges.root_units_measured(zero1) == 0
    db.add_unit(_unit(unit=unit_fingerprint(shapes), gather=0.5, reduce_scatter=1.0))
    rooted = _model(2, profile=db)
    assert rooted.root_units_measured(zero1) == 1
    assert rooted.root_units_measured(config) == 0  # ZeRO 0: DDP's buckets, no units
    with_root = rooted.estimate(zero1, global_batch=4, simulate=False).estimate
    assert with_root.collectives == at_edges.collectives
    assert with_root.iteration_seconds == pytest.approx(at_edges.iteration_seconds + 1.5, abs=0.05)
    zero3_root = rooted.estimate(zero3, global_batch=4, simulate=False).estimate
    assert zero3_root.iteration_seconds > after.iteration_seconds + 2 * 1.5 - 0.05  # gathered and reduced each of 2
    # one layer without its edges: none of the stage's are used (all or none)
    db.add(_entry(layer=key, zero=1, forward=0.25, backward=0.5, ranks=2))
    assert not _model(2, profile=db).stage_view(zero1, 0, global_batch=4).steps_measured
    # measured on 4 ranks sharing the host: no figure for a 2-rank plan
    db4 = ProfileDB(device=DEVICE)
    db4.add(_entry(layer=key, ranks=4))
    assert _model(2, profile=db4).measured_share(config, global_batch=4) == 0


def test_pipeline_stages_on_shared_cores_run_faster_while_others_wait() -> None:
    """4 CPU ranks on a host of 2 cores, priced by times measured with all 4 busy (`autopar calibrate` records
    the cores): where one pipeline stage of pp 2 x dp 2 works while the other waits (fill, drain, 1F1B's waits),
    its 2 ranks have the cores to themselves. The pace comes from the profile database where it timed layers
    with 2 ranks on the host and with 4; else the cores are shared out evenly. A plan whose ranks all work at
    once (dp 4) and a GPU cluster are priced as before."""
    import dataclasses

    from autopar.cost import ParallelConfig
    from autopar.cost.megatron import pipeline_config

    def model(cores: int | None, profile: ProfileDB | None = None, preset: str = "cpu") -> PipelineModel:
        zoo = load("gpt3-125m", batch=1, seq=16, dtype=torch.float32, layers=4, hidden=64, heads=4, vocab=128)
        cluster = load_cluster(preset).with_devices(4)
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, host_cores=cores))
        return PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), cluster, traced_batch=1, dtype="fp32",
                             profile=profile)

    def seconds(m: PipelineModel, **layout) -> float:  # noqa: ANN003
        config = pipeline_config(m, ParallelConfig(mbs=1, recompute="none", zero=0, sp=False, schedule="1f1b",
                                                   chunks=1, **layout))
        return m.estimate(config, global_batch=8).estimate.iteration_seconds

    pipeline = dict(tp=1, pp=2, dp=2)
    alone, shared = seconds(model(None), **pipeline), seconds(model(2), **pipeline)
    assert shared < 0.95 * alone
    assert seconds(model(4), **pipeline) == alone  # as many cores as ranks: nothing to share out
    assert seconds(model(2), tp=1, pp=1, dp=4) == seconds(model(None), tp=1, pp=1, dp=4)
    gpu = "a100-80g-sxm"
    assert seconds(model(2, preset=gpu), **pipeline) == seconds(model(None, preset=gpu), **pipeline)
    key = dict(zip((layer.name for layer in model(None).layers), row_fingerprints(model(None))))["layers.0"]
    db = ProfileDB(device=DEVICE)
    db.add(_entry(layer=key, ranks=4, forward=0.02, backward=0.04))
    measured_alone = seconds(model(None, db), **pipeline)
    assert seconds(model(2, db), **pipeline) < measured_alone  # no 2-rank time: shared out evenly
    db.add(_entry(layer=key, ranks=2, forward=0.02, backward=0.04))  # measured: no faster with 2 ranks busy
    assert db.pace(2, 4, dtype="fp32") == 1.0
    assert seconds(model(2, db), **pipeline) == pytest.approx(measured_alone)
    db.add(_entry(layer=key, ranks=2, forward=0.015, backward=0.03))
    assert db.pace(2, 4, dtype="fp32") == pytest.approx(0.75) and db.pace(1, 4, dtype="fp32") is None
    assert seconds(model(2, db), **pipeline) < measured_alone


def test_each_layer_keeps_its_median_round() -> None:
    """A layer profiled in three rounds keeps the middle one: a slow spell or a lucky draw in one round does not
    count. After two rounds (so far, or with --rounds 2) the faster stands."""
    from autopar.cli.profile_segments import _median

    rounds: dict = {}
    slow, fast, middle = (_entry(forward=f, backward=2 * f) for f in (0.05, 0.01, 0.02))
    assert _median(rounds, ("layer", "k"), slow, 0.15) is slow
    assert _median(rounds, ("layer", "k"), fast, 0.03) is fast
    assert _median(rounds, ("layer", "k"), middle, 0.06) is middle
    assert _median(rounds, ("unit", "k"), _unit(), 0.01).name == "root"  # units apart from layers


def test_estimate_refuses_a_database_of_another_kind_of_device(capsys, tmp_path) -> None:
    path = tmp_path / "db.json"
    ProfileDB(device=DEVICE).save(path)
    code, _, err = run_cli(capsys, "estimate", *GPT, "--gpus", "2", "--profile-db", str(path))
    assert code == 2 and str(path) in err and "a100" in err and "Traceback" not in err
    path.write_text('{"autopar_profile": 1, "device": ')
    code, _, err = run_cli(capsys, "plan", *GPT, "--gpus", "2", "--cluster", "cpu", "--profile-db", str(path))
    assert code == 2 and str(path) in err and "not JSON" in err and len(err.strip().splitlines()) == 1
    # the runtime trains in fp32: a layer timed in another dtype would be of no run
    code, _, err = run_cli(capsys, "profile-segments", *GPT, "--nproc", "2", "--db", str(tmp_path / "new.json"),
                           "--dtype", "bf16")
    assert code == 2 and "--dtype bf16" in err and not (tmp_path / "new.json").exists()


@pytest.mark.slow
def test_profile_segments_measures_each_distinct_layer_once(capsys, tmp_path) -> None:
    db = tmp_path / "db.json"
    argv = ["profile-segments", *GPT, "--nproc", "2", "--tp", "1", "2", "--samples", "1", "--recompute", "none",
            "--no-sp", "--zero", "0", "1", "3", "--repeats", "2", "--rounds", "2", "--db", str(db), "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    data = json.loads(out)
    names = sorted({e["name"] for e in data["entries"]})
    assert names == ["drop", "embed", "head", "layers.0", "norm"]  # layers.1 is a copy of layers.0
    plain = [e for e in data["entries"] if e["zero"] == 0]
    assert sorted((e["tp"], e["name"]) for e in plain) == [(tp, n) for tp in (1, 2) for n in names]
    # under ZeRO 1 and 3 (tp 1, dp 2) only the repeated layer runs alone: the rest belong to the root unit
    for zero in (1, 3):
        assert [(e["tp"], e["name"]) for e in data["entries"] if e["zero"] == zero] == [(1, "layers.0")]
    assert all(e["forward_ms"] > 0 and e["backward_ms"] > 0 for e in data["entries"] if e["name"] != "drop")
    # ZeRO 1 also times the step's first forward (weights gathered) and last backward (gradients reduce-scattered)
    assert all((e["step_forward_ms"] is not None) == (e["zero"] == 1) for e in data["entries"])
    assert all(e["step_forward_ms"] > 0 and e["step_backward_ms"] > 0 for e in data["entries"] if e["zero"] == 1)
    # and the root unit (embedding, norm, head) apart, once: its gathers and reduce-scatters are no layer's
    assert [(u["name"], u["dp"]) for u in data["units"]] == [("root", 2)]
    assert data["units"][0]["gather_ms"] > 0 and data["units"][0]["reduce_scatter_ms"] > 0
    saved = ProfileDB.load(db)
    assert len(saved.entries) == 12 and len(saved.units) == 1
    code, out, err = run_cli(capsys, *argv)  # measured again: replaced, not added
    assert code == 0, err
    assert len(ProfileDB.load(db).entries) == 12
    code, out, err = run_cli(capsys, "estimate", *GPT, "--tp", "2", "--gpus", "2", "--batch", "2", "--dtype", "fp32",
                             "--cluster", "cpu", "--profile-db", str(db), "--json")
    assert code == 0, err
    assert json.loads(out)["profile"]["measured_share"] > 0.9
    code, out, err = run_cli(capsys, "estimate", *GPT, "--dp", "2", "--zero", "3", "--gpus", "2", "--batch", "2",
                             "--dtype", "fp32", "--cluster", "cpu", "--profile-db", str(db), "--json")
    assert code == 0, err
    assert json.loads(out)["profile"]["root_units_measured"] == 1


@pytest.mark.parametrize("model, layers, shallow", [
    (["gpt3-125m", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16"], 8, 3),
    (["hf:llama", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "128", "--seq",
      "16"], 6, 3),
    (["gpt3-125m", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16"], 3, None),  # no deeper
])
def test_a_deep_model_is_profiled_on_a_shallow_copy_with_the_same_kinds_of_layer(model, layers, shallow) -> None:
    from autopar.cli.common import load_and_trace
    from autopar.cli.main import build_parser
    from autopar.cli.profile_segments import _shallower

    args = build_parser().parse_args(["profile-segments", *model, "--layers", str(layers), "--nproc", "2",
                                      "--db", "unused.json", "--dtype", "fp32"])
    traced = load_and_trace(args, batch=1)
    cluster = load_cluster("cpu").with_devices(2)
    keys = row_fingerprints(PipelineModel(traced.graph, cluster, traced_batch=1, dtype="fp32"))
    found = _shallower(args, traced.zoo, keys, cluster)
    if shallow is None:
        assert found is None
        return
    zoo, _, shallow_keys = found
    assert zoo.config.layers == shallow and set(shallow_keys) == set(keys)
    # a kind of layer found only deeper: no copy stands for the model
    assert _shallower(args, traced.zoo, [*keys, "a kind only layer 7 has"], cluster) is None


def test_a_row_whose_module_holds_other_rows_is_not_timed_alone() -> None:
    # a Hugging Face causal LM's inner ``model`` row is its own glue (masks, positions); running the module would
    # run every layer in it
    zoo = load("hf:qwen2", batch=1, seq=16, dtype=torch.float32, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128,
               vocab=128)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(2),
                          traced_batch=1, dtype="fp32")
    keys = dict(zip((layer.name for layer in model.layers), row_fingerprints(model)))
    assert "model" in keys and keys["model"] is None
    assert keys["model.layers.0"] is not None and keys["model.layers.0"] == keys["model.layers.1"]
