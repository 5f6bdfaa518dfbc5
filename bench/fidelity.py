"""How well autopar's cost model predicts published runs: Megatron-LM's weak-scaling table (Narayanan et al., SC'21,
Table 1: GPT models of 1.7 to 1008 billion parameters on 32 to 3,072 A100-80GB GPUs of Selene).

Run: python bench/fidelity.py [--cluster a100-80g-sxm] [--kernels compiled] [--without OPTION]. Prints, per row,
the published and the predicted TFLOP/s per GPU and the error, then the mean and largest error and whether the
predicted TFLOP/s rise with model size as the published ones do (the slope of TFLOP/s over log(parameters),
published 137 -> 163).

Each row is priced the way it ran, through autopar's public estimate path (`autopar.cost.estimate`, the same call
`autopar estimate` makes) on a model traced on fake tensors with the table's sizes:

- the published tensor- and pipeline-parallel sizes, GPU count and global batch; data parallelism the rest;
- full recomputation of every layer; vocabulary 51,200, sequence 2,048; bf16 (the runs used fp16: the same peak);
- the micro-batch size and pipeline schedule of Megatron-LM's own script for this table
  (``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM, the paper gives neither): micro-batches of 16 samples
  per data-parallel rank up to 7.5B, 8 for 18.4B, 4 for 39.1B, 2 for 76.1B and 145.6B, 1 beyond; the interleaved
  1F1B schedule with 5, 5, 3 and 1 layers per virtual stage for 76.1B, 145.6B, 310.1B and 529.6B (3, 2, 2 and 3
  chunks per device), plain 1F1B for 39.1B and 1008B (the script sets no virtual stages there);
- ``--kernels compiled`` by default: Megatron-LM fuses bias + GeLU, bias + dropout + residual add, the scaled
  masked softmax and LayerNorm (apex) into single kernels, which is what autopar's compiled setting prices;
- the ``a100-80g-sxm`` preset (or ``--cluster``).

TFLOP/s per GPU are counted as the table counts them, model FLOPs including the recomputed forward:
``96 B s l h^2 (1 + s / (6h) + V / (16 l h)) / (iteration seconds x GPUs)`` (autopar's Estimate counts model
FLOPs without recomputation, so the count is made here).

Megatron-LM ran three parts otherwise than autopar's runtime does; the rows are priced as it ran them, with the
estimate's options for that (`autopar.cost.ParallelConfig`; autopar's own plans never set them):

- ``vocab_parallel``: Megatron-LM splits the embedding, the tied LM head and the cross entropy over tp by
  vocabulary (VocabParallelEmbedding, parallel_lm_logits, vocab_parallel_cross_entropy in ``megatron/mpu``), where
  autopar keeps a tied head whole on every tp rank (`autopar.cost.vocab` has the terms);
- ``scatter_gather_sends``: its pipeline sends 1/tp of an activation or gradient from each tp rank and all-gathers
  it over NVLink at the receiver (``--scatter-gather-tensors-in-pipeline``, on by default in 2021), where autopar
  sends all of it from every tp rank;
- ``overlap_dp``: the script's ``--DDP-impl`` is ``torch`` for the rows without pipelining (PyTorch DDP: buckets
  all-reduced during the last micro-batch's backward, as autopar prices) and ``local`` for the rest (Megatron-LM's
  own DDP, which all-reduced every gradient after the pipeline's last backward: ``--overlap-grad-reduce`` came in
  2023), so ``overlap_dp`` is off for those. Gradients were reduced in fp16 (``--accumulate-allreduce-grads-in-fp32``
  was not set), 2 bytes each, as autopar's bf16 prices them; the tied embedding's gradient is summed between the
  first and last stages after the data-parallel all-reduce, as autopar's serial synchronisation orders it.

What autopar still does not price (see the README, "Fidelity"): the optimizer step (Megatron-LM's fp32 master
weights, Adam and gradient clipping: by arithmetic 1-2% of an iteration on the smallest rows), Megatron-LM's attention
core of 2021 (softmax materialised, the scores of b x heads x s x s written and read by several kernels), which
the fitted attention efficiency stands for per FLOP whatever the head size, and blocking point-to-point
communication (Megatron-LM of 2021 synchronises the device around each send and receive).
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from autopar.capture import Graph, trace
from autopar.cluster import Cluster, load_cluster
from autopar.cost import ParallelConfig, estimate
from autopar.zoo import load

TABLE = Path(__file__).parent / "data" / "megatron-sc21-table1.csv"
OPTIONS = ("vocab_parallel", "scatter_gather_sends", "overlap_dp")  # what Megatron-LM ran otherwise than autopar
VOCAB, SEQ = 51200, 2048
# From Megatron-LM's examples/sc21/run_table_1.sh, by model size: (micro-batch per data-parallel rank, layers per
# virtual pipeline stage, 0 for the plain 1F1B schedule, --DDP-impl)
SCRIPT = {
    1.7: (16, 0, "torch"), 3.6: (16, 0, "torch"), 7.5: (16, 0, "torch"), 18.4: (8, 0, "torch"),
    39.1: (4, 0, "local"), 76.1: (2, 5, "local"), 145.6: (2, 5, "local"), 310.1: (1, 3, "local"),
    529.6: (1, 1, "local"), 1008.0: (1, 0, "local"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One row of the table and the configuration it ran with."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    published: float  # TFLOP/s per GPU
    micro_batch: int  # samples per data-parallel rank
    chunks: int  # model chunks per device (interleaved 1F1B when > 1)
    ddp: str  # Megatron-LM's --DDP-impl: "torch" (overlapped with the backward) or "local" (after it)

    @property
    def config(self) -> ParallelConfig:
        """The row as Megatron-LM ran it: vocabulary-parallel ends, scatter/gather sends, and the data-parallel
        all-reduce overlapped under PyTorch DDP only."""
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=self.gpus // (self.tp * self.pp), mbs=self.micro_batch,
                              recompute="full", schedule="interleaved" if self.chunks > 1 else "1f1b",
                              chunks=self.chunks, vocab_parallel=True, scatter_gather_sends=True,
                              overlap_dp=self.ddp == "torch")

    @property
    def flops(self) -> float:
        """FLOPs of one iteration as the table counts them (model FLOPs with the recomputed forward)."""
        b, s, l, h = self.batch, SEQ, self.layers, self.hidden
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def read_table(path: Path = TABLE) -> list[Row]:
    """The table's rows (comment lines skipped) with Megatron-LM's micro-batch, schedule and DDP for each."""
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    rows = []
    for entry in csv.DictReader(lines):
        size = float(entry["params_billion"])
        micro, per_virtual, ddp = SCRIPT[size]
        layers, pp = int(entry["layers"]), int(entry["pipeline_parallel"])
        rows.append(Row(
            params_billion=size, heads=int(entry["heads"]), hidden=int(entry["hidden"]), layers=layers,
            tp=int(entry["tensor_parallel"]), pp=pp, gpus=int(entry["gpus"]), batch=int(entry["global_batch"]),
            published=float(entry["tflops_per_gpu"]), micro_batch=micro,
            chunks=layers // pp // per_virtual if per_virtual else 1, ddp=ddp,
        ))
    return rows


def traced(row: Row) -> Graph:
    """The row's GPT traced on fake tensors at one micro-batch (seconds, whatever its size)."""
    zoo = load("megatron-1.7b", batch=row.micro_batch, seq=SEQ, dtype=torch.bfloat16, layers=row.layers,
               hidden=row.hidden, heads=row.heads, vocab=VOCAB)
    return trace(zoo.module, example_kwargs=zoo.inputs)


