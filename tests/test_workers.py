"""Pipeline depths searched side by side in forked processes (`autopar.search.workers`): the same plans as one
process finds, errors and stops that reach the caller, and no worker left behind."""

import os
import time

import pytest

from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.api.search import simulated
from autopar.cost.pipeline import PipelineModel
from autopar.search.mcmc import mcmc
from autopar.search.pipeline import aceso, auto, data_parallel, megatron_grid, runtime_limit, score
from autopar.search import workers
from autopar.search.workers import default_workers, in_worker, share_out
from autopar.zoo import load


@pytest.fixture
def forks(monkeypatch) -> list[int]:
    """Workers are forked even where an earlier test left a thread behind (torch.compile's ``tqdm_monitor``; they
    are idle here); the list counts the forks, so that a test can check it compared two processes with one."""
    made: list[int] = []
    fork = workers._fork

    def counted(*args, **kwargs):
        made.append(1)
        return fork(*args, **kwargs)

    monkeypatch.setattr(workers, "_other_threads", lambda: [])
    monkeypatch.setattr(workers, "_fork", counted)
    return made


def _pid_after(item: int, stop, left: int) -> tuple[int, int, int]:
    time.sleep(0.05)  # long enough that every process takes some items
    return item, os.getpid(), left


def test_items_are_shared_between_processes_and_come_back_in_order(monkeypatch, forks) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "3")
    results, finished = share_out(list(range(12)), _pid_after, finish=lambda: ("done", in_worker()))
    assert [r[0] for r in results] == list(range(12))
    assert len({r[1] for r in results}) == 3 and os.getpid() in {r[1] for r in results}
    assert finished == [("done", True), ("done", True)]  # each worker's, not the caller's
    assert not in_worker()
    assert sorted(r[2] for r in results) == list(range(1, 13))  # each item knew how many were left when taken


def test_the_order_items_are_taken_in_is_the_callers(monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "1")
    taken = []
    results, _ = share_out(["a", "b", "c"], lambda item, stop, left: taken.append(item) or item, order=[2, 0, 1])
    assert taken == ["c", "a", "b"] and results == ["a", "b", "c"]
    with pytest.raises(ValueError, match="each of the 3 items' indices once"):
        share_out(["a", "b", "c"], lambda item, stop, left: item, order=[0, 0, 1])


def _fails_on_three(item: int, stop, left: int) -> int:
    if item == 3:
        raise ValueError(f"item {item} is bad")
    time.sleep(0.02)
    return item


def test_an_error_in_a_worker_is_raised_here_and_no_worker_is_left(monkeypatch, forks) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    before = _children()
    with pytest.raises(ValueError, match="item 3 is bad"):
        share_out(list(range(8)), _fails_on_three)
    assert _children() == before and forks


def test_a_stop_asked_here_reaches_the_workers(monkeypatch, forks) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    start = time.perf_counter()

    def slow(item: int, stop, left: int) -> int:
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline and not stop():
            time.sleep(0.01)
        return item

    results, _ = share_out(list(range(6)), slow, should_stop=lambda: time.perf_counter() > start + 0.5)
    assert time.perf_counter() - start < 3  # not 6 items x 5 s / 2 processes
    assert results[2:] == [None] * 4 and forks  # the two items under way ended; none was started after the stop


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_worker_count_is_refused_naming_the_variable(monkeypatch, value) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", value)
    with pytest.raises(ValueError, match="AUTOPAR_WORKERS"):
        default_workers()


def _children() -> set[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    with open(path) as f:
        return {int(p) for p in f.read().split()}


def _model(name: str, *, gpus: int, **overrides) -> PipelineModel:
    zoo = load(name, batch=1, **overrides)
    cluster = load_cluster("a100-80g-sxm").with_devices(gpus)
    return PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), cluster, traced_batch=1, screen=True)


