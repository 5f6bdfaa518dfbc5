"""MODEL in every form: hf:<model_type> from transformers' own configs, hf:path/config.json, file.py:function; their
errors; a plan from each rebuilds its model; and tp refused where the model cuts a fused projection's output."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

import autopar
from autopar.cli.main import main
from autopar.plan import load_plan
from autopar.zoo import describe, get_config, load

pytest.importorskip("transformers")

SMALL = {"layers": 2, "hidden": 64, "heads": 4}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- hf:<model_type> ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model_type", "task_inputs", "head"), [
    ("gemma", {"input_ids", "labels"}, "GemmaForCausalLM"),
    ("roberta", {"input_ids", "labels"}, "RobertaForMaskedLM"),
    ("bart", {"input_ids", "decoder_input_ids", "labels"}, "BartForConditionalGeneration"),
    ("vit", {"pixel_values", "labels"}, "ViTForImageClassification"),
    ("whisper", {"input_features", "decoder_input_ids", "labels"}, "WhisperForConditionalGeneration"),
])
def test_hf_types_build_with_options_on_their_own_fields(model_type: str, task_inputs: set[str], head: str) -> None:
    zoo = load(f"hf:{model_type}", batch=2, seq=32 if model_type != "vit" else None, **SMALL)
    config = zoo.module.config
    assert type(zoo.module).__name__ == head
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert set(zoo.inputs) == task_inputs and all(v.shape[0] == 2 for v in zoo.inputs.values())
    graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    assert graph.num_params == sum(p.numel() for p in zoo.module.parameters())
    assert graph.flops_forward > 0


def test_encoder_decoder_options_set_both_stacks() -> None:
    config = load("hf:whisper", batch=1, seq=16, **SMALL).module.config
    assert (config.encoder_layers, config.decoder_layers) == (2, 2)
    assert (config.encoder_attention_heads, config.decoder_attention_heads) == (4, 4)


@pytest.mark.parametrize("name", ["hf:t5", "t5-base"])
def test_layers_set_both_t5_stacks_unless_the_decoder_is_given(name: str) -> None:
    """``--layers 2`` on T5 used to leave its decoder at 12 layers: a model of 2 + 12 layers planned as asked."""
    def stacks(**options: int) -> tuple[int, int]:
        module = load(name, batch=1, seq=8, device="meta", **options).module
        encoder, decoder = (getattr(stack, "block", None) or stack.layers for stack in (module.encoder, module.decoder))
        return len(encoder), len(decoder)

    assert stacks(layers=2) == (2, 2)
    assert stacks(layers=2, decoder_layers=3) == (2, 3)
    assert stacks() == (12, 12)


def test_seq_is_an_image_classifier_s_image_side() -> None:
    zoo = load("hf:vit", batch=1, seq=64, **SMALL)
    assert zoo.module.config.image_size == 64 and zoo.inputs["pixel_values"].shape == (1, 3, 64, 64)
    assert load("hf:convnext", batch=1, layers=2).module.config.depths == [3, 3]  # per-stage lists at the new depth


def test_derived_sizes_follow_unless_the_config_sets_them() -> None:
    qwen3 = load("hf:qwen3", batch=1, seq=16, **SMALL).module.config  # default head_dim 128 = 4096 / 32
    assert (qwen3.head_dim, qwen3.num_key_value_heads) == (16, 4)  # both follow (multi-head default)
    gemma = load("hf:gemma", batch=1, seq=16, **SMALL).module.config  # default head_dim 256 != 3072 / 16
    assert gemma.head_dim == 256
    gemma3 = load("hf:gemma3_text", batch=1, seq=16, **SMALL, kv_heads=2).module.config
    assert gemma3.num_key_value_heads == 2 and len(gemma3.layer_types) == 2  # per-layer pattern at the new depth


def test_grouped_query_default_needs_kv_heads_that_divide() -> None:
    assert get_config("hf:gpt_oss").kv_heads == 8
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(8\)"):
        get_config("hf:gpt_oss", heads=4)


def test_dropout_off_sets_every_dropout_field() -> None:
    config = load("hf:roberta", batch=1, seq=16, dropout=0.0, **SMALL).module.config
    assert config.hidden_dropout_prob == 0.0 and config.attention_probs_dropout_prob == 0.0
    assert load("hf:roberta", batch=1, seq=16, **SMALL).module.config.hidden_dropout_prob == 0.1


def test_hand_written_specs_keep_their_sizes() -> None:
    assert get_config("hf:llama-tiny").layers == 2 and get_config("hf:llama").hidden == 4096
    assert type(load("hf:t5-tiny", batch=1, seq=16).module).__name__ == "T5ForConditionalGeneration"


def test_profile_prints_the_configuration_it_built(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "profile", "hf:gemma3_text", "--layers", "2", "--hidden", "64", "--heads", "4",
                             "--kv-heads", "2", "--seq", "64")
    assert code == 0, err
    built = out.splitlines()[1]
    assert built.startswith("built Gemma3ForCausalLM from Gemma3TextConfig")
    for part in ("kv heads 2", "head dim 256", "ffn 9216", "positions 131072", "sliding window 4096"):
        assert part in built
    code, out, err = run_cli(capsys, "profile", "hf:qwen2_moe", *_flags(SMALL), "--experts", "4", "--seq", "64",
                             "--json")
    assert code == 0, err
    built = json.loads(out)["built"]
    assert (built["experts"], built["sliding_window"], built["set"]["num_experts"]) == (4, None, 4)


def _flags(options: dict[str, int]) -> list[str]:
    return [item for key, value in options.items() for item in (f"--{key.replace('_', '-')}", str(value))]


# ---- hf:path/config.json -----------------------------------------------------------------------------------------

def test_config_file_builds_its_architecture_with_options(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "intermediate_size": 128, "vocab_size": 300}))
    cfg = get_config(f"hf:{path}")
    assert cfg.name == f"hf:{path}" and (cfg.layers, cfg.kv_heads, cfg.vocab) == (3, 2, 300)
    zoo = load(f"hf:{tmp_path}", batch=1, seq=16, layers=1)  # a folder holding config.json
    assert zoo.module.config.num_hidden_layers == 1 and zoo.module.config.intermediate_size == 128
    assert describe(zoo)["set"]["vocab_size"] == 300


# ---- file.py:function --------------------------------------------------------------------------------------------

def _user_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(50, 16)
                self.out = nn.Linear(16, 50)

            def forward(self, ids, labels):
                logits = self.out(self.embed(ids))
                return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    """) + textwrap.dedent(body))
    return path


def test_function_builds_its_model_on_meta_with_its_inputs(tmp_path: Path) -> None:
    path = _user_file(tmp_path, """
        def build(batch):
            return Net().to("cpu"), {"ids": torch.randint(0, 50, (batch, 12)), "labels": torch.randint(0, 50, (batch, 12))}
    """)
    zoo = load(f"{path}:build", batch=3)
    assert zoo.config.name == f"{path}:build" and zoo.seq == 12
    assert all(p.device.type == "meta" for p in zoo.module.parameters())
    assert zoo.inputs["ids"].shape == (3, 12) and zoo.inputs_at(5)["ids"].shape == (5, 12)
    assert autopar.trace(zoo.module, example_kwargs=zoo.inputs).num_params == 16 * 50 + 16 * 50 + 50


@pytest.mark.parametrize(("body", "name", "message"), [
    ("", "missing.py:build", "no such file"),
    ("def build(batch): pass", "mine.py:biuld", "has no function 'biuld'; did you mean build"),
    ("def build(batch): return Net()", "mine.py:build", r"must return \(model, inputs\).*returned a Net"),
    ("def build(batch): return Net(), [1]", "mine.py:build", "second item is a list"),
    ("def build(batch): return Net(), {'ids': [1]}", "mine.py:build", "input 'ids' is a list"),
    ("def build(batch): return Net(), {'ids': torch.zeros(batch + 1, 4, dtype=torch.long)}", "mine.py:build",
     r"input 'ids' has shape \[3, 4\], but its first dim must be the batch \(2\)"),
    ("def build(batch): raise RuntimeError('no data here')", "mine.py:build", r"build\(2\) raised RuntimeError: no data"),
    ("raise ImportError('needs a package')", "mine.py:build", "importing .* failed: ImportError: needs a package"),
    ("", "no_such_package_xyz.module:build", "no module named 'no_such_package_xyz'"),
])
def test_function_errors_name_the_input_and_the_fix(tmp_path: Path, body: str, name: str, message: str) -> None:
    _user_file(tmp_path, body)
    target = name if name.startswith("no_such") else str(tmp_path / name)
    with pytest.raises(ValueError, match=message):
        load(target, batch=2)


