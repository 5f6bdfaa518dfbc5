"""Search: choose a plan under the cost model. Pipeline searches (Megatron grid, Aceso, MCMC, exhaustive, exact
per-stage recomputation) over the pipeline model; the intra-op ILP over ParallelBlocks; and the baselines."""

from autopar.search.ilp import Edge, Solution, enumerate_optimum, solve
from autopar.search.mcmc import mcmc
from autopar.search.intra import BASELINES, IntraPlan, Space, baseline_choice, build_space, estimate_choice, plan_intra
from autopar.search.pipeline import Found, aceso, auto, exhaustive, megatron_grid, pipeline_searches
from autopar.search.recompute import optimal_recompute, with_optimal_recompute

__all__ = [
    "BASELINES",
    "Edge",
    "Found",
    "aceso",
    "auto",
    "exhaustive",
    "mcmc",
    "megatron_grid",
    "optimal_recompute",
    "pipeline_searches",
    "with_optimal_recompute",
    "IntraPlan",
    "Solution",
    "Space",
    "baseline_choice",
    "build_space",
    "enumerate_optimum",
    "estimate_choice",
    "plan_intra",
    "solve",
]
