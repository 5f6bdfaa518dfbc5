"""One device's training step, predicted and measured: does the cost model price a real GPU's step?

Run: python bench/gpu_step.py [--cluster LABEL=PRESET_OR_FILE ...] [--db [LABEL=]FILE ...] [--steps 10]
[--only NAME ...] [--tiny]

For each model below, builds it on this machine's first CUDA device (on a CPU where there is none, for trying the
script) at --dtype with random weights, trains it with AdamW on random tokens, and takes the median of --steps
steps after 3 warm-ups, each step synchronised: forward, loss, backward and the optimizer's step, as one device of
a plan trains. Beside it prints what `autopar estimate MODEL --gpus 1 --dp 1 --mbs BATCH --cluster C --json`
predicts for the same step on each cluster given (a preset's vendor figures, or the file `autopar calibrate --nproc
1 --out FILE` wrote on this device), and with --db (a profile database `autopar profile-ops MODEL --dtype bf16`
filled on this device; --db is repeatable) once more on each, with the share of the prediction it priced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

# (name, model flags, batch, dtype): a GPT and a LLaMA at the sizes a single GPU trains a slice of a large model at
MODELS = [
    ("gpt3-1.3b x8 layers", ["gpt3-1.3b", "--layers", "8", "--seq", "2048"], 8, "bf16"),
    # the same with its vocabulary padded to a multiple of 128, as Megatron-LM pads it: the head's GEMM then fits
    # the tensor cores' tiles (50,257 columns do not), which a roofline cannot see and a measured op can
    ("gpt3-1.3b x8 vocab 50304", ["gpt3-1.3b", "--layers", "8", "--seq", "2048", "--vocab", "50304"], 8, "bf16"),
    ("llama-7b x4 layers", ["llama-7b", "--layers", "4", "--seq", "2048"], 4, "bf16"),
]
# --tiny: the same two families small enough to try the script on a CPU, in fp32 (what a CPU trains in)
TINY = [
    ("gpt tiny", ["gpt3-125m", "--layers", "2", "--hidden", "256", "--heads", "8", "--vocab", "2048", "--seq", "128"],
     4, "fp32"),
    ("llama tiny", ["llama-7b", "--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "4", "--ffn", "768",
                    "--vocab", "2048", "--seq", "128"], 4, "fp32"),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measured_step(flags: list[str], batch: int, dtype: str, steps: int, device: torch.device) -> float:
    from autopar.cli.common import add_model_arguments, model_overrides
    from autopar.runtime.apply import loss_of
    from autopar.zoo.catalog import config_for, load, synthetic_batch

    reader = argparse.ArgumentParser()
    add_model_arguments(reader)
    parsed = reader.parse_args(flags)
    name, overrides, seq = parsed.model, model_overrides(parsed), parsed.seq
    torch.manual_seed(0)
    zoo = load(name, batch=batch, seq=seq, dtype=DTYPES[dtype], device=str(device), dropout=0.0, **overrides)
    model = zoo.module.train()
    inputs = {k: v.to(device) for k, v in synthetic_batch(config_for(name, seq=seq, **overrides), batch=batch,
                                                             seq=zoo.seq, seed=0).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(steps + 3):
        sync()
        begin = time.perf_counter()
        loss_of(model(**inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= 3:
            times.append(time.perf_counter() - begin)
    del model, optimizer, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def predicted(flags: list[str], batch: int, dtype: str, cluster: str, db: str | None) -> tuple[float, float | None]:
    argv = [sys.executable, "-m", "autopar.cli.main", "estimate", *flags, "--gpus", "1", "--dp", "1", "--batch",
            str(batch), "--mbs", str(batch), "--dtype", dtype, "--cluster", cluster, "--json"]
    if db is not None:
        argv += ["--profile-db", db]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[3:])} failed: {done.stderr.strip()}")
    data = json.loads(done.stdout)
    share = (data.get("profile") or {}).get("measured_share")
    return data["estimate"]["iteration_seconds"], share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", action="append", default=[], metavar="LABEL=PRESET_OR_FILE",
                        help="a cluster to price on (repeatable; default: the preset of this GPU)")
    parser.add_argument("--db", action="append", default=[], metavar="[LABEL=]FILE",
                        help="a profile database of this device (autopar profile-ops); repeatable, each priced on "
                             "each cluster")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="+", help="models to run, by the names this script gives them")
    parser.add_argument("--tiny", action="store_true", help="two tiny models in fp32, to try the script on a CPU")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if args.cluster:
        clusters = [tuple(c.split("=", 1)) if "=" in c else (c, c) for c in args.cluster]
    else:
        from autopar.cluster.detect import base_preset

        clusters = [(base_preset().name, base_preset().name)]
    dbs = [tuple(d.split("=", 1)) if "=" in d else (d, d) for d in args.db]
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (no CUDA device: a trial run only)"
    print(f"device: {gpu}; torch {torch.__version__}; median of {args.steps} steps after 3 warm-ups")
    rows = []
    for name, flags, batch, dtype in TINY if args.tiny else MODELS:
        if args.only and name not in args.only:
            continue
        seconds = measured_step(flags, batch, dtype, args.steps, device)
        for label, cluster in clusters:
            for db_label, db in [(None, None), *dbs]:
                guess, share = predicted(flags, batch, dtype, cluster, db)
                how = label + (f" + {db_label} ({share:.0%} measured)" if db else "")
                rows.append((name, batch, dtype, how, guess, seconds))
                print(f"{name:22s} batch {batch:2d} {dtype}  {how:48s} predicted {guess * 1e3:8.1f} ms  measured "
                      f"{seconds * 1e3:8.1f} ms  predicted/measured {guess / seconds:5.2f}", flush=True)
    print(json.dumps([{"model": r[0], "batch": r[1], "dtype": r[2], "priced_by": r[3], "predicted_s": r[4],
                       "measured_s": r[5]} for r in rows]))


if __name__ == "__main__":
    main()
