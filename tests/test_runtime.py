"""Plans run with PyTorch's distributed engine on gloo ranks and match one process (losses and gradients)."""

import dataclasses
import json

import pytest
import torch

from autopar.cli.main import main
from autopar.cli.run import compare
from autopar.plan import load_plan
from autopar.runtime import StepLog, check_supported

TINY = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "32"]


def _plan(tmp_path, capsys, *extra: str) -> dict:
    path = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--cluster", "cpu", "--gpus", "2", "--batch", "8", "--out", str(path), *extra]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_data_parallel_plan_from_the_planner_matches_one_process(tmp_path, capsys) -> None:
    path = tmp_path / "dp.json"
    path.write_text(json.dumps(_plan(tmp_path, capsys, "--search", "dp")))
    out = _run(path, 2)
    assert len(out["steps"]) == 3 and out["steps"][2]["loss"] < out["steps"][0]["loss"]


def _run(path, nproc: int) -> dict:
    """``autopar run --check --check-comm`` on ``nproc`` ranks; both checks must pass."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", str(path), "--nproc", str(nproc), "--steps", "3", "--check", "--check-comm", "--json"])
    assert code == 0, err.getvalue().strip().splitlines()[-1:]
    data = json.loads(out.getvalue())
    assert data["check"]["ok"] and data["check_comm"]["ok"]
    return data


def _pipeline_plan(
    tmp_path, name: str, overrides: dict, *, tp: int, dp: int, zero: int = 0, recompute: dict | None = None,
    pp: int = 1, schedule: str = "1f1b", sp: bool = False, chunks: int = 1, segments: list | None = None,
) -> str:
    """A plan with chosen pp x dp x tp (even stages), built with the planner's own functions."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, even_stages
    from autopar.plan import Workload, save_plan
    from autopar.search.pipeline import Found, pipeline_plan
    from autopar.zoo import load

    zoo = load(name, batch=1, seq=32, **overrides)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs),
                          load_cluster("cpu").with_devices(pp * tp * dp), traced_batch=1)
    micro, batch = (4, 8) if pp == 1 else (2 * dp, 8 * dp)  # pipelines get 4 micro-batches
    config = PipelineConfig(stages=even_stages(model, pp * chunks, tp=tp, dp=dp), micro_batch=micro, zero=zero,
                            schedule="interleaved" if chunks > 1 else schedule, sp=sp, chunks=chunks)
    found = Found(config, model.estimate(config, global_batch=batch), 1)
    work = Workload(model=name, overrides=tuple(sorted(overrides.items())), seq=32, batch=batch, dtype="fp32")
    plan = pipeline_plan(model, found, name=name, kind="test", global_batch=batch, workload=work)
    stages = tuple(
        dataclasses.replace(stage, recompute=tuple((k, v) for k, v in (recompute or {}).items() if k in stage.layers),
                            segments=tuple(tuple(s) for s in segments or () if s[0] in stage.layers))
        for stage in plan.stages
    )
    path = tmp_path / "plan.json"
    save_plan(path, dataclasses.replace(plan, stages=stages))
    return str(path)


GPT = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128}
LLAMA = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 128, "ffn": 128}
BOTH = {"layers.0": "full", "layers.1": "selective"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "tp", "dp", "recompute"),
    [
        ("gpt3-125m", GPT, 2, 1, None),  # the tied head gathers the sequence first
        ("llama-7b", LLAMA, 2, 1, {"layers.0": "full"}),  # the untied head gathers logits; recomputation
        ("gpt3-125m", GPT, 2, 2, None),  # TP + SP, gradients all-reduced over dp
    ],
)
def test_sequence_parallel_plans_match_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, tp, dp, recompute
) -> None:
    path = _pipeline_plan(tmp_path, name, overrides, tp=tp, dp=dp, recompute=recompute, sp=True)
    data = _run(path, tp * dp)
    kinds = {(row["kind"], row["axis"]) for row in data["check_comm"]["ranks"][0]["rows"]}
    assert ("reduce_scatter", "tp") in kinds and ("all_gather", "tp") in kinds


