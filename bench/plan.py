"""Intra-op planning speed: llama-7b on 8 devices (1-D, 2x4 and 2x2x2 meshes), and how planning time grows with
depth.

Run: python bench/plan.py. Each case runs in three fresh Python processes (the median is shown), as
`autopar plan --search ilp` does: capture (one trace per micro-batch size tried), ParallelBlocks and segments,
pricing, the ILP per ZeRO stage and micro-batch count, and the three baselines. Model building (the nn.Module on the meta device) is reported apart: it is the user's code.
Targets: llama-7b on 8 devices under 10 s including capture; 320 layers / 32 layers under 2x (same width, both
fitting, so the search takes the same path).
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
from autopar.search import plan_intra
from autopar.zoo import load
name, mesh = sys.argv[1], sys.argv[4]
gpus, batch, layers, hidden = (int(sys.argv[i]) for i in (2, 3, 5, 6))
shape = tuple(int(x) for x in mesh.split("x"))
overrides = {"layers": layers} if layers else {}
if hidden:
    overrides.update(hidden=hidden, heads=hidden // 128, kv_heads=hidden // 128, ffn=hidden * 11 // 4)
start = time.perf_counter()
zoo = load(name, batch=1, **overrides)
build = time.perf_counter() - start
traces = []
def trace_at(size):
    t = time.perf_counter()
    graph = trace(zoo.module, example_kwargs=zoo.inputs_at(size))
    traces.append(time.perf_counter() - t)
    return graph
start = time.perf_counter()
found = plan_intra(trace_at, load_cluster("a100-80g-sxm").with_devices(gpus), shape, global_batch=batch)
total = time.perf_counter() - start
ilp = found["ilp"]
print(json.dumps({"build_s": build, "plan_s": total, "capture_s": sum(traces), "traces": len(traces),
                  "iteration_s": ilp.estimate.iteration_seconds, "trace_each": [round(t, 3) for t in traces],
                  "fits": ilp.estimate.memory.fits,
                  "variables": len(ilp.space.representative), "blocks": len(ilp.space.blocks.blocks)}))
"""


def measure(name: str, gpus: int, batch: int, mesh: str, layers: int = 0, hidden: int = 0, repeat: int = 3) -> dict:
    """Median run (by planning time) of ``repeat`` fresh processes."""
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, name, str(gpus), str(batch), mesh, str(layers), str(hidden)],
            check=True, capture_output=True, text=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return sorted(runs, key=lambda r: r["plan_s"])[len(runs) // 2]


def main() -> None:
    print("llama-7b, global batch 512, a100-80g-sxm (target: under 10 s including capture)")
    for mesh in ("8", "2x4", "2x2x2"):
        r = measure("llama-7b", 8, 512, mesh)
        print(
            f"  mesh {mesh:4s} plan {r['plan_s']:5.2f} s (capture {r['capture_s']:.2f} s in {r['traces']} traces), "
            f"model build {r['build_s']:.2f} s, {r['blocks']} blocks -> {r['variables']} variables, "
            f"iteration {r['iteration_s']:.2f} s, fits {r['fits']}"
        )
    # hidden 1024 keeps the 320-layer model (4.4B parameters) within 8 x 80 GB, so both depths take the same search
    # path; at llama-7b's width 320 layers (67B) cannot fit at all and the search stops after one trace
    print("depth: llama, hidden 1024, 8 devices, mesh 8, global batch 512 (target: 320/32 under 2x)")
    times = {}
    for layers in (32, 320):
        r = measure("llama-7b", 8, 512, "8", layers, hidden=1024)
        times[layers] = r["plan_s"]
        print(f"  {layers:4d} layers: plan {r['plan_s']:5.2f} s (capture {r['capture_s']:.2f} s in {r['traces']} "
              f"traces), {r['blocks']} blocks -> {r['variables']} variables, fits {r['fits']}")
    print(f"  ratio 320/32: {times[320] / times[32]:.2f}")


if __name__ == "__main__":
    main()
