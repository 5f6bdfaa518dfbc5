"""Choose one strategy per block: the intra-op integer programme (MAP §5.1, after Alpa), solved with HiGHS.

Pure core: arrays in, assignment out. Blocks are ``v = 0..V-1``; block ``v`` has strategies ``i = 0..S_v-1``.

    minimise    sum_v sum_i  c[v][i] x[v][i]  +  sum_(u,v) in E  sum_i sum_j  R[u,v][i][j] y[u,v][i][j]

    subject to  sum_i x[v][i] = 1                               for every v      (one strategy per block)
                sum_j y[u,v][i][j] = x[u][i]                    for every edge, i (edge picks u's strategy)
                sum_i y[u,v][i][j] = x[v][j]                    for every edge, j (... and v's)
                sum_i t[v][i] x[v][i] <= T                     for every v      (T: the largest transient)
                sum_v sum_i m[v][i] x[v][i] + T <= M                              (per-device memory)
                x[v][i] in {0, 1},  0 <= y[u,v][i][j] <= 1,  T >= 0;  x, y fixed to 0 where a cost is infinite

``c`` holds each block's compute, its communication inside and its gradient synchronisation; ``R`` the resharding
between the layouts two blocks give and need a value in; ``m`` the parameter, gradient, optimizer and activation
bytes it keeps; ``t`` the transient bytes it needs while it runs (its largest temporary), of which only the largest
over all blocks counts. With ``x`` integral the two marginal constraints leave ``y[u,v]`` exactly one 1 (a transportation
polytope with one-hot margins), so ``y`` needs no integrality and the programme stays small. Repeated segments
enter once with their costs multiplied by their count (the caller ties them); an edge from a block to itself (one
repeated layer feeding the next) is its diagonal added to ``c``.

Implemented in `solve` (scipy.optimize.milp with a time limit: the best incumbent is kept when it runs out) and,
for checking it, `enumerate_optimum` (every combination; only for tiny problems).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Edge:
    source: int
    target: int
    costs: np.ndarray  # [strategies of source, strategies of target]


@dataclass(frozen=True, slots=True)
class Solution:
    choice: tuple[int, ...]  # strategy index per block; empty when infeasible
    objective: float
    optimal: bool  # proven optimal (False: time limit hit with an incumbent, or infeasible)
    feasible: bool
    seconds: float
    status: str


def solve(
    costs: list[np.ndarray],
    edges: list[Edge],
    memory: list[np.ndarray] | None = None,
    budget: float = math.inf,
    *,
    transient: list[np.ndarray] | None = None,
    time_limit: float = 30.0,
) -> Solution:
    start = time.perf_counter()
    offsets = np.cumsum([0] + [len(c) for c in costs])
    num_x = int(offsets[-1])
    node_costs = [np.array(c, dtype=float) for c in costs]
    merged = _merge_edges(node_costs, edges)
    edge_offsets = [num_x]
    for e in merged:
        edge_offsets.append(edge_offsets[-1] + e.costs.size)
    peak = edge_offsets[-1]  # the variable T
    num = peak + 1

    objective = np.zeros(num)
    upper = np.ones(num)
    upper[peak] = np.inf
    for v, c in enumerate(node_costs):
        objective[offsets[v] : offsets[v + 1]] = np.where(np.isfinite(c), c, 0.0)
        upper[offsets[v] : offsets[v + 1]][~np.isfinite(c)] = 0.0
    for k, e in enumerate(merged):
        flat = e.costs.ravel()
        objective[edge_offsets[k] : edge_offsets[k + 1]] = np.where(np.isfinite(flat), flat, 0.0)
        upper[edge_offsets[k] : edge_offsets[k + 1]][~np.isfinite(flat)] = 0.0

    rows, cols, vals, lower, high = [], [], [], [], []
    row = 0
    for v in range(len(costs)):  # one strategy per block
        for i in range(len(costs[v])):
            rows.append(row), cols.append(offsets[v] + i), vals.append(1.0)
        lower.append(1.0), high.append(1.0)
        row += 1
    for k, e in enumerate(merged):  # marginals tie y to x: rows of y sum to x[u], columns to x[v]
        n_u, n_v = e.costs.shape
        grid = edge_offsets[k] + np.arange(n_u * n_v).reshape(n_u, n_v)
        for lines, block in ((grid, e.source), (grid.T, e.target)):
            for strategy, line in enumerate(lines):
                rows.extend([row] * (len(line) + 1))
                cols.extend([*line.tolist(), offsets[block] + strategy])
                vals.extend([1.0] * len(line) + [-1.0])
                lower.append(0.0), high.append(0.0)
                row += 1
    if transient is not None:  # T is at least each block's transient
        for v, t in enumerate(transient):
            rows.extend([row] * (len(t) + 1))
            cols.extend([*(offsets[v] + i for i in range(len(t))), peak])
            vals.extend([*(float(x) for x in t), -1.0])
            lower.append(-np.inf), high.append(0.0)
            row += 1
    if memory is not None and math.isfinite(budget):
        for v, m in enumerate(memory):
            for i, value in enumerate(m):
                if value:
                    rows.append(row), cols.append(offsets[v] + i), vals.append(float(value))
        rows.append(row), cols.append(peak), vals.append(1.0)
        lower.append(-np.inf), high.append(float(budget))
        row += 1
    from scipy.optimize import Bounds, LinearConstraint, milp  # here: scipy costs 0.4 s to import, and most
    from scipy.sparse import coo_array  # plans never solve an ILP

    matrix = coo_array((vals, (rows, cols)), shape=(row, num)).tocsr()
    integrality = np.zeros(num)
    integrality[:num_x] = 1
    with _native_stdout_silenced():
        result = milp(
            objective,
            integrality=integrality,
            bounds=Bounds(np.zeros(num), upper),
            constraints=LinearConstraint(matrix, lower, high),
            options={"time_limit": max(time_limit, 0.01), "disp": False},
        )
    seconds = time.perf_counter() - start
    if result.x is None:
        return Solution((), math.inf, False, False, seconds, result.message)
    x = result.x[:num_x]
    choice = tuple(int(np.argmax(x[offsets[v] : offsets[v + 1]])) for v in range(len(costs)))
    value = evaluate(costs, edges, choice)
    return Solution(choice, value, result.status == 0, True, seconds, result.message)


@contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """HiGHS (scipy 1.17) writes some MIP diagnostics straight to file descriptor 1 even with ``disp`` off; they
    would corrupt ``--json`` output, so descriptor 1 points at /dev/null while it runs."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (an embedded interpreter): nothing to protect
        yield
        return
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def evaluate(costs: list[np.ndarray], edges: list[Edge], choice: tuple[int, ...]) -> float:
    """Objective of one assignment (self-edges included)."""
    total = sum(float(costs[v][i]) for v, i in enumerate(choice))
    for e in edges:
        total += float(e.costs[choice[e.source], choice[e.target]])
    return total