@pytest.mark.parametrize(("name", "overrides", "zero"), [("gpt3-125m", GPT, 1), ("llama-7b", LLAMA, 3)])
def test_sequence_parallelism_with_zero_across_dp_matches_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, zero
) -> None:
    """TP + SP on 2 x 2 ranks under FSDP's ZeRO 1 and 3: FSDP sums each norm weight's gradient over tp on its own
    before reducing over dp (once a step under ZeRO 1, every micro-batch under ZeRO 3), as priced."""
    path = _pipeline_plan(tmp_path, name, overrides, tp=2, dp=2, zero=zero, sp=True)
    data = _run(path, 4)
    rows = {(row["kind"], row["axis"]): row for row in data["check_comm"]["ranks"][0]["rows"]}
    norms = 2 * 2 + 1  # two per layer, then the final one
    weights = 2 if name == "gpt3-125m" else 1  # LayerNorm's weight and bias; RMSNorm's weight
    times = 1 if zero == 1 else load_plan(path).micro_batches
    assert rows[("all_reduce", "tp")]["counted"] == norms * weights * times


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "tp", "dp", "zero", "recompute"),
    [
        ("gpt3-125m", GPT, 1, 2, 0, None),  # DDP
        ("llama-7b", LLAMA, 1, 2, 0, None),
        ("llama-7b", LLAMA, 1, 2, 3, None),  # FSDP
        ("gpt3-125m", GPT, 1, 2, 1, None),  # FSDP2 keeping weights and whole gradients through the step
        ("llama-7b", LLAMA, 1, 2, 2, None),  # FSDP2 keeping weights, gradients reduce-scattered per micro-batch
        ("gpt3-125m", GPT, 2, 1, 0, None),  # fused QKV, tied head
        ("llama-7b", LLAMA, 2, 1, 0, None),  # grouped-query attention, rotary, SwiGLU, gathered head
        ("gpt3-125m", GPT, 1, 4, 3, None),  # FSDP on 4 ranks
        ("llama-7b", LLAMA, 2, 1, 0, BOTH),  # recomputation inside TP
        ("gpt3-125m", GPT, 1, 2, 3, BOTH),  # recomputation inside FSDP
        ("gpt3-125m", GPT, 2, 2, 0, None),  # TP with gradients all-reduced over dp by hand
        ("llama-7b", LLAMA, 2, 2, 1, None),  # TP x FSDP2 under ZeRO 1
        ("gpt3-125m", GPT, 2, 2, 3, None),  # FSDP x TP on a 2 x 2 mesh
        ("llama-7b", LLAMA, 2, 2, 3, BOTH),  # FSDP x TP with recomputation
        # Hugging Face attention: q, k and v projected apart from one normed input (its gradient reduced once)
        ("hf:mistral", {"layers": 2, "hidden": 256, "heads": 8, "vocab": 1024, "ffn": 512}, 2, 1, 0, None),
        ("hf:llama-tiny", {"layers": 2}, 2, 1, 0, None),  # and with grouped-query heads
        # heads formed with the module's own head count, view(bsz, -1, self.num_heads, head_dim): made per rank
        ("hf:opt", {"layers": 2, "hidden": 64, "heads": 4}, 2, 1, 0, None),
        # and a cross-attention's k and v reading the encoder's output: one replicated input, reduced once (its
        # audio 128 frames long, not 3,000, through a config file: no option sets it)
        ("whisper-short", {"layers": 2, "hidden": 64, "heads": 4}, 2, 1, 0, None),
        # fused q/k/v laid out group by group, each rank given whole groups as the weight stands: BLOOM's head by
        # head, Falcon's new decoder architecture's by key/value head; their ALiBi biases (and Falcon's mask, which
        # holds them) taken per rank
        ("hf:bloom", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 1024}, 2, 1, 0, None),  # not its 250,880
        ("falcon-new", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}, 2, 1, 0, None),
        # fused q/k/v cut by slices at the config's widths, and gate/up by chunk(2): laid out piece by piece
        ("hf:phi3", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128}, 2, 1, 0, None),
        # norms over all heads at once (OLMo 2's q and k norms): weights split with the features, means taken over
        # every rank's; under FSDP x TP too, their DTensor weights gathered over dp
        ("hf:olmo2", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 1024}, 2, 1, 0, None),
        ("hf:olmo2", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 1024}, 2, 2, 3, None),
    ],
)
def test_single_stage_plans_match_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, tp, dp, zero, recompute
) -> None:
    if name == "falcon-new":  # Falcon-40B's layout with ALiBi, through a config file (no option names them)
        from transformers import FalconConfig

        FalconConfig(new_decoder_architecture=True, alibi=True, architectures=["FalconForCausalLM"]).to_json_file(
            str(tmp_path / "config.json"))
        name = f"hf:{tmp_path}"
    if name == "whisper-short":  # Whisper with 64 encoder positions and a vocabulary of 1,024 (its token ids in it)
        from transformers import WhisperConfig

        WhisperConfig(vocab_size=1024, max_source_positions=64, pad_token_id=1023, bos_token_id=1022,
                      eos_token_id=1022, decoder_start_token_id=1021, suppress_tokens=[], begin_suppress_tokens=[],
                      architectures=["WhisperForConditionalGeneration"]).to_json_file(str(tmp_path / "config.json"))
        name = f"hf:{tmp_path}"
    path = _pipeline_plan(tmp_path, name, overrides, tp=tp, dp=dp, zero=zero, recompute=recompute)
    _run(path, tp * dp)


def test_the_check_names_the_first_mismatch() -> None:
    grads = {"w": torch.ones(3), "b": torch.zeros(2)}
    ref = StepLog(losses=[1.0, 0.5], grads=[grads, grads])
    same = StepLog(losses=[1.0, 0.5], grads=[dict(grads), dict(grads)])
    assert compare(same, ref)["ok"]
    off = StepLog(losses=[1.0, 0.5], grads=[grads, {"w": torch.ones(3) * 1.01, "b": torch.zeros(2)}])
    result = compare(off, ref)
    assert not result["ok"] and "step 1" in result["message"] and "of w" in result["message"]
    assert "loss" in compare(StepLog(losses=[1.0, 0.6], grads=[]), ref)["message"]


def test_a_gradient_beyond_the_tolerance_matches_where_it_is_as_close_to_float64_as_one_process() -> None:
    """A gradient outside the fp32 tolerance is compared with a float64 run: as close to it as the one-process fp32
    gradient is (within `ROUNDING` times) it is rounding, and matches; farther, or with no float64 run, it does
    not."""
    from autopar.cli.run import ROUNDING

    ref = StepLog(losses=[1.0], grads=[{"w": torch.tensor([1e-3, 2.0])}])
    ours = StepLog(losses=[1.0], grads=[{"w": torch.tensor([1e-3 + 4e-6, 2.0])}])  # off by 4e-06 > 1e-06 + 1e-7
    assert not compare(ours, ref)["ok"]
    near = StepLog(losses=[1.0], grads=[{"w": torch.tensor([1e-3 + 2e-6, 2.0], dtype=torch.float64)}])
    result = compare(ours, ref, exact=lambda: near)  # ours 2e-06 from float64, the reference 2e-06 too
    assert result["ok"] and result["rounding"]["gradients"] == 1 and result["rounding"]["largest_ratio"] <= ROUNDING
    far = StepLog(losses=[1.0], grads=[{"w": torch.tensor([1e-3 - 1e-7, 2.0], dtype=torch.float64)}])
    result = compare(ours, ref, exact=lambda: far)  # the reference is 1e-07 from float64, ours 4.1e-06
    assert not result["ok"] and "more than rounding" in result["message"]
    assert compare(ref, ref)["rounding"] is None


