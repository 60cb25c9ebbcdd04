"""Exact BPTT-MSM tables C, H, D (Gruslys et al. 2016, sections 3.3-3.4, eq. (6)-(10)).

Notation as in ``_dp.py``: t steps, m slots, C(t, m) forward evaluations, D(t, m) =
``split`` (the position y of the first push), H(t, m) = ``kind`` (hidden or internal).
With ``f(y) = y + C(y, m)``, C(0, m) = 0, C(1, m) = 1, C(t, 1) = t(t+1)/2 and m <= 0
infeasible, for t, m >= 2::

    C(t, m) = min( Q1(t)  = min_{1 <= y < t} f(y) + C(t-y, m-1)            (push h_y)
                 , Q2a(t) = 1 + C(t-1, m-beta)                  (internal state at y = 1)
                 , Q2b(t) = 1 + min_{1 <= u < t} f(u) + C(t-1-u, m-alpha) )   (at y = u+1)

Q2b only when alpha == beta (otherwise it is dominated, see `msm_tables_full`).

`msm_tables_full` fills the table row by row in O(t^2 m), vectorised over (y, m): the
tests' oracle, and the first rows of `msm_tables`. `msm_tables` fills it column by column
in O(t) vectorised work per column (plus Python work per vertex of the column's convex
hull) and certifies every column.

Why `msm_tables` is exact. Columns are filled in order of m. Within column m let c be
the stored values and (kind, split) the stored choices. The column is accepted only when,
for every t:

(a) the stored choice, evaluated from c below t and from earlier columns, equals c[t];
(b) c[t] <= Q2a(t), c[t] <= ceil(L1(t)) and c[t] <= 1 + ceil(L2(t-1)), where L1 (L2) is
    the infimal convolution ``min_y F(y) + G(t-y)`` of F, the lower convex hull of
    y -> y + c[y] over 1 <= y <= T, with G, the lower convex hull of C(., m-1) over
    1..T (of C(., m-alpha) over 0..T).

By induction on t: if c = C(., m) below t, (a) makes c[t] the cost of a feasible choice,
so c[t] >= C(t, m). F lies below c everywhere (later, not yet certified rows included),
so F(y) <= f(y) for y < t, L1(t) <= Q1(t), and ceil(L1(t)) <= Q1(t) as Q1(t) is an
integer; likewise for Q2b. (b) then gives c[t] <= C(t, m). Rows taken from
`msm_tables_full` and rows repaired by the full scan are exact by definition. The hulls
are exact (`_extend`) and so are convolutions of convex piecewise-linear functions: merge
the segments in slope order (`_Conv`); all values are integers.

Why it is fast (observed, not needed for exactness). Each column is within 1 of its lower
convex hull (max of C - hull: 0.994 for t <= 10,000, m <= 200, alpha = 5 with beta = 5 and
beta = 2, and alpha = 2), although C(., m) is not convex; the hulls have few vertices (29
on average). Then at the minimiser (y, t-y) of F(y) + G(t-y) one of the two is a vertex
(value exact) and the other within 1 of its hull, so that y attains ceil(L1(t)): one
evaluation per option and t, vectorised over t, satisfies (a) and (b). The choice at t
reads c below t, so a column is filled in blocks (T1, T2]: the hull of c over 1..T1 is
convolved with G, and T2 is where the convolution runs out of 1..T1. Where (a) or (b)
fails (a block stretched too far, a column further than 1 from its hull), that t is
computed by the full O(t) scan and the column is filled again from there: slower, never
wrong.
"""

from __future__ import annotations

import numpy as np

__all__ = ["msm_estimate_s", "msm_tables", "msm_tables_full"]

_BIG = 1 << 60  # "infinity" in int64 tables; BIG + BIG + t still fits in int64
_HIDDEN, _INTERNAL = 0, 1  # H(t, m)
_EXACT_ROWS = 64  # rows msm_tables takes from the full table (blocks start from there)
# A block (T1, T2] ends by T2 = 4 T1: the hull of the first rows says little about later
# slopes, and a block stretched too far costs a refill (4 is about the fastest).
_GROWTH = 4
# Calibrated with benchmarks/planner.py: the full table's cost per (t, m, y) candidate;
# the column-wise table's per column and per (t, m) cell.
_S_PER_CANDIDATE = 2e-9
_S_PER_COLUMN = 4e-4
_S_PER_CELL = 2.5e-7


