"""Anytime quality of the pipeline searches: the best plan's time after 1, 3, 10, 30 and 60 s for Aceso, MCMC and
auto, per bench case (`bench/pipeline.py`'s cases), each search given a 60 s budget and stopping when it converges.

Run: python bench/search.py [--quick] [--budget S]. Each (case, search) runs in a fresh Python process: build, one
trace at batch 1, then the search alone, timed from its start. The curve columns are the closed-form iteration time
(the screen every search ranks by) of the best configuration priced by then ("-": none yet; once a search has
ended, its final best); "plan" is that search's plan re-priced by the simulator, as `autopar plan` shows it;
"s" the search's wall time, "conv" whether it converged before its budget. aceso runs alone (no grid: its starts
are its own); mcmc runs the Megatron grid first (its seeds, so the grid's points count on its curve); auto runs
the grid, Aceso and MCMC. The summary counts cases where MCMC alone is at least as good as Aceso, and checks auto
against the Megatron grid (both simulated). Timings depend on the machine's load: say what else ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pipeline import CASES  # noqa: E402 - the bench cases

MARKS = (1, 3, 10, 30, 60)

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from autopar.api.search import simulated
from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.cost.pipeline import PipelineModel
from autopar.search import pipeline as searches
from autopar.zoo import load
name, gpus, batch, layers, kind, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
zoo = load(name, batch=1, **({"layers": layers} if layers else {}))
model = PipelineModel(trace(zoo.module, example_kwargs=zoo.inputs), load_cluster("a100-80g-sxm").with_devices(gpus),
                      traced_batch=1, screen=True)
curve, best = [], [None]
priced = searches.Evaluator.__call__
def recording(self, config):  # every configuration any search prices: note when the best so far improves
    result = priced(self, config)
    s = searches.score(result)
    if best[0] is None or s < best[0]:
        best[0] = s
        curve.append((time.perf_counter() - start, s[0], s[1]))
    return result
searches.Evaluator.__call__ = recording
start = time.perf_counter()
if kind == "aceso":
    found = {"aceso": searches.aceso(model, global_batch=batch, time_limit=budget)}
    found["aceso"].runners_up = []
else:
    found = searches.pipeline_searches(model, kind, global_batch=batch, time_limit=budget)
seconds = time.perf_counter() - start
searches.Evaluator.__call__ = priced
own = found[kind]
sim = simulated(model, found, global_batch=batch, own=kind)
print(json.dumps({"curve": curve, "seconds": seconds, "converged": own.converged, "by": own.by,
                  "screen": own.result.estimate.iteration_seconds, "plan": sim[kind].result.estimate.iteration_seconds,
                  "fits": sim[kind].result.estimate.memory.fits,
                  "grid": sim["megatron"].result.estimate.iteration_seconds if "megatron" in sim else None}))
"""


def at(curve: list, mark: float, seconds: float) -> str:
    """The best fitting time found by ``mark`` seconds (the final best once the search has ended)."""
    seen = [c for c in curve if c[0] <= mark or seconds <= mark]
    if not seen:
        return "-"
    over, value = seen[-1][1], seen[-1][2]
    return f"{value:.3f}" if not over else f"x{value:.2f}"


def run(case: tuple, kind: str, budget: float) -> dict:
    name, gpus, batch, layers = case
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(gpus), str(batch), str(layers), kind, str(budget)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 60.0
    cases = CASES[:2] if "--quick" in sys.argv else CASES
    print(f"{'model':16s} {'gpus':>5s} {'search':6s} " + " ".join(f"{f'{m} s':>8s}" for m in MARKS)
          + f" {'plan':>8s} {'s':>6s} conv  by")
    mcmc_wins, mcmc_plans, auto_ok, rows = 0, 0, 0, 0
    for case in cases:
        found = {kind: run(case, kind, budget) for kind in ("aceso", "mcmc", "auto")}
        label = case[0] + (f" x{case[3]}" if case[3] else "")
        for kind, r in found.items():
            print(f"{label:16s} {case[1]:5d} {kind:6s} " + " ".join(f"{at(r['curve'], m, r['seconds']):>8s}"
                                                                  for m in MARKS)
                  + f" {r['plan']:8.3f} {r['seconds']:6.1f} {'yes ' if r['converged'] else 'no  '}  {r['by']}"
                  + ("" if r["fits"] else " n/fit"))
        rows += 1
        mcmc_wins += found["mcmc"]["screen"] <= found["aceso"]["screen"] * (1 + 1e-9)
        mcmc_plans += found["mcmc"]["plan"] <= found["aceso"]["plan"] * (1 + 1e-9)
        auto_ok += found["auto"]["plan"] <= found["auto"]["grid"] * (1 + 1e-9)
        print(f"{'':16s} {'':5s} grid   {'':>44s} {found['auto']['grid']:8.3f}", flush=True)
    print(f"\nMCMC alone at least as good as Aceso: {mcmc_wins} of {rows} cases on the closed form, {mcmc_plans} of "
          f"{rows} on the simulated plans; auto no slower than the Megatron grid (simulated): {auto_ok} of {rows}")


if __name__ == "__main__":
    main()