def _stepped(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from autopar.runtime.train import LEARNING_RATE

    return {name: w - LEARNING_RATE * grads[name] for name, w in weights.items()}


def test_the_check_compares_each_steps_update_from_the_weights_the_ranks_started_it_from() -> None:
    """With weights recorded, every step is compared from the run's own weights: its first weights must be the
    model's, and each step's update (after less before) the reference's from there. A run whose optimizer moved
    one weight otherwise fails naming the step and the weight, and so does one that starts elsewhere or whose
    pipeline stages hold a tied weight apart."""
    grads = {"w": torch.tensor([0.5, -1.0]), "b": torch.tensor([0.25])}
    w0 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    w1 = _stepped(w0, grads)
    run = StepLog(losses=[1.0, 0.5], grads=[grads, grads], weights=[w0, w1, _stepped(w1, grads)])
    ref = StepLog(losses=[1.0, 0.5], grads=[grads, grads], weights=[w0, w1, _stepped(w1, grads)])
    result = compare(run, ref)
    assert result["ok"] and "updates match" in result["message"], result

    wrong = dict(run.weights[2], b=run.weights[2]["b"] + 1e-4)  # step 1 moved b by 1e-4 more
    result = compare(dataclasses.replace(run, weights=[w0, w1, wrong]), ref)
    assert not result["ok"] and "step 1" in result["message"] and "moved b" in result["message"], result

    other_start = dict(w0, w=torch.tensor([1.0, 2.0 + 1e-6]))
    result = compare(dataclasses.replace(run, weights=[other_start, w1, run.weights[2]]), ref)
    assert not result["ok"] and "start from other weights" in result["message"] and "w" in result["message"]

    result = compare(dataclasses.replace(run, apart=["after step 0, pipeline ranks hold different copies of w"]),
                     ref)
    assert not result["ok"] and "different copies of w" in result["message"]


def test_an_update_off_by_rounding_alone_matches() -> None:
    """Both sides round ``w - lr * g`` to fp32: an update a unit in the last place of a large weight apart
    matches, though that is far beyond the gradients' tolerance times the learning rate for a small gradient."""
    grads = {"w": torch.tensor([1e-6])}
    w0 = {"w": torch.tensor([1000.0])}
    w1 = _stepped(w0, grads)
    ulp = torch.nextafter(w1["w"], torch.tensor([2000.0])) - w1["w"]
    run = StepLog(losses=[1.0], grads=[grads], weights=[w0, {"w": w1["w"] + ulp}])
    ref = StepLog(losses=[1.0], grads=[grads], weights=[w0, w1])
    assert compare(run, ref)["ok"]
    far = StepLog(losses=[1.0], grads=[grads], weights=[w0, {"w": w1["w"] + 64 * ulp}])
    assert not compare(far, ref)["ok"]


@pytest.mark.slow
def test_a_relu_model_under_zero_3_passes_the_check_over_many_clipped_steps(tmp_path, capsys) -> None:
    """OPT (ReLU) under ZeRO 3, clipped hard: the ranks and one process differ by fp32 rounding each step, and a
    run and a reference that went their own ways part for good where a unit's input crosses zero between them
    (checked that way, this run failed at step 4, 5.6x farther from float64 than rounding). Each step compared
    from the ranks' own weights, it matches, and its differences stay at rounding."""
    path = tmp_path / "plan.json"
    assert main(["estimate", "hf:opt", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch",
                 "8", "--mbs", "2", "--cluster", "cpu", "--dp", "2", "--zero", "3", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--steps", "5", "--check", "--clip-grad-norm", "0.05",
                 "--json"]) == 0
    check = json.loads(capsys.readouterr().out)["check"]
    assert check["ok"] and check["steps"] == 5 and "updates match" in check["message"], check
    assert check["max_grad_diff"] < 1e-6 and 0 < check["max_update_diff"] < 1e-6, check


GPT4 = dict(GPT, layers=4)
LLAMA4 = dict(LLAMA, layers=4)
HF = {"layers": 4}  # hf:llama-tiny (hidden 64, 4 heads, 2 key/value heads) with 4 layers
POST_NORMS = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 128}  # Gemma 2's and OLMo 2's
HF_GPT2 = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128}


NESTED = [["layers.0", "layers.3"], ["layers.0", "layers.1"]]  # a run inside a run; layer 3 replays last


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "pp", "tp", "dp", "zero", "sp", "recompute", "segments"),
    [
        ("gpt3-125m", GPT4, 1, 2, 1, 0, False, {"layers.2": "full"}, NESTED),
        ("llama-7b", LLAMA4, 1, 2, 1, 0, False, {"layers.3": "full"}, [["layers.1", "layers.3"]]),  # ends nested
        ("gpt3-125m", GPT4, 1, 1, 2, 3, False, None, [["layers.0", "layers.1"], ["layers.2", "layers.3"]]),  # FSDP
        ("llama-7b", LLAMA4, 1, 2, 2, 1, False, None, NESTED),  # TP x FSDP2
        ("hf:llama-tiny", HF, 1, 2, 1, 0, False, None, [["model.layers.0", "model.layers.2"]]),
        ("gpt3-125m", GPT4, 2, 2, 1, 0, False, None, [["layers.0", "layers.1"], ["layers.2", "layers.3"]]),  # pp
        ("gpt3-125m", GPT4, 1, 2, 1, 0, True, {"layers.2": "full"}, NESTED),  # sequence parallelism
        # post-norm layers (Gemma 2's): a run's last layer replays its last all-reduce, whose output the norm saves
        ("hf:gemma2", POST_NORMS, 1, 2, 1, 0, False, {"model.layers.3": "full"},
         [["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3"]]),
    ],
)
def test_checkpointed_segments_match_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, pp, tp, dp, zero, sp, recompute, segments
) -> None:
    """Runs of layers checkpointed together, nested or not (the rotor programme's plans): the replayed collectives
    are the ones the cost model predicts."""
    path = _pipeline_plan(tmp_path, name, overrides, pp=pp, tp=tp, dp=dp, zero=zero, sp=sp, recompute=recompute,
                          segments=segments, schedule="gpipe")
    _run(path, pp * tp * dp)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "pp", "tp", "dp", "schedule", "recompute"),
    [
        ("gpt3-125m", GPT4, 2, 1, 1, "1f1b", None),  # tied head: its gradient summed over the two ends
        ("llama-7b", LLAMA4, 2, 1, 1, "gpipe", None),
        ("gpt3-125m", GPT4, 4, 1, 1, "1f1b", {"layers.1": "full", "layers.2": "selective"}),  # middle stages
        ("gpt3-125m", GPT4, 2, 2, 1, "gpipe", None),  # PP x TP
        ("llama-7b", LLAMA4, 2, 2, 1, "1f1b", {"layers.0": "full", "layers.3": "full"}),
        ("gpt3-125m", GPT4, 2, 1, 2, "gpipe", None),  # PP x DP
        ("gpt3-125m", GPT4, 2, 1, 1, "interleaved", None),  # 2 chunks per device, the tied head on the last
        ("llama-7b", LLAMA4, 2, 1, 2, "interleaved", {"layers.2": "full"}),  # interleaved x DP, chunks synced apart
        ("hf:gpt2", HF_GPT2, 2, 1, 2, "1f1b", {"transformer.h.1": "full"}),  # GPT-2's chain, its head tied
        ("hf:gpt_bigcode", HF_GPT2, 2, 1, 1, "interleaved", None),  # GPT-2-style, multi-query attention
        ("hf:gpt2", HF_GPT2, 2, 2, 1, "gpipe", None),  # PP x TP over GPT-2's Conv1D projections
        ("hf:phi", HF_GPT2, 2, 1, 1, "1f1b", None),  # LLaMA-style under Phi's names, a dropout after the embedding
        ("hf:gpt_neox", HF_GPT2, 2, 2, 1, "1f1b", None),  # and GPT-NeoX's, its head untied
        ("hf:gptj", HF_GPT2, 2, 2, 1, "gpipe", None),  # and GPT-2's (GPT-J, CodeGen), attention and MLP in parallel
        ("hf:mpt", HF_GPT2, 2, 2, 1, "gpipe", None),  # ALiBi biases over the config's longest sequence, per rank
        # OPT-style with positions added to a scaled embedding (XGLM's sinusoidal, BioGPT's learned), the head
        # output_projection
        ("hf:biogpt", HF_GPT2, 2, 2, 1, "gpipe", None),
        ("hf:falcon", HF_GPT2, 2, 1, 2, "gpipe", None),  # LLaMA-style under GPT-2's names, multi-query, PP x DP
        ("hf:bloom", HF_GPT2, 2, 1, 1, "1f1b", None),  # ALiBi biases made per stage, a norm after the embedding
        ("hf:recurrent_gemma", HF_GPT2, 2, 1, 1, "1f1b", None),  # recurrent blocks, the embedding scaled by a buffer
        # masked LMs: the layers under ``roberta.encoder.layer``, the loss unshifted, the head's decoder tied to the
        # embedding across stages and its bias to the head's own (within the last stage: not summed)
        ("hf:roberta", HF_GPT2, 2, 2, 1, "1f1b", None),
        ("hf:bert", HF_GPT2, 2, 1, 2, "gpipe", None),  # the head under ``cls``
        # images: the first stage takes pixel_values, the last classifies the class token
        ("hf:vit", {"layers": 4, "hidden": 64, "heads": 4}, 2, 2, 1, "1f1b", None),
    ],
)
def test_pipelines_match_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, pp, tp, dp, schedule, recompute
) -> None:
    chunks = 2 if schedule == "interleaved" else 1
    path = _pipeline_plan(tmp_path, name, overrides, tp=tp, dp=dp, pp=pp, schedule=schedule, recompute=recompute,
                          chunks=chunks)
    data = _run(path, pp * tp * dp)
    assert {row["axis"] for rank in data["check_comm"]["ranks"] for row in rank["rows"]} >= {"pp"}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides", "pp", "sp"), [
    ("hf:gpt_bigcode", HF_GPT2, 1, True),  # a sequential layer: the residual stream meets the attention's shard
    ("hf:falcon", HF_GPT2, 2, False),  # attention and MLP in parallel, in 2 stages
    ("llama-7b", {**LLAMA, "kv_heads": 1}, 1, True),
])
def test_multi_query_attention_kept_whole_under_tp_matches_one_process(tmp_path, name, overrides, pp, sp) -> None:
    """One key/value head: the attention runs whole on every tp rank (gathering the sequence under SP and handing
    on its shard of the output), the MLP split; the collectives are those the cost model predicts."""
    path = _pipeline_plan(tmp_path, name, overrides, tp=2, dp=1, pp=pp, schedule="gpipe", sp=sp)
    data = _run(path, 2 * pp)
    assert {row["axis"] for rank in data["check_comm"]["ranks"] for row in rank["rows"]} >= {"tp"}