@pytest.mark.parametrize(("name", "gpus", "overrides"), [
    ("gpt3-125m", 16, {"layers": 8}),
    ("llama-7b", 32, {"layers": 8, "hidden": 1024, "heads": 8, "kv_heads": 4, "ffn": 2816, "vocab": 8000}),
])
def test_searching_depths_in_workers_finds_what_one_process_finds(monkeypatch, forks, name, gpus,
                                                                  overrides) -> None:
    found = {}
    for count in ("1", "2"):
        monkeypatch.setenv("AUTOPAR_WORKERS", count)
        model = _model(name, gpus=gpus, **overrides)  # a fresh model: nothing cached from the other run
        limit = lambda config: runtime_limit(config)  # noqa: E731 - the CLI's search keeps to what runs
        result = auto(model, global_batch=64, time_limit=120, limit=limit)
        climbed = aceso(model, global_batch=64, time_limit=120)
        grid = megatron_grid(model, global_batch=64)
        dp = data_parallel(model, global_batch=64, zero=0)
        chains = mcmc(model, global_batch=64, seeds=[grid.config, dp.config], time_limit=120, seed=5)
        assert (len(forks) >= 4) if count == "2" else not forks  # the grid, Aceso (in auto and alone) and MCMC forked
        before = len(forks)
        shown = simulated(model, result, global_batch=64, own="auto")
        assert len(forks) == before + (count == "2")  # and the simulation of the finalists
        found[count] = (result, climbed, grid, chains, shown)
    (one, climbed_one, grid_one, chains_one, shown_one), (two, climbed_two, grid_two, chains_two, shown_two) = \
        found["1"], found["2"]
    assert one["auto"].converged and two["auto"].converged
    assert one["auto"].config == two["auto"].config and one["auto"].by == two["auto"].by
    assert [f.config for f in one["auto"].runners_up] == [f.config for f in two["auto"].runners_up]
    assert climbed_one.config == climbed_two.config and climbed_one.converged and climbed_two.converged
    assert score(climbed_one.result) == score(climbed_two.result)
    assert grid_one.config == grid_two.config and grid_one.evaluated == grid_two.evaluated
    assert chains_one.converged and chains_two.converged
    assert chains_one.config == chains_two.config and chains_one.evaluated == chains_two.evaluated
    for kind in ("megatron", "dp", "fsdp"):
        assert one[kind].config == two[kind].config, kind
    # what the workers priced is counted, once each, as one process counts it
    assert two["auto"].evaluated == one["auto"].evaluated > 0
    # the finalists simulated side by side: the same plans, estimates and order, each plan with its timeline
    for kind, f in shown_one.items():
        g = shown_two[kind]
        assert (f is None) == (g is None), kind
        if f is None:
            continue
        assert (f.config, f.by, f.result.estimate) == (g.config, g.by, g.result.estimate), kind
        assert [(r.config, r.result.estimate) for r in f.runners_up] == \
            [(r.config, r.result.estimate) for r in g.runners_up], kind
        assert f.result.simulation is not None and g.result.simulation is not None
        assert g.result.simulation.timeline.end == f.result.simulation.timeline.end


def test_a_worker_prices_what_the_caller_would(monkeypatch, forks) -> None:
    """A worker is a fork: its results are configurations, priced again here, never prices carried over."""
    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    model = _model("gpt3-125m", gpus=16, layers=8)
    climbed = aceso(model, global_batch=64, time_limit=120)
    assert forks
    fresh = _model("gpt3-125m", gpus=16, layers=8)
    again = fresh.estimate(climbed.config, global_batch=64)
    assert again.estimate == climbed.result.estimate
    assert score(again) == climbed.score


def test_with_another_thread_running_everything_is_done_here(monkeypatch) -> None:
    import threading

    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        results, finished = share_out(list(range(4)), _pid_after, finish=lambda: "worker")
    finally:
        release.set()
        other.join()
    assert {r[1] for r in results} == {os.getpid()} and finished == []


