"""The typed plan: every field checked on construction and when read, errors naming the file and the field, and
`run` and `dryrun` refusing the same plans before any rank starts."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import pytest

from autopar.cli.main import main
from autopar.plan import FieldError, Plan, Stage, Workload, load_plan, save_plan
from autopar.runtime import check_runnable

TINY = ["gpt3-125m", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "32", "--cluster", "cpu"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> dict:
    """A valid plan file's JSON: 4 layers on pp 2 x tp 2, 4 micro-batches of 2 (the runtime runs it)."""
    path = tmp_path_factory.mktemp("plans") / "pp.json"
    assert main(["estimate", *TINY, "--layers", "4", "--pp", "2", "--tp", "2", "--mbs", "2", "--batch", "8",
                 "--out", str(path)]) == 0
    return json.loads(path.read_text())


def _write(tmp_path, data: dict, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _mutated(pipeline: dict, edit) -> dict:  # noqa: ANN001
    data = copy.deepcopy(pipeline)
    edit(data["plan"])
    return data


def _refused(capsys, tmp_path, data: dict, command: str = "dryrun") -> str:
    """The one line ``command`` prints for the plan, after checking it exits 2 with nothing else on stderr."""
    path = _write(tmp_path, data)
    argv = [command, path] + (["--nproc", "4"] if command == "run" else [])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_the_plan_round_trips_through_its_file(pipeline, tmp_path) -> None:
    plan = Plan.from_dict(pipeline["plan"], estimate=pipeline["estimate"])
    assert plan.pp == 2 and plan.grid == (1, 2) and plan.devices == 4 and plan.schedule == "1f1b"
    assert plan.workload == Workload(model="gpt3-125m", overrides=(("heads", 4), ("hidden", 64), ("layers", 4),
                                                                   ("vocab", 128)), seq=32, batch=8, dtype="bf16")
    save_plan(tmp_path / "again.json", plan)
    assert load_plan(tmp_path / "again.json") == plan
    assert json.loads((tmp_path / "again.json").read_text())["plan"]["schema"] == 2
    summed = _mutated(pipeline, lambda p: p["modules"]["layers.0.attn.qkv"].update(summed=["layers.0.attn.qkv.bias"]))
    marked = Plan.from_dict(summed["plan"])
    assert [p.name for e in marked.modules for p in e.params if p.summed] == ["layers.0.attn.qkv.bias"]
    save_plan(tmp_path / "summed.json", marked)
    assert load_plan(tmp_path / "summed.json") == marked
    assert "summed" not in json.dumps(pipeline)  # a model with no norm per head: nothing marked


def test_expert_parallelism_round_trips_and_older_files_read_as_none(pipeline, tmp_path) -> None:
    assert pipeline["plan"]["ep"] == 1
    older = _mutated(pipeline, lambda p: p.pop("ep"))  # written before the field existed
    assert load_plan(_write(tmp_path, older)).ep == 1
    split = _mutated(pipeline, lambda p: (p.update(ep=2, micro_batch_size=2),
                                          [s.update(dp=2, tp=1) for s in p["stages"]],
                                          [e["params"].update({k: "[R, R]" for k in e["params"]})
                                           for e in p["modules"].values()]))
    plan = load_plan(_write(tmp_path, split, "ep.json"))
    assert plan.ep == 2
    save_plan(tmp_path / "again.json", plan)
    assert load_plan(tmp_path / "again.json") == plan
    assert dataclasses.replace(plan, zero=3).ep == 2  # FSDP shards the rest, the experts left to their ranks


def test_the_kernels_setting_round_trips_and_older_files_read_as_eager(pipeline, tmp_path) -> None:
    assert pipeline["plan"]["kernels"] == "eager"
    compiled = Plan.from_dict(_mutated(pipeline, lambda p: p.update(kernels="compiled"))["plan"])
    assert compiled.kernels == "compiled"
    save_plan(tmp_path / "compiled.json", compiled)
    assert load_plan(tmp_path / "compiled.json") == compiled
    assert json.loads((tmp_path / "compiled.json").read_text())["plan"]["kernels"] == "compiled"
    older = _mutated(pipeline, lambda p: p.pop("kernels"))  # written before the field existed
    assert load_plan(_write(tmp_path, older)).kernels == "eager"
    with pytest.raises(FieldError, match="kernels must be one of eager, compiled, got 'jit'"):
        dataclasses.replace(compiled, kernels="jit")


def test_schema_1_files_still_read(pipeline, tmp_path) -> None:
    old = _mutated(pipeline, lambda p: p.update(schema=1))
    del old["plan"]["workload"]
    plan = load_plan(_write(tmp_path, old))
    assert plan.workload is None and len(plan.stages) == 2
    with pytest.raises(ValueError, match="the plan has no workload"):
        check_runnable(plan)


# Each finding: how the plan was broken, and the message that now names it (run and dryrun alike).
FINDINGS = [
    ("overlapping stages", lambda p: p["stages"][1]["layers"].insert(0, "layers.1"),
     "stages[1].layers holds 'layers.1', which stage 0 holds too"),
    ("reversed stages", lambda p: p["stages"].reverse(),
     "stage 0 of the plan holds 'layers.2' where the model's chain has 'embed'"),
    ("a skipped layer", lambda p: p["stages"][1]["layers"].remove("layers.2"),
     "stage 1 of the plan holds 'layers.3' where the model's chain has 'layers.2'"),
    ("micro_batches 0", lambda p: p.update(micro_batches=0), "micro_batches must be an integer from 1 to"),
    ("micro_batches -3", lambda p: p.update(micro_batches=-3), "micro_batches must be an integer from 1 to"),
    ("micro_batches 10**12", lambda p: p.update(micro_batches=10**12),
     "micro_batches must be an integer from 1 to 16,777,216, got 1000000000000"),
    ("micro_batch_size 0", lambda p: p.update(micro_batch_size=0), "micro_batch_size must be an integer from 1"),
    ("micro_batch_size huge", lambda p: p.update(micro_batch_size=2**40), "micro_batch_size must be an integer"),
    ("size x count is not the batch", lambda p: p.update(micro_batches=3),
     "micro_batches x micro_batch_size is 3 x 2 = 6 samples, but workload.batch is 8"),
    ("a batch of 9 over 2 ranks", lambda p: (p.update(micro_batch_size=9, micro_batches=1),
                                             p["workload"].update(batch=9),
                                             [s.update(dp=2, tp=1) for s in p["stages"]]),
     "micro_batch_size 9 does not split over stage 0's dp 2"),
    ("an unknown schedule", lambda p: p.update(schedule="zigzag"),
     "schedule must be one of 1f1b, gpipe, interleaved, got 'zigzag'"),
    ("ZeRO 7", lambda p: p.update(zero=7), "zero must be an integer from 0 to 3, got 7"),
    ("ZeRO -1", lambda p: p.update(zero=-1), "zero must be an integer from 0 to 3, got -1"),
    ("a 2-layer plan on a 4-layer workload", lambda p: p["workload"]["overrides"].update(layers=6),
     "stage 1 of the plan holds 'norm' where the model's chain has 'layers.4'"),
    ("stages that stop short", lambda p: [p["stages"][1]["layers"].remove(n) for n in ("norm", "head")],
     "the plan's stages end at 'layers.3'; the model's chain goes on to 'norm' (2 more)"),
    ("an empty stage", lambda p: p["stages"][0].update(layers=[]), "stages[0].layers must name at least one layer"),
    ("tp 2 with nothing split", lambda p: [e["params"].update({k: "[R, R]" for k in e["params"]})
                                           for e in p["modules"].values()],
     "modules split no parameter over tp, but stage 0 has tp 2"),
    ("seq 0", lambda p: p["workload"].update(seq=0), "workload.seq must be an integer from 1 to 1,048,576, got 0"),
    ("a layout that is an int", lambda p: p["modules"]["embed"]["params"].update({"embed.weight": 3}),
     "modules['embed'].params['embed.weight'] must be a layout like [R, S(0)], got 3"),
    ("a dim no tensor has",
     lambda p: p["modules"]["embed"]["params"].update({"embed.weight": "[S(99999999999999999999), R]"}),
     "placement 'S(99999999999999999999)' is not one of S(<dim>), S(<dim>)/<stride>, R, P (dims 0-63, strides 2 or"),
    ("a module entry that is a string", lambda p: p["modules"].update(embed="S(0)"),
     "modules['embed'] must be an object, got 'S(0)'"),
    ("dp 2.0", lambda p: p["stages"][0].update(dp=2.0), "stages[0].dp must be an integer from 1"),
    ("recompute as a list", lambda p: p["stages"][0].update(recompute=["layers.0"]),
     "stages[0].recompute must be an object, got ['layers.0']"),
    ("overrides as a list", lambda p: p["workload"].update(overrides=[4]),
     "workload.overrides must be an object, got [4]"),
    ("overrides naming device", lambda p: p["workload"]["overrides"].update(device="cuda"),
     "workload.overrides key must be one of layers, hidden, heads, vocab, ffn, kv_heads, experts, got 'device'"),
    ("a layers override of 10**6", lambda p: p["workload"]["overrides"].update(layers=10**6),
     "workload.overrides.layers must be an integer from 1 to 2,048, got 1000000"),
    ("dp -1 x tp -2", lambda p: p["stages"][0].update(dp=-1, tp=-2), "stages[0].dp must be an integer from 1"),
    ("no model", lambda p: p.pop("model"), "model is missing"),
    ("no stages", lambda p: p.update(stages=[]), "stages or blocks: a plan has pipeline stages or intra-op blocks"),
    ("a run of three layers", lambda p: p["stages"][0].update(segments=[["layers.0", "layers.1", "layers.1"]]),
     "stages[0].segments[0] must be [first layer, last layer]"),
    ("a recomputed layer of another stage", lambda p: p["stages"][0].update(recompute={"layers.3": "full"}),
     "stages[0].recompute names 'layers.3', which is not one of the stage's layers"),
    ("a negative prediction", lambda p: p["stages"][0].update(seconds_per_micro_batch=-1.0),
     "stages[0].seconds_per_micro_batch must be a finite number of at least 0, got -1.0"),
    ("a misspelt field", lambda p: p.update(micro_batch=2), "plan has unknown field 'micro_batch'"),
    ("kernels fused", lambda p: p.update(kernels="fused"), "kernels must be one of eager, compiled, got 'fused'"),
    ("kernels true", lambda p: p.update(kernels=True), "kernels must be one of eager, compiled, got True"),
    ("ep 0", lambda p: p.update(ep=0), "ep must be an integer from 1 to 131,072, got 0"),
    ("ep 2.0", lambda p: p.update(ep=2.0), "ep must be an integer from 1 to 131,072, got 2.0"),
    ("ep other than the stages' dp", lambda p: p.update(ep=2),
     "ep 2 splits the experts over each stage's whole data-parallel group, their parameters S(0) on dp: it needs "
     "every stage's dp to be 2"),
    ("heads tp does not divide", lambda p: p["workload"]["overrides"].update(heads=3, hidden=66),
     "has shape"),
    ("summed naming another module's parameter", lambda p: p["modules"]["embed"].update(summed=["head.weight"]),
     "modules['embed'].summed names 'head.weight', which is not one of the module's params"),
    ("reads in a pipeline plan", lambda p: p["modules"]["embed"].update(reads={"embed.weight": "[R, R]"}),
     "modules['embed'].reads applies to intra-op plans only"),
    ("reads as a list", lambda p: p["modules"]["embed"].update(reads=["embed.weight"]),
     "modules['embed'].reads must be an object, got ['embed.weight']"),
    ("summed as a string", lambda p: p["modules"]["embed"].update(summed="embed.weight"),
     "modules['embed'].summed must be a list, got 'embed.weight'"),
    ("a summed weight the model does not apply to split heads",
     lambda p: p["modules"]["embed"].update(summed=["embed.weight"]),
     "has the gradient of parameter 'embed.weight' summed over tp 2, but the model does not apply it"),
]


@pytest.mark.parametrize("edit, message", [f[1:] for f in FINDINGS], ids=[f[0] for f in FINDINGS])
def test_broken_plans_are_refused_by_run_and_dryrun_alike(pipeline, tmp_path, capsys, edit, message) -> None:
    data = _mutated(pipeline, edit)
    start = time.perf_counter()
    said = _refused(capsys, tmp_path, data, "dryrun")
    assert message in said, said
    assert _refused(capsys, tmp_path, data, "run") == said.replace("autopar dryrun:", "autopar run:")
    assert time.perf_counter() - start < 30  # refused before any rank starts


@pytest.mark.parametrize("text, message", [
    ('{"plan": null}', "not a plan file (no 'plan' object)"),
    ('{"plan": {"schema": 2, "micro_batches": NaN}}', "NaN is not a number JSON allows"),
    ("", "not a plan file (invalid JSON at line 1"),
    ('{"plan": {"schema": 99}}', "schema is 99; this autopar reads plan schemas 1, 2"),
    ("[1, 2]", "not a plan file (no 'plan' object)"),
    ("[" * 100_000, "JSON nested too deeply"),
])
def test_files_that_are_no_plans(tmp_path, capsys, text, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert main(["dryrun", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(path) in err and len(err.splitlines()) == 1, err


def test_non_regular_and_non_utf8_files(tmp_path, capsys) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"plan": "\xff\xfe"}')
    for path, message in [(fifo, "plan file must be a regular file, got a named pipe"),
                          ("/dev/zero", "plan file must be a regular file, got a character device"),
                          (tmp_path, "plan file must be a regular file, got a folder"),
                          (binary, "plan file must be UTF-8 text, got byte 0xff at offset 10"),
                          (tmp_path / "missing.json", "no such plan file")]:
        assert main(["run", str(path), "--nproc", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_records_check_themselves_when_built_in_python(pipeline) -> None:
    plan = Plan.from_dict(pipeline["plan"])
    with pytest.raises(FieldError, match="dp must be an integer"):
        dataclasses.replace(plan.stages[0], dp=True)
    with pytest.raises(FieldError, match="recompute names 'layers.9', which is not one of the stage's layers"):
        dataclasses.replace(plan.stages[0], recompute=(("layers.9", "full"),))
    with pytest.raises(FieldError, match=r"recompute\['layers.0'\] must be one of none, selective, full"):
        dataclasses.replace(plan.stages[0], recompute=(("layers.0", "some"),))
    with pytest.raises(FieldError, match="stages must be a tuple of Stage"):
        dataclasses.replace(plan, stages=list(plan.stages))
    with pytest.raises(FieldError, match="intra needs tp 2 or more"):
        Stage(layers=("layers.0",), dp=2, tp=1, intra=True)
    with pytest.raises(FieldError, match="iteration_seconds must be a finite number of at least 0, got nan"):
        dataclasses.replace(plan.estimate or Plan.from_dict(pipeline["plan"], estimate=pipeline["estimate"]).estimate,
                            iteration_seconds=float("nan"))


def test_batch_norm_is_refused_under_data_parallelism(tmp_path, capsys) -> None:
    path = tmp_path / "wrn.json"
    args = ["estimate", "wrn-50-1", "--cluster", "cpu", "--batch", "4", "--tp", "1", "--pp", "1", "--out", str(path)]
    # refused when planned: no plan file is written
    assert main([*args, "--gpus", "2", "--mbs", "2"]) == 2
    assert "is a BatchNorm2d: under data parallelism over 2 ranks" in capsys.readouterr().err
    assert not path.exists()
    # one process, one micro-batch: the statistics are the ones one process computes
    assert main([*args, "--gpus", "1", "--mbs", "4"]) == 0
    capsys.readouterr()
    check_runnable(load_plan(path))