@pytest.mark.slow
def test_latent_attention_kept_whole_under_tp_and_sp_matches_one_process(tmp_path) -> None:
    """DeepSeek-V3's latent attention runs whole on every tp rank, as a multi-query one does, its MLP split. Under
    SP it gathers the sequence, so the norms inside it (of q's and of the keys' and values' latents) see the whole
    sequence and their weights' gradients need no sum: they once got SP's sequence-shard style, and q's norm's
    gradient was off by 1.6e-05 at the first step."""
    from transformers import AutoConfig

    AutoConfig.for_model("deepseek_v3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=128, vocab_size=128, q_lora_rank=32, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16).to_json_file(tmp_path / "config.json")
    path = _pipeline_plan(tmp_path, f"hf:{tmp_path / 'config.json'}", {}, tp=2, dp=1, sp=True)
    data = _run(path, 2)
    assert {row["kind"] for rank in data["check_comm"]["ranks"] for row in rank["rows"]} >= {"reduce_scatter"}


@pytest.mark.slow
def test_ctrl_in_two_stages_over_tp_matches_one_process(tmp_path) -> None:
    """CTRL's chain (a scaled embedding plus a sinusoidal table kept as a buffer, the head tied to the embedding) in
    2 stages x tp 2. Its attention takes its input three times (as v, k and q): the one replicated input the runtime
    makes is handed on for all three, so its gradient is reduced once, as priced (it was reduced three times, and
    the plan refused when planned). With GELU: CTRL's ReLU has units at a kink at these sizes, where fp32 sums in
    another order part a step's gradients from one process's whatever the plan, as OPT's do."""
    (tmp_path / "ctrl_gelu.py").write_text(
        "import torch\nfrom torch import nn\nfrom transformers import CTRLConfig, CTRLLMHeadModel\n\n\n"
        "def build(batch):\n"
        "    model = CTRLLMHeadModel(CTRLConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, dff=128,\n"
        "                                       n_positions=64))\n"
        "    for layer in model.transformer.h:\n"
        "        layer.ffn[1] = nn.GELU()\n"
        "    ids = torch.randint(0, 128, (batch, 32))\n"
        "    return model, {'input_ids': ids, 'labels': ids}\n")
    path = _pipeline_plan(tmp_path, f"{tmp_path / 'ctrl_gelu.py'}:build", {}, tp=2, dp=1, pp=2, schedule="gpipe")
    data = _run(path, 4)
    assert {row["axis"] for rank in data["check_comm"]["ranks"] for row in rank["rows"]} >= {"pp", "tp"}


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "sp"), [(2, False), (2, True), (1, True)])
def test_opt_plans_with_tp_match_one_process(tmp_path, pp, sp) -> None:
    """OPT's chain (learned positions offset by 2, its head tied to the embedding) in 2 stages, or one, over tp 2,
    its attention forming heads with the module's own head count (made per rank). Under sequence parallelism its
    decoder layer holds its MLP's linears itself, flattening the stream's batch and sequence into rows before
    them, and its final norm, registered before its layers, runs after them on sequence shards. With GELU: OPT's
    ReLU has units whose input lies within 1e-7 of zero at these sizes, which fp32 sums in another order can put on
    the other side, so a step's gradients differ from one process's at a kink, whatever the plan."""
    from transformers import OPTConfig

    OPTConfig(num_hidden_layers=4, hidden_size=64, word_embed_proj_dim=64, num_attention_heads=4, ffn_dim=256,
              vocab_size=128, activation_function="gelu").to_json_file(tmp_path / "config.json")
    path = _pipeline_plan(tmp_path, f"hf:{tmp_path / 'config.json'}", {}, tp=2, dp=1, pp=pp, schedule="gpipe",
                          sp=sp)
    data = _run(path, 2 * pp)
    axes = {row["axis"] for rank in data["check_comm"]["ranks"] for row in rank["rows"]}
    assert axes >= ({"pp", "tp"} if pp > 1 else {"tp"})


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_pipelines_of_sliding_window_models_match_one_process(tmp_path, model_type) -> None:
    """A window of 8 tokens at sequence 32: each stage gives its layers the masks (and, Gemma 3, the rotary tables)
    of their attention types, as the whole model does. Gemma 3's head dim (256) exceeds its hidden size: the
    stages send the residual stream, not the larger rotary tables its layers also read."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=256, vocab_size=256, sliding_window=8)
    if model_type == "gemma3_text":
        config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.to_json_file(tmp_path / "config.json")
    path = _pipeline_plan(tmp_path, f"hf:{tmp_path / 'config.json'}", {}, tp=1, dp=1, pp=2, schedule="1f1b")
    data = _run(path, 2)
    assert {row["axis"] for rank in data["check_comm"]["ranks"] for row in rank["rows"]} >= {"pp"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "schedule", "zero"),
    [("gpt3-125m", GPT4, "1f1b", 1), ("llama-7b", LLAMA4, "gpipe", 1), ("hf:llama-tiny", HF, "1f1b", 1),
     ("gpt3-125m", GPT4, "gpipe", 2), ("llama-7b", LLAMA4, "1f1b", 3), ("hf:llama-tiny", HF, "gpipe", 3),
     ("llama-7b", LLAMA4, "interleaved", 3), ("hf:gpt2", {"layers": 4, "hidden": 64, "heads": 4}, "1f1b", 3)],
)
def test_pipelines_under_zero_match_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, schedule, zero
) -> None:
    """2 stages x dp 2, FSDP2 over dp inside each stage; the schedule reduce-scatters once a step under ZeRO 1,
    after every micro-batch under ZeRO 2 and 3 (and ZeRO 3 gathers the weights for every forward and backward):
    the counts `--check-comm` compares differ between the three."""
    chunks = 2 if schedule == "interleaved" else 1
    path = _pipeline_plan(tmp_path, name, overrides, tp=1, dp=2, pp=2, zero=zero, schedule=schedule, chunks=chunks)
    data = _run(path, 4)
    kinds = {(row["kind"], row["axis"]) for row in data["check_comm"]["ranks"][0]["rows"]}
    assert {("all_gather", "dp"), ("reduce_scatter", "dp"), ("send_recv", "pp")} <= kinds


def test_a_1f1b_pipeline_with_fewer_micro_batches_than_stages_is_refused_when_planned(tmp_path, capsys) -> None:
    """PyTorch's 1F1B schedule refuses it when the ranks build it: `estimate --out` says so first, and how to plan
    one that runs; GPipe takes it."""
    small = ["gpt3-125m", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq", "32",
             "--cluster", "cpu", "--batch", "4", "--mbs", "4", "--gpus", "2", "--pp", "2"]
    out = tmp_path / "plan.json"
    assert main(["estimate", *small, "--out", str(out)]) == 2
    assert "the 1F1B schedule needs at least as many micro-batches as stages: 1 micro-batch of 4 samples for pp 2; " \
           "plan a smaller micro-batch (--mbs), or --schedule gpipe" in capsys.readouterr().err
    assert not out.exists()
    assert main(["estimate", *small, "--schedule", "gpipe", "--out", str(out)]) == 0 and out.exists()


def test_plans_the_runtime_cannot_apply_are_refused_by_name(tmp_path, capsys) -> None:
    from autopar.runtime.apply import check_matches
    from autopar.runtime.train import Workload, build_model

    from autopar.plan import Plan

    data = _plan(tmp_path, capsys, "--search", "dp")
    plan = Plan.from_dict(data["plan"])
    check_supported(plan)
    intra = json.loads(json.dumps(data["plan"]))
    intra["blocks"] = [{"id": 0, "layer": "embed", "module": "embed", "split": "m"}]
    intra["mesh"] = {"shape": [2], "axes": ["dp"]}
    del intra["stages"], intra["schedule"], intra["chunks"]
    intra["modules"] = {}
    for zero in (0, 1, 2, 3):  # intra-op plans run (`runtime.intra`), with ZeRO 0-3
        intra["zero"] = zero
        check_supported(Plan.from_dict(intra))
    intra["kernels"] = "compiled"
    with pytest.raises(NotImplementedError, match="intra-op plans run eager only"):
        check_supported(Plan.from_dict(intra))
    intra["kernels"] = "eager"
    model = build_model(Workload.of(plan))
    check_matches(model, plan)

    def changed(edit) -> Plan:  # noqa: ANN001
        other = json.loads(json.dumps(data["plan"]))
        edit(other)
        return Plan.from_dict(other)

    deeper = changed(lambda p: p["stages"][0]["layers"].append("layers.7"))  # planned for a deeper model
    with pytest.raises(ValueError, match="'layers.7', which the model does not have"):
        check_matches(model, deeper)
    narrower = changed(lambda p: p["modules"]["layers.0.attn.qkv"]["shapes"].update(  # planned at hidden 32
        {"layers.0.attn.qkv.weight": [96, 32]}))
    with pytest.raises(ValueError, match=r"'layers.0.attn.qkv.weight' of 'layers.0.attn.qkv' has shape \[192, 64\]"):
        check_matches(model, narrower)
    extra = changed(lambda p: p["modules"]["layers.0.attn.qkv"]["params"].update(
        {"layers.0.attn.qkv.scale": "[R, R]"}))
    with pytest.raises(ValueError, match="parameter 'layers.0.attn.qkv.scale' of 'layers.0.attn.qkv'"):
        check_matches(model, extra)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["run", str(path), "--nproc", "2", "--steps", "2", "--check-comm"]) == 2
    assert "--check-comm counts the last step and needs --steps 3 or more" in capsys.readouterr().err


def test_estimate_writes_a_configuration_as_a_plan_the_runtime_reads(tmp_path, capsys) -> None:
    from autopar.runtime.apply import check_matches
    from autopar.runtime.comm import stage_predictions
    from autopar.runtime.train import Workload, build_model

    path = tmp_path / "pp.json"
    assert main(["estimate", *TINY, "--layers", "4", "--cluster", "cpu", "--pp", "2", "--tp", "2", "--mbs", "2",
                 "--batch", "8", "--schedule", "gpipe", "--out", str(path)]) == 0
    capsys.readouterr()
    plan = json.loads(path.read_text())["plan"]
    assert plan["schedule"] == "gpipe" and [(s["dp"], s["tp"]) for s in plan["stages"]] == [(1, 2), (1, 2)]
    assert plan["workload"]["overrides"]["layers"] == 4 and plan["micro_batches"] == 4
    plan = load_plan(path)
    check_matches(build_model(Workload.of(plan)), plan)
    first, last = stage_predictions(plan)  # the tied head's gradient is summed over the two ends
    assert {(c["kind"], c["axis"]) for c in first} == {("all_reduce", "tp"), ("all_reduce", "pp"), ("send_recv", "pp")}
    assert [c for c in first if c["axis"] == "pp" and c["kind"] == "all_reduce"][0]["count"] == 1


def test_recomputation_keeps_fewer_tensors_and_the_same_gradients() -> None:
    from autopar.runtime.apply import recompute
    from autopar.runtime.train import Workload, build_model, global_batch

    work = Workload(model="gpt3-125m", overrides=GPT, seq=32, batch=4, micro_batch=4, micro_batches=1)
    batch = global_batch(work, 0)

    def run(levels: dict) -> tuple[int, dict]:
        model = build_model(work)
        recompute(model, levels)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
            loss = model(**batch)
        loss.backward()
        return sum(kept), {n: p.grad for n, p in model.named_parameters()}

    plain, grads = run({})
    selective, grads_s = run({"layers.0": "selective", "layers.1": "selective"})
    full, grads_f = run({"layers.0": "full", "layers.1": "full"})
    assert full < selective < plain
    for other in (grads_s, grads_f):
        for name, grad in grads.items():
            torch.testing.assert_close(other[name], grad)


@pytest.mark.slow
def test_the_auto_plan_of_a_tiny_model_runs_on_four_ranks(tmp_path, capsys) -> None:
    path = tmp_path / "auto.json"
    assert main(["plan", *TINY, "--cluster", "cpu", "--gpus", "4", "--batch", "16", "--out", str(path)]) == 0
    capsys.readouterr()
    code = main(["run", str(path), "--nproc", "4", "--steps", "3", "--check", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["check"]["ok"]


@pytest.mark.parametrize("name", ["hf:gemma2", "hf:olmo2"])
def test_a_checkpointed_run_ending_in_a_post_norm_layer_replays_its_last_collective(tmp_path, capsys, name) -> None:
    """A run of layers checkpointed together replays its last layer up to the last tensor the backward saved; a
    post-norm saves the output of that layer's last all-reduce, so the replay issues it again. It was priced as not
    replayed, and the rehearsal refused such plans at tp 2 (`all_reduce on tp: 40 calls ... counted, 38 ...
    predicted` for Gemma 2); the slow tier runs them against one process."""
    path = _pipeline_plan(tmp_path, name, POST_NORMS, tp=2, dp=1, segments=[["model.layers.0", "model.layers.1"]])
    assert main(["dryrun", path, "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["ok"]


def test_dryrun_matches_the_prediction_on_a_fake_process_group(tmp_path, capsys) -> None:
    path = _pipeline_plan(tmp_path, "llama-7b", LLAMA, tp=2, dp=2, zero=3)
    assert main(["dryrun", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["world_size"] == 4
    kinds = {(r["kind"], r["axis"]) for r in out["rows"]}
    assert {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "tp")} <= kinds
    # the same counts against the prediction for ZeRO 0 fail, naming the first difference
    from autopar.runtime.comm import compare, stage_predictions

    plan = load_plan(path)
    counted = [{"kind": r["kind"], "axis": r["axis"], "count": r["counted"], "bytes": r["counted_bytes"]}
               for r in out["rows"]]
    result = compare(counted, stage_predictions(dataclasses.replace(plan, zero=0))[0])
    assert not result["ok"] and result["message"].startswith("all_gather on dp: 10 calls")


# post-norms, alternating sliding-window layers; a vocabulary of 128 (Gemma 2's own, 256,000, took 2 of a run's 2.5
# minutes in its logits and tied head)
# ffn 128: Gemma 2's and Qwen3's own MLP widths (14,336 and 22,016) would hold nearly all the weights and time
GEMMA2 = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 128, "ffn": 128}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "schedule", "chunks"),
    [
        ("llama-7b", LLAMA4, "1f1b", 1),
        ("gpt3-125m", GPT4, "gpipe", 1),  # the tied head: the last stage gathers the sequence before it
        ("llama-7b", LLAMA4, "interleaved", 2),  # each chunk sums its norms' gradients over tp, as priced
        ("hf:gemma2", GEMMA2, "1f1b", 1),  # masks and rotary tables made for the whole sequence on every stage
        ("hf:qwen3", GEMMA2, "1f1b", 1),  # q/k norms per head, summed over tp
        # the embedding's norm sees the whole sequence (it comes before the layers in the stage, as in the model)
        ("hf:roberta", HF_GPT2, "gpipe", 1),
    ],
)
def test_pipelines_with_sequence_parallelism_match_one_process_and_the_predicted_collectives(
    tmp_path, name, overrides, schedule, chunks
) -> None:
    """2 stages x tp 2 under SP: the first stage scatters the stream, stages hand each other sequence shards (a
    tp rank sends its own 1/tp), the last gathers it for the head."""
    path = _pipeline_plan(tmp_path, name, overrides, tp=2, dp=1, pp=2, sp=True, schedule=schedule, chunks=chunks)
    data = _run(path, 4)
    sends = [row for row in data["check_comm"]["ranks"][0]["rows"] if row["kind"] == "send_recv"]
    plain = _run(_pipeline_plan(tmp_path, name, overrides, tp=2, dp=1, pp=2, schedule=schedule, chunks=chunks), 4)
    whole = [row for row in plain["check_comm"]["ranks"][0]["rows"] if row["kind"] == "send_recv"]
    assert sends[0]["counted_bytes"] * 2 == whole[0]["counted_bytes"]  # sequence shards cross, not the stream


def test_dryrun_of_a_pipeline_with_sequence_parallelism(tmp_path, capsys) -> None:
    path = _pipeline_plan(tmp_path, "hf:gemma2", GEMMA2, tp=2, dp=1, pp=2, sp=True)
    assert main(["dryrun", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [r["rank"] for r in out["ranks"]] == [0, 2]
    kinds = {(r["kind"], r["axis"]) for r in out["ranks"][1]["rows"]}
    assert {("reduce_scatter", "tp"), ("all_gather", "tp"), ("send_recv", "pp")} <= kinds


@pytest.mark.parametrize(
    ("name", "overrides", "pp", "tp", "dp", "zero", "chunks", "schedule"),
    [
        ("llama-7b", LLAMA4, 2, 1, 2, 3, 1, "1f1b"),  # FSDP2 inside stages, reduce-scattering per micro-batch
        ("gpt3-125m", GPT4, 2, 2, 2, 1, 1, "gpipe"),  # tp inside stages, the tied head summed over the ends
        ("llama-7b", dict(LLAMA, layers=8), 4, 2, 4, 0, 2, "1f1b"),  # 32 ranks, interleaved: 8 chunks
        ("hf:llama-tiny", HF, 2, 1, 2, 2, 1, "1f1b"),
    ],
)
def test_dryrun_of_a_pipeline_rehearses_each_stage_on_a_fake_process_group(
    tmp_path, capsys, monkeypatch, name, overrides, pp, tp, dp, zero, chunks, schedule
) -> None:
    """Each pipeline stage's first rank runs the schedule on a fake process group (sends and receives move
    nothing; the stages' shapes are worked out on the meta device) and is compared with its stages' prediction."""
    path = _pipeline_plan(tmp_path, name, overrides, tp=tp, dp=dp, zero=zero, pp=pp, chunks=chunks,
                          schedule=schedule)
    assert main(["dryrun", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["world_size"] == pp * dp * tp
    assert [r["rank"] for r in out["ranks"]] == [d * dp * tp for d in range(pp)] and all(r["ok"] for r in out["ranks"])
    sends = [row for rank in out["ranks"] for row in rank["rows"] if row["kind"] == "send_recv"]
    assert len(sends) == pp and all(row["counted"] == row["predicted"] > 0 for row in sends)
    # a prediction one call short for the last stage is found, and the rank named
    from autopar.runtime import comm, dryrun

    real = comm.stage_predictions

    def short(plan, **kwargs):  # noqa: ANN001, ANN003, ANN202
        stages = real(plan, **kwargs)
        last = stages[-1]
        row = next(r for r in last if r["kind"] == "send_recv")
        return [*stages[:-1], [r if r is not row else {**r, "count": r["count"] - 1} for r in last]]

    monkeypatch.setattr(dryrun, "stage_predictions", short)
    assert main(["dryrun", path]) != 0
    last_rank = ((len(load_plan(path).stages) - 1) % pp) * dp * tp
    assert f"rank {last_rank}: send_recv on pp" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_dryrun_of_a_64_way_plan_for_a_billion_parameter_model(tmp_path, capsys, zero: int) -> None:
    """gpt3-1.3b on 8 x 8 (dp x tp) at its full world size, in one process."""
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, even_stages
    from autopar.plan import Workload, save_plan
    from autopar.search.pipeline import Found, pipeline_plan
    from autopar.zoo import load

    zoo = load("gpt3-1.3b", batch=1, seq=2048)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs),
                          load_cluster("a100-80g-sxm").with_devices(64), traced_batch=1)
    config = PipelineConfig(stages=even_stages(model, 1, tp=8, dp=8), micro_batch=8, zero=zero)
    plan = pipeline_plan(model, Found(config, model.estimate(config, global_batch=16), 1), name="gpt3-1.3b",
                         kind="test", global_batch=16, workload=Workload(model="gpt3-1.3b", seq=2048, batch=16))
    path = tmp_path / "plan.json"
    save_plan(path, plan)
    assert main(["dryrun", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["world_size"] == 64
    tp_rows = [r for r in out["rows"] if r["axis"] == "tp"]
    assert tp_rows and tp_rows[0]["counted"] == 24 * 4 * 2  # 24 layers, 4 all-reduces each, 2 micro-batches



@pytest.mark.slow
@pytest.mark.parametrize(
    ("pp", "tp", "dp", "zero", "sp", "schedule", "recompute"),
    [
        (1, 1, 2, 0, False, "1f1b", None),  # DDP
        (1, 1, 2, 3, False, "1f1b", None),  # FSDP
        (1, 2, 1, 0, False, "1f1b", {"model.layers.1": "full"}),  # TP (separate q, k, v) with recomputation
        (1, 2, 1, 0, True, "1f1b", None),  # TP + SP
        (1, 2, 2, 3, False, "1f1b", None),  # FSDP x TP
        (2, 1, 1, 0, False, "gpipe", None),  # PP
        (2, 2, 1, 0, False, "1f1b", None),  # PP x TP
    ],
)
def test_hugging_face_llama_plans_match_one_process_and_the_predicted_collectives(
    tmp_path, pp, tp, dp, zero, sp, schedule, recompute
) -> None:
    path = _pipeline_plan(tmp_path, "hf:llama-tiny", HF, tp=tp, dp=dp, zero=zero, recompute=recompute, pp=pp,
                          schedule=schedule, sp=sp)
    _run(path, pp * tp * dp)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--dp", "2", "--zero", "3", "--recompute", "selective"],  # FSDP2 units compiled, attention recomputed
    ["--tp", "2", "--recompute", "full"],  # DTensor layers compiled inside their checkpoints
    ["--pp", "2", "--mbs", "2"],  # pipeline stages of compiled layers
])
def test_plans_with_compiled_kernels_run_compiled_and_match_one_process(tmp_path, capsys, extra) -> None:
    """Each repeated layer runs through torch.compile with fullgraph (a layer dynamo could not capture whole would
    fail the run, not fall back to eager); losses and gradients match one eager process, and the collectives,
    those inside compiled layers included, are the predicted ones."""
    path = tmp_path / "compiled.json"
    assert main(["estimate", *TINY, "--cluster", "cpu", "--gpus", "2", "--batch", "8", "--kernels", "compiled",
                 *extra, "--out", str(path)]) == 0
    capsys.readouterr()
    assert load_plan(path).kernels == "compiled"
    _run(path, 2)


def test_compiled_kernels_with_selective_recomputation_under_tp_are_refused_before_ranks_start(
        tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    args = ["estimate", *TINY, "--cluster", "cpu", "--gpus", "2", "--batch", "8", "--tp", "2", "--recompute",
            "selective", "--out", str(path)]
    assert main([*args, "--kernels", "compiled"]) == 2  # refused when planned: no plan file for run to refuse
    err = capsys.readouterr().err.strip()
    assert "recomputes attention selectively under tensor parallelism with compiled kernels" in err
    assert len(err.splitlines()) == 1 and not path.exists()
    assert main([*args, "--kernels", "eager"]) == 0
    data = json.loads(path.read_text())
    data["plan"]["kernels"] = "compiled"  # the same plan edited by hand: run's own check refuses it
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "recomputes attention selectively under tensor parallelism with compiled kernels" in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("name", "grid"), [
    ("hf:phi", {"tp": 2, "dp": 1}),  # attention and MLP read one norm's output: each reduces its gradient
    ("hf:phi", {"tp": 2, "dp": 1, "sp": True}),
    ("hf:gemma", {"tp": 1, "dp": 2}),  # a 62 MiB embedding: DDP's buckets are whole tensors, not 25 MiB slices
    ("hf:gemma2", {"tp": 1, "dp": 2, "zero": 3}),  # alternating layer kinds: each layer is its own FSDP unit
    ("hf:gpt2", {"tp": 1, "dp": 2}),  # its configs' dropout 0.1, turned off by the runtime
    # Conv1D projections (weights stored (in, out)); a fused q/k/v cut by .split(split_size); under SP the model
    # reshapes its final norm's output by the whole sequence
    ("hf:gpt2", {"tp": 2, "dp": 1}),
    ("hf:gpt2", {"tp": 2, "dp": 1, "sp": True}),
    ("hf:bert", {"tp": 2, "dp": 1}),  # q, k, v in attention.self, their row partner in attention.output
    # under SP: the embedding's norm sees the whole sequence, the MLM head's dense layer gathers it, and the norm
    # after that dense layer runs whole (its gradient is not summed over tp)
    ("hf:roberta", {"tp": 2, "dp": 1, "sp": True}),
    ("hf:codegen", {"tp": 2, "dp": 1}),  # rotary by stacking two halves along a new dim: the heads stay split
    # q and k norms per head: their gradients summed over tp once a step (with SP's norm weights under SP; each
    # rank's ZeRO shard of them under ZeRO 3)
    ("hf:qwen3", {"tp": 2, "dp": 1}),
    ("hf:qwen3", {"tp": 2, "dp": 1, "sp": True}),
    ("hf:gemma3_text", {"tp": 2, "dp": 1}),
    ("hf:gemma2", {"tp": 2, "dp": 1, "sp": True}),  # norms after each block meet the stream as local shards
    ("hf:qwen3", {"tp": 2, "dp": 2, "zero": 3}),
])
def test_hugging_face_models_match_one_process_and_the_predicted_collectives(tmp_path, name, grid) -> None:
    """Cases `autopar run --check --check-comm` failed on (or that were refused) before: predicted collectives that
    the runtime does not issue, dropout left on, replicated weights on split heads. With a vocabulary of 128 but
    for Gemma's DDP case, which is about its large embedding (Gemma's, Gemma 2's and Qwen3's own vocabularies made
    their logits most of each run's time)."""
    # ffn 128: the configs' own MLP widths (Qwen3's 22,016) would hold nearly all the weights and time
    size = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128, **({} if name == "hf:gemma" else {"vocab": 128})}
    _run(_pipeline_plan(tmp_path, name, size, **grid), grid["tp"] * grid["dp"])


