"""Random intra-op assignments of a tiny GPT and a tiny grouped-query LLaMA (and of Hugging Face models from config:
`--family hf-gpt2 hf-bert hf-opt hf-gemma hf-phi hf-qwen3`), trained on 4 gloo ranks beside one process: does every
plan the rehearsal accepts train what one process trains?

Run: python bench/intra_assignments.py [--count 50] [--seed 1] [--steps 3] [--family gpt llama hf-llama]
[--zero 0 1 2 3] [--recompute].
For each family, `--count` plans on a 2 x 2 mesh (Megatron's layout, pure data parallelism, then per-block splits,
micro-batch counts and ZeRO stages drawn at random, and with `--recompute` each repeated layer recomputed in full or
not; tests/intra_ranks.py) are rehearsed on a fake process group of 4 ranks;
those it accepts run `--steps` AdamW steps on 4 gloo ranks in one launch. Prints per family how many were refused
(and why), how many ran, the largest loss and first-step gradient differences from one process and the largest
difference between replicated copies of a shard; exits 1 if any plan failed on the ranks or differed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import intra_ranks  # noqa: E402

from autopar.cluster.ranks import run_ranks  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.runtime.validate import rehearsal  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--family", nargs="+", default=["gpt", "llama", "hf-llama"], choices=sorted(intra_ranks.MODELS))
    parser.add_argument("--zero", type=int, nargs="+", default=[0], choices=(0, 1, 2, 3),
                        help="ZeRO stages to draw from (default 0)")
    parser.add_argument("--recompute", action="store_true",
                        help="also draw, per repeated layer, whether it is recomputed in full")
    args = parser.parse_args()
    bad = False
    for family in args.family:
        start = time.perf_counter()
        plans = intra_ranks.assignments(family, args.count, seed=args.seed, zero=tuple(args.zero),
                                        recompute=args.recompute)
        accepted, refused = [], Counter()
        for data in plans:
            try:
                rehearsal(Plan.from_dict(data))
                accepted.append(data)
            except (ValueError, NotImplementedError) as exc:  # a refusal, saying why
                refused[str(exc)[:160]] += 1
        results = run_ranks(intra_ranks._catching, 4, args=(accepted, args.steps))
        failed = [k for k in range(len(accepted)) if any("error" in r[k] for r in results)]
        worst = {key: max((r[k].get(key, 0.0) for r in results for k in range(len(accepted))), default=0.0)
                 for key in ("loss", "grads", "drift")}
        differ = worst["loss"] > 1e-4 or worst["grads"] > 1e-4 or worst["drift"] > 0
        bad |= bool(failed) or differ
        stages = Counter(d["zero"] for d in accepted)
        again = Counter(len(d.get("recompute", [])) for d in accepted)
        print(f"{family}: {len(plans)} plans (ZeRO drawn from {args.zero}), {sum(refused.values())} refused by the "
              f"rehearsal, {len(accepted)} run on 4 ranks (by ZeRO stage {dict(sorted(stages.items()))}"
              + (f", by layers recomputed {dict(sorted(again.items()))}" if args.recompute else "")
              + f"; {len(failed)} failed); largest difference from one process: loss {worst['loss']:.1e}, first-step "
              f"gradients {worst['grads']:.1e}; replicated shards apart by {worst['drift']:.1e}; "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        for why, n in refused.items():
            print(f"  refused ({n}): {why}")
        for k in failed:
            print(f"  failed: {[b['split'] for b in accepted[k]['blocks']]}: "
                  f"{next(r[k]['error'] for r in results if 'error' in r[k])}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
