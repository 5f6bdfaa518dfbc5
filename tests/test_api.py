"""The Python API: planning a model of one's own, plan files, which rows a rank trains, and one's own training loop
on gloo ranks matching one process (examples/train_llama.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cli.run import GRAD_TOLERANCE, LOSS_TOLERANCE
from autopar.plan import Mesh, ModuleLayout, ParamLayout, Plan, Stage, load_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    ex = api_ranks.example()
    return ex.build_model(), ex.global_batch(0)


@pytest.fixture(scope="module")
def planned(llama) -> Plan:
    model, batch = llama
    return autopar.plan(model, batch, cluster="cpu", gpus=2, batch=8, budget_s=10)


def test_a_plan_from_python_leaves_the_model_alone_and_explains_itself(llama, planned) -> None:
    model, batch = llama
    fresh = api_ranks.example().build_model()  # the same seed: what the model held before it was planned
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q), name
    assert planned.kind == "auto" and planned.workload is None and planned.devices == 2
    assert planned.micro_batch_size * planned.micro_batches == 8 and planned.estimate.memory.fits
    text = planned.explain()
    assert text.startswith("LlamaForCausalLM on 2 x cpu, global batch 8 x seq 32\nplan (auto, found by ")
    assert "against the baselines (same cost model)" in text and "note:" not in text


def test_a_plan_saves_and_loads_without_its_report(tmp_path, planned) -> None:
    path = tmp_path / "plan.json"
    planned.save(path)
    loaded = Plan.load(path)
    assert loaded == planned and load_plan(path) == planned and loaded.report is None
    assert loaded.explain().startswith(f"LlamaForCausalLM: auto plan for 2 devices, global batch 8\n"
                                       f"plan (auto): {len(planned.stages)} pipeline stage")
    assert "iteration" in loaded.explain() and "against the baselines" not in loaded.explain()


def test_autopar_run_points_a_python_plan_to_parallelize(planned) -> None:
    from autopar.runtime import check_runnable

    with pytest.raises(ValueError, match=r"made from Python \(autopar.plan\), or written by an older autopar; name "
                                         r"its model with --model .* or run it in your own script with "
                                         r"autopar.parallelize\(model, plan\)"):
        check_runnable(planned)


@pytest.mark.parametrize(("change", "message"), [
    ({"model": "llama"}, "model must be a torch.nn.Module, got str"),
    ({"example_inputs": {"input_ids": torch.tensor(3)}}, r"example_inputs\['input_ids'\] must be a tensor with the "
                                                         "batch along dim 0"),
    ({"example_inputs": {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(3, 4)}},
     r"example_inputs hold batches of different sizes \[2, 3\]"),
    ({"cluster": "no-such-cluster"}, "^cluster: unknown cluster 'no-such-cluster': not a preset"),
    ({"gpus": 0}, "^gpus must be an integer from 1"),
    ({"batch": 2.0}, "^batch must be an integer from 1"),
    ({"search": "ilp"}, "^search must be one of auto, aceso"),
    ({"budget_s": 0}, "^budget_s must be a positive number of seconds"),
    ({"kernels": "fused"}, "^kernels must be one of eager, compiled"),
    ({"optimizer": "lamb"}, "^optimizer must be one of sgd, momentum, adam"),
    ({"batch": 3, "search": "dp"}, "^batch 3 does not divide over the 2 devices: no dp plan exists for it"),
])
def test_planning_errors_name_the_argument(llama, change, message) -> None:
    model, batch = llama
    kwargs = {"model": model, "example_inputs": batch, "cluster": "cpu", "gpus": 2, "batch": 8, "budget_s": 5,
              **change}
    with pytest.raises((ValueError, TypeError), match=message):
        autopar.plan(kwargs.pop("model"), kwargs.pop("example_inputs"), **kwargs)


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(torch.relu(self.bn(self.conv(images))).flatten(1)), labels)


def test_runnable_only_refuses_or_notes_what_the_runtime_cannot_run() -> None:
    """As ``autopar plan --runnable`` does: the runners-up are tried, and when none can run, an error says why; with
    runnable_only=False the plan comes back with the reason in its report."""
    inputs = {"images": torch.randn(4, 3, 8, 8), "labels": torch.randint(0, 10, (4,))}
    why = "module 'bn' is a BatchNorm2d: under data parallelism over 2 ranks"
    with pytest.raises(ValueError, match=f"best fitting plans found can run on _BatchNormNet: {why}"):
        autopar.plan(_BatchNormNet(), inputs, cluster="cpu", gpus=2, batch=8, budget_s=5)
    plan = autopar.plan(_BatchNormNet(), inputs, cluster="cpu", gpus=2, batch=8, budget_s=5, runnable_only=False)
    assert f"note: autopar.parallelize cannot run this plan yet: {why}" in plan.explain()
    alone = autopar.plan(_BatchNormNet(), inputs, cluster="cpu", gpus=1, batch=8, budget_s=5)
    assert alone.explain().startswith("_BatchNormNet on 1 x cpu, global batch 8\n")  # no sequence to speak of


def test_pipelines_of_hugging_face_models_take_any_attention() -> None:
    """Pipeline stages give their layers the masks the model makes for its attention implementation: SDPA's (none,
    causal by itself) and eager attention's alike, checked against the whole model's logits."""
    import transformers

    from autopar.api.search import can_pipeline

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    with torch.device("meta"):
        sdpa = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
        eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="eager"))
    assert can_pipeline(sdpa) and can_pipeline(eager)


def test_pipelines_are_refused_for_a_forward_that_does_more_than_stages_run() -> None:
    transformers = pytest.importorskip("transformers")

    from autopar.api.search import can_pipeline
    from autopar.runtime.pipeline import check_stage_forward

    class _DoubledLogits(transformers.LlamaForCausalLM):
        """A user's causal LM whose forward does a step after the head that pipeline stages do not know."""

        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        doubled = _DoubledLogits(config)
    assert not can_pipeline(doubled)
    with pytest.raises(NotImplementedError, match="_DoubledLogits would train a different model"):
        check_stage_forward(doubled, seq=16)


