"""The exact per-layer format search of :func:`~modelopt_lite.algorithms.auto_quantize.auto_quantize`.

A multiple-choice knapsack: every group ``g`` picks one candidate ``k`` with a score ``s[g][k]`` (estimated loss
increase) and a cost ``c[g][k]`` (weight elements times bits); minimise ``sum s`` subject to ``sum c <= budget``.

:func:`solve` is a dynamic programme over the Pareto frontier of partial assignments: after each group it keeps only
the (cost, score) pairs that no other pair beats on both, with a back-pointer per pair. Dropping a dominated pair
never loses the optimum (any completion of it is matched by the same completion of the pair that dominates it), so
the result is exact, for integer and fractional costs alike, with no budget discretisation. The frontier is bounded
by the number of distinct cost sums, which stays small for real models (costs are a few weight shapes times a few
bit widths). Above ``max_states`` pairs only the best pair per cost bucket of ``budget / max_states`` is kept (the
result still meets the budget, but is then only near-optimal, and :attr:`Solution.exact` says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: frontier size above which states are thinned per cost bucket (the search stays feasible, no longer exact)
MAX_STATES = 200_000


@dataclass
class Solution:
    """The search result: ``choice[g]`` is the index of the candidate picked for group ``g``."""

    choice: list[int]
    cost: float
    score: float
    exact: bool


def _check(scores: list[list[float]], costs: list[list[float]], budget: float) -> None:
    if len(scores) != len(costs):
        raise ValueError(f"auto_quantize search: {len(scores)} score lists but {len(costs)} cost lists")
    for g, (s, c) in enumerate(zip(scores, costs)):
        if not s or len(s) != len(c):
            raise ValueError(
                f"auto_quantize search: group {g} has {len(s)} scores and {len(c)} costs (need >= 1, equal)"
            )
        bad = [v for v in (*s, *c) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"auto_quantize search: group {g} has a non-finite score or cost: {bad[0]!r}")
        if min(c) < 0:
            raise ValueError(f"auto_quantize search: group {g} has a negative cost {min(c)!r}")
    if not math.isfinite(budget):
        raise ValueError(f"auto_quantize search: budget must be finite, got {budget!r}")


def _prune(cost: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Indices of the Pareto frontier (ascending cost, strictly descending score)."""
    order = np.lexsort((score, cost))  # by cost, then score
    s = score[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], s[:-1])))
    return order[s < best_before]


def solve(scores: list[list[float]], costs: list[list[float]], budget: float, max_states: int = MAX_STATES) -> Solution:
    """Minimise the total score over one candidate per group with total cost ``<= budget`` (see the module doc).

    Ties in score go to the cheaper assignment. Raises ValueError when even the cheapest assignment is over budget.
    """
    _check(scores, costs, budget)
    min_cost = sum(min(c) for c in costs)
    if min_cost > budget:
        raise ValueError(
            f"auto_quantize search: the cheapest assignment costs {min_cost!r}, over the budget {budget!r}"
        )
    return _dp(scores, costs, budget, max_states)


def _thin(cost: np.ndarray, score: np.ndarray, width: float) -> np.ndarray:
    """Of a frontier (ascending cost), the lowest-score state of each cost bucket of ``width`` (its last one)."""
    bucket = np.floor(cost / width)
    return np.flatnonzero(np.append(bucket[1:] != bucket[:-1], True))


def _dp(scores, costs, budget: float, max_states: int) -> Solution:
    # the cheapest possible rest of the assignment after each group, to drop states that cannot finish in budget
    mins = [min(c) for c in costs]
    rest = [sum(mins[g + 1 :]) for g in range(len(costs))]
    st_cost = np.zeros(1)
    st_score = np.zeros(1)
    exact = True
    back: list[tuple[np.ndarray, np.ndarray]] = []  # per group: (parent state index, candidate index)
    for g, (s, c) in enumerate(zip(scores, costs)):
        k = len(s)
        new_cost = (st_cost[:, None] + np.asarray(c, dtype=np.float64)[None, :]).ravel()
        new_score = (st_score[:, None] + np.asarray(s, dtype=np.float64)[None, :]).ravel()
        parent = np.repeat(np.arange(len(st_cost)), k)
        cand = np.tile(np.arange(k), len(st_cost))
        ok = np.flatnonzero(new_cost + rest[g] <= budget)
        keep = ok[_prune(new_cost[ok], new_score[ok])]
        if len(keep) > max_states:  # too many: keep the best state per cost bucket (feasible, near-optimal)
            keep = keep[_thin(new_cost[keep], new_score[keep], max(budget, 1e-300) / max_states)]
            exact = False
        st_cost, st_score = new_cost[keep], new_score[keep]
        back.append((parent[keep], cand[keep]))
    best = len(st_score) - 1  # the frontier's scores strictly decrease with cost: the last state is the best
    choice = [0] * len(scores)
    i = best
    for g in range(len(scores) - 1, -1, -1):
        par, cand = back[g]
        choice[g] = int(cand[i])
        i = int(par[i])
    return Solution(choice, float(st_cost[best]), float(st_score[best]), exact)
