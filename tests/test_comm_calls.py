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