def memory_of(
    memory: list[np.ndarray], choice: tuple[int, ...], transient: list[np.ndarray] | None = None
) -> float:
    """Memory of one assignment: what every block keeps plus the largest transient."""
    peak = max((float(transient[v][i]) for v, i in enumerate(choice)), default=0.0) if transient else 0.0
    return sum(float(memory[v][i]) for v, i in enumerate(choice)) + peak


def enumerate_optimum(
    costs: list[np.ndarray],
    edges: list[Edge],
    memory: list[np.ndarray] | None = None,
    budget: float = math.inf,
    *,
    transient: list[np.ndarray] | None = None,
) -> tuple[tuple[int, ...], float]:
    """Brute force over every combination (for tests and tiny spaces)."""
    best: tuple[tuple[int, ...], float] = ((), math.inf)
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        if memory is not None and memory_of(memory, choice, transient) > budget:
            continue
        value = evaluate(costs, edges, choice)
        if value < best[1]:
            best = (choice, value)
    return best


def dense_optimum(
    costs: list[np.ndarray],
    edges: list[Edge],
    memory: list[np.ndarray] | None = None,
    budget: float = math.inf,
) -> tuple[tuple[int, ...], float] | None:
    """Every combination at once with numpy broadcasting: for small problems (a few blocks) it is exact and far
    quicker than starting the solver. None when nothing is within ``budget``."""
    n = len(costs)

    def along(values: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        shape = [1] * n
        for axis, size in zip(axes, values.shape):
            shape[axis] = size
        return values.reshape(shape)

    total = sum((along(np.asarray(c, dtype=float), (v,)) for v, c in enumerate(costs)), np.zeros([1] * n))
    for e in edges:
        matrix = np.asarray(e.costs, dtype=float)
        if e.source == e.target:
            total = total + along(np.diagonal(matrix).copy(), (e.source,))
        elif e.source < e.target:
            total = total + along(matrix, (e.source, e.target))
        else:
            total = total + along(matrix.T, (e.target, e.source))
    if memory is not None:
        held = sum((along(np.asarray(m, dtype=float), (v,)) for v, m in enumerate(memory)), np.zeros([1] * n))
        total = np.where(held <= budget, total, math.inf)
    total = np.broadcast_to(total, tuple(len(c) for c in costs))
    flat = int(np.argmin(total))
    value = float(total.flat[flat])
    if not math.isfinite(value):
        return None
    return tuple(int(i) for i in np.unravel_index(flat, total.shape)), value


def _merge_edges(costs: list[np.ndarray], edges: list[Edge]) -> list[Edge]:
    """Sum parallel edges; fold self-edges' diagonals into ``costs`` (modified in place)."""
    merged: dict[tuple[int, int], np.ndarray] = {}
    for e in edges:
        if e.source == e.target:
            continue
        key = (e.source, e.target)
        merged[key] = merged[key] + e.costs if key in merged else np.asarray(e.costs, dtype=float).copy()
    for e in edges:
        if e.source == e.target:
            costs[e.source] += np.diag(e.costs)
    return [Edge(u, v, c) for (u, v), c in merged.items()]
