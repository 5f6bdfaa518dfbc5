"""``autopar run PLAN.json``: train a plan on local ranks and, with ``--check``, prove it matches one process."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from autopar.cli.common import add_rebuild_arguments, load_runnable
from autopar.cli.render import binary_bytes, table
from autopar.runtime import Workload, reference, run_plan
from autopar.runtime.launch import prestart_for
from autopar.runtime.comm import check_ranks
from autopar.runtime.train import LEARNING_RATE

LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
GRAD_TOLERANCE = dict(rtol=1e-4, atol=1e-6)
# A gradient outside GRAD_TOLERANCE still matches where it is no farther from a float64 run of the same steps than
# this many times one fp32 process's own distance from it: both are that fp32 result, summed in another order.
ROUNDING = 4.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train a plan on local ranks (gloo on CPU); --check compares with a single process",
        description="Launch --nproc ranks, apply PLAN.json with PyTorch's distributed engine, train --steps steps "
        "of SGD on synthetic data (every nn.Dropout set to 0; dropout the model's own code applies stays on) and "
        "print per-step loss, seconds and peak memory. With --check, "
        "each step runs again in one process from the weights the ranks started it from, on the same batch: losses, "
        "gradients and the optimizer step's update must match.",
    )
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by autopar plan --out")
    parser.add_argument("--nproc", type=int, required=True, help="ranks to launch (the plan's device count)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--check", action="store_true",
                        help="compare each step's loss, gradients and update with one process's from the same weights")
    parser.add_argument("--check-comm", action="store_true",
                        help="count every rank's collectives in the last step (--steps 3 or more) and compare them (kind, mesh axis, "
                        "calls, bytes) with the cost model's prediction for the plan")
    parser.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                        help="clip the norm of the whole model's gradients to MAX before each optimizer step, as "
                        "torch.nn.utils.clip_grad_norm_ does in one process (with --check, each step's norm must "
                        "match one process's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_rebuild_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict[str, Any] | str:
    if args.nproc < 1 or args.steps < 1:
        raise ValueError(f"--nproc and --steps must be positive, got {args.nproc} and {args.steps}")
    if args.check_comm and args.steps < 3:
        raise ValueError(f"--check-comm counts the last step and needs --steps 3 or more (got {args.steps}): "
                         "the first two include one-time set-up (DDP rebuilds its buckets in the second)")
    clip = args.clip_grad_norm
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"--clip-grad-norm must be a positive number, got {clip}")
    # the ranks' fork server starts once the plan is read, its imports beside the plan's checks
    plan = load_runnable(args.plan, args=args, before_check=prestart_for)
    work = Workload.of(plan) if args.check else None
    if work is not None:  # refused before any rank starts where the comparison could not hold
        draws = reference(work, steps=1, clip=clip).random_draws
        if draws:
            raise ValueError(random_refusal(draws))
    log = run_plan(plan, nproc=args.nproc, steps=args.steps, check=args.check, check_comm=args.check_comm,
                   checked=True, clip=clip)
    data: dict[str, Any] = {
        "plan": args.plan,
        "nproc": args.nproc,
        "steps": [
            {"step": i, "loss": loss, "seconds": sec, "peak_memory": peak}
            for i, (loss, sec, peak) in enumerate(zip(log.losses, log.seconds, log.peak_bytes))
        ],
    }
    for step, norm in zip(data["steps"], log.grad_norms):
        step["grad_norm"] = norm
    data["timing"] = timing(plan, log.seconds)
    if work is not None:  # one process runs each step from the weights the ranks started it from
        ref = reference(work, steps=args.steps, clip=clip, starts=log.weights)
        data["check"] = compare(log, ref, exact=lambda: reference(work, steps=args.steps, dtype=torch.float64,
                                                                  clip=clip, starts=log.weights))
    if args.check_comm:
        data["check_comm"] = check_ranks(plan, log.collectives)
    failed = [data[key]["message"] for key in ("check", "check_comm") if not data.get(key, {"ok": True})["ok"]]
    step = next((i for i, loss in enumerate(log.losses) if not math.isfinite(loss)), None)
    if step is not None and not failed:  # a loss that is not finite trains nothing: not a success
        failed.append(f"step {step}: the loss is {log.losses[step]}: the model gives no finite loss on this "
                      "workload (a causal LM at sequence 1 has no next token to predict) or the step diverged")
    if failed:
        if args.json:  # strict JSON, as every command prints: a loss that is not finite is null
            print(json.dumps(_finite(data), indent=2, allow_nan=False))
        raise RuntimeError("; ".join(failed))
    return data if args.json else render(data)


def random_refusal(places: list[str]) -> str:
    shown = "; ".join(places[:3]) + (f"; and {len(places) - 3} more" if len(places) > 3 else "")
    return (f"--check cannot compare this model with one process: it draws random numbers in training ({shown}), "
            "and ranks draw theirs for their own rows, stages and shards, so losses would differ by the draws "
            "alone. autopar run sets every nn.Dropout module to 0, but cannot reach dropout or noise the model's own "
            "code applies: run without --check, or apply dropout through nn.Dropout modules")


def timing(plan: Any, seconds: list[float]) -> dict[str, Any]:
    """The measured step time beside the plan's prediction: the median of the steps after the first (which
    builds buckets, caches and allocator pools), or the only step. The ratio is given only where the prediction
    was made for these ranks' kind of device: a plan priced for a GPU preset says nothing of a CPU process."""
    import statistics

    from autopar.cluster import PRESETS

    timed = seconds[1:] or seconds
    measured = statistics.median(timed)
    out: dict[str, Any] = {"measured_seconds": measured, "steps_timed": len(timed), "predicted_seconds": None,
                           "cluster": None, "ratio": None, "why_no_ratio": None}
    estimate = plan.estimate
    if estimate is None:
        out["why_no_ratio"] = "the plan carries no estimate"
        return out
    out["predicted_seconds"], out["cluster"] = estimate.iteration_seconds, estimate.cluster
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if estimate.cluster is None:
        out["why_no_ratio"] = "the plan does not record the cluster it was priced for"
    elif estimate.cluster in PRESETS and (estimate.cluster == "cpu") != (here == "cpu"):
        out["why_no_ratio"] = (f"the plan was priced for {estimate.cluster}, not for these {here} ranks; plan with "
                               "--cluster FILE from `autopar calibrate` to compare")
    else:
        out["ratio"] = measured / estimate.iteration_seconds
    return out


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite (a NaN loss) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def compare(log, ref, exact: Any = None) -> dict[str, Any]:  # noqa: ANN001
    """Losses, gradients and optimizer steps of every step against the reference; the first mismatch is named.

    Where the run recorded its weights (`StepLog.weights`), the reference started each step from them
    (`autopar.runtime.reference` with ``starts``): both sides of every step start from the same point, the run's
    first weights must equal the model's own, and each step's update (weights after it less weights before) must
    equal the reference's from the same weights. A gradient or update outside the tolerance is checked again
    against ``exact()`` (the reference's steps in float64, from the same weights, run once, when first needed):
    where the run's value is no farther from it than `ROUNDING` times the reference's own, the two differ by fp32
    rounding alone (sums in another order: a reduction over ranks, a contraction split over features) and match;
    ``rounding`` then counts them."""
    worst = worst_update = 0.0
    rounding: list[float] = []  # per gradient or update matched so, its distance from float64 over the reference's
    exact_log: list = []
    failed = _apart_or_start(log, ref)
    if failed:
        return {"ok": False, "message": failed}
    for step, (ours, theirs) in enumerate(zip(log.losses, ref.losses)):  # each step's values, the earliest named
        if not math.isfinite(theirs):
            return {"ok": False, "message": f"step {step}: the loss is {theirs} in one process too (here {ours}): "
                                            "the model gives no finite loss on this workload (a causal LM at "
                                            "sequence 1 has no next token to predict), so there is nothing to "
                                            "compare"}
        if not torch.isclose(torch.tensor(ours), torch.tensor(theirs), **LOSS_TOLERANCE):
            return {"ok": False, "message": f"step {step}: loss {ours:.8f}, one process {theirs:.8f}"}
        norms = (log.grad_norms[step], ref.grad_norms[step]) if step < min(len(log.grad_norms),
                                                                            len(ref.grad_norms)) else None
        if norms is not None and not torch.isclose(torch.tensor(norms[0]), torch.tensor(norms[1]), **GRAD_TOLERANCE):
            return {"ok": False, "message": f"step {step}: the gradients' norm is {norms[0]:.8g}, one process's "
                                            f"{norms[1]:.8g}"}
        if step < min(len(log.grads), len(ref.grads)):
            failed, largest = _gradients(log.grads[step], ref.grads[step], step, exact, exact_log, rounding)
            if failed:
                return {"ok": False, "message": failed}
            worst = max(worst, largest)
        if step + 1 < min(len(log.weights), len(ref.weights)):
            failed, largest = _updates(log, ref, step, exact, exact_log, rounding)
            if failed:
                return {"ok": False, "message": failed}
            worst_update = max(worst_update, largest)
    out = {"ok": True, "max_grad_diff": worst, "max_update_diff": worst_update, "steps": len(ref.losses),
           "message": "losses, gradients and updates match" if len(log.weights) > 1 else "losses and gradients match",
           "rounding": None}
    if rounding:
        out["rounding"] = {"gradients": len(rounding), "largest_ratio": max(rounding)}
        out["message"] += (f" ({len(rounding)} value{'s' if len(rounding) != 1 else ''} beyond the tolerance "
                           f"{'are' if len(rounding) != 1 else 'is'} as close to a float64 run as one fp32 process "
                           f"is: within {max(rounding):.1f}x its rounding)")
    return out


