"""What checking a plan on the user's model costs as the model gets deeper (`autopar.runtime.check_runnable`).

Run: python bench/rehearsal.py [--layers 10 100 1000] [--whole-up-to 100] [--zero 3] [--pp 1]. For a GPT of each
depth (`gpt3-1.3b --layers N --hidden 1024 --seq 512`) on 16 A100s, a single-stage plan (dp 16 with the ZeRO stage
given, 4 micro-batches, every fourth layer recomputed in full) is checked as `autopar plan` checks a plan before
printing it: the model built on the meta device, its chain and layouts checked, and the plan applied and stepped
once on a fake process group of 16 ranks. That step runs one layer of each kind (`autopar.runtime.thin`); up to
``--whole-up-to`` layers it is also timed whole (every layer and micro-batch), as it ran before. With ``--pp P``,
the plan has P even stages over dp 16 / P (ZeRO and recomputation alike), and the step is the pipeline's check:
each pipeline device steps its own stage, every stage thinned to its kinds of layers, under the plan's schedule.

Prints, per depth, the whole check, the step alone (thinned and whole; each builds the model first) and the
model's build and trace, which grow with depth in any case. Target: the thinned step less the build, 1,000 layers
within 1.5x of 10 layers'. The first depth is checked once before timing, so that start-up costs land nowhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import tempfile
import time
from pathlib import Path

from autopar.cli.main import main as cli
from autopar.plan import Plan
from autopar.runtime.source import ModelSource
from autopar.runtime.train import Workload
from autopar.runtime.validate import _check_pipeline, check_runnable, rehearsal


def plan_for(layers: int, zero: int, folder: Path, pp: int = 1) -> Plan:
    path = folder / f"gpt-{layers}.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["estimate", "gpt3-1.3b", "--layers", str(layers), "--hidden", "1024", "--seq", "512",
                    "--cluster", "a100-80g-sxm", "--gpus", "16", "--batch", "64", "--mbs", "1", "--zero", str(zero),
                    "--pp", str(pp), "--dp", str(16 // pp), "--out", str(path)])
    if code != 0:
        raise SystemExit(f"autopar estimate exited {code} for {layers} layers")
    plan = Plan.load(path)
    def every_fourth(stage):  # noqa: ANN001, ANN202
        return tuple((name, "full") for name in stage.layers
                     if name.startswith("layers.") and int(name.rpartition(".")[2]) % 4 == 3)

    stages = tuple(dataclasses.replace(stage, recompute=every_fourth(stage)) for stage in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def timed(run) -> float:  # noqa: ANN001
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--whole-up-to", type=int, default=100)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=3)
    parser.add_argument("--pp", type=int, choices=(1, 2, 4, 8), default=1)
    args = parser.parse_args()
    print(f"{'layers':>6}  {'check':>7}  {'step less build':>15}  {'whole step':>10}  {'build':>6}  {'trace':>6}")
    steps = {}
    with tempfile.TemporaryDirectory() as folder:
        for at, layers in enumerate(args.layers):
            plan = plan_for(layers, args.zero, Path(folder), args.pp)
            source = ModelSource.of_workload(Workload.of(plan))
            if at == 0:
                check_runnable(plan, source=source)
            build = timed(source.meta)
            trace = timed(source.chain)
            check = timed(lambda: check_runnable(plan, source=source))
            if args.pp > 1:  # the pipeline's own check, stage by stage on every pipeline device
                steps[layers] = timed(lambda: _check_pipeline(plan, source)) - build
                whole = f"{'-':>10}"
            else:
                steps[layers] = timed(lambda: rehearsal(plan, source=source, whole=False)) - build
                whole = f"{timed(lambda: rehearsal(plan, source=source)):9.2f}s" if layers <= args.whole_up_to \
                    else f"{'-':>10}"
            print(f"{layers:>6}  {check:6.2f}s  {steps[layers]:14.2f}s  {whole}  {build:5.2f}s  {trace:5.2f}s",
                  flush=True)
    low, high = min(steps), max(steps)
    print(f"thinned step less the build, {high} layers against {low}: {steps[high] / steps[low]:.2f}x (target under "
          "1.5x)")


if __name__ == "__main__":
    main()