def test_forward_that_returns_no_loss_is_refused(tmp_path: Path) -> None:
    path = _user_file(tmp_path, """
        class Logits(Net):
            def forward(self, ids, labels):
                return self.out(self.embed(ids))

        def build(batch):
            return Logits(), {"ids": torch.zeros(batch, 8, dtype=torch.long), "labels": torch.zeros(batch, 8, dtype=torch.long)}
    """)
    zoo = load(f"{path}:build", batch=2)
    with pytest.raises(Exception, match=r"returned a tensor of shape \[2, 8, 50\]; it must return the training loss"):
        autopar.trace(zoo.module, example_kwargs=zoo.inputs)


def test_model_options_do_not_apply_to_a_function(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _user_file(tmp_path, "def build(batch): return Net(), {'ids': torch.zeros(batch, 8, dtype=torch.long), "
                                "'labels': torch.zeros(batch, 8, dtype=torch.long)}")
    code, _, err = run_cli(capsys, "profile", f"{path}:build", "--layers", "2")
    assert code == 2 and "option(s) layers do not apply to a model your function builds" in err
    code, _, err = run_cli(capsys, "profile", f"{path}:build", "--seq", "16")
    assert code == 2 and "the function's inputs have 8" in err


def test_unknown_forms_list_close_matches(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "profile", "hf:gemmma")
    assert code == 2 and "unknown Hugging Face model type 'gemmma'; close: hf:gemma" in err
    code, _, err = run_cli(capsys, "profile", "hf:gemma-tiny")
    assert code == 2 and "-tiny names only the seven hand-written specs" in err
    code, _, err = run_cli(capsys, "profile", "hf:/no/such/config.json")
    assert code == 2 and "no such config file" in err


# ---- plans record what rebuilds the model ------------------------------------------------------------------------

def test_plan_from_a_file_records_its_absolute_path_and_rebuilds(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.runtime import check_runnable

    monkeypatch.chdir(EXAMPLES.parent)
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "plan", "examples/nanogpt.py:build", "--cluster", "cpu", "--gpus", "2", "--batch",
                           "4", "--budget-s", "2", "--runnable", "--out", str(out))
    assert code == 0, err
    plan = load_plan(str(out))
    assert plan.workload.model == f"{EXAMPLES / 'nanogpt.py'}:build"
    monkeypatch.chdir(tmp_path)  # elsewhere: the recorded path still finds the file
    check_runnable(plan, rehearse=False)


def test_plan_from_a_type_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "plan", "hf:qwen3", *_flags(SMALL), "--seq", "32", "--cluster", "cpu", "--gpus",
                           "2", "--batch", "2", "--budget-s", "2", "--out", str(out))
    assert code == 0, err
    work = load_plan(str(out)).workload
    assert (work.model, work.override_map, work.seq) == ("hf:qwen3", SMALL, 32)


# ---- tp where the model cuts a fused projection ------------------------------------------------------------------

def test_fused_qkv_split_is_refused_under_tp_naming_the_module(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    example = f"{EXAMPLES / 'nanogpt.py'}:build"
    code, _, err = run_cli(capsys, "estimate", example, "--cluster", "cpu", "--gpus", "2", "--batch", "4", "--tp",
                           "2", "--pp", "1", "--mbs", "4", "--out", str(tmp_path / "tp.json"))
    assert code == 2
    assert "module 'model.transformer.h.0.attn.c_attn' would be split by output features over tp 2" in err
    assert not (tmp_path / "tp.json").exists()


def test_a_chunked_fused_projection_is_refused_and_separate_ones_are_not(tmp_path: Path) -> None:
    from autopar.runtime.validate import tensor_parallel_refusal

    path = tmp_path / "attn.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self, fused):
                super().__init__()
                self.fused = fused
                self.qkv = nn.Linear(32, 96) if fused else None
                self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3)) if not fused else (None,) * 3
                self.proj = nn.Linear(32, 32)

            def forward(self, x):
                b, t, _ = x.shape
                q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
                q, k, v = (y.view(b, t, 4, 8).transpose(1, 2) for y in (q, k, v))
                y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.proj(y.transpose(1, 2).reshape(b, t, 32)).pow(2).mean()

        def fused(batch):
            return Block(True), {"x": torch.randn(batch, 8, 32)}

        def separate(batch):
            return Block(False), {"x": torch.randn(batch, 8, 32)}
    """))
    for function, refused in (("fused", True), ("separate", False)):
        zoo = load(f"{path}:{function}", batch=2)
        reason = tensor_parallel_refusal(autopar.trace(zoo.module, example_kwargs=zoo.inputs), zoo.module)
        assert (reason is not None) == refused
        if refused:
            assert reason.startswith("module 'qkv' would be split by output features over tp")


_ALL_HEADS_NORM = """
import torch
from torch import nn


