"""Exhaustive search over every valid schedule of a tiny problem (independent of the DP).

A Dijkstra search over replay states, one forward evaluation at a time, with the
simulator's rules (first sweep in order, back-propagation in reverse order, slot sizes,
beta when the input is held, no freeing of a reduced internal state's input). It knows
nothing of the recursion, the split y or the equations: it is the ground truth the
dynamic programs are checked against.
"""

from __future__ import annotations

import heapq


def search(
    num_steps: int,
    memory: int,
    *,
    hidden: bool,
    internal: bool,
    fused: bool,
    counts_initial: bool,
    alpha: int = 1,
    beta: int = 1,
    forward_costs=None,
    hidden_sizes=None,
    internal_sizes=None,
    early_free: bool = False,
    host_memory: float = 0,
    host_charges: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
) -> float:
    """Least total forward cost of a valid schedule, or inf if none fits.

    ``hidden`` / ``internal`` allow SAVE_HIDDEN / SAVE_INTERNAL; ``fused`` allows
    BACKWARD_FUSED (ISM back-propagates from internal states only).

    The paper's model keeps every stored state until the steps it serves are all
    back-propagated (a stack: Algorithm 2 pops a state when its right part is done). The
    search always frees states as soon as they are useless; ``early_free=True`` also lets
    it free a state that is still useful, which the simulator accepts but the paper's
    equations do not model.

    ``host_memory`` adds a second level (``memento.plan``'s two-level model): the states
    ``hidden`` / ``internal`` allow may also be copied to host slots (a hidden state takes
    1, an internal state ``alpha``), loaded back, and back-propagated from; each copy adds
    its entry of ``host_charges`` = (store hidden, load hidden, store internal, load
    internal). As in the model, an internal state goes to the host only when a step
    follows it (a right part), and beta applies to inputs held on the device only.
    """
    t = num_steps
    u = forward_costs or [1] * t
    hs = hidden_sizes or [1] * (t + 1)

    def held(pos, hid, inn):
        return pos == 0 or pos in hid or any(step == pos - 1 for step, _, _ in inn)

    def internal_size(pos, hid, inn):
        is_held = held(pos, hid, inn)
        if internal_sizes is not None:
            full = internal_sizes[pos]
            return (full - hs[pos], True) if is_held else (full, False)
        return (beta, beta < alpha) if is_held else (alpha, False)

    def used(hid, inn):
        return (
            (hs[0] if counts_initial else 0)
            + sum(hs[p] for p in hid)
            + sum(size for _, size, _ in inn)
        )

    def inputs_ok(hid, inn):
        return all(held(step, hid, inn) for step, _, reduced in inn if reduced)

    sh, lh, si, li = host_charges
    alpha_host = alpha if internal_sizes is None else None

    def host_used(hh, hi):
        return len(hh) + sum(alpha_host for _ in hi)

    # state: (cur or -1, expected step, hidden positions, internal (step, size, reduced),
    # sweeping, host hidden positions, host internal steps). cur = -1: no working state.
    empty = frozenset()
    start = (0, t - 1, empty, empty, True, empty, empty)
    best = {start: 0}
    heap = [(0, 0, start)]
    tie = 0
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best.get(state, float("inf")):
            continue
        cur, expect, hid, inn, sweeping, hh, hi = state
        if expect == -1:
            return cost
        nxt = []
        if cur >= 0:
            if cur < t - 1:  # advance one step (never to h_t)
                nxt.append((u[cur], (cur + 1, expect, hid, inn, sweeping, hh, hi)))
            if hidden and cur > 0 and cur not in hid:
                nxt.append((0, (cur, expect, hid | {cur}, inn, sweeping, hh, hi)))
            if internal and cur <= expect and all(step != cur for step, _, _ in inn):
                size, reduced = internal_size(cur, hid, inn)
                new = inn | {(cur, size, reduced)}
                nxt.append((u[cur], (cur + 1, expect, hid, new, sweeping, hh, hi)))
            if fused and cur == expect:
                nxt.append((u[cur], (-1, expect - 1, hid, inn, False, hh, hi)))
            if host_memory and hidden and cur > 0 and cur not in hh:
                nxt.append((sh, (cur, expect, hid, inn, sweeping, hh | {cur}, hi)))
            if host_memory and internal and cur < expect and cur not in hi:
                nxt.append((u[cur] + si, (cur + 1, expect, hid, inn, sweeping, hh, hi | {cur})))
        for step, _, _ in inn:
            if step == expect:
                nxt.append((0, (-1, expect - 1, hid, inn, False, hh, hi)))
        if expect in hi:
            nxt.append((li, (-1, expect - 1, hid, inn, False, hh, hi)))
        if not sweeping:
            nxt.append((0, (0, expect, hid, inn, False, hh, hi)))  # load h_0
            for p in hid:
                nxt.append((0, (p, expect, hid, inn, False, hh, hi)))
            for step, _, _ in inn:
                nxt.append((0, (step + 1, expect, hid, inn, False, hh, hi)))
            for p in hh:
                nxt.append((lh, (p, expect, hid, inn, False, hh, hi)))
            for step in hi:
                nxt.append((lh, (step + 1, expect, hid, inn, False, hh, hi)))
        if early_free:
            for p in hid:
                nxt.append((0, (cur, expect, hid - {p}, inn, sweeping, hh, hi)))
            for item in inn:
                nxt.append((0, (cur, expect, hid, inn - {item}, sweeping, hh, hi)))
        for dc, new_state in nxt:
            c1, e2, h2, i2, sw, hh2, hi2 = new_state
            if used(h2, i2) > memory or not inputs_ok(h2, i2):
                continue
            if host_used(hh2, hi2) > host_memory:
                continue
            # States past what remains to be back-propagated are useless: freeing them
            # costs nothing, so drop them at once (keeps the search small).
            if any(p > e2 for p in h2) or any(q > e2 for q, _, _ in i2):
                h2 = frozenset(p for p in h2 if p <= e2)
                i2 = frozenset(x for x in i2 if x[0] <= e2)
            if any(p > e2 for p in hh2) or any(q > e2 for q in hi2):
                hh2 = frozenset(p for p in hh2 if p <= e2)
                hi2 = frozenset(q for q in hi2 if q <= e2)
            new_state = (c1 if c1 <= e2 else -1, e2, h2, i2, sw, hh2, hi2)
            c2 = cost + dc
            if c2 < best.get(new_state, float("inf")):
                best[new_state] = c2
                tie += 1
                heapq.heappush(heap, (c2, tie, new_state))
    return float("inf")
