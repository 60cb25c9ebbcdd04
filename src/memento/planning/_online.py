"""Online checkpointing: where to keep carries when the number of steps is not known.

A while loop learns its length n only when its predicate fails. Its forward sweep must
therefore decide *online*, at each step p, whether to keep ``h_p`` in one of the
``memory - 1`` slots (``h_0`` is the first of ``memory``) and which kept carry to give up
for it. Once n is known the backward pass reverses the segments between kept carries,
last first, each with the slots the earlier segments leave free, by the HSM recursion
(`hsm_cost`, `hsm_split`): segment i (0-based, in position order) gets ``memory - i``
slots, its base included. Total forward evaluations, the quantity compared with the
offline optimum ``plan(n, memory, policy="hsm").cost``::

    n + sum_i C_hsm(L_i, memory - i),       L_i = length of segment i.

The policy has three phases (c = ``memory``):

1. ``p < c``: keep every carry (free slots).
2. ``p < binom(c + 2, 2) - 1``: every segment stays a *chain* (``L_i <= c - i + 1``, so
   reversing it costs ``2 L_i - 1``) and all c slots stay in use, which makes the total
   ``3n - c``: the online optimum of Stumm and Walther's algorithm I (the range where it
   is optimal). A carry is kept when the last segment would leave its chain bound, or
   earlier when dropping one carry fills a segment exactly to its bound (which keeps the
   range reachable to its end; dropping the earliest possible carry alone falls short).
3. Beyond: the loop is assumed to end either right away or at a *horizon* H (one step
   ahead up to 1.2 binom(c + 2, 2), then a geometric sequence of ratio 1.2); the next carry is kept where the offline plan for H
   would keep it, and at each keep the carries whose removal lowers the predicted cost
   (segments so far plus the offline cost of the rest, relative to the offline optimum,
   summed over the two ends) are dropped, one by one, greedily. Crossing a horizon thins
   the set.

The decisions depend on p and c only, so they are computed here once (NumPy-free Python
on exact integers) as a table of events; the executor only reads it.
"""

from __future__ import annotations

import dataclasses
import functools
from math import comb

import numpy as np

from ._closed import hsm_cost, hsm_split

__all__ = ["OnlineEvents", "checkpoints_at", "online_evaluations", "online_events"]

_GROWTH = 1.2  # horizon ratio of phase 3; the fewest evaluations of {1.2, 1.3, 1.5, 2}


def _next_horizon(c: int, horizon: int) -> int:
    # Right after phase 2 the horizon moves one step at a time (the policy then minimises
    # the cost of stopping now): larger first horizons thinned the set too early and cost
    # up to 4 evaluations more than Equinox at n = binom(c + 2, 2) + 1. Then geometric.
    if horizon < _GROWTH * comb(c + 2, 2):
        return horizon + 1
    return max(horizon + 1, int(horizon * _GROWTH))


def _targets(p: int, horizon: int) -> tuple[int, ...]:
    # The loop may end right after h_p (n = p + 1) or at the horizon: weigh both, each
    # relative to its offline optimum. Measured better than the horizon alone, than two
    # horizons, or than adding points in between.
    return (p + 1, horizon)


# Without max_steps, events are planned up to the int32 step counter's limit.
DEFAULT_CAP = (1 << 31) - 2


@functools.lru_cache(maxsize=1 << 16)
def _cost(length: int, m: int) -> int:
    """C_hsm(length, m), with C(0, m) = 0 and the quadratic m = 1 case."""
    if length <= 0:
        return 0
    if m <= 1:
        return length * (length + 1) // 2
    return hsm_cost(length, m)


def _future(length: int, m: int) -> int:
    # Predicted cost of the rest, from the last kept carry: its offline cost, sweep
    # included (the backward sweeps it again; fewer evaluations than leaving it out).
    return _cost(length, m)


