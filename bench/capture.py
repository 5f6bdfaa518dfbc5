"""Capture speed: llama-7b at seq 4096, and how capture time grows with depth (10, 100, 1,000 layers).

Run: python bench/capture.py [--repeat N]. Each model is measured in a fresh Python process, as a user meets it
(`autopar profile` starts cold: PyTorch's fake-tensor dispatch cache is empty), then traced again N times in that
process ("warm": the cache is hot, so the fixed cost shrinks and the per-layer bookkeeping shows). Model building
(constructing the nn.Module on the meta device) is reported separately: it is the user's code, not capture.
Targets: llama-7b capture under 10 s; 1,000-layer / 10-layer capture-time ratio under 3.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
import autopar
from autopar.zoo import load
name, batch, seq, layers, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
overrides = {"layers": layers} if layers else {}
start = time.perf_counter()
zoo = load(name, batch=batch, seq=seq, **overrides)
build = time.perf_counter() - start
start = time.perf_counter()
graph = autopar.trace(zoo.module, example_kwargs=zoo.inputs)
cold = time.perf_counter() - start
warm = []
for _ in range(repeat):
    start = time.perf_counter()
    autopar.trace(zoo.module, example_kwargs=zoo.inputs)
    warm.append(time.perf_counter() - start)
print(json.dumps({"build_s": build, "cold_s": cold, "warm_s": statistics.median(warm), "nodes": graph.num_nodes}))
"""


def measure(name: str, *, batch: int, seq: int, layers: int, repeat: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(batch), str(seq), str(layers), str(repeat)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="warm traces per process (median reported)")
    args = parser.parse_args()
    results = {"llama-7b seq4096": measure("llama-7b", batch=1, seq=4096, layers=0, repeat=args.repeat)}
    for layers in (10, 100, 1000):
        results[f"gpt d=1024 x{layers}"] = measure("gpt3-350m", batch=8, seq=1024, layers=layers, repeat=args.repeat)
    for name, r in results.items():
        print(
            f"{name:18s} trace cold {r['cold_s']:.3f} s, warm {r['warm_s']:.3f} s; "
            f"model build {r['build_s']:.2f} s; {int(r['nodes'])} nodes"
        )
    deep, shallow = results["gpt d=1024 x1000"], results["gpt d=1024 x10"]
    ratios = {"cold": deep["cold_s"] / shallow["cold_s"], "warm": deep["warm_s"] / shallow["warm_s"]}
    print(f"1000-layer / 10-layer trace time: cold {ratios['cold']:.2f}, warm {ratios['warm']:.2f}")
    print(json.dumps({"results": results, "depth_ratio": ratios}))


if __name__ == "__main__":
    main()