def iteration(row: Row, graph: Graph, cluster: Cluster, *, kernels: str = "compiled",
              recompute: str = "full", without: tuple[str, ...] = ()) -> float:
    """Predicted seconds of one iteration of ``row`` (through `autopar.cost.estimate`), the options named in
    ``without`` (of `OPTIONS`) left at autopar's defaults."""
    defaults = {f.name: f.default for f in fields(ParallelConfig)}
    config = replace(row.config, recompute=recompute, **{name: defaults[name] for name in without})
    result = estimate(graph, cluster.with_devices(row.gpus), config, global_batch=row.batch, dtype="bf16",
                      kernels=kernels)
    return result.iteration_seconds


def predict(row: Row, graph: Graph, cluster: Cluster, *, kernels: str = "compiled") -> float:
    """Predicted TFLOP/s per GPU of ``row`` as the table counts them."""
    return row.flops / iteration(row, graph, cluster, kernels=kernels) / row.gpus / 1e12


def errors(rows: list[Row], predicted: list[float]) -> tuple[list[float], float, float]:
    """Relative errors (predicted / published - 1), their mean absolute value and the largest absolute value."""
    errs = [p / r.published - 1 for r, p in zip(rows, predicted)]
    return errs, sum(abs(e) for e in errs) / len(errs), max(abs(e) for e in errs)