def _estimates_s(num_steps: int, memory: int, alpha: int, beta: int) -> tuple[float, float]:
    """Seconds `msm_tables_full` and the column-wise `msm_tables` are expected to take."""
    candidates = (2 if alpha == beta else 1) * num_steps * num_steps * memory / 2
    return _S_PER_CANDIDATE * candidates, memory * (_S_PER_COLUMN + _S_PER_CELL * num_steps)


def msm_estimate_s(num_steps: int, memory: int, alpha: int, beta: int) -> float:
    """Seconds `memento.plan` is expected to spend on the exact BPTT-MSM table.

    About ``4e-4 m + 2.5e-7 t m`` (calibrated with ``benchmarks/planner.py``), or
    the O(t^2 m) full table's time where that is less (t below about 500). Zero for
    ``alpha = 1``, which `memento.plan` plans by ISM's closed form.
    """
    if alpha == 1:
        return 0.0
    return min(_estimates_s(num_steps, memory, alpha, beta))


# --------------------------------------------------------------------------- full table


def _row(cx, t: int, lo: int, hi: int, pad: int, alpha: int, beta: int, big: int):
    """C(t, m), H(t, m), D(t, m) for lo <= m <= hi by the full scan over y, vectorised.

    ``cx[t', pad + m']`` holds C(t', m') for t' < t and every m' <= hi (BIG for m' <= 0).
    """
    cols = slice(pad + lo, pad + hi + 1)
    ar = np.arange(hi - lo + 1)
    # y + C(y, m) for y = 1..t-1; also (y+1) + C(y, m) - 1 for Q2b at y+1 below.
    left = cx[1:t, cols] + np.arange(1, t, dtype=cx.dtype)[:, None]
    q1 = left + cx[t - 1 : 0 : -1, pad + lo - 1 : pad + hi]  # + C(t-y, m-1)
    d1 = q1.argmin(0)
    best = q1[d1, ar]
    h = np.zeros(len(ar), dtype=np.int8)
    d = d1 + 1
    q2 = 1 + cx[t - 1, pad + lo - beta : pad + hi + 1 - beta]  # Q2a: 1 + C(t-1, m-beta)
    take = q2 < best
    best = np.where(take, q2, best)
    h[take] = _INTERNAL
    d[take] = 1
    if alpha == beta:  # Q2b at y = 2..t: y + C(y-1, m) + C(t-y, m-alpha)
        q2 = left + cx[t - 2 :: -1, pad + lo - alpha : pad + hi + 1 - alpha]
        d2 = q2.argmin(0)
        v2 = q2[d2, ar] + 1
        take = v2 < best
        best = np.where(take, v2, best)
        h[take] = _INTERNAL
        d[take] = d2[take] + 2
    return np.minimum(best, big), h, d


def msm_tables_full(num_steps: int, memory: int, alpha: int, beta: int):
    """Exact C, H and D of BPTT-MSM with beta, eq. (6)-(10), for t <= num_steps, m <= memory.

    Returns int64 ``C`` (``_BIG`` = infeasible), int8 ``H`` and int32 ``D`` of shape
    ``(num_steps + 1, memory + 1)``. O(t^2 m), vectorised over (y, m) for each t.

    Two facts keep this exact and smaller:
    - if alpha > beta, Q2 with y >= 2 never beats Q1 at y - 1 followed by Q2 at y' = 1
      (that costs y + C(y-1, m) + C(t-y, m-1-beta) <= Q2(y) since m-1-beta >= m-alpha and
      C is non-increasing in m), so only y = 1 is tried for internal states;
    - C(., m) is *not* convex in t for alpha >= 2 and the optimal y are not an interval
      (found with the oracle), so the argmin cannot be tracked with a moving pointer.
    """
    # int32 halves the memory traffic of this bandwidth-bound loop; it is exact while two
    # finite entries plus t stay below the int32 "infinity" 2^29 (C <= t(t+1)/2).
    small = num_steps * (num_steps + 1) + num_steps < (1 << 29)
    dtype = np.int32 if small else np.int64
    big = (1 << 29) if small else _BIG
    pad = alpha  # columns m <= 0 are infeasible: store them as BIG on the left
    cx = np.full((num_steps + 1, memory + 1 + pad), big, dtype=dtype)
    cx[0, pad + 1 :] = 0  # C(0, m) = 0 for m >= 1
    ts = np.arange(num_steps + 1, dtype=np.int64)
    cx[1:, pad + 1] = ts[1:] * (ts[1:] + 1) // 2  # C(t, 1): h_0 only
    cx[1, pad + 1 :] = 1  # C(1, m) = 1: one fused step
    kind = np.zeros((num_steps + 1, memory + 1), dtype=np.int8)
    split = np.ones((num_steps + 1, memory + 1), dtype=np.int32)
    if memory >= 2:
        for t in range(2, num_steps + 1):
            best, h, d = _row(cx, t, 2, memory, pad, alpha, beta, big)
            cx[t, pad + 2 :] = best
            kind[t, 2:] = h
            split[t, 2:] = d
    c = cx[:, pad:].astype(np.int64)
    c[c >= big] = _BIG
    return c, kind, split