def _plan(dp: int, tp: int, *, micro: int = 4, batches: int = 2) -> Plan:
    weight = ParamLayout(name="fc.weight", placements=(Replicate(), Shard(0)), shape=(8, 8))
    return Plan(model="m", kind="test", mesh=Mesh(shape=(1, dp * tp), axes=("pp", "dp_tp")),
                micro_batch_size=micro, micro_batches=batches, stages=(Stage(layers=("fc",), dp=dp, tp=tp),),
                modules=(ModuleLayout(fqn="fc", params=(weight,)),))


def test_a_rank_trains_its_data_parallel_share_of_every_micro_batch() -> None:
    batch = {"x": torch.arange(8 * 3).view(8, 3), "y": torch.arange(8)}
    plan = _plan(dp=2, tp=2)  # ranks 0, 1: dp rank 0; ranks 2, 3: dp rank 1 (tp innermost)
    rows = {rank: plan.local_batch(batch, rank).rows.tolist() for rank in range(4)}
    assert rows == {0: [0, 1, 4, 5], 1: [0, 1, 4, 5], 2: [2, 3, 6, 7], 3: [2, 3, 6, 7]}
    local = plan.local_batch(batch, 2)
    assert [mb["y"].tolist() for mb in local.micro_batches] == [[2, 3], [6, 7]]
    assert torch.equal(local.inputs["x"], batch["x"][local.rows])
    assert _plan(dp=1, tp=4).local_batch(batch, 3).rows.tolist() == list(range(8))
    with pytest.raises(ValueError, match=r"^batch\['y'\] has 6 rows; the plan's global batch is 2 micro-batches x "
                                         r"4 = 8 rows$"):
        plan.local_batch({**batch, "y": torch.arange(6)}, 0)
    with pytest.raises(ValueError, match="^rank must be an integer from 0 to 3, got 4$"):
        plan.local_batch(batch, 4)