class Norm(nn.Module):
    \"\"\"A norm over all heads' features at once, its statistics taken as ``how`` says.\"\"\"

    def __init__(self, width, how):
        super().__init__()
        self.weight, self.how = nn.Parameter(torch.ones(width)), how

    def forward(self, x):
        if self.how == "rms_norm":
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)
        if self.how == "layer_norm":
            return nn.functional.layer_norm(x, (x.shape[-1],), self.weight)
        if self.how == "var":
            return x * torch.rsqrt(x.var(-1, keepdim=True) + 1e-6) * self.weight
        centred = x - x.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))
        self.q_norm = Norm(32, how)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x)).view(b, t, -1, 8).transpose(1, 2)
        k, v = (y.view(b, t, -1, 8).transpose(1, 2) for y in (self.k(x), self.v(x)))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.blocks = nn.ModuleList(Attention(how) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def build(batch, how="mean"):
    torch.manual_seed(0)
    return Net(how), {"x": torch.randn(batch, 8, 32)}


def with_var(batch):
    return build(batch, "var")


def with_rms_norm(batch):
    return build(batch, "rms_norm")


def with_layer_norm(batch):
    return build(batch, "layer_norm")


class Residual(Attention):
    def forward(self, x):
        return x + super().forward(x)


class Inside(nn.Module):  # the residual add inside the module holding the projections
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Residual("mean") for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def residual_inside(batch):
    torch.manual_seed(0)
    return Inside(), {"x": torch.randn(batch, 8, 32)}
"""


@pytest.mark.parametrize(("function", "written"), [
    ("build", True), ("with_rms_norm", True), ("with_var", False), ("with_layer_norm", False)])
def test_a_users_norm_over_all_heads_runs_split_where_its_means_can_be_summed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], function: str, written: bool) -> None:
    """A norm of one's own over all heads at once, written with means (or ``rms_norm``) over the features tp
    splits: its weight is split with them and the runtime takes its means over every rank's features, so the plan
    is written (the slow tier runs it against one process). Written with ``var`` or ``layer_norm``, which the
    runtime does not take over the ranks, it is refused naming the norm."""
    (tmp_path / "net.py").write_text(_ALL_HEADS_NORM)
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", f"{tmp_path / 'net.py'}:{function}", "--cluster", "cpu", "--gpus",
                           "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2", "--out", str(out))
    assert (code == 0) == written == out.exists(), err
    if written:
        modules = json.loads(out.read_text())["plan"]["modules"]
        assert modules["blocks.0.q_norm"]["params"] == {"blocks.0.q_norm.weight": "[R, S(0)]"}
    else:
        assert "module 'blocks.0.q_norm' reduces over 32 features of the activations tp 2 splits" in err


def test_a_residual_add_inside_the_module_holding_the_projections_is_refused_saying_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under tp the input a block's q, k and v share is one replicated DTensor; a residual add in the same module
    meets it with the projection's plain output. Refused when planned, with what to change, not only DTensor's
    own message."""
    (tmp_path / "net.py").write_text(_ALL_HEADS_NORM)
    code, _, err = run_cli(capsys, "estimate", f"{tmp_path / 'net.py'}:residual_inside", "--cluster", "cpu",
                           "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2", "--out",
                           str(tmp_path / "plan.json"))
    assert code == 2 and not (tmp_path / "plan.json").exists()
    assert "got mixed torch.Tensor and DTensor" in err and "keep the residual add and the norm in the module" in err


@pytest.mark.slow
def test_a_users_norm_over_all_heads_split_over_tp_trains_what_one_process_trains(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "net.py").write_text(_ALL_HEADS_NORM)
    for function in ("build", "with_rms_norm"):
        out = tmp_path / f"{function}.json"
        code, _, err = run_cli(capsys, "estimate", f"{tmp_path / 'net.py'}:{function}", "--cluster", "cpu", "--gpus",
                               "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2", "--out", str(out))
        assert code == 0, err
        code, text, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--steps", "3", "--check", "--check-comm")
        assert code == 0, err
        assert "check: losses, gradients and updates match" in text and "check-comm: every rank's" in text


def test_the_zoo_fused_attention_is_not_refused() -> None:
    from autopar.runtime.validate import tensor_parallel_refusal

    zoo = load("gpt3-125m", batch=1, seq=16, layers=2, hidden=64, heads=4, vocab=128)
    assert tensor_parallel_refusal(autopar.trace(zoo.module, example_kwargs=zoo.inputs), zoo.module) is None


@pytest.mark.slow
def test_nanogpt_example_plans_and_runs_on_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nanogpt.json"
    example = f"{EXAMPLES / 'nanogpt.py'}:build"
    code, _, err = run_cli(capsys, "plan", example, "--cluster", "cpu", "--gpus", "2", "--batch", "8", "--runnable",
                           "--budget-s", "5", "--out", str(out))
    assert code == 0, err
    code, text, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--check")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text
    assert os.path.exists(out)


@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_full_recomputation_under_tp_replays_a_post_norms_collective(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Checkpointing's replay stops once it has every tensor the backward saved, so a pre-norm layer's last
    all-reduce (its output only feeds the residual add) is not issued again; a layer normalising that output first
    (Gemma 2's and OLMo 2's post-norms, which save their input) issues it again. The cost model assumed the first
    for every layer, and the plan-time rehearsal refused these plans (one all-reduce a layer and micro-batch more
    than priced); now they are written (`autopar run --check --check-comm` passes them on 2 ranks)."""
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", f"hf:{name}", *_flags(SMALL), "--kv-heads", "2", "--seq", "32",
                           "--cluster", "cpu", "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "8", "--mbs", "2",
                           "--recompute", "full", "--out", str(out))
    assert code == 0 and out.exists(), err


@pytest.mark.slow
def test_nanogpt_under_zero_3_shards_its_tied_embedding_with_the_head(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nanoGPT's embedding, held beside the position table in a ``ModuleDict``, shares its weight with the head: it
    is sharded in the root's FSDP unit with the head, as priced (FSDP used to refuse it as a unit of its own)."""
    out = tmp_path / "z3.json"
    code, _, err = run_cli(capsys, "estimate", f"{EXAMPLES / 'nanogpt.py'}:build", "--cluster", "cpu", "--gpus", "2",
                           "--batch", "4", "--mbs", "2", "--tp", "1", "--pp", "1", "--dp", "2", "--zero", "3",
                           "--out", str(out))
    assert code == 0, err
    code, text, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--steps", "3", "--check", "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text and "check-comm: every rank's" in text


def test_norms_per_head_are_summed_over_tp_and_norms_over_all_heads_split_with_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3 and Gemma 3 normalise q and k per head with one weight each: under tp each rank computes its gradient
    from its own heads, so the plan marks those weights summed over tp (`autopar run --check` measured a difference
    of 1.4e-3 without the sum). OLMo 2 normalises q and k over all heads at once: their weights are split with the
    features (nothing summed), and the runtime takes the norms' means over every rank's features (the slow tier
    runs it against one process). A plan that does not sum what it must is refused."""
    common = ["--seq", "32", "--cluster", "cpu", "--gpus", "2", "--batch", "4", "--tp", "2", "--pp", "1", "--mbs", "4"]
    for name in ("qwen3", "gemma3_text"):  # Gemma 3 scales by 1 + weight: an op on the weight alone first
        out = tmp_path / f"{name}.json"
        code, _, err = run_cli(capsys, "estimate", f"hf:{name}", *_flags(SMALL), "--kv-heads", "2", *common,
                               "--out", str(out))
        assert code == 0, err
        modules = json.loads(out.read_text())["plan"]["modules"]
        summed = sorted(name for entry in modules.values() for name in entry.get("summed", []))
        assert summed == [f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "kq"]
    code, _, err = run_cli(capsys, "estimate", "hf:olmo2", *_flags(SMALL), "--kv-heads", "2", *common, "--out",
                           str(tmp_path / "olmo2.json"))
    assert code == 0, err
    modules = json.loads((tmp_path / "olmo2.json").read_text())["plan"]["modules"]
    assert not [name for entry in modules.values() for name in entry.get("summed", [])]
    for norm in ("q_norm", "k_norm"):
        assert modules[f"model.layers.1.self_attn.{norm}"]["params"] == {
            f"model.layers.1.self_attn.{norm}.weight": "[R, S(0)]"}
    data = json.loads((tmp_path / "qwen3.json").read_text())
    for entry in data["plan"]["modules"].values():
        entry.pop("summed", None)
    (tmp_path / "old.json").write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "dryrun", str(tmp_path / "old.json"))
    assert code == 2 and "parameter 'model.layers.0.self_attn.q_norm.weight' is applied whole to the activations " \
        "tp 2 splits" in err and "the plan does not have its gradient summed over tp" in err
    data = json.loads((tmp_path / "qwen3.json").read_text())  # marks every norm per head, and one more
    data["plan"]["modules"]["model.layers.0.input_layernorm"]["summed"] = ["model.layers.0.input_layernorm.weight"]
    (tmp_path / "extra.json").write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "dryrun", str(tmp_path / "extra.json"))
    assert code == 2 and "has the gradient of parameter 'model.layers.0.input_layernorm.weight' summed over tp 2, " \
        "but the model does not apply it" in err


def test_one_norm_for_q_and_k_under_tp_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model that normalises q and k with one module: the runtime would sum its gradient right, but the cost
    model prices each use apart, so its estimate would not be what runs."""
    path = tmp_path / "shared_norm.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import torch.nn.functional as F

        class Attention(nn.Module):
            def __init__(self, dim, heads, shared):
                super().__init__()
                self.hd = dim // heads
                self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
                self.qn = nn.RMSNorm(self.hd)
                self.kn = self.qn if shared else nn.RMSNorm(self.hd)

            def forward(self, x):
                b, s, _ = x.shape
                q, k, v = (p(x).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
                y = F.scaled_dot_product_attention(self.qn(q), self.kn(k), v, is_causal=True)
                return self.o(y.transpose(1, 2).reshape(b, s, -1))

        class Net(nn.Module):
            def __init__(self, shared):
                super().__init__()
                self.emb = nn.Embedding(64, 32)
                self.layers = nn.ModuleList(Attention(32, 4, shared) for _ in range(2))
                self.head = nn.Linear(32, 64)

            def forward(self, input_ids, labels):
                x = self.emb(input_ids)
                for layer in self.layers:
                    x = x + layer(x)
                return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

        def _inputs(batch):
            return {"input_ids": torch.randint(0, 64, (batch, 16)), "labels": torch.randint(0, 64, (batch, 16))}

        def shared(batch=2):
            return Net(True), _inputs(batch)

        def separate(batch=2):
            return Net(False), _inputs(batch)
    """))
    common = ["--cluster", "cpu", "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2"]
    code, _, err = run_cli(capsys, "estimate", f"{path}:shared", *common, "--out", str(tmp_path / "shared.json"))
    assert code == 2 and "parameter 'layers.0.qn.weight' is applied to the activations tp 2 splits in more than " \
        "one place (twice in 'layers.0.qn')" in err
    code, _, err = run_cli(capsys, "estimate", f"{path}:separate", *common, "--out", str(tmp_path / "separate.json"))
    assert code == 0, err


NORMED_BLOCKS = textwrap.dedent("""
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, dim, heads, pre):
            super().__init__()
            self.hd, self.pre = dim // heads, pre
            self.norm = nn.LayerNorm(dim)
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

        def forward(self, x):
            y = self.norm(x) if self.pre else x
            b, s, _ = y.shape  # y's: under SP, x holds a rank's share of the sequence
            q, k, v = (p(y).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
            return x + a if self.pre else self.norm(x + a)

    class MLP(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.RMSNorm(dim)
            self.gate, self.up = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
            self.down = nn.Linear(2 * dim, dim)

        def forward(self, x):
            y = self.norm(x) * 0.5
            y = y * torch.sigmoid(y)  # the block's own ops between the norm and the projections
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Net(nn.Module):
        def __init__(self, pre):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.layers = nn.ModuleList(nn.Sequential(Attention(32, 4, pre), MLP(32)) for _ in range(2))
            self.head = nn.Linear(32, 64)

        def forward(self, input_ids, labels):
            x = self.emb(input_ids)
            for layer in self.layers:
                x = layer(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    def _inputs(batch):
        ids = torch.randint(0, 64, (batch, 16))
        return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}

    def pre(batch=2):
        return Net(True), _inputs(batch)

    def post(batch=2):
        return Net(False), _inputs(batch)
""")
TP2 = ["--cluster", "cpu", "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2"]


@pytest.mark.slow
def test_blocks_that_normalise_their_own_input_run_under_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pre-norm written inside the attention and MLP modules, residual add included: q, k and v (and the MLP's
    gate and up) read the norm's output, not the module's input. Such plans used to fail their rehearsal ("mixed
    torch.Tensor and DTensor"); now they train what one process trains, with the predicted collectives, under TP
    and TP + SP (where the norm runs on sequence shards and its output is gathered)."""
    path = tmp_path / "normed.py"
    path.write_text(NORMED_BLOCKS)
    for extra in ([], ["--sp"]):
        out = tmp_path / "tp.json"
        code, _, err = run_cli(capsys, "estimate", f"{path}:pre", *TP2, *extra, "--out", str(out))
        assert code == 0, err
        code, text, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--steps", "3", "--check", "--check-comm")
        assert code == 0, (extra, err)
        assert "check: losses, gradients and updates match" in text
        assert "check-comm: every rank's collectives match" in text


CONV_STEM = textwrap.dedent("""
    import torch
    from torch import nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc1 = nn.Linear(width, 2 * width)
            self.fc2 = nn.Linear(2 * width, width)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Net(nn.Module):
        # a patch stem as vision models write it, then an MLP over the patches and a classifier
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 32, kernel_size=4, stride=4)
            self.mlp = MLP(32)
            self.head = nn.Linear(32, 10)

        def forward(self, images, labels):
            x = self.stem(images).flatten(2).transpose(1, 2)  # (batch, patches, channels), not contiguous
            x = x + self.mlp(x)
            return F.cross_entropy(self.head(x.mean(1)), labels)

    def build(batch=2):
        return Net(), {"images": torch.randn(batch, 3, 16, 16), "labels": torch.randint(0, 10, (batch,))}
""")


@pytest.mark.slow
def test_a_convolution_stays_whole_under_tp_and_the_plan_trains_as_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's layout keeps a convolution whole on tp (a patch stem or an audio stem: its input and output are
    the replicated stream) and splits the linears after it: the plan says so, and it trains what one process
    trains with the collectives priced. Convolutions were split by output channels in the plan, which the runtime
    refused. The MLP reads the stem's output transposed, not contiguous, so its first Linear runs as ``mm`` and a
    separate bias ``add``: the bias is split with the column's features (the plan used to mark it a whole weight
    whose gradient tp sums, which the plan-time check refused)."""
    path = tmp_path / "stem.py"
    path.write_text(CONV_STEM)
    out = tmp_path / "tp.json"
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", *TP2, "--out", str(out))
    assert code == 0, err
    params = {name: placements for module in json.loads(out.read_text())["plan"]["modules"].values()
              for name, placements in module["params"].items()}
    assert params["stem.weight"] == params["stem.bias"] == "[R, R]"  # (dp, tp)
    assert params["mlp.fc1.weight"] == params["mlp.fc1.bias"] == "[R, S(0)]"  # its bias added by an op of its own
    assert params["mlp.fc2.weight"] == "[R, S(1)]"
    code, text, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--steps", "3", "--check", "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text
    assert "check-comm: every rank's collectives match" in text


def test_a_norm_in_a_block_that_its_projections_do_not_read_is_refused_under_tp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The runtime reads a block's one norm over its input features as a norm of the block's input; where the
    model applies it to the block's output instead, the traced model says so and the plan is refused."""
    path = tmp_path / "normed.py"
    path.write_text(NORMED_BLOCKS)
    code, _, err = run_cli(capsys, "estimate", f"{path}:post", *TP2, "--out", str(tmp_path / "post.json"))
    assert code == 2 and "the runtime takes 'layers.0.0.norm', the only norm in block 'layers.0.0'" in err
    assert "the model feeds 'layers.0.0.q' from aten.embedding.default in 'emb'" in err
    assert not (tmp_path / "post.json").exists()


OWN_HEAD_COUNT = textwrap.dedent("""
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.n_head = heads  # a name the runtime does not make per rank
            self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
            self.o = nn.Linear(width, width)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = (p(x).view(b, -1, self.n_head, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
            return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, -1, 64))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 64)
            self.attn = Attention(64, 4)
            self.head = nn.Linear(64, 64)

        def forward(self, input_ids, labels):
            x = self.emb(input_ids)
            return F.cross_entropy(self.head(x + self.attn(x)).flatten(0, 1), labels.flatten())

    def build(batch=2):
        ids = torch.randint(0, 64, (batch, 16))
        return Net(), {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
""")


def test_attention_that_forms_heads_from_the_full_head_count_is_refused_under_tp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Attention that shapes q, k and v with view(b, -1, self.n_head, 16), a head count the runtime does not make
    per rank: under tp each rank's half of the features would become half the sequence, so the plan is refused,
    naming the module (`autopar run --check` measured a different loss at step 0 before this refusal). OPT's
    attention does the same with ``num_heads``, which the runtime makes per rank: its plan is offered, as is
    LLaMA-style view(*shape, -1, head_dim), which forms each rank's share of the heads by itself."""
    path = tmp_path / "heads.py"
    path.write_text(OWN_HEAD_COUNT)
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", *TP2, "--out", str(tmp_path / "own.json"))
    assert code == 2, err
    assert "the attention in module 'attn' runs on 4 heads x 8 positions" in err
    assert "where a rank's share of the model's (4 heads x 16 positions x 16) is 2 heads x 16 positions x 16" in err
    assert not (tmp_path / "own.json").exists()
    common = ["--seq", "32", "--cluster", "cpu", "--gpus", "2", "--batch", "4", "--tp", "2", "--pp", "1", "--mbs", "4"]
    for model in ("hf:opt", "hf:gpt_neox"):
        code, _, err = run_cli(capsys, "estimate", model, *_flags(SMALL), *common, "--out", str(tmp_path / "p.json"))
        assert code == 0, (model, err)


def test_a_model_that_traces_in_fp32_only_is_traced_in_fp32_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """FNet's FFT has no bf16 kernel under fake tensors: the trace falls back to fp32, labelled."""
    code, out, err = run_cli(capsys, "profile", "hf:fnet", "--layers", "2", "--hidden", "64", "--seq", "64", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["dtype"] == "bf16" and data["note"].startswith("traced in fp32, with fp32's bytes: the bf16 trace")
    code, out, err = run_cli(capsys, "profile", "hf:fnet", "--layers", "2", "--hidden", "64", "--seq", "64", "--dtype",
                             "fp32", "--json")
    assert code == 0 and "note" not in json.loads(out)


def test_a_hugging_face_moe_plan_is_runnable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its grouped matmul has a bf16-only fake kernel on CPU: the fp32 rehearsal fails where the real fp32 step runs
    (`autopar run --check` passes on 2 ranks), so the rehearsal is taken in bf16 then."""
    code, _, err = run_cli(capsys, "plan", "hf:qwen2_moe", *_flags(SMALL), "--experts", "4", "--seq", "32", "--cluster",
                           "cpu", "--gpus", "2", "--batch", "4", "--runnable", "--budget-s", "2", "--out",
                           str(tmp_path / "moe.json"))
    assert code == 0, err
    assert load_plan(str(tmp_path / "moe.json")).workload.override_map["experts"] == 4


# ---- pipeline stages compute what the model's forward does ---------------------------------------------------------

@pytest.mark.parametrize(("model", "window", "written"), [
    ("hf:mistral", 16, True),  # a sliding window shorter than the sequence: stages mask as the model does
    ("hf:mistral", 64, True),  # a window as long as the sequence: causal throughout
    ("hf:cohere", None, True),  # logits scaled after the head, as the last stage scales them
    ("hf:gemma2", None, True),  # logits soft-capped after the head
    ("hf:llama", None, True),
])
def test_pipeline_stages_are_refused_where_they_would_train_a_different_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, window: int | None, written: bool) -> None:
    """Checked on a small copy of the model (`runtime.pipeline.check_stage_forward`): before the check, a Mistral
    plan with a window of 16, when stages passed no mask, was written, and `autopar run --check` found its loss
    5.5476 against 5.5507. Stages now mask, scale and cap as the model does, and pass the check (a model whose
    forward does another step is refused: `test_api`)."""
    name = model
    if window is not None:
        from transformers import AutoConfig

        config = AutoConfig.for_model(model.removeprefix("hf:"), num_hidden_layers=4, hidden_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=256, sliding_window=window)
        config.to_json_file(tmp_path / "config.json")
        name, options = f"hf:{tmp_path / 'config.json'}", []
    else:
        options = _flags({"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2})
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", name, *options, "--seq", "64", "--cluster", "cpu", "--gpus", "2",
                           "--pp", "2", "--mbs", "2", "--batch", "4", "--dtype", "fp32", "--out", str(out))
    if written:
        assert code == 0 and out.exists(), err
    else:
        assert code == 2 and not out.exists()
        assert "would train a different model" in err and "plan without pipeline parallelism" in err


@pytest.mark.parametrize(("model", "kind"), [("gptj", "gptj"), ("codegen", "gptj"), ("persimmon", "persimmon"),
                                           ("mpt", "mpt"), ("xglm", "xglm"), ("biogpt", "biogpt"),
                                           ("gpt_neo", "gpt2"), ("deepseek_v3", "hf"), ("ctrl", "ctrl"),
                                           ("recurrent_gemma", "recurrent_gemma")])
def test_more_hugging_face_chains_are_cut_at_their_layers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, kind: str) -> None:
    """GPT-J's, CodeGen's, Persimmon's, MPT's, XGLM's and BioGPT's forwards cannot be traced symbolically (torch.fx:
    "co_varnames is too small", or a proxy assigned to), so their pipelines were refused. The first three are
    LLaMA-style chains under other names (GPT-J's and CodeGen's ``transformer.wte``, ``drop``, ``h``, ``ln_f``, a
    rotary table for every layer; Persimmon's final norm ``final_layernorm``); MPT's layers take ALiBi biases made
    from its config's longest sequence; XGLM and BioGPT add positions to a scaled embedding (BioGPT's head is
    ``output_projection``). GPT-Neo is GPT-2-style, but its layers return a tuple, which failed on the small copy.
    DeepSeek-V3 is LLaMA-style, but its small copy failed: its config's ``head_dim`` is the rotary width of its
    latent attention (``qk_rope_head_dim``), which the small copy now keeps. CTRL scales its token embedding and adds
    a sinusoidal table it keeps as a buffer; RecurrentGemma scales its embedding by a bf16 buffer, calls its layers
    with positions and a sliding-window mask positionally and soft-caps its logits. Each is checked on a small copy
    of the model when planned (the slow tier runs GPT-J, MPT, BioGPT, CTRL and RecurrentGemma against one
    process)."""
    from autopar.runtime.pipeline import chain_kind

    assert chain_kind(load(f"hf:{model}", batch=1, seq=8, **SMALL).module) == kind
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", f"hf:{model}", *_flags(SMALL), "--seq", "32", "--cluster", "cpu",
                           "--gpus", "2", "--pp", "2", "--mbs", "2", "--batch", "4", "--out", str(out))
    assert code == 0 and out.exists(), err


def test_recurrent_gemma_stages_give_its_local_attention_its_window() -> None:
    """A window of 8 positions at sequence 32, the third layer a local attention between recurrent ones: two stages
    give the same logits as the whole model (`check_stage_forward` compares them on this copy)."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    from autopar.runtime.pipeline import chain_kind, check_stage_forward

    config = RecurrentGemmaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                                  attention_window_size=8, intermediate_size=128, lru_width=64)
    assert config.layers_block_type[2] == "sliding_attention"
    model = RecurrentGemmaForCausalLM(config)
    assert chain_kind(model) == "recurrent_gemma"
    check_stage_forward(model, seq=32)


@pytest.mark.parametrize(("options", "runs"), [
    ({}, True),  # rotary positions, multi-query attention
    ({"multi_query": False, "parallel_attn": False}, True),  # as many key/value heads as heads (no field for them)
    ({"new_decoder_architecture": True, "num_kv_heads": 2}, True),
    ({"alibi": True}, False),  # ALiBi biases, which the stages leave out: caught on numbers
])
def test_falcon_pipelines_run_where_the_stages_compute_its_forward(options: dict, runs: bool) -> None:
    """Falcon's chain is LLaMA-style under GPT-2's names; its layers also take an ALiBi bias, which stages pass as
    None. A Falcon configured with ALiBi is refused by the check on a small copy, not trusted by name."""
    from transformers import FalconConfig, FalconForCausalLM

    from autopar.runtime.pipeline import chain_kind, check_stage_forward

    model = FalconForCausalLM(FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                           vocab_size=128, **options))
    assert chain_kind(model) == "falcon"
    if runs:
        check_stage_forward(model, seq=32)
    else:
        with pytest.raises(NotImplementedError, match="would train a different model"):
            check_stage_forward(model, seq=32)


@pytest.mark.parametrize("model", ["hf:gpt2", "hf:gpt_bigcode"])
def test_gpt2_style_models_plan_pipelines(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str) -> None:
    """GPT-2's chain (``transformer``: token and position embeddings, dropout, ``h``, ``ln_f``; a tied head) is cut
    into stages, checked on a small copy against the model's own forward; such plans used to be refused ("pipeline
    stages of a GPT2LMHeadModel cannot be run yet"). `test_runtime` runs them against one process."""
    from autopar.runtime.pipeline import check_stage_forward, stage_layers

    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", model, *_flags({"layers": 4, "hidden": 64, "heads": 4}), "--cluster",
                           "cpu", "--gpus", "2", "--pp", "2", "--mbs", "2", "--batch", "4", "--out", str(out))
    assert code == 0 and out.exists(), err
    module = load(model, batch=1, seq=16, layers=4, hidden=64, heads=4).module
    check_stage_forward(module, seq=16)
    assert stage_layers(module, load_plan(out)) == [[0, 1], [2, 3]]