# --------------------------------------------------------------------------- convex hulls


def _chain(hx: list[int], hy: list[int], xs: list[int], ys: list[int]) -> None:
    """Adds the points (xs, ys), x increasing, to the lower convex hull (hx, hy) in place.

    Andrew's monotone chain, in exact Python integers.
    """
    for x, y in zip(xs, ys):
        while len(hx) >= 2:
            x1, y1, x2, y2 = hx[-2], hy[-2], hx[-1], hy[-1]
            if (y2 - y1) * (x - x1) < (y - y1) * (x2 - x1):
                break  # (x2, y2) stays strictly below the chord
            hx.pop()
            hy.pop()
        hx.append(x)
        hy.append(y)


def _extend(hx: list[int], hy: list[int], v: np.ndarray, hi: int) -> None:
    """Extends the lower convex hull (hx, hy) of the points (x, v[x]), x <= hx[-1], to hi.

    A hull vertex is an end point or a convex kink (v's slope rises there), so only those
    points go through the chain.
    """
    start = hx[-1]
    if hi <= start:
        return
    d = np.diff(v[start : hi + 1])
    xs = (np.flatnonzero(d[1:] > d[:-1]) + start + 1).tolist()
    xs.append(hi)
    _chain(hx, hy, xs, v[xs].tolist())


def _hull(v: np.ndarray, lo: int, hi: int) -> tuple[list[int], list[int]]:
    """Lower convex hull of the points (x, v[x]) for lo <= x <= hi, as vertex lists."""
    hx, hy = [lo], [int(v[lo])]
    _extend(hx, hy, v, hi)
    return hx, hy


class _Piecewise:
    """A convex piecewise-linear function with integer vertices: first vertex + segments.

    ``whole``, ``frac``: each segment's slope dy/dx as its integer part and the fraction in
    [0, 1), the exact sort key of `_Conv`.
    """

    __slots__ = ("dx", "dy", "frac", "whole", "x0", "y0")

    def __init__(self, hx: list[int], hy: list[int], slope: int = 0):
        x = np.array(hx, dtype=np.int64)
        y = np.array(hy, dtype=np.int64) + slope * x  # + slope*x keeps it convex
        self.x0, self.y0 = hx[0], int(y[0])
        self.dx, self.dy = np.diff(x), np.diff(y)
        self.whole = self.dy // self.dx
        # Two distinct fractions with dx <= T differ by >= 1/T^2, far above float64's
        # 2^-53 error for T < 2^26, and equal ones round equally: the order is exact.
        self.frac = (self.dy - self.whole * self.dx) / self.dx