def test_one_process_steps_average_micro_batch_losses_as_the_whole_batch() -> None:
    """A model not made by parallelize trains the LocalBatch it is given: gradients of the whole batch's mean
    loss, and that loss."""
    from autopar.plan.batch import split_batch
    from autopar.runtime.apply import ParallelModel

    torch.manual_seed(0)
    model, whole = nn.Linear(3, 1), nn.Linear(3, 1)
    whole.load_state_dict(model.state_dict())
    batch = {"input": torch.randn(8, 3), "target": torch.randn(8, 1)}

    class Loss(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: A002
            return nn.functional.mse_loss(self.inner(input), target)

    parallel = ParallelModel(Loss(model), 0, lambda cls, **kw: cls(model.parameters(), **kw))
    loss = parallel.step(split_batch(batch, micro_batch_size=2, micro_batches=4, dp=1, dp_rank=0))
    expected = Loss(whole)(**batch)
    expected.backward()
    torch.testing.assert_close(torch.tensor(loss), expected.detach(), **LOSS_TOLERANCE)
    torch.testing.assert_close(model.weight.grad, whole.weight.grad, **GRAD_TOLERANCE)
    with pytest.raises(ValueError, match="was not made by autopar.parallelize"):
        parallel.step(batch)


def test_the_readme_shows_the_example_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Your model, your loop"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    assert block[: block.index("```\n")] == (ROOT / "examples" / "train_llama.py").read_text()


# ---- gloo ranks -------------------------------------------------------------------------------------------------


def _compare(losses: list[float], weights: dict[str, torch.Tensor], steps: int) -> None:
    """Losses and final weights against the example's loop in one process, within the runtime tests' tolerances
    (`autopar run --check`: losses and gradients)."""
    ref_losses, ref_weights = api_ranks.one_process(steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOLERANCE)
    assert set(weights) == set(ref_weights)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(weights[name], weight, **GRAD_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_the_example_trains_on_two_ranks_as_one_process(tmp_path) -> None:
    """examples/train_llama.py, as the README says to run it: torchrun, 2 gloo ranks, the plan made on rank 0 and
    shared, 3 AdamW steps; losses and final weights equal one process's."""
    out = tmp_path / "result.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "train_llama.py"), "--steps", "3", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LlamaForCausalLM on 2 x cpu, global batch 8 x seq 32" in done.stdout and "step 2: loss" in done.stdout
    result = torch.load(out, weights_only=False)
    assert Plan.from_dict(result["plan"]).devices == 2
    _compare(result["losses"], result["weights"], 3)


def _layout_plan(pp: int, dp: int, tp: int, *, zero: int = 0, schedule: str = "1f1b") -> Plan:
    """A plan of the example's model laid out as asked (even stages), as the planner writes one from Python."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, even_stages
    from autopar.runtime.source import meta_copy
    from autopar.search.pipeline import Found, pipeline_plan

    ex = api_ranks.example()
    meta = meta_copy(ex.build_model())
    inputs = {key: value[:1].to("meta") for key, value in ex.global_batch(0).items()}
    model = PipelineModel(trace(meta, example_kwargs=inputs), load_cluster("cpu").with_devices(pp * dp * tp),
                          traced_batch=1, dtype="fp32")
    config = PipelineConfig(stages=even_stages(model, pp, tp=tp, dp=dp), micro_batch=4, zero=zero,
                            schedule=schedule)
    found = Found(config, model.estimate(config, global_batch=8), 1)
    return pipeline_plan(model, found, name="LlamaForCausalLM", kind="test", global_batch=8)


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "dp", "tp", "zero", "schedule"), [
    (1, 2, 1, 3, "1f1b"),  # FSDP, two micro-batches
    (1, 1, 2, 0, "1f1b"),  # tensor parallelism (separate q, k, v; gathered head)
    (2, 1, 1, 0, "gpipe"),  # a pipeline: the loss lives on the last stage
    (2, 1, 1, 0, "1f1b"),
])
def test_python_plans_of_every_layout_train_as_one_process(pp, dp, tp, zero, schedule) -> None:
    from autopar.cluster.ranks import run_ranks

    plan = _layout_plan(pp, dp, tp, zero=zero, schedule=schedule)
    assert plan.workload is None and plan.micro_batches == 2
    results = run_ranks(api_ranks.train, pp * dp * tp, args=(plan, 3))
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank reports the averaged loss
    weights = {name: w for r in results for name, w in api_ranks.weights(r).items()}  # a pipeline: each stage's
    _compare(results[0]["losses"], weights, 3)


@pytest.mark.slow
def test_plan_once_shares_rank_0s_plan_and_its_errors() -> None:
    from autopar.cluster.ranks import run_ranks

    shared = run_ranks(api_ranks.plan_once, 2, args=(8, "auto"))
    assert shared[0] == shared[1] and shared[0]["plan"]["kind"] == "auto"
    failed = run_ranks(api_ranks.plan_once, 2, args=(3, "dp"))
    assert failed[0] == failed[1] == {"error": "batch 3 does not divide over the 2 devices: no dp plan exists for "
                                               "it"}


def test_a_faster_plan_that_cannot_run_is_named_beside_the_plan_that_can() -> None:
    """Pipeline searches offer only plans the runtime runs: when the fastest plan found is refused, the search runs
    again within what runs, and the faster plan comes back beside it with its reason and its time."""
    from autopar.api.report import COMMAND_LINE, pipeline_report, render_pipeline
    from autopar.api.search import SearchOptions, Subject, search_pipeline
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.zoo import load

    zoo = load("gpt3-125m", batch=1, seq=64, layers=4, hidden=128, heads=4, vocab=256)
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    cluster = load_cluster("a100-80g-sxm").with_devices(8)

    def shape(plan):  # noqa: ANN001, ANN202
        return plan.pp, plan.grid, plan.micro_batch_size, plan.zero

    free = search_pipeline(Subject(graph=graph, name="gpt", check=lambda plan: None), cluster,
                           SearchOptions(batch=64, budget_s=10, runnable_only=False))
    assert free.not_runnable is None and free.faster is None  # the best runs: one search, nothing beside it
    refused = shape(free.plan)
    why = "refused here: the shape of the fastest plan"

    def check(plan):  # noqa: ANN001, ANN202
        return why if shape(plan) == refused else None

    got = search_pipeline(Subject(graph=graph, name="gpt", check=check), cluster, SearchOptions(batch=64, budget_s=10))
    assert got.not_runnable is None and shape(got.plan) != refused
    assert got.faster is not None and shape(got.faster.plan) == refused and got.faster.not_runnable == why
    data = pipeline_report(got, model="gpt", config={"batch": 64, "seq": 64}, cluster=cluster, params=1)
    faster = data["faster_unrunnable"]
    assert faster["not_runnable"] == why and faster["vs_plan"] < 1
    assert faster["estimate"]["iteration_seconds"] == free.chosen.result.estimate.iteration_seconds
    text = render_pipeline(data, runner=COMMAND_LINE)
    assert f"but `autopar run` cannot run it yet: {why} (--allow-unrunnable offers it)" in text
    assert "cannot run this plan" not in text
    from autopar.report.build import plan_report

    report = plan_report({**data, "search": "auto", "gpus": 8, "cluster": cluster.name}, simulation=None)
    beside = [row for row in report.comparisons if row.label.startswith("fastest found")]
    assert len(beside) == 1 and beside[0].iteration_seconds == faster["estimate"]["iteration_seconds"]
    assert any(why in note and "--allow-unrunnable" in note for note in report.notes)
    # asked for the fastest whatever runs: that plan, with its reason, and nothing beside it
    anyway = search_pipeline(Subject(graph=graph, name="gpt", check=check), cluster,
                             SearchOptions(batch=64, budget_s=10, runnable_only=False))
    assert shape(anyway.plan) == refused and anyway.not_runnable == why and anyway.faster is None


_NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)


def build(batch):
    return Net(), {"x": torch.randn(batch, 16), "y": torch.randint(0, 4, (batch,))}
"""


@pytest.mark.slow
def test_a_plan_made_from_python_runs_from_the_command_line_given_its_model(tmp_path, capsys, monkeypatch) -> None:
    """``autopar run --model`` rebuilds the model of a plan that names none, as ``autopar plan`` names models, and
    checks the plan against it like any other: the model the user names, or a refusal naming the module."""
    import importlib.util

    from autopar.cli.main import main

    (tmp_path / "net.py").write_text(_NET)
    spec = importlib.util.spec_from_file_location("user_net", tmp_path / "net.py")
    net = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net)
    model, inputs = net.build(4)
    path = tmp_path / "py.json"
    autopar.plan(model, inputs, cluster="cpu", gpus=2, batch=8, budget_s=5).save(path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(path), "--nproc", "2", "--steps", "3", "--check", "--check-comm", "--json",
                 "--model", "net.py:build"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"] and out["check_comm"]["ok"]
    assert main(["dryrun", str(path), "--model", "net.py:build"]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--model", "gpt3-125m", "--layers", "2", "--hidden", "64",
                 "--heads", "4"]) == 2  # not the model it was planned for: refused before any rank starts
    assert "which the model does not have" in capsys.readouterr().err
    assert main(["run", str(path), "--nproc", "2", "--layers", "2"]) == 2
    assert "go with --model" in capsys.readouterr().err