def test_gpt2_conv1d_projections_are_planned_by_the_dims_they_split(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2's Conv1D stores its weight as (in, out): under tp the plan splits a column-parallel one on dim 1 and a
    row-parallel one on dim 0 (a Linear's the other way round), and the estimate's collectives are Megatron's
    all-reduces only: the fused q/k/v cut into heads and the attention's softmax stay split by heads (its
    ``_safe_softmax`` was once priced as gathered, two all-gathers per layer the runtime never issues)."""
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", "hf:gpt2", *_flags({"layers": 2, "hidden": 64, "heads": 4}),
                           "--gpus", "2", "--tp", "2", "--batch", "2", "--seq", "32", "--out", str(out))
    assert code == 0 and out.exists(), err
    plan = load_plan(out)
    from autopar.sharding import short

    placements = {p.name: short(p.on(1)) for entry in plan.modules for p in entry.params}
    assert placements["transformer.h.0.attn.c_attn.weight"] == "S(1)"
    assert placements["transformer.h.0.attn.c_attn.bias"] == "S(0)"
    assert placements["transformer.h.0.attn.c_proj.weight"] == "S(0)"
    assert placements["transformer.h.0.attn.c_proj.bias"] == "R"
    assert placements["transformer.h.0.mlp.c_fc.weight"] == "S(1)"
    kinds = {str(getattr(c.kind, "value", c.kind)) for c in plan.estimate.collectives}
    assert kinds == {"all_reduce"}


def test_a_moe_model_traces_in_fp32_as_in_bf16(capfd):
    """Hugging Face MoE experts run a grouped matmul whose fake kernel takes bf16 only on CPU; traced in fp32 the
    model runs the same grouped matmuls with the same flops as in bf16, at fp32 sizes, and no traceback is
    logged."""
    import torch

    graphs = {}
    for dtype in (torch.float32, torch.bfloat16):
        zoo = load("hf:mixtral-tiny", batch=2, seq=16, layers=2, dtype=dtype)
        graphs[dtype] = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    fp32, bf16 = graphs[torch.float32], graphs[torch.bfloat16]
    grouped = [n for n in fp32.nodes if "grouped_mm" in n.op]
    assert grouped, "the experts run a grouped matmul"
    others = [n for n in bf16.nodes if "grouped_mm" in n.op]
    assert len(grouped) == len(others)
    for a, b in zip(grouped, others):
        assert a.flops_forward == b.flops_forward > 0
        assert a.output_bytes == 2 * b.output_bytes
    assert sum(n.flops_forward for n in fp32.nodes) == sum(n.flops_forward for n in bf16.nodes)
    assert "Traceback" not in capfd.readouterr().err


def test_a_pipeline_stage_tp_cannot_split_is_refused_when_planned(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-OSS's experts add a bias per expert, which the runtime does not split: a pp 2 x tp 2 plan is refused
    when planned, naming the module, as a single-stage one is (Mixtral's router, which the runtime once could not
    run, used to give a pp 2 x tp 2 plan that failed on rank 1 of `autopar run`)."""
    code, _, err = run_cli(capsys, "estimate", "hf:gpt_oss", *_flags(SMALL), "--kv-heads", "2", "--ffn", "128",
                           "--seq", "32", "--cluster", "cpu", "--gpus", "4", "--batch", "8", "--mbs", "2", "--tp", "2",
                           "--pp", "2", "--dp", "1", "--out", str(tmp_path / "gpt_oss.json"))
    assert code == 2
    assert "module 'model.layers.0.mlp.experts' (GptOssExperts) cannot be split by tensor parallelism yet" in err
    assert not (tmp_path / "gpt_oss.json").exists()


# ---- a model that draws random numbers in its own code, and --check -----------------------------------------------

NOISY = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.up = nn.Linear(16, 32)
            self.down = nn.Linear(32, 16)
            self.out = nn.Linear(16, 50)

        def forward(self, ids, labels):
            x = self.embed(ids)
            x = x + self.down(F.dropout(F.gelu(self.up(x)), p=0.1, training=self.training))
            x = x + 0.01 * torch.randn_like(x)
            return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())

    def build(batch):
        ids = torch.randint(0, 50, (batch, 8))
        return Net(), {"ids": ids, "labels": ids}