@dataclasses.dataclass(frozen=True, eq=False)
class OnlineEvents:
    """The online policy for ``memory`` slots as a table of events, in time order.

    Attributes:
        memory: c, slots including ``h_0``; there are ``c - 1`` physical slots.
        cap: events cover positions ``p < cap``.
        pos: ``(R,)`` position p of each row.
        slot: ``(R,)`` physical slot (0 .. c-2) the row writes or frees.
        store: ``(R,)`` True: keep ``h_p`` in ``slot``; False: ``slot`` is given up.
            Within one position, frees come before the store.
    """

    memory: int
    cap: int
    pos: np.ndarray
    slot: np.ndarray
    store: np.ndarray

    @property
    def store_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, slots) of the stores only, the forward pass's table."""
        return self.pos[self.store], self.slot[self.store]


def _phase2_drop(c: int, kept: list[int], p: int) -> int | None:
    """Phase 2: index of the carry to drop to keep ``h_p``, or None to keep nothing."""
    lengths = [b - a for a, b in zip(kept, [*kept[1:], p], strict=True)]
    forced = p + 1 - kept[-1] > 2  # the last segment (1 slot) may hold 2 steps
    first_fit = None
    for j in range(1, c):
        merged = lengths[j - 1] + lengths[j]
        bound = c - (j - 1) + 1
        if merged == bound:
            return j
        if merged < bound and first_fit is None:
            first_fit = j
    return first_fit if forced else None


def _phase3(c: int, kept: list[int], p: int, horizon: int) -> tuple[list[int], list[int]]:
    """Phase 3: the kept set after considering ``h_p``, and the dropped positions."""
    cand = [*kept, p]
    dropped: list[int] = []
    targets = _targets(p, horizon)

    weights = [1 / _cost(h, c) for h in targets]

    def predicted(ps: list[int]) -> float:
        if len(ps) > c:
            return float("inf")
        k = len(ps) - 1
        s = sum(_cost(ps[i + 1] - ps[i], c - i) for i in range(k))
        return _weigh(s, ps[-1], c - k)

    def _weigh(segments: int, last: int, m: int) -> float:
        return sum((segments + _future(h - last, m)) * w for h, w in zip(targets, weights))

    def best_drop(ps: list[int]) -> tuple[float, int]:
        # Dropping ps[j] merges segments j-1 and j and gives every later segment one more
        # slot: prefix sums of the costs at both slot counts make each trial O(1).
        k = len(ps) - 1
        lengths = [ps[i + 1] - ps[i] for i in range(k)]
        at = [_cost(lengths[i], c - i) for i in range(k)]
        shifted = [_cost(lengths[i], c - i + 1) for i in range(k)]
        prefix = [0]
        for v in at:
            prefix.append(prefix[-1] + v)
        suffix = [0] * (k + 1)
        for i in range(k - 1, -1, -1):
            suffix[i] = suffix[i + 1] + shifted[i]
        m_after = c - (k - 1)
        out = (_weigh(prefix[k - 1], ps[k - 1], m_after), k)  # drop the last
        for j in range(1, k):
            merged = _cost(lengths[j - 1] + lengths[j], c - (j - 1))
            segs = prefix[j - 1] + merged + suffix[j + 1]
            out = min(out, (_weigh(segs, ps[k], m_after), j))
        return out

    best = predicted(cand)
    while len(cand) > 1:
        value, j = best_drop(cand)
        if value >= best:
            break
        best = value
        dropped.append(cand.pop(j))
    return cand, dropped


def _next_keep(c: int, kept: list[int], p: int, horizon: int) -> int:
    """Where the offline plan for ``horizon`` keeps the next carry (phase 3)."""
    q, m = kept[-1], c - (len(kept) - 1)
    if m >= 2 and horizon - q >= 2:
        return max(p + 1, q + hsm_split(horizon - q, m))
    return max(p + 1, horizon)


def online_events(memory: int, cap: int | None = None) -> OnlineEvents:
    """Runs the online policy for positions ``p < cap`` and records its events.

    ``cap=None``: up to the int32 step counter's limit (a loop without ``max_steps``).
    Cached per ``(memory, cap)``.
    """
    return _events(memory, DEFAULT_CAP if cap is None else cap)


