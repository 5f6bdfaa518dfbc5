"""The op database (`autopar profile-ops`): ops keyed by what they compute, kept and refused like the rest of the
profile database, and read by the cost model where it has them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from autopar.capture import trace
from autopar.cli.profile_ops import points_of
from autopar.cluster import load_cluster
from autopar.cost.pipeline import PipelineModel
from autopar.profiling import OpEntry, ProfileDB, ProfileError
from autopar.profiling.db import DispatchEntry
from autopar.profiling.ops import OpTimes, distinct_ops, measure, op_key, shapes_at
from autopar.zoo import load
from tests.test_cli import run_cli

DEVICE = "cpu: test processor, 1 thread(s) per rank"
GPT = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "16"]


def _graph(batch: int = 1, layers: int = 2):  # noqa: ANN202
    zoo = load("gpt3-125m", batch=batch, seq=16, dtype=torch.float32, layers=layers, hidden=64, heads=4, vocab=128)
    return trace(zoo.module, example_kwargs=zoo.inputs)


def _op(**kw) -> OpEntry:  # noqa: ANN003
    base = dict(op="aten.addmm.default", inputs=((64,), (16, 64), (64, 64)), dtype="fp32", ranks=2,
                name="layers.0.attn.proj", points=((0.5, 1e-5, 2e-5), (1.0, 2e-5, 4e-5)), repeats=3)
    return OpEntry(**{**base, **kw})


def test_ops_are_keyed_per_sample_whatever_the_batch_traced_and_wherever_they_sit() -> None:
    one, four = _graph(1), _graph(4)
    keys_one = {op_key(n, 1) for n in one.nodes} - {None}
    keys_four = {op_key(n, 4) for n in four.nodes} - {None}
    assert keys_one == keys_four
    jobs = distinct_ops(one.nodes)
    assert len({j.key for j in jobs}) == len(jobs)
    # the two layers' projections are one op; a deeper copy of the model has no other kinds of op
    assert sum(j.key[0] == "aten.addmm.default" for j in jobs) == 4  # qkv, proj, fc1, fc2
    assert {j.key for j in distinct_ops(_graph(1, layers=6).nodes)} == {j.key for j in jobs}


def test_an_op_is_measured_at_the_samples_and_splits_the_search_prices() -> None:
    qkv = next(n for n in _graph().nodes if n.module.endswith("attn.qkv") and n.op == "aten.addmm.default")
    assert shapes_at(qkv, 1, 1) == ((192,), (16, 64), (64, 192))
    assert shapes_at(qkv, 2, 1) == ((192,), (32, 64), (64, 192))  # the activation deepens, the weight does not
    assert shapes_at(qkv, 1, 2) == ((96,), (16, 64), (64, 96))  # split by output features, as Megatron's column
    assert shapes_at(qkv, 1, 5) is None
    # one size per amount of work, unsplit where samples alone give it
    assert points_of([1, 2, 4], [1, 2]) == [(1, 2), (1, 1), (2, 1), (4, 1)]
    assert points_of([1], [3]) == [(1, 3), (1, 1)]  # unsplit ops are always timed
    # the cost model reads an op at the work its strategy gives it: between two measured, log-log interpolated;
    # outside them, nothing (the roofline prices it)
    curve = OpTimes({op_key(qkv, 1): [(0.5, 1.0, 2.0), (1.0, 4.0, 8.0)]})
    assert curve.seconds(qkv, traced_batch=1, shard=2) == (1.0, 2.0)
    assert curve.seconds(qkv, traced_batch=1, shard=1 / 0.75) == pytest.approx((4 ** math.log2(1.5),
                                                                                2 * 4 ** math.log2(1.5)))
    assert curve.seconds(qkv, traced_batch=1, shard=4) is None and curve.seconds(qkv, traced_batch=1, shard=0.5) is None
    times, skipped = measure([j for j in distinct_ops([qkv])], [(1, 2), (1, 1)], repeats=2)
    assert [t[2] for t in times] == [0.5, 1.0] and all(t[3] > 0 and t[4] > 0 for t in times) and not skipped


def test_a_database_keeps_op_times_and_refuses_a_corrupt_entry(tmp_path) -> None:
    db = ProfileDB(device=DEVICE)
    db.add_op(_op())
    db.add_op(_op(points=((1.0, 3e-5, 6e-5), (2.0, 5e-5, 9e-5))))  # work 1 measured again: replaced, 0.5 kept
    path = tmp_path / "db.json"
    db.save(path)
    again = ProfileDB.load(path, device=DEVICE)
    (entry,) = again.ops.values()
    assert entry.points == ((0.5, 1e-5, 2e-5), (1.0, 3e-5, 6e-5), (2.0, 5e-5, 9e-5))
    assert again.op_times(ranks=2, dtype="fp32") and not again.op_times(ranks=4, dtype="fp32")
    assert not again.op_times(ranks=2, dtype="bf16")
    # DTensor's dispatch per op, as intra-op plans pay it
    db.dispatch[(2, "fp32")] = DispatchEntry(ranks=2, dtype="fp32", forward=5e-5, backward=8e-5, repeats=3)
    db.save(path)
    assert ProfileDB.load(path).op_times(ranks=2, dtype="fp32").dispatch == (5e-5, 8e-5)
    assert ProfileDB.load(path).op_times(ranks=4, dtype="fp32").dispatch is None
    text = path.read_text()
    for mutate, message in [
        (text.replace('"backward": 8e-05', '"backward": -1'), "dispatch[0].backward"),
        (json.dumps({**json.loads(text), "dispatch": {"a": 1}}), "dispatch must be a list"),
        (text.replace('"ops": [', '"ops": {"a": ').replace(']\n}', '}\n}'), "ops must be a list"),
        (text.replace("5e-05", "-5e-05"), "ops[0].points"),
        (text.replace('"op": "aten.addmm.default"', '"op": "addmm"'), "ops[0].op"),
        (text.replace('"repeats": 3', '"repeats": 3, "extra": 1'), "ops[0]: unknown extra"),
        (text[: len(text) - 20], "not JSON"),
    ]:
        path.write_text(mutate)
        with pytest.raises(ProfileError, match=re.escape(message)) as info:
            ProfileDB.load(path)
        assert str(path) in str(info.value)


def test_the_cost_model_prices_measured_ops_by_their_times() -> None:
    graph = _graph()
    jobs = distinct_ops(graph.nodes)
    db = ProfileDB(device=DEVICE)
    slow = 0.01  # far slower than the roofline says: the estimate must move by what was measured
    for job in jobs:
        if job.key[0] == "aten.addmm.default":
            db.add_op(OpEntry(op=job.key[0], inputs=tuple(tuple(s) for s in json.loads(job.key[1])), dtype="fp32",
                              ranks=2, name=job.name, points=((0.5, slow, 2 * slow), (1.0, slow, 2 * slow)),
                              repeats=1))
    cluster = load_cluster("cpu").with_devices(2)
    plain = PipelineModel(graph, cluster, traced_batch=1, dtype="fp32")
    priced = PipelineModel(graph, cluster, traced_batch=1, dtype="fp32", profile=db)
    layer = next(i for i, row in enumerate(plain.layers) if row.repeated)

    def price(model: PipelineModel, tp: int, samples: float):  # noqa: ANN202
        return model.price(layer, tp=tp, samples=samples, recompute="none", sp=False, mesh=model._mesh(tp, 2 // tp, 1))

    before, after = price(plain, 1, 1), price(priced, 1, 1)
    assert after.forward == pytest.approx(4 * slow + before.forward - _roofline(plain, layer, "forward"), rel=1e-6)
    assert after.measured_ops == pytest.approx(4 * 3 * slow) and not after.measured
    # outside the amounts of work measured, the roofline prices the op
    assert price(priced, 1, 2).forward == pytest.approx(price(plain, 1, 2).forward)
    assert price(priced, 2, 1).measured_ops == pytest.approx(4 * 3 * slow)  # split two ways: work 0.5, measured
    # between two amounts of work measured, the times are interpolated (log-log)
    assert priced.op_times.seconds(next(n for n in plain.layers[layer].nodes if n.op == "aten.addmm.default"),
                                   traced_batch=1, shard=1 / 0.75) == pytest.approx((slow, 2 * slow))


def _roofline(model: PipelineModel, row: int, which: str) -> float:
    """The roofline's seconds of the row's four linear layers."""
    from autopar.cost.compute import node_seconds

    return sum(node_seconds(n, model.cluster.device, backward=which == "backward")
               for n in model.layers[row].nodes if n.op == "aten.addmm.default")


def test_profile_ops_times_each_distinct_op_and_estimate_reads_them(capsys, tmp_path) -> None:
    db = tmp_path / "db.json"
    argv = ["profile-ops", *GPT, "--nproc", "2", "--samples", "1", "2", "--tp", "1", "2", "--repeats", "2",
            "--db", str(db), "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    data = json.loads(out)
    assert data["timed_ops"] >= data["distinct_ops"] - len(data["skipped"]) > 10
    assert data["dispatch"]["forward_ms"] >= 0 and ProfileDB.load(db).dispatch[(2, "fp32")].repeats == 2
    assert [(s["samples"], s["tp"]) for s in data["sizes"]] == [(1, 2), (1, 1), (2, 1)]
    saved = ProfileDB.load(db)
    assert len(saved.ops) == data["timed_ops"] and all(e.ranks == 2 for e in saved.ops.values())
    code, out, err = run_cli(capsys, *argv)  # measured again: replaced, not added
    assert code == 0, err
    assert len(ProfileDB.load(db).ops) == data["timed_ops"]
    # every collective kind on the group of both ranks, at the model's sizes, ascending
    assert sorted(c["kind"] for c in data["collectives"]) == ["all_gather", "all_reduce", "all_to_all",
                                                              "reduce_scatter"]
    assert all(c["group"] == 2 and len(c["points"]) >= 2 and all(p["ms"] > 0 for p in c["points"])
               for c in data["collectives"])
    assert all(a["bytes"] < b["bytes"] for c in data["collectives"] for a, b in zip(c["points"], c["points"][1:]))
    estimate = ["estimate", *GPT, "--gpus", "2", "--batch", "4", "--dtype", "fp32", "--cluster", "cpu", "--json"]
    code, out, err = run_cli(capsys, *estimate, "--profile-db", str(db))
    assert code == 0, err
    profile = json.loads(out)["profile"]
    assert profile["measured_share"] > 0.5
    assert profile["collectives"] == ["all_gather/2", "all_reduce/2", "all_to_all/2", "reduce_scatter/2"]
    code, out, err = run_cli(capsys, *argv[:-1], "--dtype", "bf16")
    assert code == 2 and "--dtype bf16" in err and "Traceback" not in err


def test_the_intra_op_planner_prices_measured_ops(capsys, tmp_path) -> None:
    db = tmp_path / "db.json"
    code, out, err = run_cli(capsys, "profile-ops", *GPT, "--nproc", "2", "--samples", "1", "2", "4", "8", "--tp", "1",
                             "--repeats", "1", "--db", str(db), "--json")
    assert code == 0, err
    plan = ["plan", *GPT, "--gpus", "2", "--batch", "8", "--dtype", "fp32", "--cluster", "cpu", "--search", "ilp",
            "--json"]
    code, out, err = run_cli(capsys, *plan)
    assert code == 0, err
    roofline = json.loads(out)
    code, out, err = run_cli(capsys, *plan, "--profile-db", str(db))
    assert code == 0, err
    measured = json.loads(out)
    assert "profile" not in roofline or roofline["profile"] is None
    assert measured["profile"]["db"] == str(db) and 0.3 < measured["profile"]["measured_share"] <= 1
    assert measured["estimate"]["iteration_seconds"] != roofline["estimate"]["iteration_seconds"]


def test_intra_op_plans_pay_dtensor_dispatch_on_every_op() -> None:
    from autopar.cluster import build_mesh
    from autopar.search.intra import baseline_choice, build_space, plan_of_choice

    graph = _graph(batch=4)
    cluster = load_cluster("cpu").with_devices(2)
    mesh = build_mesh(cluster, {"x0": 2})
    plain = build_space(graph, mesh, cluster)
    dispatched = build_space(graph, mesh, cluster, ops=OpTimes({}, dispatch=(1e-3, 2e-3)), traced_batch=4)
    choice = baseline_choice(plain, "dp")
    before = plan_of_choice(plain, choice, global_batch=4, dtype="fp32").estimate
    after = plan_of_choice(dispatched, choice, global_batch=4, dtype="fp32").estimate
    ops = len(graph.nodes)
    computed = sum(1 for n in graph.nodes if not n.is_view)
    assert after.compute_seconds - before.compute_seconds == pytest.approx(1e-3 * ops + 2e-3 * computed, rel=1e-6)


def test_ops_taking_a_list_of_tensors_replay_and_a_gpu_runs_the_attention_core_a_cpu_trace_recorded() -> None:
    """``cat`` recorded its tensors as a list: it is replayed with a list (it was skipped before). A model traced on
    a CPU records SDPA's CPU kernel, which no GPU has: on a GPU the op is timed as `_attention`, which computes what
    the CPU kernel does, grouped-query attention included."""
    from autopar.profiling.ops import _attention

    zoo = load("llama-7b", batch=1, seq=16, dtype=torch.float32, layers=1, hidden=64, heads=4, kv_heads=2, ffn=128,
               vocab=128)
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    jobs = [j for j in distinct_ops(graph.nodes) if j.key[0] == "aten.cat.default"]
    assert jobs
    times, skipped = measure(jobs, [(1, 1), (2, 1)], repeats=2)
    assert not skipped and len(times) == 2 * len(jobs)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    for causal in (False, True):
        expected = cpu(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), 0.0, causal)[0]
        torch.testing.assert_close(_attention(q, k, v, 0.0, causal), expected)


def test_collectives_measured_by_kind_price_that_kind_on_groups_of_their_size(tmp_path) -> None:
    """A profile database's collective tables become the cluster's link tables (`ProfileDB.links`): a collective
    of that kind on a group of that size is read from its table (log-log between sizes, the smallest's time below
    them, scaled by size above), every other one priced as before. The tables survive the database's and the
    cluster file's round trips; a malformed entry is refused naming the file."""
    from autopar.cluster import Collective, flat_seconds
    from autopar.cluster.spec import cluster_from_dict, cluster_to_dict
    from autopar.profiling.db import CollectiveEntry

    db = ProfileDB(device=DEVICE)
    db.add_collective(CollectiveEntry("all_gather", 2, 2, ((4096, 1e-4), (1 << 20, 4e-3)), 3))
    db.add_collective(CollectiveEntry("all_gather", 2, 2, ((1 << 20, 2e-3), (1 << 22, 9e-3)), 3))  # replaced
    db.add_collective(CollectiveEntry("reduce_scatter", 2, 4, ((4096, 1e-4), (1 << 20, 5e-3)), 3))  # 4 on the host
    path = tmp_path / "db.json"
    db.save(path)
    again = ProfileDB.load(path)
    assert again.collectives[("all_gather", 2, 2)].points == ((4096, 1e-4), (1 << 20, 2e-3), (1 << 22, 9e-3))
    cluster = load_cluster("cpu").with_devices(2)
    priced = again.links(cluster)
    link = priced.intra
    assert [(t.kind, t.ranks) for t in link.tables] == [("all_gather", 2)]  # measured with 2 ranks on the host
    assert flat_seconds(Collective.ALL_GATHER, 1 << 20, 2, link) == pytest.approx(2e-3)
    assert flat_seconds(Collective.ALL_GATHER, 1 << 21, 2, link) == pytest.approx(math.sqrt(2e-3 * 9e-3))
    assert flat_seconds(Collective.ALL_GATHER, 1024, 2, link) == pytest.approx(1e-4)
    assert flat_seconds(Collective.ALL_GATHER, 1 << 23, 2, link) == pytest.approx(18e-3)
    for kind, n in ((Collective.REDUCE_SCATTER, 2), (Collective.ALL_GATHER, 4)):  # no table: priced as before
        assert flat_seconds(kind, 1 << 20, n, link) == flat_seconds(kind, 1 << 20, n, cluster.intra)
    assert cluster_from_dict(cluster_to_dict(priced)) == priced
    data = json.loads(path.read_text())
    data["collectives"][0]["points"][1][1] = -1.0
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=f"{re.escape(str(path))}: collectives\\[0\\]: points must be"):
        ProfileDB.load(path)
    data["collectives"][0]["points"] = [[1 << 20, 1e-3], [4096, 1e-4]]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="ascending bytes"):
        ProfileDB.load(path)
    data["collectives"][0].update(points=[[4096, 1e-4]], group=3)
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="group 3 does not divide the 2 ranks"):
        ProfileDB.load(path)


def test_a_burst_times_runs_issued_back_to_back_and_walks_one_graph_again() -> None:
    """On a GPU each op is timed as ``burst`` runs issued back to back (a training step's stream hides the later
    launches behind the earlier kernels); its backward walks one graph that many times, which needs the graph kept
    until the last walk."""
    import contextlib

    from autopar.profiling.ops import time_op

    qkv = next(n for n in _graph().nodes if n.module.endswith("attn.qkv") and n.op == "aten.addmm.default")
    entered = []

    @contextlib.contextmanager
    def counting():  # noqa: ANN202
        entered.append(1)
        yield

    forward, backward = time_op(qkv, shapes_at(qkv, 1, 1), repeats=2, burst=3, inside=counting)
    assert forward > 0 and backward > 0
    # one warm-up, then per sample: the burst's runs and one run whose graph the backward walks
    assert len(entered) == 1 + (2 + 1) * (3 + 1)
    with pytest.raises(ValueError, match="burst"):
        time_op(qkv, shapes_at(qkv, 1, 1), repeats=1, burst=0)