def _dropout_rank(rank: int, rendezvous, plan_path: str) -> dict:
    """Three SGD steps of the tiny GPT with dropout on, through the Python API, on a rank seeded apart from its peers
    after the model is built (as a training script seeding its data order per rank does); the 1-D weights."""
    import torch.distributed as dist

    import autopar
    from autopar.zoo.catalog import load

    torch.set_num_threads(1)
    rendezvous.join(rank, backend="gloo")
    try:
        torch.manual_seed(0)
        zoo = load("gpt3-125m", batch=4, seq=32, dtype=torch.float32, device="cpu", layers=2, hidden=64, heads=4,
                   vocab=128, dropout=0.1)
        torch.manual_seed(1234 + rank)
        parallel = autopar.parallelize(zoo.module, load_plan(plan_path))
        optimizer = parallel.make_optimizer(torch.optim.SGD, lr=0.1)
        for step in range(3):
            optimizer.zero_grad()
            ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(step))
            parallel.step({"input_ids": ids, "labels": ids})
            optimizer.step()
            torch.rand(rank + 1)  # ranks draw apart between steps too
        return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().tolist()
                for name, p in zoo.module.named_parameters() if p.dim() == 1}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "ranks"), [(["--tp", "2", "--dp", "1", "--mbs", "2"], 2),
                                               (["--tp", "2", "--dp", "2", "--zero", "3", "--mbs", "2"], 4)])