@functools.lru_cache(maxsize=64)
def _events(memory: int, cap: int) -> OnlineEvents:
    c = memory
    rows: list[tuple[int, int, bool]] = []
    free = list(range(c - 2, -1, -1))  # physical slots, popped from the end
    slot_of: dict[int, int] = {}
    kept = [0]

    def keep(p: int, drops: list[int]) -> None:
        for d in drops:
            if d == p:  # h_p itself was not kept: nothing to free
                continue
            s = slot_of.pop(d)
            free.append(s)
            rows.append((d, s, False))
        if p in drops:
            return
        s = free.pop()
        slot_of[p] = s
        rows.append((p, s, True))

    # Frees are recorded at the position of the event that makes them (below we fix the
    # position column), so that "rows with pos < n" is the state after the forward pass.
    def record(p: int, drops: list[int]) -> None:
        start = len(rows)
        keep(p, drops)
        for i in range(start, len(rows)):
            rows[i] = (p, rows[i][1], rows[i][2])

    phase2_end = comb(c + 2, 2) - 1
    p = 1
    horizon = max(phase2_end + 1, 2)
    while p < cap and c > 1:
        if p < c:  # phase 1
            record(p, [])
            kept.append(p)
            p += 1
            continue
        if p < phase2_end:  # phase 2
            j = _phase2_drop(c, kept, p)
            if j is not None:
                d = kept.pop(j)
                record(p, [d])
                kept.append(p)
            p += 1
            continue
        while horizon <= p:  # phase 3
            horizon = _next_horizon(c, horizon)
        new, dropped = _phase3(c, kept, p, horizon)
        if new != kept:
            record(p, dropped)
            kept = new
        p = _next_keep(c, kept, p, horizon)
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    pos, slot, store = arr[:, 0], arr[:, 1], arr[:, 2].astype(bool)
    for a in (pos, slot, store):
        a.setflags(write=False)
    return OnlineEvents(memory=c, cap=cap, pos=pos, slot=slot, store=store)


def checkpoints_at(events: OnlineEvents, num_steps: int) -> list[int]:
    """Positions of the carries kept when the loop stops after ``num_steps`` steps."""
    held: dict[int, int] = {}
    for p, s, st in zip(events.pos.tolist(), events.slot.tolist(), events.store.tolist()):
        if p >= num_steps:
            break
        if st:
            held[s] = p
        else:
            held.pop(s, None)
    return [0, *sorted(held.values())]


def online_evaluations(
    memory: int, num_steps: int, cap: int = DEFAULT_CAP, host_memory: int = 0
) -> int:
    """Forward evaluations of `memento.while_loop` for ``num_steps`` steps, sweep included.

    This is what the executor runs: n primal steps forward, then the kept segments
    reversed last first by the HSM recursion with the slots left (module docstring).

    With ``host_memory`` (``H >= 1`` host slots, ``h_0`` not among them): the loop keeps
    its carries in the host slots by the same policy for ``H + 1`` slots, and reverses
    each host segment from its first carry with all ``memory`` device slots, so
    ``n + sum_i C_hsm(L_i, memory)``; ``2n`` (nothing recomputed) when the host keeps
    every carry (``H >= n``: the policy fills free slots first, checked for every
    ``n <= H <= 24``; answered without running the policy, which for ``H + 1`` slots
    up to the default cap took minutes at ``H = 1000``).
    """
    n = num_steps
    if n <= 0:
        return 0
    if host_memory >= n:
        return 2 * n
    if host_memory:
        ps = [*checkpoints_at(online_events(min(host_memory, cap) + 1, cap), n), n]
        return n + sum(_cost(ps[i + 1] - ps[i], memory) for i in range(len(ps) - 1))
    ps = [*checkpoints_at(online_events(memory, cap), n), n]
    return n + sum(_cost(ps[i + 1] - ps[i], memory - i) for i in range(len(ps) - 1))
