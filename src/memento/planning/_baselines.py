"""Classic checkpointing strategies as `Schedule`s, to compare against the optimal policies.

Each baseline is unrolled into the same rows as the planner's schedules (FREE rows
included) and replayed by the simulator: its ``memory`` is the peak the replay measures,
its ``cost`` the forward evaluations it emits (the paper's C). Memory is counted in
hidden-state slots as in `Schedule`: an internal state takes ``alpha`` slots, ``beta``
when its input state is held at that moment (Gruslys et al. 2016, section 3.4).

============== ========================== ========================= ===================
baseline       stores                     cost C                    memory (slots)
============== ========================== ========================= ===================
store_all      every internal state       t                         t * beta
store_none     h_0 only                   t (t + 1) / 2             1
chen_sqrt      sqrt(t) hidden + sqrt(t)   2 t - (last segment)      ~ sqrt(t) (1 + beta)
               internal states
chen_recursive k hidden states per level  ~ t log_{k+1} t           ~ k log_{k+1} t
revolve        ``snaps`` hidden states    C_hsm(t, snaps), optimal  snaps
============== ========================== ========================= ===================

References:
    Gruslys, Munos, Danihelka, Lanctot, Graves. Memory-Efficient Backpropagation Through
    Time. NeurIPS 2016 (sections 2.2, 3, 4.2).
    Chen, Xu, Zhang, Guestrin. Training Deep Nets with Sublinear Memory Cost. 2016.
    Griewank, Walther. Algorithm 799: revolve. ACM TOMS 26(1), 2000.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from math import comb

import numpy as np

from ._schedule import INITIAL, Op, Schedule, simulate

__all__ = [
    "BpttComparison",
    "chen_recursive",
    "chen_sqrt",
    "compare_to_bptt",
    "revolve",
    "revolve_cost",
    "store_all",
    "store_none",
]


def _check_int(name: str, value, minimum: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an integer, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}.")
    return int(value)


def _check_sizes(alpha, beta, where: str) -> tuple[int, int]:
    alpha = _check_int("alpha", 1 if alpha is None else alpha, 1, where)
    beta = alpha if beta is None else _check_int("beta", beta, 1, where)
    if beta > alpha:
        raise ValueError(
            f"{where}: beta (an internal state whose input is held) cannot exceed alpha, "
            f"got alpha={alpha}, beta={beta}."
        )
    return alpha, beta


class _Rows:
    """Emits schedule rows while tracking the working position and the forward count."""

    def __init__(self):
        self.rows: list[tuple[int, int, int]] = []
        self.cur: int | None = 0
        self.cost = 0

    def restore(self, slot: int, pos: int):
        # Reload h_pos unless it is already the working state.
        if self.cur != pos:
            self.rows.append((Op.LOAD_HIDDEN, slot, pos))
            self.cur = pos

    def advance(self, to: int):
        assert self.cur is not None and to >= self.cur
        if to > self.cur:
            self.rows.append((Op.ADVANCE, to - self.cur, self.cur))
            self.cost += to - self.cur
            self.cur = to

    def save_hidden(self, slot: int):
        assert self.cur is not None
        self.rows.append((Op.SAVE_HIDDEN, slot, self.cur))

    def save_internal(self, slot: int):
        assert self.cur is not None
        self.rows.append((Op.SAVE_INTERNAL, slot, self.cur))
        self.cost += 1
        self.cur += 1

    def backward_fused(self):
        assert self.cur is not None
        self.rows.append((Op.BACKWARD_FUSED, 0, self.cur))
        self.cost += 1
        self.cur = None

    def backward_internal(self, slot: int, step: int):
        # Back-propagate from the stored internal state and release it at once.
        self.rows.append((Op.BACKWARD_INTERNAL, slot, step))
        self.rows.append((Op.FREE_INTERNAL, slot, step))
        self.cur = None

    def free_hidden(self, slot: int, pos: int):
        self.rows.append((Op.FREE_HIDDEN, slot, pos))

    def schedule(self, num_steps: int, policy: str, **sizes) -> Schedule:
        # The budget is what the replay measures: plan with an unbounded budget, replay,
        # then record the peak (the replay also checks every rule of the contract).
        rows = np.array(self.rows, dtype=np.int64).reshape(-1, 3)
        draft = Schedule(num_steps, sys.maxsize, policy, self.cost, rows, **sizes)
        return dataclasses.replace(draft, memory=simulate(draft).peak_memory)


def _segment_bounds(length: int, parts: int) -> list[int]:
    """Boundaries ``0 = b_0 < ... < b_parts = length`` of near-equal parts."""
    return [i * length // parts for i in range(parts + 1)]


def store_all(num_steps: int, *, alpha: int | None = None, beta: int | None = None) -> Schedule:
    """Plain BPTT: stores the internal state of every step, then back-propagates them all.

    The fastest schedule (cost t, the paper's ISM with plentiful memory) and the most
    memory-hungry: t internal states. ``h_0`` is not counted (as in ISM); every internal
    state's input is held (``h_0``, or the previous internal state's output), so each
    takes ``beta`` slots.

    Args:
        num_steps: the sequence length t >= 1.
        alpha: slots per internal state (default 1: memory counted in internal states).
        beta: slots per internal state whose input state is held (default ``alpha``).

    Returns:
        A `Schedule` with ``cost == num_steps`` and ``memory == num_steps * beta``.
    """
    where = "memento.store_all"
    t = _check_int("num_steps", num_steps, 1, where)
    alpha, beta = _check_sizes(alpha, beta, where)
    rows = _Rows()
    for p in range(t):
        rows.save_internal(slot=p)
    for p in reversed(range(t)):
        rows.backward_internal(slot=p, step=p)
    return rows.schedule(t, "store_all", alpha=alpha, beta=beta, counts_initial=False)


def store_none(num_steps: int) -> Schedule:
    """Stores nothing but ``h_0``: every step is recomputed from the start before its backward.

    The minimal-memory extreme of section 3 of Gruslys et al.: constant memory (one slot,
    ``h_0``) and t (t + 1) / 2 forward evaluations, the paper's C(t, 1).

    Args:
        num_steps: the sequence length t >= 1.

    Returns:
        A `Schedule` with ``cost == t * (t + 1) // 2`` and ``memory == 1``.
    """
    t = _check_int("num_steps", num_steps, 1, "memento.store_none")
    rows = _Rows()
    _reverse_from(rows, INITIAL, 0, t)
    return rows.schedule(t, "store_none")


def _reverse_from(rows: _Rows, slot: int, start: int, length: int):
    """Back-propagates steps ``start .. start+length-1`` restarting each from ``h_start``."""
    for p in reversed(range(start, start + length)):
        rows.restore(slot, start)
        rows.advance(p)
        rows.backward_fused()


def chen_sqrt(
    num_steps: int,
    *,
    segment_length: int | None = None,
    alpha: int | None = None,
    beta: int | None = None,
) -> Schedule:
    """Chen et al.'s sqrt(t) checkpointing: hidden states between segments, internals within.

    The sequence is cut into segments of about sqrt(t) steps. The first sweep stores the
    hidden state at the start of every segment but the last, and the internal states of
    the last segment. Each earlier segment is then re-run from its stored start, storing
    its internal states, and back-propagated. Cost: t plus one more pass over all but
    the last segment, about 2t. Memory: about sqrt(t) hidden states and sqrt(t) internal
    states whose input is held, sqrt(t) (1 + beta) slots (section 4.2 of Gruslys et al.).

    Args:
        num_steps: the sequence length t >= 1.
        segment_length: steps per segment (default ``round(sqrt(t))``); the sequence is
            split into ``ceil(t / segment_length)`` near-equal segments.
        alpha: slots per internal state (default 1).
        beta: slots per internal state whose input state is held (default ``alpha``).

    Returns:
        A `Schedule` with ``cost == 2 t - (length of the last segment)``.
    """
    where = "memento.chen_sqrt"
    t = _check_int("num_steps", num_steps, 1, where)
    alpha, beta = _check_sizes(alpha, beta, where)
    if segment_length is None:
        segment_length = max(1, round(math.sqrt(t)))
    k = _check_int("segment_length", segment_length, 1, where)
    bounds = _segment_bounds(t, -(-t // k))
    n = len(bounds) - 1
    slot_of = {0: INITIAL}
    rows = _Rows()
    # First sweep: hidden states at segment starts (h_0 is held by the caller).
    for i in range(1, n - 1):
        rows.advance(bounds[i])
        rows.save_hidden(slot=i - 1)
        slot_of[bounds[i]] = i - 1
    rows.advance(bounds[n - 1])
    # Back to front: (re)compute a segment storing its internal states, back-propagate it.
    for i in reversed(range(n)):
        start, stop = bounds[i], bounds[i + 1]
        if i < n - 1:
            rows.restore(slot_of[start], start)
        for p in range(start, stop):
            rows.save_internal(slot=p - start)
        for p in reversed(range(start, stop)):
            rows.backward_internal(slot=p - start, step=p)
        if 0 < i < n - 1:
            rows.free_hidden(slot_of[start], start)
    return rows.schedule(t, "chen_sqrt", alpha=alpha, beta=beta)


def chen_recursive(num_steps: int, *, k: int = 1) -> Schedule:
    """Chen et al.'s recursive checkpointing, hidden states only.

    A segment is split into ``k + 1`` near-equal parts; the sweep over it stores the ``k``
    inner boundary states, and the parts are then back-propagated right to left, each by
    the same rule, down to single steps. Memory about ``k log_{k+1}(t)`` hidden states
    (``k = 1``: bisection, about log2(t)), cost about ``t log_{k+1}(t)`` (section 2.2 of
    Gruslys et al.). ``h_0`` takes one slot, as in HSM.

    Args:
        num_steps: the sequence length t >= 1.
        k: boundary states stored per level of the recursion (>= 1).

    Returns:
        A hidden-states-only `Schedule`; its cost is never below HSM's optimum at the same
        memory.
    """
    where = "memento.chen_recursive"
    t = _check_int("num_steps", num_steps, 1, where)
    k = _check_int("k", k, 1, where)
    rows = _Rows()
    # Explicit stack of tasks instead of recursion: depth can reach t.
    # ("rev", slot, start, length, depth): back-propagate [start, start+length) from the
    # state h_start held in `slot`, with `depth` hidden slots (h_0 excluded) already live.
    # ("free", slot, pos): release a boundary once its part is done.
    tasks: list[tuple] = [("rev", INITIAL, 0, t, 0)]
    while tasks:
        task = tasks.pop()
        if task[0] == "free":
            rows.free_hidden(task[1], task[2])
            continue
        _, slot, start, length, depth = task
        if length == 1:
            rows.restore(slot, start)
            rows.backward_fused()
            continue
        bounds = [start + b for b in _segment_bounds(length, min(k + 1, length))]
        rows.restore(slot, start)
        tasks.append(("rev", slot, start, bounds[1] - start, depth))
        for j, pos in enumerate(bounds[1:-1]):
            rows.advance(pos)
            rows.save_hidden(slot=depth + j)
            # Pushed after its left neighbour: the rightmost part is processed first.
            tasks.append(("free", depth + j, pos))
            tasks.append(("rev", depth + j, pos, bounds[j + 2] - pos, depth + j + 1))
    return rows.schedule(t, "chen_recursive")


def _binomial_reps(num_steps: int, snaps: int) -> int:
    """The repetition number r: the least r with binom(snaps + r, snaps) >= num_steps."""
    r = 0
    while comb(snaps + r, snaps) < num_steps:
        r += 1
    return r


def revolve_cost(num_steps: int, snaps: int) -> int:
    """Forward evaluations of binomial checkpointing: HSM's optimum C(t, m) in closed form.

    Griewank and Walther's minimal number of advances for reversing l = t steps with
    s = m checkpoints (``h_0`` in one of them) is ``r l - binom(s + r, s + 1)``, with r
    the least integer such that ``binom(s + r, s) >= l``. HSM counts the t fused
    forward evaluations of the backward sweep as well, so
    ``C(t, m) = (r + 1) t - binom(m + r, m + 1)``.

    Args:
        num_steps: the sequence length t >= 1.
        snaps: hidden-state slots m >= 1, ``h_0`` included.

    Returns:
        The paper's C_hsm(t, m) as an ``int``.
    """
    where = "memento.revolve_cost"
    t = _check_int("num_steps", num_steps, 1, where)
    m = _check_int("snaps", snaps, 1, where)
    r = _binomial_reps(t, m)
    return (r + 1) * t - comb(m + r, m + 1)


def _binomial_split(length: int, snaps: int) -> int:
    """Where revolve places the next checkpoint, as an offset from the segment's start.

    With s snaps and repetition number r for this segment, every offset y with
    ``binom(s + r - 2, s) <= y`` (the left part needs at most r - 1 repetitions with s
    snaps) and ``length - y <= binom(s - 1 + r, s - 1)`` (the right part at most r with
    s - 1 snaps) is optimal; we take the smallest.
    """
    r = _binomial_reps(length, snaps)
    left_min = comb(snaps + r - 2, snaps) if r >= 2 else 0
    return max(1, left_min, length - comb(snaps - 1 + r, snaps - 1))


def revolve(num_steps: int, snaps: int) -> Schedule:
    """Griewank and Walther's binomial checkpointing ("revolve"), hidden states only.

    The optimal hidden-state schedule for ``snaps`` checkpoints, placed by the binomial
    rule instead of a dynamic program: its cost equals the paper's HSM optimum
    C_hsm(t, snaps) (see `revolve_cost`). HSM is revolve in another notation.

    Args:
        num_steps: the sequence length t >= 1.
        snaps: hidden-state slots, ``h_0`` included (>= 1); the paper's m.

    Returns:
        A `Schedule` with ``cost == revolve_cost(num_steps, snaps)`` and ``memory <=
        snaps``.
    """
    where = "memento.revolve"
    t = _check_int("num_steps", num_steps, 1, where)
    m = _check_int("snaps", snaps, 1, where)
    rows = _Rows()
    # ("rev", slot, start, length, snaps, depth): back-propagate [start, start+length)
    # from h_start held in `slot`, with `snaps` slots for it (that one included).
    tasks: list[tuple] = [("rev", INITIAL, 0, t, m, 0)]
    while tasks:
        task = tasks.pop()
        if task[0] == "free":
            rows.free_hidden(task[1], task[2])
            continue
        _, slot, start, length, s, depth = task
        if s == 1 or length == 1:
            _reverse_from(rows, slot, start, length)
            continue
        y = _binomial_split(length, s)
        rows.restore(slot, start)
        rows.advance(start + y)
        rows.save_hidden(slot=depth)
        tasks.append(("rev", slot, start, y, s, depth))
        tasks.append(("free", depth, start + y))
        tasks.append(("rev", depth, start + y, length - y, s - 1, depth + 1))
    return rows.schedule(t, "revolve")


@dataclasses.dataclass(frozen=True)
class BpttComparison:
    """A schedule against plain BPTT (`store_all`), under a simple time model.

    Time model: a forward step costs 1, a backward step ``backward_cost``; every schedule
    back-propagates each step once, so BPTT takes ``t (1 + b)`` and the schedule
    ``C + t b``.

    Attributes:
        num_steps: t.
        cost: the schedule's forward evaluations, C.
        cost_per_step: C / t.
        memory: slots the schedule uses at its peak (at most its budget).
        bptt_memory: slots plain BPTT needs (every internal state, same alpha and beta).
        memory_saved: ``1 - memory / bptt_memory``, the fraction of memory saved.
        backward_cost: b, the cost of one backward step in forward steps.
        time_ratio: ``(C + t b) / (t (1 + b))``, predicted time against plain BPTT.
    """

    num_steps: int
    cost: int
    cost_per_step: float
    memory: int
    bptt_memory: int
    memory_saved: float
    backward_cost: float
    time_ratio: float


def compare_to_bptt(schedule: Schedule, *, backward_cost: float = 2.0) -> BpttComparison:
    """Cost, memory saved and predicted time of ``schedule`` against plain BPTT.

    Plain BPTT is `store_all` with the schedule's ``alpha`` and ``beta``; ``h_0`` is
    added to its memory when the schedule counts it. Gruslys et al. take a backward step
    to cost two forward steps (section 3.2): their ISM at t = 1000, m = 50 saves 95% of
    the memory for about 33% more time.

    Args:
        schedule: a uniform-loop `Schedule` (not a heterogeneous chain).
        backward_cost: time of one backward step, in forward steps (> 0).

    Returns:
        A `BpttComparison`.

    Raises:
        NotImplementedError: for heterogeneous chains and two-level (host memory) plans.
    """
    where = "memento.compare_to_bptt"
    if not isinstance(schedule, Schedule):
        raise TypeError(f"{where}: expected a Schedule, got {type(schedule).__name__}.")
    if schedule.hidden_sizes is not None or schedule.internal_sizes is not None:
        raise NotImplementedError(f"{where}: heterogeneous chains are not supported.")
    if schedule.host_memory:
        raise NotImplementedError(
            f"{where}: a two-level schedule (host_memory={schedule.host_memory}) costs "
            "transfers too; compare its cost with plan(num_steps, memory).cost instead."
        )
    if isinstance(backward_cost, bool) or not isinstance(backward_cost, numbers.Real):
        raise TypeError(f"{where}: backward_cost must be a number, got {backward_cost!r}.")
    b = float(backward_cost)
    if not (b > 0 and math.isfinite(b)):
        raise ValueError(f"{where}: backward_cost must be > 0, got {backward_cost!r}.")
    t = schedule.num_steps
    # store_all's memory, t beta (tested against its replay), without building it.
    bptt_memory = t * schedule.beta + int(schedule.counts_initial)
    return BpttComparison(
        num_steps=t,
        cost=int(schedule.cost),
        cost_per_step=schedule.cost / t,
        memory=schedule.peak_memory,
        bptt_memory=bptt_memory,
        memory_saved=1.0 - schedule.peak_memory / bptt_memory,
        backward_cost=b,
        time_ratio=(schedule.cost + t * b) / (t * (1.0 + b)),
    )