def _gradients(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], step: int, exact: Any, cache: list,
               rounding: list[float]) -> tuple[str | None, float]:
    """One step's gradients against the reference's: (the mismatch or None, the largest difference)."""
    if set(ours) != set(theirs):
        return f"step {step}: gradients differ in which parameters have one: {sorted(set(theirs) ^ set(ours))[:3]}", 0
    largest = 0.0
    for name, grad in theirs.items():
        diff = float((ours[name] - grad).abs().max())
        largest = max(largest, diff)
        if not torch.allclose(ours[name], grad, **GRAD_TOLERANCE):
            ratio = _rounding_ratio(ours[name], grad, lambda e: _entry(e.grads, step, name), exact, cache)
            if ratio is None or ratio > ROUNDING:
                return f"step {step}: gradient of {name} differs by up to {diff:.3g}" + _beyond(ratio), largest
            rounding.append(ratio)
    return None, largest


def _beyond(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f" ({ratio:.1f}x as far from a float64 run as one fp32 process is: more than rounding)"


def _apart_or_start(log, ref) -> str | None:  # noqa: ANN001
    """Why the run cannot be compared step by step: tied copies apart, or other first weights than the model's."""
    if log.apart:
        return log.apart[0]
    if not log.weights or not ref.weights:
        return None
    ours, theirs = log.weights[0], ref.weights[0]
    if set(ours) != set(theirs):
        return f"the run holds other parameters than the model: {sorted(set(ours) ^ set(theirs))[:3]}"
    for name, weight in theirs.items():
        if ours[name].shape != weight.shape or not torch.equal(ours[name].to(weight.dtype), weight):
            return (f"the ranks start from other weights than the model's own: {name} "
                    + (f"has shape {list(ours[name].shape)}, the model's {list(weight.shape)}"
                       if ours[name].shape != weight.shape
                       else f"differs by up to {float((ours[name] - weight).abs().max()):.3g}"))
    return None


def _updates(log, ref, step: int, exact: Any, cache: list,  # noqa: ANN001
             rounding: list[float]) -> tuple[str | None, float]:
    """Each weight's update in ``step`` (after less before, both the run's) against the reference's from the run's
    weights. Beside the gradients' tolerance times the learning rate, each element may differ by the rounding of
    its weight (a few units in the last place of ``|weight|``): both sides round ``w - lr * g`` to fp32."""
    before, after, theirs = log.weights[step], log.weights[step + 1], ref.weights[step + 1]
    largest = 0.0
    for name, start in before.items():
        if name not in after or name not in theirs:
            return f"step {step}: the weights after it lack {name}", largest
        ours_update, their_update = after[name] - start, theirs[name] - start
        diff = (ours_update - their_update).abs()
        largest = max(largest, float(diff.max()))
        ulp = torch.finfo(torch.float32).eps * torch.maximum(start.abs(), after[name].abs())
        bound = GRAD_TOLERANCE["rtol"] * their_update.abs() + LEARNING_RATE * GRAD_TOLERANCE["atol"] + 4 * ulp
        if bool((diff > bound).any()):
            ratio = _rounding_ratio(ours_update, their_update, lambda e: _float64_update(e, start, step, name),
                                    exact, cache)
            if ratio is None or ratio > ROUNDING:
                return (f"step {step}: the optimizer step moved {name} otherwise than one process's from the same "
                        f"weights, by up to {float(diff.max()):.3g}" + _beyond(ratio)), largest
            rounding.append(ratio)
    return None, largest


def _entry(table: list[dict[str, torch.Tensor]], step: int, name: str) -> torch.Tensor | None:
    """``table[step][name]`` (a float64 run's gradient or weight), or None where that run has none."""
    return table[step].get(name) if step < len(table) else None


def _float64_update(exact, before: torch.Tensor, step: int, name: str) -> torch.Tensor | None:  # noqa: ANN001
    """The float64 run's update of ``name`` in ``step``, from the run's weight ``before`` it."""
    after = _entry(exact.weights, step + 1, name)
    return None if after is None else after - before.double()


def _rounding_ratio(ours: torch.Tensor, theirs: torch.Tensor, value: Any, exact: Any, cache: list) -> float | None:
    """How many times farther ``ours`` is from the float64 run's value (``value(run)``: a gradient or an update,
    None where it has none) than the reference's ``theirs`` is (largest elements); None without a float64 run
    (none given, or the model cannot run in float64)."""
    if exact is None:
        return None
    if not cache:
        try:
            cache.append(exact())
        except (RuntimeError, TypeError, ValueError):  # an op with no float64 kernel: the fp32 tolerance stands
            cache.append(None)
    truth = None if cache[0] is None else value(cache[0])
    if truth is None:
        return None
    ours_off = float((ours.double() - truth).abs().max())
    theirs_off = float((theirs.double() - truth).abs().max())
    return ours_off / theirs_off if theirs_off > 0 else math.inf


def render(data: dict[str, Any]) -> str:
    clipped = any("grad_norm" in s for s in data["steps"])
    rows = [[str(s["step"]), f"{s['loss']:.6f}", *([f"{s['grad_norm']:.4g}"] if clipped else []),
             f"{s['seconds']:.3f} s", binary_bytes(s["peak_memory"])] for s in data["steps"]]
    headers = ["step", "loss", *(["gradient norm"] if clipped else []), "time", "peak memory (rank 0)"]
    lines = [f"{data['plan']} on {data['nproc']} ranks", table(headers, rows)]
    t = data["timing"]
    steps = {1: "the only step" if len(rows) == 1 else "the step after the first"}.get(
        t["steps_timed"], f"median of the {t['steps_timed']} steps after the first")
    line = f"step time {t['measured_seconds']:.3f} s ({steps})"
    if t["predicted_seconds"] is not None:
        line += f"; predicted {t['predicted_seconds']:.3f} s for {t['cluster'] or 'an unrecorded cluster'}"
    ratio = t["ratio"]
    line += f": measured / predicted {ratio:.2f}" if ratio is not None else f" (no ratio: {t['why_no_ratio']})"
    lines.append(line)
    if "check" in data:
        c = data["check"]
        update = f", update {c['max_update_diff']:.2g}" if c.get("max_update_diff") else ""
        lines.append(f"check: {c['message']} over {c['steps']} steps, each from the ranks' weights (largest "
                     f"gradient difference {c['max_grad_diff']:.2g}{update})")
    if "check_comm" in data:
        lines += ["", "collectives in the last step, rank 0 (counted / predicted)", comm_table(data["check_comm"]["ranks"][0]["rows"]),
                  f"check-comm: {data['check_comm']['message']}"]
    return "\n".join(lines)


def comm_table(rows: list[dict[str, Any]]) -> str:
    """Counted against predicted collectives, one row per (axis, kind)."""
    return table(
        ["axis", "kind", "calls", "bytes", ""],
        [[r["axis"], r["kind"], f"{r['counted']} / {r['predicted']}",
          f"{binary_bytes(r['counted_bytes'])} / {binary_bytes(r['predicted_bytes'])}", "ok" if r["ok"] else "MISMATCH"]
         for r in rows],
    )