""")


def test_check_refuses_a_model_that_draws_random_numbers_naming_where(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout the model's own code applies (``F.dropout``) and noise it adds cannot be turned off by `autopar run`,
    and ranks draw them for their own rows: the check used to fail on it with a bare loss mismatch ("step 0: loss
    5.08459044, one process 5.08347178"), which reads as a plan bug. It is refused before any rank starts, naming
    each draw's line; a run without --check still trains."""
    import autopar.cli.run as run_command

    path = tmp_path / "noisy.py"
    path.write_text(NOISY)
    out = tmp_path / "dp.json"
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", "--cluster", "cpu", "--gpus", "2", "--batch", "4",
                           "--out", str(out))
    assert code == 0, err
    started = []
    monkeypatch.setattr(run_command, "run_plan", lambda *a, **k: started.append(1))
    code, _, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--steps", "1", "--check")
    assert code == 2 and not started
    assert "--check cannot compare this model with one process" in err
    lines = NOISY.splitlines()
    dropout, noise = (1 + next(i for i, line in enumerate(lines) if key in line) for key in ("F.dropout", "randn_like"))
    assert f"bernoulli_ at noisy.py:{dropout} in forward, module Net" in err
    assert f"randn_like at noisy.py:{noise} in forward, module Net" in err


def test_random_draws_are_noted_only_where_they_draw() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from autopar.runtime.train import RandomDraws

    x = torch.randn(2, 4, 8, 16)
    quiet = [
        lambda: nn.Dropout(0.0).train()(x),
        lambda: nn.Dropout(0.5).eval()(x),
        lambda: F.dropout(x, 0.3, training=False),
        lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.0),
        lambda: F.alpha_dropout(x, 0.0, training=True),
    ]
    for k, work in enumerate(quiet):
        with RandomDraws() as seen:
            work()
        assert seen.places == [], k
    loud = [
        (lambda: nn.Dropout(0.5).train()(x), "bernoulli_"),
        (lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.2), "bernoulli_"),  # the math path drops out itself
        (lambda: torch.rand_like(x), "rand_like"),
        (lambda: torch.randperm(5), "randperm"),
    ]
    for work, op in loud:
        with RandomDraws() as seen:
            work()
        assert len(seen.places) == 1 and seen.places[0].startswith(op), seen.places
        assert "test_model_forms.py:" in seen.places[0]


