"""Closed forms for BPTT-HSM and BPTT-ISM (Gruslys et al. 2016, sections 3.1 and 3.2).

Derivation (checked against the O(t^2 m) oracle in ``_reference.py`` by the tests).

ISM, eq. (4)-(5): substitute ``u = y - 1``::

    C(t, m) = 1 + min_{0 <= u <= t-1} [g(u) + h(t-1-u)],  g(u) = u + C(u, m),  h = C(., m-1).

The min is an infimal convolution. If ``C(., m)`` and ``C(., m-1)`` are convex in t (true by
induction, see below), the infimal convolution of two convex sequences is convex and its
increments are the sorted merge of the increments of g and h. Hence the multiset S_m of
increments ``C(t, m) - C(t-1, m)`` (t >= 1) satisfies ``S_m = {1} + merge(1 + S_m, S_{m-1})``
with ``S_0`` empty (no memory: infinite cost). Counting the increments equal to v gives
``n_m(v) = [v == 1] + n_m(v-1) + n_{m-1}(v)``, whose solution is ``n_m(v) = binom(m+v-1, v)``:
the increment v occurs ``binom(m+v-1, v)`` times, ``N_m(v) = binom(m+v, v) - 1`` increments
are <= v. So ``C_ism(t, m)`` is the sum of the t smallest increments; with r the unique
integer such that ``N_m(r-1) < t <= N_m(r)``::

    C_ism(t, m) = sum_{v<r} v n_m(v) + r (t - N_m(r-1))
                = m binom(m+r-1, r-2) + r (t + 1 - binom(m+r-1, r-1)).

The same argument for HSM, eq. (1)-(3) with y, t-y >= 1 and ``C(1, m) = 1``, gives
increments of HSM that are those of ISM shifted by one, which yields::

    C_hsm(t, m) = t + C_ism(t-1, m) = t + r t - binom(m+r, r-1),
    binom(m+r-1, r-1) < t <= binom(m+r, r)

(Griewank-Walther's binomial checkpointing: revolve's advances plus one fused evaluation per
step). An optimal split is read off the merge as well: the split takes every increment below
the s-th smallest from both sides, and as many of the ties as each side has (`ism_split`).
"""

from __future__ import annotations

import bisect
from math import comb

import numpy as np

__all__ = ["hsm_cost", "hsm_split", "ism_column", "ism_cost", "ism_split"]


_BINOMS: dict[int, list[int]] = {}  # m -> [binom(m+r, r) for r = 0, 1, ...], grown on demand


def _level(m: int, s: int, offset: int) -> int:
    """Smallest r >= 1 with ``binom(m+r, r) - offset >= s``."""
    table = _BINOMS.setdefault(m, [1])
    target = s + offset
    while table[-1] < target:
        r = len(table)
        table.append(table[-1] * (m + r) // r)  # binom(m+r, r) from binom(m+r-1, r-1)
    return max(1, bisect.bisect_left(table, target))


def ism_cost(t: int, m: int) -> int:
    """C_ism(t, m) in closed form (m internal slots, ``h_0`` free); exact Python int."""
    if t <= 0:
        return 0
    if m == 1:
        return t * (t + 1) // 2
    # r: N_m(r-1) < t <= N_m(r) with N_m(r) = binom(m+r, r) - 1.
    r = _level(m, t, 1)
    head = m * comb(m + r - 1, r - 2) if r >= 2 else 0
    return head + r * (t + 1 - comb(m + r - 1, r - 1))


def hsm_cost(t: int, m: int) -> int:
    """C_hsm(t, m) in closed form (m slots, ``h_0`` included); exact Python int."""
    return t + ism_cost(t - 1, m)


def ism_split(s: int, m: int, high: bool) -> int:
    """How many increments an optimal split of ``min_u g(u) + h(s-u)`` takes from g.

    ``g(u) = u + C_ism(u, m)``, ``h = C_ism(., m-1)``, m >= 2. g's increments equal to w
    number ``binom(m+w-2, w-1)`` (w >= 2), h's ``binom(m+w-2, w)`` (w >= 1); in all,
    ``binom(m+w, w) - 2`` increments are <= w. The optimal u form an interval (the ties at
    the s-th smallest increment may come from either side); ``high`` picks its upper end.
    """
    if s <= 0:
        return 0
    w = _level(m, s, 2)
    base_g = comb(m + w - 2, w - 2) - 1 if w >= 2 else 0  # g increments <= w-1
    base_h = comb(m + w - 2, w - 1) - 1  # h increments <= w-1
    k = s - base_g - base_h  # ties at level w still to take
    n_g = comb(m + w - 2, w - 1) if w >= 2 else 0
    n_h = comb(m + w - 2, w)
    return base_g + (min(k, n_g) if high else max(0, k - n_h))


def hsm_split(t: int, m: int, high: bool = True) -> int:
    """An optimal first checkpoint y (1 <= y < t) of BPTT-HSM, eq. (3); t >= 2, m >= 2."""
    # HSM's increments from t = 2 on are ISM's shifted by one (module docstring), so the
    # split of the t-2 increments after g(1) + h(1) is ISM's.
    return 1 + ism_split(t - 2, m, high)


def ism_column(num_steps: int, m: int) -> np.ndarray:
    """``[C_ism(t, m) for t in 0..num_steps]`` as float64, by summing sorted increments."""
    out = np.zeros(num_steps + 1)
    if m < 1:
        out[1:] = np.inf
        return out
    counts = []
    total = 0
    v = 1
    while total < num_steps:
        n = comb(m + v - 1, v)
        counts.append(min(n, num_steps - total))
        total += counts[-1]
        v += 1
    inc = np.repeat(np.arange(1, len(counts) + 1, dtype=np.float64), counts)
    out[1:] = np.cumsum(inc)
    return out
