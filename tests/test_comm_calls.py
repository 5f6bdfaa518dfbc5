"""The one record of a counted collective (`autopar.cluster.calls`) and the plan's uses built from it."""

import random

import pytest

from autopar.cluster import Collective
from autopar.cluster.calls import CommCall, Phase, merge_calls, subtract_calls
from autopar.cost.uses import collective_uses

AR, AG = Collective.ALL_REDUCE, Collective.ALL_GATHER


def _call(kind=AR, axis="tp", nbytes=1024.0, phase=Phase.FORWARD, calls=1):  # noqa: ANN001, ANN202
    return CommCall(kind=kind, axis=axis, bytes=nbytes, phase=phase, calls=calls)


def test_merge_sums_the_calls_of_one_collective_and_keeps_the_others_apart() -> None:
    calls = [_call(), _call(kind=AG), _call(calls=2), _call(phase=Phase.BACKWARD), _call(axis="dp"),
             _call(nbytes=2048.0), _call(kind=AG, calls=3)]
    merged = merge_calls(calls)
    assert merged == (_call(calls=3), _call(kind=AG, calls=4), _call(phase=Phase.BACKWARD), _call(axis="dp"),
                      _call(nbytes=2048.0))
    assert merge_calls([]) == ()
    assert merge_calls([_call(calls=0), _call(axis="dp")]) == (_call(axis="dp"),)  # no calls: nothing to count


def test_merging_in_parts_is_merging_at_once() -> None:
    rng = random.Random(0)
    calls = [_call(kind=rng.choice([AR, AG]), axis=rng.choice(["tp", "dp"]), nbytes=rng.choice([1.0, 2.0, 3.0]),
                   phase=rng.choice(list(Phase)), calls=rng.randint(1, 5)) for _ in range(200)]
    whole = merge_calls(calls)
    parts = merge_calls(merge_calls(calls[:77]) + merge_calls(calls[77:]))
    assert sorted(whole, key=repr) == sorted(parts, key=repr)
    assert sum(c.calls for c in whole) == sum(c.calls for c in calls)
    assert len({c.key for c in whole}) == len(whole)


def test_times_scaled_and_during_change_one_field() -> None:
    c = _call(calls=2)
    assert c.times(8) == _call(calls=16)
    assert c.scaled(0.5) == _call(nbytes=512.0, calls=2)
    assert c.during(Phase.BACKWARD) == _call(phase=Phase.BACKWARD, calls=2)


def test_subtract_removes_calls_and_refuses_what_is_not_there() -> None:
    held = [_call(calls=2), _call(kind=AG)]
    assert subtract_calls(held, [_call()]) == (_call(), _call(kind=AG))
    assert subtract_calls(held, [_call(kind=AG)]) == (_call(calls=2),)
    with pytest.raises(ValueError, match="cannot remove"):
        subtract_calls(held, [_call(phase=Phase.BACKWARD)])
    with pytest.raises(ValueError, match="cannot remove"):
        subtract_calls(held, [_call(calls=3)])


@pytest.mark.parametrize("bad", [{"kind": "all_reduce"}, {"phase": "f"}, {"nbytes": -1.0}, {"calls": -1},
                                 {"nbytes": float("inf")}])
def test_a_record_refuses_bad_fields(bad: dict) -> None:
    with pytest.raises(ValueError):
        _call(**bad)


def test_uses_sum_phases_sort_and_label_axes() -> None:
    calls = [_call(phase=Phase.BACKWARD, calls=3), _call(kind=AG, axis="dp", calls=2), _call(calls=5),
             _call(axis="dp", nbytes=10.0, phase=Phase.SYNC)]
    uses = collective_uses(calls)
    assert [(u.kind, u.axis, u.bytes, u.count) for u in uses] == [
        ("all_gather", "dp", 1024.0, 2), ("all_reduce", "dp", 10.0, 1), ("all_reduce", "tp", 1024.0, 8)]
    assert all(type(u.count) is int for u in uses)
    labelled = collective_uses(calls, labels={"tp": "x1", "dp": "x0"})
    assert [(u.kind, u.axis) for u in labelled] == [("all_gather", "x0"), ("all_reduce", "x0"), ("all_reduce", "x1")]


def test_uses_refuse_what_the_plan_file_cannot_say() -> None:
    with pytest.raises(ValueError, match="no mesh axis"):
        collective_uses([_call(axis=None)])
    with pytest.raises(ValueError, match="whole number"):
        collective_uses([_call(calls=0.5)])
    assert collective_uses([_call(calls=0.5), _call(calls=1.5)])[0].count == 2


_DDP_BUCKETS = r"""
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from autopar.runtime.apply import DDP_BUCKET_MB
from autopar.zoo import load
torch.set_num_threads(1)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
built = load(sys.argv[1], batch=2, seq=16, dtype=torch.float32, device="cpu", dropout=0.0, **json.loads(sys.argv[3]))
ddp = DistributedDataParallel(built.module.train(), bucket_cap_mb=DDP_BUCKET_MB, forward_sync_buffers=False)
sizes = []
def count(state, bucket):
    sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done
ddp.register_comm_hook(None, count)
for step in range(3):  # DDP rebuilds its buckets after the first step
    sizes.clear()
    out = ddp(**built.inputs)
    (out if torch.is_tensor(out) else out.loss).backward()
print(json.dumps(sizes))
"""


@pytest.mark.parametrize(("name", "overrides"), [
    ("gpt3-350m", {"layers": 2}),  # a 200 MiB tied embedding, larger than a bucket
    ("hf:qwen3", {"layers": 2, "hidden": 64, "heads": 4}),  # a large untied head and embedding
])
def test_ddp_buckets_are_the_ones_ddp_makes(name: str, overrides: dict) -> None:
    """The cost model's DDP all-reduces are DDP's own buckets: whole tensors in the order gradients become ready,
    not the gradients cut into equal slices (which made 3-5 predicted all-reduces of 1-2 real ones)."""
    import json
    import socket
    import subprocess
    import sys

    import torch

    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.memory import ddp_buckets
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage
    from autopar.zoo import load

    built = load(name, batch=1, seq=16, dtype=torch.float32, **overrides)
    model = PipelineModel(trace(built.module, example_kwargs=built.inputs), load_cluster("cpu").with_devices(2),
                          traced_batch=1, dtype="fp32")
    predicted = ddp_buckets(n * 4 for n in model._ddp_gradients)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", _DDP_BUCKETS, name, str(port), json.dumps(overrides)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert predicted == json.loads(done.stdout.strip().splitlines()[-1])
    assert len(predicted) > 1
    # and the estimate of DDP's plan counts one all-reduce per bucket
    config = PipelineConfig(stages=(Stage(start=0, end=len(model.layers), tp=1, dp=2),), micro_batch=2)
    calls = [c for c in model.estimate(config, global_batch=2).stages[0].calls if c.axis == "dp"]
    assert sorted(c.bytes for c in calls for _ in range(c.calls)) == sorted(predicted)
