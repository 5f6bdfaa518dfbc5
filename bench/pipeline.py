"""Pipeline planning (`autopar plan --search auto`): speed on the two large targets, and auto against the best
Megatron-LM grid point (interleaved points included) under the same cost model across model families and
cluster sizes.

Run: python bench/pipeline.py [--quick]. Each case runs in a fresh Python process: model build, one trace at batch 1,
layer analysis, the Megatron grid, Aceso over every pipeline depth (30 s budget), and the DP/FSDP baselines, all
ranked by the closed form (the screen), then the plans and baselines re-priced by the simulator, as `autopar plan`
does; the iteration times shown are simulated.
Targets: gpt3-175b on 1,024 GPUs (batch 1536) and a 1,000-layer GPT on 8 GPUs each under 60 s; auto never slower
than the grid. "n/fit" marks a plan that does not fit the devices (the ratio then compares memory overflow).
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from autopar.capture import trace
from autopar.cluster import load_cluster
from autopar.cli.plan import simulated
from autopar.cost.pipeline import PipelineModel
from autopar.search.pipeline import auto
from autopar.zoo import load
name, gpus, batch, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
zoo = load(name, batch=1, **({"layers": layers} if layers else {}))
build = time.perf_counter() - start
graph = trace(zoo.module, example_kwargs=zoo.inputs)
model = PipelineModel(graph, load_cluster("a100-80g-sxm").with_devices(gpus), traced_batch=1, screen=True)
found = simulated(model, auto(model, global_batch=batch, time_limit=30), global_batch=batch, own="auto")
total = time.perf_counter() - start
a, g = found["auto"], found["megatron"]
c = a.config
print(json.dumps({
    "total_s": total, "build_s": build, "auto_s": a.result.estimate.iteration_seconds, "grid_s": g.result.estimate.iteration_seconds,
    "auto_fits": a.result.estimate.memory.fits, "grid_fits": g.result.estimate.memory.fits, "priced": a.evaluated,
    "pp": c.pp, "tps": sorted({s.tp for s in c.stages}), "uneven": len({s.end - s.start for s in c.stages}) > 1,
    "recomputed": sum(len(s.recomputed_rows()) for s in c.stages),
    "runs": sum(len(s.segments) for s in c.stages), "mfu": a.result.estimate.mfu,
    "chunks": c.chunks, "intra": sum(s.intra for s in c.stages),
    "laid_out": sum(len(model.stage_view(c, i, global_batch=batch).layouts) for i in range(len(c.stages))),
}))
"""

CASES = [
    ("gpt3-175b", 1024, 1536, 0),
    ("gpt3-350m", 8, 64, 1000),
    ("gpt3-1.3b", 8, 256, 0),
    ("gpt3-13b", 64, 512, 0),
    ("llama-7b", 8, 256, 0),
    ("llama-70b", 64, 512, 0),
    ("llama-70b", 1024, 2048, 0),
    ("t5-large", 8, 256, 0),
    ("t5-3b", 64, 1024, 0),
    ("t5-3b", 1024, 4096, 0),
    ("moe-1.3b-e32", 8, 256, 0),
    ("moe-6.7b-e64", 64, 1024, 0),
    ("moe-6.7b-e64", 1024, 4096, 0),
    ("wrn-101-8", 8, 1024, 0),
    ("wrn-152-16", 64, 2048, 0),
    ("wrn-152-16", 1024, 16384, 0),
]


def main() -> None:
    cases = CASES[:2] if "--quick" in sys.argv else CASES
    print(f"{'model':16s} {'gpus':>5s} {'batch':>6s} {'plan s':>7s} {'auto it/s':>10s} {'grid it/s':>10s} "
          f"{'grid/auto':>9s} {'MFU':>6s}  plan")
    for name, gpus, batch, layers in cases:
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(gpus), str(batch), str(layers)],
                             check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        label = name + (f" x{layers}" if layers else "")
        fits = "" if r["auto_fits"] else " n/fit"
        shape = (f"pp {r['pp']}, tp {'/'.join(map(str, r['tps']))}" + (", uneven stages" if r["uneven"] else "")
                 + (f", interleaved x{r['chunks']}" if r["chunks"] > 1 else "")
                 + (f", {r['recomputed']} recomputed" if r["recomputed"] else "")
                 + (f" ({r['runs']} checkpointed runs)" if r["runs"] else "")
                 + (f", {r['laid_out']} layers intra-op" if r["laid_out"] else "") + f", {r['priced']:,} priced")
        print(f"{label:16s} {gpus:5d} {batch:6d} {r['total_s']:7.1f} {r['auto_s']:10.3f} {r['grid_s']:10.3f} "
              f"{r['grid_s'] / r['auto_s']:9.3f} {r['mfu']:6.1%}  {shape}{fits}")


if __name__ == "__main__":
    main()
