"""The intra-op ILP against brute force on random small problems (same cost model, every combination)."""

import math

import numpy as np
import pytest

from autopar.search.ilp import Edge, enumerate_optimum, evaluate, memory_of, solve


def _random_problem(rng: np.random.Generator):
    blocks = int(rng.integers(2, 6))
    sizes = [int(rng.integers(1, 5)) for _ in range(blocks)]
    costs = [rng.uniform(0, 10, size=s) for s in sizes]
    edges = []
    for _ in range(int(rng.integers(0, 2 * blocks))):
        u, v = (int(x) for x in rng.integers(0, blocks, size=2))
        matrix = rng.uniform(0, 5, size=(sizes[u], sizes[v]))
        if u == v:
            matrix = np.diag(np.diag(rng.uniform(0, 5, size=(sizes[u], sizes[u]))))
        if rng.random() < 0.2:  # an illegal conversion
            matrix[int(rng.integers(0, sizes[u])), int(rng.integers(0, sizes[v]))] = math.inf
        edges.append(Edge(u, v, matrix))
    memory = [rng.uniform(0, 4, size=s) for s in sizes]
    transient = [rng.uniform(0, 3, size=s) for s in sizes]
    budget = float(rng.uniform(0.3, 1.0) * (sum(m.max() for m in memory) + 3))
    return costs, edges, memory, budget, transient


@pytest.mark.parametrize("seed", range(40))
def test_ilp_equals_brute_force(seed: int) -> None:
    costs, edges, memory, budget, transient = _random_problem(np.random.default_rng(seed))
    best_choice, best_value = enumerate_optimum(costs, edges, memory, budget, transient=transient)
    solution = solve(costs, edges, memory, budget, transient=transient, time_limit=10)
    if not math.isfinite(best_value):
        assert not solution.feasible
        return
    assert solution.feasible and solution.optimal
    assert solution.objective == pytest.approx(best_value, rel=1e-6, abs=1e-9)
    assert memory_of(memory, solution.choice, transient) <= budget + 1e-6
    assert evaluate(costs, edges, solution.choice) == pytest.approx(solution.objective)


def test_memory_budget_changes_the_choice() -> None:
    costs = [np.array([1.0, 5.0])]
    memory = [np.array([10.0, 2.0])]
    assert solve(costs, [], memory, budget=20).choice == (0,)
    assert solve(costs, [], memory, budget=5).choice == (1,)
    assert not solve(costs, [], memory, budget=1).feasible


def test_only_the_largest_transient_counts() -> None:
    costs = [np.array([1.0, 2.0]), np.array([1.0, 2.0])]
    memory = [np.array([1.0, 1.0]), np.array([1.0, 1.0])]
    transient = [np.array([5.0, 1.0]), np.array([5.0, 1.0])]
    assert solve(costs, [], memory, 7.0, transient=transient).choice == (0, 0)  # 1 + 1 + max(5, 5)
    assert solve(costs, [], memory, 6.0, transient=transient).objective == pytest.approx(4.0)  # both small


def test_resharding_edge_pulls_neighbours_together() -> None:
    # each block alone prefers a different strategy; converting between them costs more than agreeing
    costs = [np.array([0.0, 1.0]), np.array([1.0, 0.0])]
    edges = [Edge(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))]
    solution = solve(costs, edges)
    assert solution.choice in ((0, 0), (1, 1)) and solution.objective == pytest.approx(1.0)
