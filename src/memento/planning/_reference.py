"""Textbook O(t^2 m) dynamic programs of Gruslys et al. (2016): the tests' oracle.

Plain Python, no cleverness, so that the fast planner in ``_dp.py`` / ``_closed.py`` can be
checked against the equations as printed. ``inf`` marks infeasible entries.
"""

from __future__ import annotations

import math

INF = math.inf


def _table(num_steps: int, memory: int) -> list[list[float]]:
    table = [[INF] * (memory + 1) for _ in range(num_steps + 1)]
    for m in range(1, memory + 1):
        table[0][m] = 0  # empty sequence: nothing to do (C(0, m) = 0)
    return table


def hsm_table(num_steps: int, memory: int) -> list[list[float]]:
    """C(t, m) of BPTT-HSM, eq. (1)-(3): m slots with h_0, C(t,1) = t(t+1)/2, C(1,m) = 1."""
    c = _table(num_steps, memory)
    for t in range(1, num_steps + 1):
        for m in range(1, memory + 1):
            if m == 1:
                c[t][m] = t * (t + 1) // 2
            elif t == 1:
                c[t][m] = 1
            else:
                c[t][m] = min(y + c[y][m] + c[t - y][m - 1] for y in range(1, t))
    return c


def ism_table(num_steps: int, memory: int) -> list[list[float]]:
    """C(t, m) of BPTT-ISM, eq. (4)-(5): m internal slots, h_0 free, C(t, 0) = inf."""
    c = _table(num_steps, memory)
    c[0][0] = 0  # an empty right part needs no slot (y = t with the last slot)
    for t in range(1, num_steps + 1):
        for m in range(1, memory + 1):
            c[t][m] = min(y + c[y - 1][m] + c[t - y][m - 1] for y in range(1, t + 1))
    return c


def msm_table(num_steps: int, memory: int, alpha: int, beta: int) -> list[list[float]]:
    """C(t, m) of BPTT-MSM with beta, eq. (6)-(10).

    Boundaries: C(t, 1) = t(t+1)/2, C(1, m) = 1, C(0, m) = 0 for m >= 1, and C(t, m) = inf
    for m <= 0 (an internal state must leave at least the right part's base slot, so an
    empty right part with m - alpha <= 0 is infeasible too; this never changes C, because
    then Q1 at y - 1 costs the same).
    """
    c = _table(num_steps, memory)

    def at(t: int, m: int) -> float:
        return c[t][m] if m >= 1 else INF

    for t in range(1, num_steps + 1):
        for m in range(1, memory + 1):
            if m == 1:
                c[t][m] = t * (t + 1) // 2
                continue
            if t == 1:
                c[t][m] = 1
                continue
            q1 = min(y + c[y][m] + at(t - y, m - 1) for y in range(1, t))
            q2 = min(
                y + c[y - 1][m] + at(t - y, m - (beta if y == 1 else alpha))
                for y in range(1, t + 1)
            )
            c[t][m] = min(q1, q2)
    return c