class _Conv:
    """The infimal convolution ``h(t) = min_x a(x) + b(t-x)`` of convex `_Piecewise` a, b.

    Its graph starts at a's first vertex plus b's and follows all their segments sorted by
    slope, so it is convex with integer vertices ``(vx, vy)``; segment k goes from vertex k
    along (dx[k], dy[k]), came from a if ``from_a[k]``, and starts at a's argument
    ``a_at[k]``. a's domain is used up at t = ``a_end``.
    """

    __slots__ = ("a_at", "a_end", "dx", "dy", "from_a", "vx", "vy")

    def __init__(self, a: _Piecewise, b: _Piecewise):
        order = np.lexsort((np.concatenate((a.frac, b.frac)), np.concatenate((a.whole, b.whole))))
        self.dx = np.concatenate((a.dx, b.dx))[order]
        self.dy = np.concatenate((a.dy, b.dy))[order]
        self.from_a = order < len(a.dx)
        start = a.x0 + b.x0
        self.vx = np.concatenate(([start], start + np.cumsum(self.dx)))
        self.vy = np.concatenate(([a.y0 + b.y0], a.y0 + b.y0 + np.cumsum(self.dy)))
        self.a_at = np.concatenate(([a.x0], a.x0 + np.cumsum(self.dx * self.from_a)))
        last = np.flatnonzero(self.from_a)
        self.a_end = int(self.vx[last[-1] + 1]) if len(last) else start

    def _segments(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """For t = first..last: the segment k holding t and the offset t - vx[k]."""
        vx = self.vx
        k0, k1 = np.searchsorted(vx, (first, last), side="right") - 1
        k1 = min(k1, len(self.dx) - 1)  # t = the last vertex: end of the last segment
        ends = vx[k0 : k1 + 2].copy()
        ends[0], ends[-1] = first, last + 1
        k = np.repeat(np.arange(k0, k1 + 1), np.diff(ends))
        return k, np.arange(first, last + 1) - vx[k]

    def ceil(self, first: int, last: int) -> np.ndarray:
        """ceil(h(t)) for t = first..last, exactly."""
        k, off = self._segments(first, last)
        return self.vy[k] - (-(off * self.dy[k]) // self.dx[k])

    def argmin(self, first: int, last: int) -> np.ndarray:
        """For t = first..last, an x with a(x) + b(t-x) = h(t) (a or b at a vertex there)."""
        k, off = self._segments(first, last)
        return self.a_at[k] + off * self.from_a[k]


# --------------------------------------------------------------------------- fast table


class _Column:
    """Fills and certifies column m of the padded table ``cx`` (module docstring)."""

    def __init__(self, cx, kind, split, m: int, pad: int, alpha: int, beta: int, hulls):
        self.cx, self.kind, self.split = cx, kind, split
        self.m, self.pad, self.alpha, self.beta = m, pad, alpha, beta
        self.T = cx.shape[0] - 1
        self.c = cx[:, pad + m]  # a view: writes go to the table
        self.q2a = 1 + cx[:-1, pad + m - beta]  # Q2a(t) = q2a[t-1]; BIG + 1 if m <= beta
        # Options convolving c with an earlier column: value s + f(u) + g(t-s-u), first push
        # at y = u + s; (s, g, hull of g, kind). Q1: s = 0; Q2b: s = 1, g from 0 (t-y >= 0).
        self.convs = [(0, cx[:, pad + m - 1], hulls[m - 1][0], _HIDDEN)]
        if alpha == beta and m > alpha:
            self.convs.append((1, cx[:, pad + m - alpha], hulls[m - alpha][1], _INTERNAL))

    def fill(self, lo: int) -> None:
        """Fills rows lo..T in blocks from the rows below lo (taken as exact)."""
        c, T = self.c, self.T
        self.hx, self.hy = _hull(c, 1, lo - 1)
        t1 = lo - 1
        active = [True] * len(self.convs)  # Q1 and the options that won the last block
        while t1 < T:
            f = _Piecewise(self.hx, self.hy, slope=1)  # y + c[y] over 1..t1
            convs = [_Conv(f, g) for _, _, g, _ in self.convs]
            t2 = min(h.a_end + s for h, (s, *_), a in zip(convs, self.convs, active) if a)
            t2 = min(T, max(t2, t1 + 1), _GROWTH * t1)
            ts = np.arange(t1 + 1, t2 + 1)
            best = self.q2a[ts - 1]
            kinds = np.full(len(ts), _INTERNAL, dtype=np.int8)
            ys = np.ones(len(ts), dtype=np.int64)
            for i, (h, (s, g, _, kind)) in enumerate(zip(convs, self.convs)):
                u = h.argmin(t1 + 1 - s, t2 - s)
                value = s + u + c[u] + g[ts - s - u]
                take = value < best if i else value <= best  # Q1 first on ties
                best = np.where(take, value, best)
                kinds[take] = kind
                ys = np.where(take, u + s, ys)
                active[i] = i == 0 or bool(take.any())
            c[t1 + 1 : t2 + 1] = best
            self.kind[t1 + 1 : t2 + 1, self.m] = kinds
            self.split[t1 + 1 : t2 + 1, self.m] = ys
            _extend(self.hx, self.hy, c, t2)
            t1 = t2

    def failures(self, lo: int) -> np.ndarray:
        """The rows t >= lo where certificate (a) or (b) fails."""
        c, m, pad, T = self.c, self.m, self.pad, self.T
        ts = np.arange(lo, T + 1)
        value = c[lo:]
        y = self.split[lo:, m].astype(np.int64)
        internal = self.kind[lo:, m]
        # (a): the choice's cost, y + C(y - [internal], m) + C(t - y, m - 1 / beta / alpha).
        right = pad + m - np.where(internal == 0, 1, np.where(y == 1, self.beta, self.alpha))
        flat = self.cx.reshape(-1)
        bad = y + c[y - internal] + flat[(ts - y) * self.cx.shape[1] + right] != value
        bad |= value > self.q2a[lo - 1 :]  # (b)
        f = _Piecewise(self.hx, self.hy, slope=1)
        for s, _, g, _ in self.convs:
            bad |= value > s + _Conv(f, g).ceil(lo - s, T - s)
        return ts[bad]

    def run(self, lo: int) -> None:
        """Fills rows lo..T and certifies them, repairing failures by the full scan."""
        self.fill(lo)
        while True:
            for t in self.failures(lo).tolist():
                best, h, d = _row(self.cx, t, self.m, self.m, self.pad, self.alpha, self.beta, _BIG)
                old = self.c[t]
                self.c[t], self.kind[t, self.m], self.split[t, self.m] = best[0], h[0], d[0]
                if best[0] != old:  # rows above were built on the wrong value: refill them
                    lo = t + 1
                    if lo <= self.T:
                        self.fill(lo)
                    break
            else:
                return


def msm_tables(
    num_steps: int,
    memory: int,
    alpha: int,
    beta: int,
    *,
    exact_rows: int | None = None,
    progress=None,
):
    """`msm_tables_full`'s C, H and D (same C; H and D optimal), column by column, certified.

    Rows up to ``exact_rows`` (>= 2) come from `msm_tables_full`, the rest from `_Column`.
    By default short tables are `msm_tables_full`'s (faster below about 500 steps) and
    ``exact_rows`` is 64; the tests pass small values to exercise the columns.
    """
    if exact_rows is None:
        full_s, columns_s = _estimates_s(num_steps, memory, alpha, beta)
        exact_rows = num_steps if full_s <= columns_s else _EXACT_ROWS
    exact_rows = max(exact_rows, 2)  # the blocks need a hull over 1..T1 with T1 >= 2
    if num_steps <= exact_rows or memory < 2:
        return msm_tables_full(num_steps, memory, alpha, beta)
    c0, k0, s0 = msm_tables_full(exact_rows, memory, alpha, beta)
    pad = alpha
    cx = np.full((num_steps + 1, memory + 1 + pad), _BIG, dtype=np.int64)
    cx[: exact_rows + 1, pad:] = c0
    ts = np.arange(exact_rows + 1, num_steps + 1, dtype=np.int64)
    cx[exact_rows + 1 :, pad + 1] = ts * (ts + 1) // 2  # C(t, 1)
    kind = np.zeros((num_steps + 1, memory + 1), dtype=np.int8)
    split = np.ones((num_steps + 1, memory + 1), dtype=np.int32)
    kind[: exact_rows + 1], split[: exact_rows + 1] = k0, s0
    hulls = {}  # m -> hull of C(., m) over 1..T, over 0..T

    def done(m: int, hx: list[int], hy: list[int]) -> None:
        # The hull over 0..T is that of (0, C(0, m)) and the vertices of the one over 1..T.
        x0, y0 = [0], [int(cx[0, pad + m])]
        _chain(x0, y0, hx, hy)
        hulls[m] = (_Piecewise(hx, hy), _Piecewise(x0, y0))
        hulls.pop(m - alpha, None)  # no later column reads it

    done(1, *_hull(cx[:, pad + 1], 1, num_steps))
    for m in range(2, memory + 1):
        column = _Column(cx, kind, split, m, pad, alpha, beta, hulls)
        column.run(exact_rows + 1)
        done(m, column.hx, column.hy)
        if progress is not None:
            progress(m / memory)
    return cx[:, pad:], kind, split