# a user's two-layer model around an ``Attention`` written in between: imports, then the model and its batch
ATTENTION_HEAD = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F
    from torch import nn


""")
TWO_LAYERS = textwrap.dedent("""\
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.layers = nn.ModuleList([Attention() for _ in range(2)])
            self.out = nn.Linear(32, 64)

        def forward(self, ids, labels):
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x)
            return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


    def build(batch):
        ids = torch.randint(0, 64, (batch, 16))
        return Net(), {"ids": ids, "labels": ids}
""")


GROUPED_SPLIT = ATTENTION_HEAD + textwrap.dedent("""\
    class Attention(nn.Module):
        def __init__(self, width=32, groups=2):
            super().__init__()
            self.groups, self.part = groups, width // groups
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)

        def forward(self, x):
            b, s, _ = x.shape
            grouped = self.qkv(x).reshape(b, s, self.groups, -1)  # the split size below assumes the whole width
            q, k, v = torch.split(grouped, self.part, dim=-1)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))

""") + TWO_LAYERS


def test_a_model_s_own_value_error_under_a_plan_is_refused_naming_the_module(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model that cuts its fused q/k/v after a reshape, with a split size that assumes the whole width (as
    CodeGen's attention did in earlier transformers): under tp 2 its unpacking raises ValueError. That error used
    to be given as the whole reason ("not enough values to unpack (expected 3, got 2)"), naming no module, as if it
    were autopar's own refusal."""
    path = tmp_path / "grouped.py"
    path.write_text(GROUPED_SPLIT)
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", "--cluster", "cpu", "--gpus", "2", "--tp", "2",
                           "--pp", "1", "--batch", "4", "--mbs", "2", "--out", str(out))
    assert code == 2 and not out.exists()
    assert "the plan fails in module 'layers.0' when applied on a fake process group of 2 ranks: " \
           "ValueError: not enough values to unpack" in err


