"""Predicted against measured step times of plans run on this machine's gloo ranks: is the cost model's order of
plans the order they really run in?

Run: python bench/fidelity_real.py [--cluster2 FILE] [--cluster4 FILE] [--db FILE] [--ops FILE] [--steps 5]
[--passes 2] [--only NAME ...] [--keep FOLDER].
Without cluster files, `autopar calibrate --nproc N --out ...` measures this machine first (links and compute, on 2
and on 4 ranks). Without --db, `autopar profile-segments MODEL --nproc N --tp 1 2` times each model's layers under
the layouts the configurations use into a profile database (on 2 and on 4 ranks). Without --ops, `autopar
profile-ops MODEL --nproc N --samples 1 2 4 --tp 1 2` times each model's ops into an op database, whose ops are
also added to the profile database (one file holds both). Each configuration of two small models (a GPT and a
grouped-query LLaMA, fp32, as `autopar run` trains) is priced three times by `autopar estimate ... --cluster FILE`
(the intra-op plan by `autopar plan --search ilp`): by the calibrated roofline alone, with the op database alone
(`--profile-db` of the ops: every layer priced op by op), and with the profile database (layers as measured whole,
ops elsewhere; the intra-op plan, whose layouts no layer was measured in, by its ops); then the plan is run with
`autopar run
--steps S --json`: a run's step time is the median of the steps after the first (every rank waits for the others
around a step, `autopar.runtime.train`). Every plan runs once in each of P passes over all of them, the passes in
alternating order, and its measured time is its fastest pass: a slow spell of this shared machine (the same plan has
run 1.6x slower in one run than in the next) then has to last a whole pass to count. Prints per configuration both
predictions, each pass, the measurement and their ratios, and how far apart a plan's passes were; then for each way
of pricing, per rank count and over all, the mean absolute percentage error (MAPE), Spearman's rank correlation of
predicted against measured, and whether the plan predicted fastest is the one measured fastest. Exits 1, listing
them, if a plan was refused, could not be priced with the database, or failed on the ranks in any pass.

The intra-op configuration is what `autopar plan --search ilp` offers for 2 ranks (a plan `autopar run` runs, with
DTensor: where the programme's own plan cannot run, the fastest that can of the baselines, data parallelism with
ZeRO 1 and 2, and the programme within ZeRO 0-2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT = ["gpt3-125m", "--layers", "4", "--hidden", "256", "--heads", "8", "--vocab", "2048", "--seq", "128"]
LLAMA = ["llama-7b", "--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--ffn", "768",
         "--vocab", "2048", "--seq", "128"]
# (name, ranks, model, estimate flags): global batch 8 throughout
CONFIGS = [
    ("gpt dp2", 2, GPT, ["--dp", "2"]),
    ("gpt zero1", 2, GPT, ["--dp", "2", "--zero", "1", "--mbs", "2"]),
    ("gpt zero3", 2, GPT, ["--dp", "2", "--zero", "3"]),
    ("gpt tp2", 2, GPT, ["--tp", "2"]),
    ("gpt tp2 sp", 2, GPT, ["--tp", "2", "--sp"]),
    ("gpt pp2 1f1b", 2, GPT, ["--pp", "2", "--mbs", "2"]),
    ("gpt pp2 gpipe", 2, GPT, ["--pp", "2", "--mbs", "2", "--schedule", "gpipe"]),
    ("gpt dp2 full", 2, GPT, ["--dp", "2", "--recompute", "full"]),
    ("llama dp2", 2, LLAMA, ["--dp", "2"]),
    ("llama tp2", 2, LLAMA, ["--tp", "2"]),
    ("llama tp2 selective", 2, LLAMA, ["--tp", "2", "--recompute", "selective"]),
    ("llama zero3", 2, LLAMA, ["--dp", "2", "--zero", "3"]),
    ("llama pp2 1f1b", 2, LLAMA, ["--pp", "2", "--mbs", "1"]),
    ("gpt pp2 tp2", 4, GPT, ["--pp", "2", "--tp", "2", "--mbs", "2"]),
    ("gpt dp2 tp2", 4, GPT, ["--dp", "2", "--tp", "2"]),
    ("gpt zero3 dp4", 4, GPT, ["--dp", "4", "--zero", "3"]),
    ("llama pp2 tp2", 4, LLAMA, ["--pp", "2", "--tp", "2", "--mbs", "2"]),
    ("gpt intra-op", 2, GPT, ["--search", "ilp"]),  # priced and written by `autopar plan`
]


def autopar(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.cli.main", *argv], capture_output=True, text=True)


def calibrated(ranks: int, folder: Path) -> str:
    path = folder / f"cluster{ranks}.yaml"
    start = time.perf_counter()
    done = autopar("calibrate", "--nproc", str(ranks), "--out", str(path), "--json")
    if done.returncode != 0:
        raise SystemExit(f"autopar calibrate --nproc {ranks} failed: {done.stderr.strip()}")
    peak = json.loads(done.stdout)["compute"]["peak_gflops"]
    print(f"calibrated {ranks} ranks in {time.perf_counter() - start:.0f} s (GEMM peak {peak:.1f} GFLOP/s per rank)",
          flush=True)
    return str(path)


def profiled(models: list[tuple[int, list[str]]], folder: Path) -> str:
    path = folder / "profile.json"
    for ranks, model in models:
        start = time.perf_counter()
        done = autopar("profile-segments", *model, "--nproc", str(ranks), "--tp", "1", "2", "--db", str(path),
                       "--json")
        if done.returncode != 0:
            raise SystemExit(f"autopar profile-segments {model[0]} --nproc {ranks} failed: {done.stderr.strip()}")
        print(f"profiled {model[0]} on {ranks} ranks in {time.perf_counter() - start:.0f} s "
              f"({len(json.loads(done.stdout)['entries'])} layer times)", flush=True)
    return str(path)


def ops_profiled(models: list[tuple[int, list[str]]], folder: Path, db: str) -> str:
    """An op database of every model on its rank counts (`autopar profile-ops`); its ops and DTensor's dispatch are
    added to ``db`` too."""
    from autopar.profiling import ProfileDB

    path = folder / "ops.json"
    for ranks, model in models:
        start = time.perf_counter()
        done = autopar("profile-ops", *model, "--nproc", str(ranks), "--samples", "1", "2", "4", "--tp", "1", "2",
                       "--db", str(path), "--json")
        if done.returncode != 0:
            raise SystemExit(f"autopar profile-ops {model[0]} --nproc {ranks} failed: {done.stderr.strip()}")
        print(f"timed {json.loads(done.stdout)['timed_ops']} ops of {model[0]} on {ranks} ranks in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    layers, ops = ProfileDB.load(db), ProfileDB.load(path)
    for entry in ops.ops.values():
        layers.add_op(entry)
    layers.dispatch.update(ops.dispatch)  # DTensor's cost per op, which intra-op plans pay
    layers.save(db)
    return str(path)


def price_intra(plan_file: Path, cluster_file: str, db: str) -> tuple[float, float]:
    """(iteration seconds, share measured) of the intra-op plan in ``plan_file`` priced with the op times of the
    profile database ``db``: its blocks' splits, micro-batching and ZeRO stage as written, its model traced at its
    micro-batch size."""
    from autopar.cluster import load_cluster
    from autopar.plan.io import load_plan
    from autopar.profiling import ProfileDB
    from autopar.runtime.source import ModelSource
    from autopar.runtime.train import Workload
    from autopar.search.intra import measured_share, repriced

    plan = load_plan(plan_file)
    cluster = load_cluster(cluster_file).with_devices(plan.devices)
    ops = ProfileDB.load(db).op_times(ranks=cluster.ranks_per_host, dtype="fp32") or None
    graph = ModelSource.of_workload(Workload.of(plan)).traced_at(plan.micro_batch_size)
    priced = repriced(plan, graph, cluster, ops=ops)
    return priced.estimate.iteration_seconds, measured_share(priced)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def summary(label: str, rows: list[tuple[str, float, float]]) -> None:
    if len(rows) < 2:
        return
    predicted, measured = [p for _, p, _ in rows], [m for _, _, m in rows]
    mape = statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured))
    fastest_p = min(rows, key=lambda r: r[1])[0]
    fastest_m = min(rows, key=lambda r: r[2])[0]
    same = "the same" if fastest_p == fastest_m else f"not the measured fastest ({fastest_m})"
    print(f"{label}: {len(rows)} plans, MAPE {mape:.1%}, Spearman {spearman(predicted, measured):+.2f}; predicted "
          f"fastest {fastest_p}: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster2", help="cluster file for 2 ranks (default: calibrate now)")
    parser.add_argument("--cluster4", help="cluster file for 4 ranks (default: calibrate now)")
    parser.add_argument("--db", help="profile database of both models on 2 and 4 ranks (default: profile now)")
    parser.add_argument("--ops", help="op database of both models on 2 and 4 ranks (default: profile-ops now, its "
                        "ops added to the profile database)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--passes", type=int, default=2, help="runs of each plan; its measured time is the fastest")
    parser.add_argument("--only", nargs="+", help="configurations whose names contain one of these")
    parser.add_argument("--keep", metavar="FOLDER", help="write the cluster files, profile database and plans here "
                        "(default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if not args.only or any(word in c[0] for word in args.only)]
    results: list[tuple[int, str, float, float, float]] = []
    failures: list[str] = []  # plans refused, priced without the database or failed on the ranks (in any pass)

    def fail(message: str) -> None:
        failures.append(message)
        print(message, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        clusters = {2: args.cluster2, 4: args.cluster4}
        for ranks in sorted({c[1] for c in configs}):
            clusters[ranks] = clusters[ranks] or calibrated(ranks, folder)
        pairs = []
        for _, ranks, model, _ in configs:
            if (ranks, model) not in pairs:
                pairs.append((ranks, model))
        db = args.db or profiled(pairs, folder)
        ops = args.ops or ops_profiled(pairs, folder, db)
        priced: list[tuple[str, int, Path, float, float, float, float]] = []
        for name, ranks, model, flags in configs:
            plan = folder / f"{name.replace(' ', '_')}.json"
            command = "plan" if "--search" in flags else "estimate"
            common = [*model, *flags, "--cluster", clusters[ranks], "--gpus", str(ranks), "--batch", "8",
                      "--dtype", "fp32", "--json"]
            done = autopar(command, *common, "--out", str(plan))
            if done.returncode != 0:
                fail(f"{name}: refused: {done.stderr.strip().splitlines()[-1]}")
                continue
            if command == "plan":
                chosen = json.loads(done.stdout)["plan"]
                print(f"{name}: autopar plan offers the {chosen['kind']} plan, micro-batch "
                      f"{chosen['micro_batch_size']} x {chosen['micro_batches']}, ZeRO {chosen['zero']}", flush=True)
            roofline = json.loads(done.stdout)["estimate"]["iteration_seconds"]
            if command == "plan":  # the plan it wrote, priced with each database (a search might choose another)
                (ops_seconds, _), (db_seconds, share) = (price_intra(plan, clusters[ranks], file) for file in (ops, db))
                priced.append((name, ranks, plan, roofline, ops_seconds, db_seconds, share))
                continue
            estimates = []
            for file in (ops, db):
                with_db = autopar(command, *common, "--profile-db", file)
                if with_db.returncode != 0:
                    fail(f"{name}: --profile-db {file} failed: {with_db.stderr.strip().splitlines()[-1]}")
                    break
                estimates.append(json.loads(with_db.stdout))
            if len(estimates) < 2:
                continue
            priced.append((name, ranks, plan, roofline, estimates[0]["estimate"]["iteration_seconds"],
                           estimates[1]["estimate"]["iteration_seconds"], estimates[1]["profile"]["measured_share"]))
        # Each plan runs once per pass; passes alternate the order, so a slow spell of the machine lands on
        # different plans in each, and a plan's measured time is its faster pass.
        runs: dict[str, list[float]] = {name: [] for name, *_ in priced}
        for number in range(args.passes):
            ordered = priced if number % 2 == 0 else priced[::-1]
            for name, ranks, plan, *_ in ordered:
                ran = autopar("run", str(plan), "--nproc", str(ranks), "--steps", str(args.steps), "--json")
                if ran.returncode != 0:
                    fail(f"pass {number + 1}: {name}: run failed: {ran.stderr.strip().splitlines()[-1]}")
                    continue
                runs[name].append(json.loads(ran.stdout)["timing"]["measured_seconds"])
                print(f"pass {number + 1}/{args.passes}: {name} ran in {runs[name][-1]:.3f} s per step", flush=True)
        passes = " ".join(f"{'pass ' + str(n + 1):>7}" for n in range(args.passes))
        print(f"\n{'configuration':<20} {'ranks':>5} {'roofline':>9} {'ops':>9} {'profiled':>9} {passes} "
              f"{'measured':>9} {'ratios':>17}")
        spreads = []
        for name, ranks, _, roofline, ops_seconds, profiled_seconds, share in priced:
            if not runs[name]:
                continue
            measured = min(runs[name])
            if len(runs[name]) > 1:  # a plan that failed in a pass says nothing of the noise
                spreads.append(max(runs[name]) / measured - 1)
            results.append((ranks, name, roofline, ops_seconds, profiled_seconds, measured))
            times = " ".join(f"{t:6.3f}s" for t in runs[name]) + " " * 8 * (args.passes - len(runs[name]))
            print(f"{name:<20} {ranks:>5} {roofline:8.3f}s {ops_seconds:8.3f}s {profiled_seconds:8.3f}s {times} "
                  f"{measured:8.3f}s {measured / roofline:5.2f} {measured / ops_seconds:5.2f} "
                  f"{measured / profiled_seconds:5.2f}  ({share:.0%} of layer time measured)")
        if spreads:  # only plans that ran in more than one pass
            print(f"a plan's slower pass took {statistics.fmean(spreads):.0%} longer than its faster one on average "
                  f"(at most {max(spreads):.0%}): the machine's own noise between runs of one plan")
    for label, column in (("calibrated roofline", 2), ("with the op database alone", 3),
                          ("with the profile database", 4)):
        print(f"\n{label}:")
        for ranks in sorted({r for r, *_ in results}):
            summary(f"{ranks} ranks", [(row[1], row[column], row[5]) for row in results if row[0] == ranks])
        summary("all", [(row[1], row[column], row[5]) for row in results])
    if failures:
        raise SystemExit(f"\n{len(failures)} failed (left out of the figures above; a plan that ran in another pass "
                         "keeps that pass):\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
