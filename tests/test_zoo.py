"""Every zoo and hf: model builds on the meta device and traces."""

from __future__ import annotations

import pytest

import autopar
from autopar.zoo import get_config, load, model_names

QUICK = ["gpt3-125m", "llama-7b", "bert-base", "t5-base", "moe-125m-e8", "wrn-50-2", "hf:gpt2-tiny", "hf:bert-tiny"]


def _trace(name: str, seq: int | None) -> autopar.Graph:
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    zoo = load(name, batch=1, seq=seq)
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    assert graph.num_params == sum(p.numel() for p in zoo.module.parameters())
    assert graph.flops_forward > 0 and graph.saved_bytes > 0
    return graph


@pytest.mark.parametrize("name", QUICK)
def test_quick_models_trace(name: str) -> None:
    _trace(name, 128 if not name.startswith("wrn") else 64)


@pytest.mark.slow
@pytest.mark.parametrize("name", model_names())
def test_every_model_traces_at_full_size(name: str) -> None:
    graph = _trace(name, None)
    if get_config(name).layers > 2:
        assert graph.repeats


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(ValueError, match="did you mean.*gpt3-1.3b"):
        get_config("gpt3-1.3")


def test_bad_override_is_named() -> None:
    with pytest.raises(ValueError, match="hidden .* divisible by heads"):
        get_config("llama-7b", hidden=100)
    with pytest.raises(ValueError, match="unknown model option"):
        get_config("llama-7b", depth=3)


def test_parametric_names() -> None:
    assert get_config("moe-1.3b-e16").experts == 16
    cfg = get_config("wrn-101-4")
    assert (cfg.layers, cfg.width) == (101, 4)


@pytest.mark.parametrize("name", ["gpt3-125m", "bert-base", "t5-base", "llama-7b"])
def test_no_module_runs_twice_in_one_forward(name: str) -> None:
    """Module-level tools (CommDebugMode's tracker, per-module profilers) need each module called once per
    forward; this runs a small real model under CommDebugMode, which raises otherwise."""
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.runtime.train import Workload, build_model, global_batch

    small = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}
    if name == "llama-7b":
        small.update(kv_heads=4, ffn=128)
    work = Workload(model=name, overrides=small, seq=16, batch=2, micro_batch=2, micro_batches=1)
    model = build_model(work)
    with CommDebugMode() as comm:
        model(**global_batch(work, 0)).backward()
    assert comm.get_total_counts() == 0  # one process: no collectives


@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5", "llama"])
def test_hand_written_hugging_face_models_carry_their_dropout_and_the_runtime_turns_it_off(kind: str) -> None:
    """`autopar run` builds with dropout 0: every dropout of the model must then be off, or its ranks and the
    one-process reference drop different units (hf:gpt2 under DP measured a different loss at step 0)."""
    import torch
    import transformers

    from autopar.zoo.hf import SPECS
    from autopar.zoo.hf_fields import dropouts

    spec = SPECS[kind]
    defaults = dropouts(getattr(transformers, spec.config_class)())
    assert spec.dropout == max(defaults.values(), default=0.0)
    assert get_config(f"hf:{kind}-tiny").dropout == spec.dropout
    off = load(f"hf:{kind}-tiny", batch=1, seq=16, dtype=torch.float32, dropout=0.0).module
    assert all(getattr(off.config, name) == 0.0 for name in defaults)
    assert all(m.p == 0.0 for m in off.modules() if isinstance(m, torch.nn.Dropout))
    on = load(f"hf:{kind}-tiny", batch=1, seq=16).module
    assert all(getattr(on.config, name) == spec.dropout for name, value in defaults.items() if value)


@pytest.mark.parametrize("name", ["hf:llama-tiny", "hf:mistral"])
def test_a_config_transformers_refuses_is_a_one_line_error_naming_the_model(name: str) -> None:
    """transformers' configs validate themselves (huggingface_hub's strict dataclasses): a hidden size the head
    count does not divide (LLaMA's check) or an odd rotary dimension (Mistral's, first) is refused as a ValueError
    naming the model, not a traceback of theirs."""
    with pytest.raises(ValueError, match=rf"{name}: transformers refuses this configuration \("
                                         r"StrictDataclassClassValidationError: .*(hidden size \(63\)|`head_dim`=15)"):
        load(name, batch=1, seq=16, hidden=63, heads=4, kv_heads=2, layers=1, device="meta")