def test_attention_written_out_by_hand_with_the_full_head_count_is_refused_under_tp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DeBERTa-v2 forms heads with view(..., num_attention_heads, -1) and multiplies them with bmm, not SDPA: under
    tp 2 each rank got 4 heads of 8 features instead of 2 of 16, trained a different model (its q and k gradients
    differed from one process's by as much as their size) and only `--check` saw it. The rehearsal now compares
    each batched product a rank forms with the traced model's. BERT's attention, whose q, k and v sit in
    ``attention.self`` and its row partner in ``attention.output``, forms whole heads per rank and passes."""
    common = ["--seq", "32", "--gpus", "2", "--batch", "4", "--tp", "2"]
    code, _, err = run_cli(capsys, "estimate", "hf:deberta-v2", *_flags(SMALL), *common, "--out",
                           str(tmp_path / "deberta.json"))
    assert code == 2 and not (tmp_path / "deberta.json").exists()
    assert "module 'deberta.encoder.layer.0.attention.self' multiplies 32 x 8 by 8 x 32 matrices per rank" in err
    assert "(32 x 16 by 16 x 32, 32 x 32 by 32 x 16)" in err
    code, _, err = run_cli(capsys, "estimate", "hf:bert", *_flags(SMALL), *common, "--out", str(tmp_path / "bert.json"))
    assert code == 0, err


def test_columns_pair_with_the_row_of_their_layer_not_only_of_their_parent() -> None:
    from autopar.runtime.apply import column_groups

    placements = {
        "enc.layer.0.attention.self.query": "S(0)", "enc.layer.0.attention.self.key": "S(0)",
        "enc.layer.0.attention.output.dense": "S(1)",
        "enc.layer.0.intermediate.dense": "S(0)", "enc.layer.0.output.dense": "S(1)",
        "layers.0.mlp.up": "S(0)", "layers.0.mlp.down": "S(1)",
        "head.dense": "S(0)", "lm_head": "S(0)",  # outside the numbered layers: gathered, never paired
    }
    assert column_groups(placements) == {
        "enc.layer.0.attention.self": ["enc.layer.0.attention.self.query", "enc.layer.0.attention.self.key"],
        "enc.layer.0.intermediate": ["enc.layer.0.intermediate.dense"],
        "layers.0.mlp": ["layers.0.mlp.up"],
    }
    assert column_groups({"fc1": "S(0)", "fc2": "S(1)"}) == {"": ["fc1"]}  # one block at the root: by their parent


def test_a_reshape_by_the_whole_head_count_under_tp_is_refused_saying_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """XGLM reshapes its attention's output with view(bsz, tgt_len, embed_dim), the model's whole width: under tp 2
    the rehearsal fails with a bare shape error, which says what it means."""
    code, _, err = run_cli(capsys, "estimate", "hf:xglm", *_flags(SMALL), "--seq", "32", "--cluster", "cpu",
                           "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2", "--out",
                           str(tmp_path / "plan.json"))
    assert code == 2 and not (tmp_path / "plan.json").exists()
    assert "the plan fails in module 'model.layers.0.self_attn'" in err and "is invalid for input of size" in err
    assert "reshapes them by the model's whole head count or width fails so: plan with tp 1" in err


@pytest.mark.parametrize(("model", "config", "written"), [
    ("hf:bloom", {}, True),  # q, k and v fused head by head
    ("hf:persimmon", {}, True),  # and so, with a norm of each head's q and k
    ("falcon", {"new_decoder_architecture": True}, True),  # fused by key/value head (2 of them)
    ("falcon", {"multi_query": False, "alibi": True}, True),  # head by head, ALiBi
    ("falcon", {}, True),  # multi-query attention: one key/value head, kept whole
    ("hf:phi3", {}, True),  # q, k and v cut by slices at its config's widths, gate and up by chunk(2)
    ("hf:mpt", {}, True),  # q, k and v cut by chunk(3), ALiBi biases of every head
])
def test_tp_plans_of_fused_qkv_laid_out_by_head_are_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, config: dict, written: bool) -> None:
    """BLOOM's, Persimmon's and Falcon's fused q/k/v runs group by group (each head's, or each key/value head's, q,
    k and v together): a tp rank's contiguous shard holds whole groups, so the plan-time rehearsal passes and the
    plan is written (the slow tier runs BLOOM and Falcon against one process). One key/value head cannot be split:
    that attention is kept whole (`test_multi_query_attention_is_kept_whole_under_tp`). Phi-3's fused projections
    are laid out piece by piece per rank instead (each rank's q, k and v, or gate and up, contiguous), and its
    attention given its own config with one rank's head counts; MPT's ``Wqkv`` so too (cut by ``chunk(3)``), its
    attention given its head count per rank and its own heads' ALiBi biases (the slow tier runs it in 2 stages x
    tp 2)."""
    if model == "falcon":
        from transformers import FalconConfig

        FalconConfig(architectures=["FalconForCausalLM"], **config).to_json_file(str(tmp_path / "config.json"))
        model = f"hf:{tmp_path}"
    grouped = ["--kv-heads", "2"] if config.get("new_decoder_architecture") else []
    code, _, err = run_cli(capsys, "estimate", model, *_flags(SMALL), *grouped, "--seq", "32", "--cluster", "cpu",
                           "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2", "--out",
                           str(tmp_path / "plan.json"))
    assert (code == 0) == written == (tmp_path / "plan.json").exists(), err


@pytest.mark.parametrize(("model", "attention", "sp"), [
    ("hf:gpt_bigcode", "transformer.h.0.attn", True),  # q, k and v fused, cut by split
    ("hf:falcon", "transformer.h.0.self_attention", False),  # attention and MLP in parallel
    ("llama-7b", "layers.0.attn", True),  # the zoo's, with --kv-heads 1
    ("hf:deepseek_v3", "model.layers.0.self_attn", True),  # latent attention: its latent cut by split_with_sizes
])
def test_multi_query_attention_is_kept_whole_under_tp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, attention: str, sp: bool) -> None:
    """One key/value head for all the query heads (GPTBigCode's and Falcon's default, Falcon-7B's): no tp degree
    divides it. Those plans used to be refused ("has 1 kv_heads, which tp 2 does not divide"). The attention is
    now kept whole on every rank, its weights' gradients need no sum, and the MLP is split: the plan is rehearsed
    and written. Under SP the attention gathers the sequence and its output projection hands on this rank's shard
    at once, which the cost model prices as the runtime runs it (the slow tier runs both against one process).
    DeepSeek's latent attention is kept whole too: its keys and values are projected down to one latent shared by
    all heads, which the model cuts with ``split_with_sizes`` (and q through a low-rank pair of projections), so
    splitting its first projections by output features would misplace the cuts; those plans used to be refused."""
    from autopar.capture.graph import multi_query_attentions
    from autopar.cost.layers import analyse, kept_whole
    from autopar.plan import load_plan
    from autopar.runtime.source import ModelSource
    from autopar.runtime.train import Workload

    size = {**SMALL, "kv_heads": 1} if model == "llama-7b" else SMALL
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", model, *_flags(size), "--seq", "32", "--cluster", "cpu", "--gpus", "2",
                           "--tp", "2", "--pp", "1", "--batch", "4", "--mbs", "2", *(["--sp"] if sp else []),
                           "--out", str(out))
    assert code == 0, err
    modules = json.loads(out.read_text())["plan"]["modules"]
    inside = {name: layout for entry in modules.values() for name, layout in entry["params"].items()
              if name.startswith(f"{attention}.")}
    assert inside and set(inside.values()) == {"[R, R]"}
    assert any("S(" in layout for fqn, entry in modules.items() if ".mlp." in fqn
               for layout in entry["params"].values())
    source = ModelSource.of_workload(Workload.of(load_plan(out)))
    graph = source.traced_at(1)
    assert attention in graph.multi_query == multi_query_attentions(source.meta())
    whole = kept_whole(graph)
    contractions = [n for n in graph.nodes if n.module.startswith(attention) and n.reads_params
                    and n.op.startswith(("aten.mm.", "aten.addmm.", "aten.bmm."))]
    assert contractions and all(n.id in whole for n in contractions)
    assert not any(n.id in layer.sharded for layer in analyse(graph) for n in contractions)


def test_a_width_tp_cannot_divide_is_named_by_its_module(capsys: pytest.CaptureFixture[str]) -> None:
    """An MLP of 129 features under tp 2; the refusal used to say only "(here 129)". (Qwen2-MoE's shared-expert
    gate, of one feature, was refused so before one-feature projections came to be kept whole.)"""
    code, _, err = run_cli(capsys, "estimate", "hf:mistral", *_flags({**SMALL, "kv_heads": 2, "ffn": 129}),
                           "--seq", "32", "--cluster", "cpu", "--gpus", "2", "--tp", "2", "--pp", "1", "--batch", "4",
                           "--mbs", "2")
    assert code == 2
    assert "(here 129, of module 'model.layers.0.mlp.gate_proj' (Linear, its output features))" in err


def test_sequence_parallelism_keeps_an_encoders_embedding_norm_and_mlm_head_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RoBERTa under tp 2 with SP used to be refused with a bare shape error: the stream was never scattered (its
    layers sit in ``encoder.layer``), so every norm took the whole sequence for a shard. Now the stream is
    scattered where it enters the layers, the MLM head's dense layer gathers it, and the norms outside that span
    (the embedding's, the head's) run whole: only the layers' norms have their gradients summed over tp, and the
    tied decoder gathers nothing more."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, "estimate", "hf:roberta", *_flags(SMALL), "--seq", "32", "--cluster", "cpu",
                             "--gpus", "2", "--tp", "2", "--pp", "1", "--sp", "--batch", "8", "--mbs", "2",
                             "--out", str(path), "--json")
    assert code == 0 and path.exists(), err
    calls = {(c["kind"], c["bytes"]): c["count"] for c in json.loads(out)["estimate"]["collectives"]}
    # 2 layers x 2 norms x (weight + bias) of 64 features, bf16: not the embedding's or the head's norm
    assert calls[("all_reduce", 2 * 2 * 2 * 64 * 2)] == 1

    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineModel

    zoo = load("hf:roberta", batch=2, seq=32, **SMALL)
    model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("cpu").with_devices(2),
                          traced_batch=2)
    rows = {row.name: row for row in model.layers}
    assert [rows[f"roberta.encoder.layer.{i}"].sp_partial_params for i in (0, 1)] == [256, 256]
    assert rows["roberta.embeddings"].sp_partial_params == 0 and rows["lm_head"].sp_partial_params == 0
    stream = 2 * 32 * 64 * 2  # bf16, as `load` builds it

    def calls(name: str) -> dict:
        row = next(r for r, layer in enumerate(model.layers) if layer.name == name)
        price = model.price(row, tp=2, samples=2, recompute="none", sp=True, mesh=model._mesh(1, 1, 2))
        return {(c.kind.value, c.bytes, c.phase.value): c.calls for c in price.collectives}

    # the stream scattered as the embeddings hand it to the layers: its gradient gathered, once
    assert calls("roberta.embeddings") == {("all_gather", stream, "backward"): 1}
    # dense gathers the stream as a column-parallel input (its gradient reduce-scattered back to shards) and its own
    # output of as many features (a column-parallel layer with a whole output); the tied decoder gathers nothing
    assert calls("lm_head") == {("all_gather", stream, "forward"): 2, ("reduce_scatter", stream, "backward"): 1}


ROTATE_EVERY_TWO = ATTENTION_HEAD + textwrap.dedent("""\
    class Attention(nn.Module):
        def __init__(self, width=32, heads=4):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
            self.proj = nn.Linear(width, width)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (f(x).view(b, s, -1, 8) for f in (self.q, self.k, self.v))
            # rotate every two features, as GPT-J and CodeGen do: a stack along a new last dim
            q = torch.stack((-q[..., 1::2], q[..., ::2]), dim=-1).flatten(-2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))