def test_tensor_parallel_ranks_draw_the_same_dropout_whatever_their_seeds(tmp_path, capsys, layout, ranks) -> None:
    """Tensor-parallel ranks hold the same replicated activations; dropout masks drawn apart on them would make
    the replicated weights (norms, row-parallel biases) drift apart without an error."""
    from autopar.cluster.ranks import run_ranks

    path = tmp_path / "plan.json"
    assert main(["estimate", *TINY, "--cluster", "cpu", "--batch", "4", "--pp", "1", *layout, "--out", str(path)]) == 0
    capsys.readouterr()
    weights = run_ranks(_dropout_rank, ranks, args=(str(path),))
    # replicated over tp: the norms and the row-parallel projections' biases (column-parallel ones are split)
    replicated = [name for name in weights[0]
                  if name.rpartition(".")[0].endswith(("ln1", "ln2", "norm", "proj", "fc2"))]
    assert len(replicated) == 14
    for first, second in zip(weights[::2], weights[1::2]):  # tp innermost: ranks 2k and 2k + 1 form a tp group
        assert {name: first[name] for name in replicated} == {name: second[name] for name in replicated}


def test_a_model_with_a_child_named_module_is_read_whole_under_fsdp(tmp_path, capsys) -> None:
    """A user's model may name a child ``module``, as DDP names the model it wraps: under FSDP (no DDP wrapper) the
    weights and gradients read back are the whole model's, not that child's, so the check passes."""
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.module = nn.Linear(16, 32)\n"
        "        self.head = nn.Linear(32, 4)\n\n"
        "    def forward(self, x, y):\n"
        "        return nn.functional.cross_entropy(self.head(torch.relu(self.module(x))), y)\n\n\n"
        "def build(batch):\n"
        "    return Net(), {'x': torch.randn(batch, 16), 'y': torch.randint(0, 4, (batch,))}\n")
    path = tmp_path / "z1.json"
    assert main(["estimate", f"{tmp_path / 'net.py'}:build", "--cluster", "cpu", "--batch", "8", "--dp", "2",
                 "--zero", "1", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["check"]["ok"], data["check"]
