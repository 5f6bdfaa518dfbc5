"""Exports of a plan to torchtitan 0.3 and Megatron-LM: the arguments, the degrees they multiply to, and what each
target cannot express (warnings). Pure tests build plans in Python; the last tests build torchtitan's own
``Trainer.Config`` and ``ParallelDims`` from the export where torchtitan is installed (skipped otherwise)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from torch.distributed.tensor import Replicate, Shard

from autopar.cli.main import main
from autopar.export import Target, to_megatron, to_torchtitan
from autopar.export.models import TITAN_LLAMA3
from autopar.plan import Mesh, ModuleLayout, ParamLayout, Plan, Stage, Workload, save_plan
from autopar.zoo import config_for


def _stage_rows(counts: tuple[int, ...], k: int, start: int) -> tuple[str, ...]:
    rows = tuple(f"layers.{i}" for i in range(start, start + counts[k]))
    if k == 0:
        rows = ("embed", "rotary", *rows)
    if k == len(counts) - 1:
        rows = (*rows, "norm", "head", "")
    return rows


def _plan(*, counts: tuple[int, ...] = (20, 20, 20, 20), grids: tuple[tuple[int, int], ...] | None = None,
          zero: int = 1, sp: bool = False, schedule: str = "1f1b", chunks: int = 1, mbs: int = 8, m: int = 64,
          recompute: dict[int, dict[str, str]] | None = None, segments: dict[int, tuple] | None = None,
          intra: tuple[int, ...] = (), model: str = "llama-70b", dtype: str = "bf16", seq: int = 4096) -> Plan:
    """A pipeline plan of llama-70b's rows (embed, rotary, layers.N, norm, head, the root), ``counts`` layers per
    stage, on ``grids`` (default 8 x 2 everywhere)."""
    grids = grids or ((8, 2),) * len(counts)
    stages, start = [], 0
    for k, (dp, tp) in enumerate(grids):
        rows = _stage_rows(counts, k, start)
        start += counts[k]
        layouts = tuple((r, (("attn.qkv", "m"),)) for r in rows if r.startswith("layers.")) if k in intra else ()
        stages.append(Stage(layers=rows, dp=dp, tp=tp, recompute=tuple((recompute or {}).get(k, {}).items()),
                            segments=(segments or {}).get(k, ()), intra=k in intra, layouts=layouts))
    per_stage = grids[0][0] * grids[0][1]
    module = ModuleLayout(fqn="layers.0.attn.qkv", params=(
        ParamLayout(name="layers.0.attn.qkv.weight", placements=(Replicate(), Shard(0))),))
    return Plan(model=model, kind="auto", mesh=Mesh(shape=(len(counts) // chunks, per_stage), axes=("pp", "dp_tp")),
                micro_batch_size=mbs, micro_batches=m, zero=zero, sp=sp, schedule=schedule, chunks=chunks,
                stages=tuple(stages), modules=(module,),
                workload=Workload(model=model, seq=seq, batch=mbs * m, dtype=dtype))


def _model(plan: Plan):  # noqa: ANN202
    return config_for(plan.workload.model, seq=plan.workload.seq)


def _mega(plan: Plan):  # noqa: ANN202
    return to_megatron(plan, model=_model(plan))


def _args(export) -> str:  # noqa: ANN001
    return " ".join(export.arguments)


def _features(export) -> list[str]:  # noqa: ANN001
    return [w.feature for w in export.warnings]


def _all_full(counts: tuple[int, ...]) -> dict[int, dict[str, str]]:
    out, start = {}, 0
    for k, c in enumerate(counts):
        out[k] = {f"layers.{i}": "full" for i in range(start, start + c)}
        start += c
    return out


# Megatron-LM

def test_megatron_arguments_of_an_even_pipeline_are_exact() -> None:
    plan = _plan(recompute=_all_full((20, 20, 20, 20)))
    export = to_megatron(plan, model=_model(plan))
    assert export.target is Target.MEGATRON and export.warnings == ()
    assert dict(export.degrees) == {"pp": 4, "dp": 8, "tp": 2} and export.world_size == 64
    text = _args(export)
    for part in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 4", "--micro-batch-size 1",
                 "--global-batch-size 512", "--num-layers 80", "--seq-length 4096",
                 "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                 "--use-distributed-optimizer", "--bf16", "--num-query-groups 8", "--swiglu"):
        assert part in text, part
    assert "--pipeline-model-parallel-layout" not in text and "--sequence-parallel" not in text
    assert export.setting("--micro-batch-size") == 1 and export.setting("--bf16") is True


def test_megatron_uneven_and_interleaved_stages() -> None:
    uneven = to_megatron(_plan(counts=(19, 21, 20, 20)), model=None)
    assert "--pipeline-model-parallel-layout Et*19|t*21|t*20|t*20L" in _args(uneven)
    assert any("core 0.13" in n for n in uneven.notes)
    interleaved = _plan(counts=(10,) * 8, chunks=2, schedule="interleaved")
    text = _args(to_megatron(interleaved, model=None))
    assert "--num-layers-per-virtual-pipeline-stage 10" in text and "--pipeline-model-parallel-size 4" in text
    ragged = to_megatron(_plan(counts=(9, 11, 10, 10, 10, 10, 10, 10), chunks=2, schedule="interleaved"))
    assert "Et*9|t*11|t*10|t*10|t*10|t*10|t*10|t*10L" in _args(ragged)


def test_megatron_lists_what_it_cannot_express() -> None:
    plan = _plan(grids=((8, 2), (8, 2), (4, 4), (8, 2)), intra=(1,), schedule="gpipe",
                 recompute={0: {"layers.0": "full"}, 2: {"layers.40": "full", "layers.41": "full"}})
    export = to_megatron(plan, model=_model(plan))
    assert sorted(_features(export)) == ["grid", "intra", "recompute", "schedule"]
    assert "--tensor-model-parallel-size 2" in _args(export)  # the grid of most layers
    assert "--recompute-method block --recompute-num-layers 2" in _args(export)  # the most of any stage
    grid = next(w for w in export.warnings if w.feature == "grid")
    assert "stage 2 4 x 4" in grid.plan and "stages 2 run on it" in grid.closest


def test_megatron_recomputation_and_data_parallel_settings() -> None:
    same_count = _plan(recompute={k: {f"layers.{20 * k + 19}": "full"} for k in range(4)})
    export = to_megatron(same_count, model=_model(same_count))
    assert export.warnings == () and "--recompute-num-layers 1" in _args(export)
    assert any("first 1 layers" in n for n in export.notes)  # the plan names the last layer of each stage
    every = {k: {f"layers.{i}": "selective" for i in range(20 * k, 20 * k + 20)} for k in range(4)}
    assert "--recompute-granularity selective" in _args(to_megatron(_plan(recompute=every)))
    some = _mega(_plan(recompute={1: {"layers.20": "selective"}}))
    assert _features(some) == ["recompute"] and "--recompute-granularity selective" in _args(some)
    assert "optim_grads_params" in _args(to_megatron(_plan(zero=3)))
    assert "--data-parallel-sharding-strategy optim_grads " in _args(to_megatron(_plan(zero=2))) + " "
    assert "--use-distributed-optimizer" not in _args(to_megatron(_plan(zero=0)))
    text = _args(to_megatron(_plan(sp=True, dtype="fp16")))
    assert "--sequence-parallel" in text and "--fp16" in text and "--bf16" not in text


# torchtitan (pure: no torchtitan needed)

def test_torchtitan_overrides_of_a_pipeline_plan() -> None:
    plan = _plan(counts=(19, 21, 20, 20), recompute=_all_full((19, 21, 20, 20)))
    export = to_torchtitan(plan, model=_model(plan))
    assert dict(export.degrees) == {"pp": 4, "dp_replicate": 1, "dp_shard": 8, "tp": 2}
    assert export.world_size == 64
    assert export.arguments[:4] == ("--module", "llama3", "--config", "llama3_70b")
    assert export.arguments[-1] == "activation-checkpoint:full"  # a subcommand: last
    assert export.setting("parallelism.enable_sequence_parallel") is False
    assert "--parallelism.no_enable_sequence_parallel" in export.arguments
    assert export.setting("training.local_batch_size") == 64  # 1 sample per rank x 64 micro-batches
    assert export.setting("parallelism.pipeline_parallel_microbatch_size") == 1
    assert export.setting("parallelism.fsdp_reshard_after_forward") == "never"
    parts = export.setting("parallelism.module_fqns_per_model_part")
    assert [len(p) for p in parts] == [20, 21, 20, 22] and parts[0][0] == "tok_embeddings"
    assert parts[-1][-2:] == ("norm", "lm_head")
    assert _features(export) == ["model"]  # vocab 32000 against torchtitan's llama3_70b's 128256


@pytest.mark.parametrize("zero, pp, m, expected, warned", [
    (0, 4, 64, (8, 1, None), False),
    (1, 4, 64, (1, 8, "never"), False),  # the pipeline schedule reduce-scatters once, after the last micro-batch
    (1, 1, 4, (1, 8, "never"), True),  # torchtitan's accumulation loop reduce-scatters after each micro-batch
    (1, 1, 1, (1, 8, "never"), False),
    (2, 1, 4, (1, 8, "never"), False),
    (2, 4, 64, (1, 8, "never"), True),
    (3, 1, 4, (1, 8, "always"), False),
    (3, 4, 64, (1, 8, "always"), True),
])
def test_torchtitan_zero_stages(zero: int, pp: int, m: int, expected: tuple, warned: bool) -> None:
    counts = (20,) * pp if pp > 1 else (80,)
    export = to_torchtitan(_plan(counts=counts, zero=zero, m=m))
    got = (export.setting("parallelism.data_parallel_replicate_degree"),
           export.setting("parallelism.data_parallel_shard_degree"),
           export.setting("parallelism.fsdp_reshard_after_forward"))
    assert got == expected
    assert ("zero" in _features(export)) is warned
    if pp == 1:  # no pipeline: the micro-batches are torchtitan's accumulation steps
        assert export.setting("training.local_batch_size") == 1
        assert export.setting("training.global_batch_size") == 8 * m
        assert export.setting("parallelism.pipeline_parallel_schedule") is None


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_torchtitan_splits_experts_over_fsdp_s_ranks_only(zero: int) -> None:
    """torchtitan's expert degree takes its ranks from FSDP's: under ZeRO 1-3 the plan's dp is FSDP's and the
    experts split over it; under ZeRO 0 there are none to take, which the export says."""
    plan = replace(_plan(grids=((8, 1),) * 4, zero=zero), ep=8)
    export = to_torchtitan(plan)
    assert export.setting("parallelism.expert_parallel_degree") == (8 if zero else None)
    assert ("ep" in _features(export)) is (zero == 0)


def test_torchtitan_recomputation_and_placement_approximations() -> None:
    partial = to_torchtitan(_plan(recompute={0: {"layers.3": "full"}}))
    assert partial.arguments[-1] == "activation-checkpoint:full" and "recompute" in _features(partial)
    none = to_torchtitan(_plan())
    assert none.arguments[-1] == "activation-checkpoint:none" and "recompute" not in _features(none)
    selective = to_torchtitan(_plan(recompute={0: {"layers.3": "selective"}}))
    assert selective.arguments[-1] == "activation-checkpoint:selective" and "recompute" in _features(selective)
    runs = to_torchtitan(_plan(segments={0: (("layers.0", "layers.3"),)}))
    assert runs.arguments[-1] == "activation-checkpoint:full" and "recompute" in _features(runs)
    # the head on stage 2, the loss alone on stage 3: the head moves to the last stage, said so
    plan = _plan(counts=(20, 20, 20, 20))
    head = Stage(layers=(*plan.stages[2].layers, *plan.stages[3].layers[:-1]), dp=8, tp=2)
    plan = replace(plan, stages=(*plan.stages[:2], head, Stage(layers=("",), dp=8, tp=2)))
    export = to_torchtitan(plan, model=_model(plan))
    parts = export.setting("parallelism.module_fqns_per_model_part")
    assert parts[-1] == ("norm", "lm_head") and "lm_head" not in parts[2]
    assert "stages" in _features(export)
    assert "stages" in _features(to_megatron(plan))


def test_models_torchtitan_does_not_define() -> None:
    gpt = _plan(model="gpt3-1.3b", counts=(6, 6, 6, 6), seq=2048)
    export = to_torchtitan(gpt, model=_model(gpt))
    assert "--module" not in export.arguments and export.setting("parallelism.module_fqns_per_model_part") is None
    assert _features(export) == ["model"]
    llama7 = _plan(model="llama-7b", counts=(8, 8, 8, 8))
    close = to_torchtitan(llama7, model=_model(llama7))
    assert close.arguments[:4] == ("--module", "llama3", "--config", "llama3_8b")
    warning = next(w for w in close.warnings if w.feature == "model")
    assert "kv_heads 32 (torchtitan 8)" in warning.plan and "ffn 11008 (torchtitan 14336)" in warning.plan
    assert "--hidden-size" not in _args(to_megatron(_plan(model="t5-base", counts=(3, 3, 3, 3), seq=512),
                                                    model=config_for("t5-base")))


def test_intra_op_plans_are_refused() -> None:
    from autopar.plan import Block

    plan = Plan(model="m", kind="ilp", mesh=Mesh(shape=(2, 2), axes=("tp0", "tp1")), micro_batch_size=8,
                micro_batches=1, blocks=(Block(id=0, layer="embed", module="embed", split="n,n"),))
    for export in (to_torchtitan, to_megatron):
        with pytest.raises(ValueError, match="intra-op plan"):
            export(plan)


def test_the_command_prints_arguments_and_json(tmp_path, capsys) -> None:
    path = str(tmp_path / "p.json")
    save_plan(path, _plan(counts=(19, 21, 20, 20), intra=(1,)))
    assert main(["export", path, "--to", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert "--pipeline-model-parallel-layout 'Et*19|t*21|t*20|t*20L'" in out  # shell-quoted
    assert "# 1 approximated" in out and "intra:" in out and "1 plan feature approximated" in err
    assert main(["export", path, "--to", "torchtitan", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"] == "torchtitan" and data["world_size"] == 64
    assert math.prod(data["degrees"].values()) == 64
    assert {w["feature"] for w in data["warnings"]} == {"intra", "model"}
    assert data["settings"]["parallelism.module_fqns_per_model_part"][0][0] == "tok_embeddings"
    assert main(["export", path, "--to", "deepspeed"]) == 2


# torchtitan itself, where installed

def _titan():  # noqa: ANN202
    pytest.importorskip("triton")  # its model registry imports it
    return pytest.importorskip("torchtitan.config")


_TITAN_CASES = {
    "uneven 1F1B, ZeRO 1": dict(counts=(19, 21, 20, 20), recompute=_all_full((19, 21, 20, 20))),
    "interleaved, SP, selective": dict(counts=(10,) * 8, chunks=2, schedule="interleaved", sp=True, zero=0,
                                       recompute={0: {"layers.0": "selective"}}),
    "one stage, ZeRO 3, accumulation": dict(counts=(80,), grids=((32, 2),), zero=3, mbs=32, m=4),
}


@pytest.mark.parametrize("case", list(_TITAN_CASES))
def test_torchtitan_builds_its_config_and_parallel_dims_from_the_export(case: str) -> None:
    config_module = _titan()
    import torch
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed.parallel_dims import ParallelDims

    plan = _plan(**_TITAN_CASES[case])
    export = to_torchtitan(plan, model=_model(plan))
    config = config_module.ConfigManager().parse_args(list(export.arguments))
    p = config.parallelism
    dims = ParallelDims.from_config(p, world_size=export.world_size)  # asserts the degrees multiply to it
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == tuple(dict(export.degrees).values())
    assert p.enable_sequence_parallel is plan.sp
    assert p.fsdp_reshard_after_forward == (export.setting("parallelism.fsdp_reshard_after_forward") or "default")
    mode = export.arguments[-1].split(":")[1]
    assert (config.activation_checkpoint is None) == (mode == "none")
    assert mode == "none" or type(config.activation_checkpoint).__qualname__.lower().startswith(mode)
    # torchtitan's batch arithmetic (Trainer.__init__): accumulation steps x pipeline micro-batches = the plan's
    local = config.training.local_batch_size
    steps = config.training.global_batch_size // (local * dims.dp_replicate * dims.dp_shard)
    per_step = local // p.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    assert steps * per_step == plan.micro_batches and config.training.seq_len == 4096
    if dims.pp == 1:
        return
    assert get_schedule_class(p.pipeline_parallel_schedule).__name__ == {
        "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}[plan.schedule]
    with torch.device("meta"):
        model = config.model_spec.model.build()
    names = {name for name, _ in model.named_modules()}
    parts = p.module_fqns_per_model_part
    assert len(parts) == len(plan.stages) and all(fqn in names for part in parts for fqn in part)
    assert [fqn for part in parts for fqn in part] == ["tok_embeddings", *(f"layers.{i}" for i in range(80)),
                                                       "norm", "lm_head"]


def test_torchtitan_config_shapes_are_torchtitans_own() -> None:
    _titan()
    from torchtitan.models.llama3 import config_registry

    for known in TITAN_LLAMA3:
        model = getattr(config_registry, known.name)().model_spec.model
        block = model.layers[0]
        shape = {"layers": len(model.layers), "hidden": model.dim, "heads": block.attention.n_heads,
                 "kv_heads": block.attention.n_kv_heads, "vocab": model.vocab_size,
                 "ffn": block.feed_forward.w1.out_features}
        assert shape == known.shape(), known.name
