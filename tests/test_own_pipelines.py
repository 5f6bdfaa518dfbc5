"""Pipelines of models of one's own (`autopar.runtime.chain`): a plain PyTorch model's forward, traced down to the
plan's rows, is cut into stages that compute what it computes, or the cut is refused naming what stops it."""

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.cli.main import main
from autopar.runtime.chain import ChainStage, can_cut, cut

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WIDTH, VOCAB, SEQ = 32, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """A language model as users write them: a learned position table the forward slices and adds (a parameter
    of the model itself), a final norm, the loss computed in the forward."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Masked(Net):
    """Every block reads a mask made from the ids: two values cross each stage boundary."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        keep = (ids > 0).unsqueeze(-1).float()
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x) * keep
        return nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


ROWS = ["embed", "", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]


def _batch(rows: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(0))
    return {"ids": ids, "labels": ids}


def _staged(model: nn.Module, stages: list[list[str]], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    parts = [ChainStage(model, stages, index) for index in range(len(stages))]
    x = batch[parts[0].inputs]
    for part in parts:
        x = part(x)
    return parts[-1].loss_fn(x, batch[parts[0].target])


@pytest.mark.parametrize("at", [3, 4, 6])
def test_stages_compute_the_forward_and_its_gradients(at: int) -> None:
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    whole = model(**batch)
    whole.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    staged = _staged(model, [ROWS[:at], ROWS[at:]], batch)
    staged.backward()
    assert torch.equal(staged, whole)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=0, atol=1e-7), name


def test_stages_hold_their_own_modules_under_the_whole_model_s_names() -> None:
    model = Net()
    first, last = (ChainStage(model, [ROWS[:4], ROWS[4:]], k) for k in (0, 1))
    assert {"embed.weight", "pos", "blocks.0.norm.weight"} <= {n for n, _ in first.named_parameters()}
    assert not any(n.startswith(("embed", "pos", "blocks.0.", "blocks.1.")) for n, _ in last.named_parameters())
    assert [type(u).__name__ for u in first.units] == ["Block", "Block"]  # FSDP units: the list's layers
    assert (first.inputs, first.target) == ("ids", "labels")