def slope(rows: list[Row], values: list[float]) -> float:
    """Least-squares slope of ``values`` over log10(parameters): TFLOP/s gained per tenfold model size."""
    xs = [math.log10(r.params_billion) for r in rows]
    mx, my = sum(xs) / len(xs), sum(values) / len(values)
    return sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100-80g-sxm", help="preset name or cluster file")
    parser.add_argument("--kernels", choices=("eager", "compiled"), default="compiled")
    parser.add_argument("--without", action="append", choices=OPTIONS, default=[],
                        help="price the rows with this option as autopar's runtime runs it, not as Megatron-LM ran "
                        "(repeatable)")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    rows = read_table()
    without = tuple(args.without)
    print(f"Megatron-LM SC'21 Table 1 on {cluster.name}, full recomputation, {args.kernels} kernels"
          + (f", without {', '.join(without)}" if without else ""))
    print(f"{'params':>8} {'tp':>3} {'pp':>3} {'gpus':>5} {'batch':>5} {'mbs':>4} {'sched':>6} "
          f"{'published':>9} {'predicted':>9} {'error':>7} {'full/sel':>8} {'s':>5}")
    predicted = []
    for row in rows:
        start = time.perf_counter()
        graph = traced(row)
        seconds = iteration(row, graph, cluster, kernels=args.kernels, without=without)
        selective = iteration(row, graph, cluster, kernels=args.kernels, recompute="selective", without=without)
        value = row.flops / seconds / row.gpus / 1e12
        predicted.append(value)
        schedule = f"int x{row.chunks}" if row.chunks > 1 else "1f1b"
        ratio = seconds / selective  # iteration time under full over selective recomputation
        print(f"{row.params_billion:>7.1f}B {row.tp:>3} {row.pp:>3} {row.gpus:>5} {row.batch:>5} "
              f"{row.micro_batch:>4} {schedule:>6} {row.published:>9.0f} {value:>9.1f} "
              f"{value / row.published - 1:>+7.1%} {ratio:>8.2f} {time.perf_counter() - start:>5.1f}")
    errs, mean, worst = errors(rows, predicted)
    published_slope, predicted_slope = slope(rows, [r.published for r in rows]), slope(rows, predicted)
    print(f"mean |error| {mean:.1%}, max |error| {worst:.1%}")
    print(f"trend: published {rows[0].published:.0f} -> {rows[-1].published:.0f} TFLOP/s "
          f"({published_slope:+.1f} per 10x parameters), predicted {predicted[0]:.0f} -> {predicted[-1]:.0f} "
          f"({predicted_slope:+.1f} per 10x): {'rises' if predicted_slope > 0 else 'does not rise'}")


if __name__ == "__main__":
    main()