def test_a_job_beside_runs_in_another_process_and_its_result_or_error_comes_back(monkeypatch, forks) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    before = _children()
    job = workers.beside(lambda: (os.getpid(), in_worker()))
    pid, inside = job.result()
    assert pid != os.getpid() and inside and len(forks) == 1 and _children() == before

    def fails() -> None:
        raise ValueError("the job is bad")

    with pytest.raises(ValueError, match="the job is bad"):
        workers.beside(fails).result()
    assert _children() == before


def test_a_job_beside_that_is_cancelled_leaves_no_process(monkeypatch, forks) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    before = _children()
    job = workers.beside(lambda: time.sleep(30))
    assert _children() != before
    start = time.perf_counter()
    job.cancel()
    job.cancel()  # twice is harmless
    assert _children() == before and time.perf_counter() - start < 5


def test_a_job_beside_with_one_worker_runs_here_when_asked(monkeypatch, forks) -> None:
    monkeypatch.setenv("AUTOPAR_WORKERS", "1")
    ran = []
    job = workers.beside(lambda: ran.append(os.getpid()) or "done")
    assert not ran and not forks  # nothing done until its result is asked for
    assert job.result() == "done" and ran == [os.getpid()]
    with pytest.raises(RuntimeError, match="already taken"):
        job.result()
    skipped = workers.beside(lambda: ran.append("again"))
    skipped.cancel()
    assert ran == [os.getpid()]


@pytest.mark.parametrize("count", ["1", "2"])
def test_the_plan_is_checked_once_beside_the_simulation_and_its_reason_kept(monkeypatch, forks, tmp_path,
                                                                          count) -> None:
    """The search's favourite is checked while the finalists are simulated: in a worker where there are cores for
    it, here otherwise; the plan shown carries that check's answer, and nothing is checked twice."""
    from autopar.api.search import SearchOptions, Subject, search_pipeline

    monkeypatch.setenv("AUTOPAR_WORKERS", count)
    calls = tmp_path / "calls"

    def check(plan) -> str:
        with open(calls, "a") as f:
            f.write(f"{os.getpid()} {plan.pp} {plan.micro_batch_size}\n")
        return "refused by the test"

    zoo = load("gpt3-125m", batch=1, layers=8)
    subject = Subject(graph=trace(zoo.module, example_kwargs=zoo.inputs), name="gpt", check=check)
    searched = search_pipeline(subject, load_cluster("a100-80g-sxm").with_devices(16),
                               SearchOptions(batch=64, budget_s=60, runnable_only=False))
    lines = calls.read_text().split()
    assert searched.not_runnable == "refused by the test"
    assert len(lines) == 3 and (int(lines[0]) != os.getpid()) == (count == "2")
    plan = searched.plan
    assert (int(lines[1]), int(lines[2])) == (plan.pp, plan.micro_batch_size)
    assert not [pid for pid in _children() if pid == int(lines[0])]


FORK_AFTER_PARALLEL_OP = """
import torch
torch.set_num_threads(2)
torch.randn(1 << 22).mul(2).sum()  # OpenMP's threads run this one
from autopar.search.workers import beside
job = beside(lambda: float(torch.zeros(1 << 20, dtype=torch.long).add(1).sum()))
print(job._child is not None, job.result())
"""


def test_a_worker_forked_after_a_parallel_op_runs_parallel_ops_too() -> None:
    """OpenMP's thread pool does not survive a fork: a worker's first parallel op used to wait forever for threads
    its parent's pool had (``autopar plan`` of Qwen1.5-MoE at batch 32 x 2,048 hung in its plan-time check)."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "AUTOPAR_WORKERS": "2"}
    process = subprocess.Popen([sys.executable, "-c", FORK_AFTER_PARALLEL_OP], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the worker too
        process.communicate()
        pytest.fail("the worker's parallel op did not finish in 120 s")
    assert process.returncode == 0, err
    assert out.split() == ["True", str(float(1 << 20))]
