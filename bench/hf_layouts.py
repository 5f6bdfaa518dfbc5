"""Hugging Face types x parallel layouts, as a user runs them: every plan either trains what one process trains, with
the predicted collectives, or is refused when it is planned.

Run: python bench/hf_layouts.py [--types gemma,opt,...] [--layouts dp,z3,tp,tpsp,pp,pptp,pptpsp,ppz3] [--timeout 300]
[--clip-grad-norm MAX]

Each type is built from its default config at 2 layers, hidden 64, 4 heads (2 key/value heads where the config
groups them; Mistral with a sliding window of 16 at sequence 32), and each layout is written as a plan by
``autopar estimate ... --cluster cpu --batch 8 --mbs 2 --out PLAN.json`` and then, if a plan was written, run by
``autopar run PLAN.json --nproc N --steps 5 --check --check-comm`` (2 ranks; 4 for pp x tp, with or without SP,
and pp x dp under ZeRO 3), one at a time with one
thread per rank; with ``--clip-grad-norm MAX`` the run clips the whole model's gradient norm to MAX before each step
and ``--check`` also compares each step's norm with one process's. A cell is ``pass`` (both checks pass), ``refused`` (estimate exits 2 with a reason: the plan is
refused when planned), or a bug: ``run refused`` (a plan was written that the ranks refuse), ``mismatch`` (a check
fails) or ``crash`` (anything else, a timeout included). Prints one row per type and, for every cell that is not
``pass``, its reason; exits 1 if any cell is a bug. The first six layouts (108 cells) took 26 to 57 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TYPES = ["gpt2", "opt", "falcon", "bloom", "gpt_neox", "phi", "phi3", "qwen3", "gemma", "gemma2", "gemma3_text",
         "olmo2", "mistral", "mixtral", "qwen2_moe", "roberta", "vit", "whisper"]
LAYOUTS = {  # name: (estimate options, ranks)
    "dp": (["--tp", "1", "--pp", "1", "--dp", "2"], 2),
    "z3": (["--tp", "1", "--pp", "1", "--dp", "2", "--zero", "3"], 2),
    "tp": (["--tp", "2", "--pp", "1", "--dp", "1"], 2),
    "tpsp": (["--tp", "2", "--pp", "1", "--dp", "1", "--sp"], 2),
    "pp": (["--tp", "1", "--pp", "2", "--dp", "1"], 2),
    "pptp": (["--tp", "2", "--pp", "2", "--dp", "1"], 4),
    "pptpsp": (["--tp", "2", "--pp", "2", "--dp", "1", "--sp"], 4),
    "ppz3": (["--tp", "1", "--pp", "2", "--dp", "2", "--zero", "3"], 4),
}
SIZE = ["--layers", "2", "--hidden", "64", "--heads", "4"]
GROUPED = {"mixtral"}  # default configs with more key/value heads than 4 query heads allow


def model_args(kind: str, folder: Path) -> list[str]:
    """The CLI's name and options of one type: Mistral through a config file with a window shorter than the
    sequence (the CLI has no window option), so that its sliding window is exercised."""
    if kind == "mistral":
        from transformers import MistralConfig

        path = folder / "mistral" / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        MistralConfig(sliding_window=16, architectures=["MistralForCausalLM"]).to_json_file(str(path))
        return [f"hf:{path.parent}", *SIZE, "--kv-heads", "2"]
    return [f"hf:{kind}", *SIZE, *(["--kv-heads", "2"] if kind in GROUPED else [])]


def cell(kind: str, layout: str, folder: Path, timeout: int, clip: float | None = None) -> tuple[str, str]:
    """(class, reason) of one type under one layout."""
    options, ranks = LAYOUTS[layout]
    plan = folder / f"{kind}-{layout}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    estimate = [sys.executable, "-m", "autopar.cli.main", "estimate", *model_args(kind, folder), "--seq", "32",
                "--batch", "8", "--mbs", "2", "--cluster", "cpu", *options, "--out", str(plan)]
    try:
        made = subprocess.run(estimate, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "crash", f"estimate took over {timeout} s"
    if made.returncode == 2 and not plan.exists():
        return "refused", _last(made.stderr)
    if made.returncode != 0 or not plan.exists():
        return "crash", f"estimate exited {made.returncode}: {_last(made.stderr)}"
    run = [sys.executable, "-m", "autopar.cli.main", "run", str(plan), "--nproc", str(ranks), "--steps", "5",
           "--check", "--check-comm", "--json", *(["--clip-grad-norm", str(clip)] if clip is not None else [])]
    try:
        done = subprocess.run(run, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "crash", f"run took over {timeout} s"
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        data = None
    if done.returncode == 0 and data and data["check"]["ok"] and data["check_comm"]["ok"]:
        return "pass", ""
    reason = _last(done.stderr)
    if data is not None:  # it trained: a check failed, or a loss was not finite
        return "mismatch", reason
    if done.returncode == 2:  # refused before any rank trained
        return "run refused", reason
    return "crash", f"run exited {done.returncode}: {reason}"


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and "Warning" not in line]
    return lines[-1][:300] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated Hugging Face model types")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per command (default 300)")
    parser.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                        help="autopar run clips the gradients' norm to MAX, each step's norm checked")
    args = parser.parse_args()
    kinds, layouts = args.types.split(","), args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        sys.exit(f"hf_layouts: unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    bugs, notes = 0, []
    print(f"{'type':12s} " + " ".join(f"{name:>11s}" for name in layouts), flush=True)
    with tempfile.TemporaryDirectory(prefix="autopar-hf-layouts-") as tmp:
        for kind in kinds:
            row = []
            for layout in layouts:
                verdict, reason = cell(kind, layout, Path(tmp), args.timeout, args.clip_grad_norm)
                row.append(verdict)
                bugs += verdict not in ("pass", "refused")
                if reason:
                    notes.append(f"{kind} {layout}: {verdict}: {reason}")
            print(f"{kind:12s} " + " ".join(f"{v:>11s}" for v in row), flush=True)
    print()
    print("\n".join(notes))
    cells = len(kinds) * len(layouts)
    print(f"\n{cells} cells: {bugs} bugs (run refused, mismatch or crash)")
    sys.exit(1 if bugs else 0)


if __name__ == "__main__":
    main()