def test_a_wrapped_model_with_a_tied_head_and_an_assert_on_the_length_is_cut() -> None:
    """nanoGPT under a wrapper returning the loss: traced through the wrapper, its ``assert t <= block_size``
    kept as an assert, its head's weight (the embedding's) held by both ends."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import nanogpt
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(0)
    model, batch = nanogpt.build(2)
    layers = len(model.model.transformer.h)
    rows = ["model", "model.transformer.wte", "model.transformer.wpe", "model.transformer.drop",
            *(f"model.transformer.h.{i}" for i in range(layers)), "model.transformer.ln_f", "model.lm_head"]
    model.eval()  # no dropout: the two forwards draw no numbers
    staged = _staged(model, [rows[:5], rows[5:]], batch)
    assert torch.allclose(staged, model(**batch), rtol=0, atol=1e-6)


class Sinusoidal(Net):
    """A fixed position table registered as a buffer, sliced by the traced length; the stream transposed between
    the blocks (token mixing, as MLP-Mixer does), so the value a stage hands on is a view."""

    def __init__(self) -> None:
        super().__init__()
        del self.pos
        self.register_buffer("table", torch.randn(SEQ, WIDTH), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.table[: ids.shape[1]]
        for block in self.blocks:
            x = block(x).transpose(0, 1)
        logits = self.head(self.norm(x.transpose(0, 1) if len(self.blocks) % 2 else x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_a_buffer_sliced_by_the_length_is_traced_and_a_stage_hands_on_a_contiguous_value() -> None:
    """A buffer read as an attribute and sliced by ``ids.shape[1]`` used to stop the trace ("slice indices must be
    integers"); a transposed value handed on made the ranks' send fail ("input tensor has to be contiguous") after
    the plan passed its checks, which move no data."""
    torch.manual_seed(0)
    model, batch = Sinusoidal(), _batch()
    rows = [r for r in ROWS if r != ""] + [""]
    stages = [rows[:3], rows[3:]]
    first = ChainStage(model, stages, 0)
    handed = first(batch["ids"])
    assert handed.is_contiguous()
    assert "table" in dict(first.named_buffers())
    assert torch.equal(_staged(model, stages, batch), model(**batch))


def test_cuts_that_stages_cannot_make_are_refused_naming_what_crosses() -> None:
    with pytest.raises(NotImplementedError, match=r"stage 1 reads 2 values .*\(Tensor.float of value 'unsqueeze' in "
                                                  r"the forward\), module 'blocks.1'"):
        cut(Masked(), [ROWS[:4], ROWS[4:]])
    # the position table's row ("") on the second stage: the first hands on the embedding and the ids
    with pytest.raises(NotImplementedError, match=r"stage 1 reads 2 values .*input 'ids', module 'embed'"):
        cut(Net(), [ROWS[:1], ROWS[1:]])
    with pytest.raises(NotImplementedError, match=r"module 'blocks.1' on stage 0 reads module 'blocks.0', computed "
                                                  r"on stage 1 after it"):
        cut(Net(), [[*ROWS[:2], "blocks.1"], ["blocks.0", *ROWS[4:], "blocks.2", "blocks.3"]])
    assert can_cut(Net(), ROWS)
    cut(Masked(), [ROWS[:-1], ROWS[-1:]])  # after the last block, the mask is read no more

    class MaskedToTheEnd(Masked):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            keep = (ids > 0).unsqueeze(-1).float()
            x = self.embed(ids) + self.pos[: ids.shape[1]]
            for block in self.blocks:
                x = block(x) * keep
            return nn.functional.cross_entropy((self.head(self.norm(x)) * keep).flatten(0, 1), labels.flatten())

    assert not can_cut(MaskedToTheEnd(), ROWS)


class SharedModules(Net):
    """One dropout called after every block and the loss as a module attribute, as users write them: modules that
    hold nothing run on whichever stage calls them (they were pinned to their row's stage, and a cut was refused
    as reading a later stage, or the labels were said to feed the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.0)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = self.drop(block(x))
        return self.loss(self.head(self.norm(x))[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def test_modules_that_hold_nothing_run_on_every_stage_that_calls_them() -> None:
    torch.manual_seed(0)
    model, batch = SharedModules(), _batch()
    rows = ["embed", "", "blocks.0", "drop", "blocks.1", "blocks.2", "blocks.3", "norm", "head", "loss"]
    stages = [rows[:5], rows[5:]]
    parts = [ChainStage(model, stages, k) for k in (0, 1)]
    assert all(isinstance(part.drop, nn.Dropout) for part in parts)
    assert torch.equal(_staged(model, stages, batch), model(**batch))


def test_a_forward_the_tracer_cannot_follow_is_refused() -> None:
    class Branchy(Net):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            if x.sum() > 0:  # control flow on values
                x = -x
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    with pytest.raises(NotImplementedError, match=r"cannot be traced symbolically .* at .*test_own_pipelines.py:\d+\)"):
        cut(Branchy(), [ROWS[:4], ROWS[4:]])


def test_a_draw_the_tracer_would_bake_into_the_stages_is_refused() -> None:
    """Noise of a fixed shape drawn in the forward runs once while tracing; the stages would replay that one draw
    every step, where one process draws anew."""

    class Noisy(Net):
        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids) + 0.01 * torch.randn(SEQ, WIDTH)
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())

    model = Noisy()
    before = torch.random.get_rng_state()
    with pytest.raises(NotImplementedError, match="draws random numbers between its modules"):
        cut(model, [ROWS[:4], ROWS[4:]])
    assert torch.equal(before, torch.random.get_rng_state())  # the user's generator is left as it was
    assert not can_cut(model, ROWS)


# ---- planned, checked and run --------------------------------------------------------------------------------------

def _user_file(tmp_path: Path) -> Path:
    source = Path(__file__).read_text()
    start, end = source.index("class Block(nn.Module):"), source.index("ROWS = [")
    path = tmp_path / "mine.py"
    path.write_text("import torch\nfrom torch import nn\n\nWIDTH, VOCAB, SEQ = 32, 64, 16\n\n\n" + source[start:end]
                    + textwrap.dedent("""
        def build(batch):
            ids = torch.randint(0, VOCAB, (batch, SEQ))
            return Net(), {"ids": ids, "labels": ids}


        def masked(batch):
            ids = torch.randint(0, VOCAB, (batch, SEQ))
            return Masked(), {"ids": ids, "labels": ids}
    """))
    return path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_plan_whose_cut_stages_cannot_make_is_refused_when_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", f"{_user_file(tmp_path)}:masked", "--cluster", "cpu", "--gpus", "2",
                        "--batch", "4", "--pp", "2", "--out", str(out))
    assert code == 2 and not out.exists()
    assert "pipeline stages of Masked cannot be cut as planned: stage 1 reads 2 values" in err


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    ["--pp", "2", "--dp", "2", "--zero", "3"],
    ["--pp", "2", "--tp", "2"],
    ["--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--recompute", "full"],
])
def test_pipelines_of_a_plain_model_match_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      options: list[str]) -> None:
    """Before, any pipeline plan of a model of one's own was refused ("pipeline stages of a Net cannot be run
    yet")."""
    out = tmp_path / "plan.json"
    devices = 4 if "--dp" in options or "--tp" in options else 2
    code, _, err = _cli(capsys, "estimate", f"{_user_file(tmp_path)}:build", "--cluster", "cpu", "--gpus",
                        str(devices), "--batch", "8", *options, "--out", str(out))
    assert code == 0, err
    code, text, err = _cli(capsys, "run", str(out), "--nproc", str(devices), "--steps", "3", "--check",
                           "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text
    assert "check-comm: every rank's collectives match" in text


@pytest.mark.slow
def test_nanogpt_pipeline_sums_its_tied_head_across_the_ends(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The head's weight is the embedding's: the two ends each hold it and sum its gradient, which the estimate
    prices (it did not, while the trace named the weight by the head and the embedding's read went unseen)."""
    out = tmp_path / "plan.json"
    code, _, err = _cli(capsys, "estimate", f"{EXAMPLES / 'nanogpt.py'}:build", "--cluster", "cpu", "--gpus", "2",
                        "--batch", "8", "--pp", "2", "--out", str(out))
    assert code == 0, err
    code, text, err = _cli(capsys, "run", str(out), "--nproc", "2", "--steps", "3", "--check", "--check-comm")
    assert code == 0, err
    assert "check: losses, gradients and updates match" in text
    assert "check-comm: every rank's collectives match" in text


def test_the_search_starts_stages_only_where_the_forward_can_be_cut() -> None:
    """A model cut by its traced forward tells the search the rows a stage may start at; a configuration starting
    one elsewhere is refused by the search's limit, by name, before it is priced as runnable."""
    from autopar.api.search import Subject, _limit
    from autopar.capture import trace
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage
    from autopar.cluster import load_cluster
    from autopar.runtime.chain import cut_points

    model, batch = Masked(), _batch()
    graph = trace(model, example_kwargs=batch)
    rows = [layer.name for layer in graph.layers()]
    subject = Subject.of(graph, model, name="masked", check=lambda plan: None)
    assert subject.pipelines and subject.cuts == frozenset(cut_points(model, rows))
    assert rows.index("norm") in subject.cuts and rows.index("blocks.2") not in subject.cuts
    priced = PipelineModel(graph, load_cluster("cpu").with_devices(2), traced_batch=1)
    limit = _limit(True, "eager", None, cuts=subject.cuts, rows=priced.layers)
    at = rows.index("blocks.2")

    def config(cut: int) -> PipelineConfig:
        return PipelineConfig(stages=(Stage(start=0, end=cut, tp=1, dp=1, recompute=("none",) * cut),
                                      Stage(start=cut, end=len(rows), tp=1, dp=1,
                                            recompute=("none",) * (len(rows) - cut))), micro_batch=1)

    assert limit(config(at)) == ("the model's forward cannot be cut before 'blocks.2': the stages either side "
                                 "would hand each other more than one value")
    assert limit(config(rows.index("norm"))) is None