""") + TWO_LAYERS


def test_a_stack_along_a_new_dim_keeps_the_heads_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rotating every two features (GPT-J's and CodeGen's rotary) stacks two halves along a new last dim. The
    stack's dims rule used to map no input dim to the output's, so the cost model gathered q's heads before it and
    priced all-gathers the runtime never issues (``run --check-comm`` refused CodeGen's plan). Now the only gather is
    the untied head's output, and the plan runs with the predicted collectives (`test_runtime`)."""
    path = tmp_path / "every_two.py"
    path.write_text(ROTATE_EVERY_TWO)
    out = tmp_path / "plan.json"
    code, text, err = run_cli(capsys, "estimate", f"{path}:build", "--cluster", "cpu", "--gpus", "2", "--tp", "2",
                              "--pp", "1", "--batch", "4", "--mbs", "2", "--out", str(out), "--json")
    assert code == 0 and out.exists(), err
    gathers = [(c["bytes"], c["count"]) for c in json.loads(text)["estimate"]["collectives"]
               if c["kind"] == "all_gather"]
    assert gathers == [(2 * 16 * 64 * 2, 2)]  # the head's logits (2 x 16 x vocab 64, bf16), once per micro-batch


SEQUENTIAL = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width=32):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.layers = nn.Sequential(Block(), Block())
            self.out = nn.Linear(32, 64)

        def forward(self, ids, labels):
            return F.cross_entropy(self.out(self.layers(self.embed(ids))).flatten(0, 1), labels.flatten())


    def build(batch):
        ids = torch.randint(0, 64, (batch, 16))
        return Net(), {"ids": ids, "labels": ids}
""")


def test_sequence_parallelism_finds_layers_in_a_sequential_and_refuses_loose_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stream is scattered where it enters the container of the layers tp splits: an nn.Sequential as well as
    an nn.ModuleList. Layers held as plain attributes leave no such place, and two lists (an encoder's and a
    decoder's) more than one; SP there used to fail on bare shape errors ("Expected input batch_size (64) to match
    target batch_size (32)"), or on BART on the attention-shape check, and is now refused saying why."""
    path = tmp_path / "seq.py"
    path.write_text(SEQUENTIAL)
    flags = ["--cluster", "cpu", "--gpus", "2", "--tp", "2", "--pp", "1", "--sp", "--batch", "4", "--mbs", "2"]
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", *flags, "--out", str(tmp_path / "a.json"))
    assert code == 0, err
    loose = tmp_path / "loose.py"
    loose.write_text(SEQUENTIAL.replace("self.layers = nn.Sequential(Block(), Block())",
                                        "self.first, self.second = Block(), Block()")
                     .replace("self.layers(self.embed(ids))", "self.second(self.first(self.embed(ids)))"))
    code, _, err = run_cli(capsys, "estimate", f"{loose}:build", *flags, "--out", str(tmp_path / "b.json"))
    assert code == 2 and not (tmp_path / "b.json").exists()
    assert "no nn.ModuleList or nn.Sequential of this model holds a module tp splits: plan without --sp" in err
    two = tmp_path / "two.py"  # an encoder's list of layers and a decoder's: only one stream would be scattered
    two.write_text(SEQUENTIAL.replace("self.layers = nn.Sequential(Block(), Block())",
                                      "self.layers, self.more = nn.Sequential(Block()), nn.ModuleList([Block()])")
                   .replace("self.layers(self.embed(ids))", "self.more[0](self.layers(self.embed(ids)))"))
    code, _, err = run_cli(capsys, "estimate", f"{two}:build", *flags, "--out", str(tmp_path / "c.json"))
    assert code == 2 and not (tmp_path / "c.json").exists()
    assert "sequence parallelism runs one list of layers on sequence shards ('layers'), and module 'more.0.up'" in err


LLAMA_WHOLE_HEADS = textwrap.dedent("""\
    import types

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    HEADS = 4


    def attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        # heads formed from the whole head count, as OPT's attention does: under tp each rank would fold its half
        # of the features into the head size
        b, s, _ = hidden_states.shape
        q, k, v = (f(hidden_states).view(b, s, HEADS, -1).transpose(1, 2) for f in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


    def build(batch):
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                             num_key_value_heads=HEADS, vocab_size=128)
        model = LlamaForCausalLM(config)
        for layer in model.model.layers:
            layer.self_attn.forward = types.MethodType(attention, layer.self_attn)
        ids = torch.randint(0, 128, (batch, 16))
        return model, {"input_ids": ids, "labels": ids}
""")


def test_a_pipeline_plans_tensor_parallelism_is_rehearsed_as_one_stage(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline cannot be stepped on a fake process group, so pp x tp plans were checked without tp: a LLaMA
    whose attention forms heads from the whole head count got a pp 2 x tp 2 plan written, which trained a different
    model (`--check`: "step 1: loss 4.86207485, one process 4.86191368"). Its tp is now rehearsed as one stage of
    tp devices holding every layer, and the plan is refused when planned."""
    path = tmp_path / "llama_heads.py"
    path.write_text(LLAMA_WHOLE_HEADS)
    flags = ["--cluster", "cpu", "--batch", "4", "--mbs", "2"]
    out = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", *flags, "--gpus", "4", "--tp", "2", "--pp", "2",
                           "--out", str(out))
    assert code == 2 and not out.exists()
    assert "the attention in module 'model.layers.0.self_attn' runs on 4 heads x 16 positions x 8 per rank" in err
    assert "(the plan's tensor parallelism, rehearsed as one stage of its tp 2)" in err
    code, _, err = run_cli(capsys, "estimate", f"{path}:build", *flags, "--gpus", "2", "--tp", "1", "--pp", "2",
                           "--out", str(out))
    assert code == 0 and out.exists(), err  # without tp its pipeline runs
