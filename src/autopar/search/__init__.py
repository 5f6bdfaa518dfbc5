"""Search: choose a plan from the space under the cost model (intra-op ILP and the baselines so far)."""

from autopar.search.ilp import Edge, Solution, enumerate_optimum, solve
from autopar.search.intra import BASELINES, IntraPlan, Space, baseline_choice, build_space, estimate_choice, plan_intra

__all__ = [
    "BASELINES",
    "Edge",
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
