"""Optimal checkpointing of heterogeneous chains (Gruslys et al. 2016, appendix C).

Appendix C (eq. 18-25) generalises BPTT-HSM to layers of different costs ``u`` and hidden
sizes ``s``; here it is generalised further the way MSM generalises HSM: at each push the
plan may keep a hidden state, an internal state, or (eq. 24) nothing at all.

Subproblem ``(x, t, E)``: back-propagate steps ``x .. x+t-1`` with the working state at
``h_x``, which is held, and ``E`` more memory units free. With ``U(x, y)`` the cost of the
steps ``x .. x+y-1`` (eq. 21's cumulative cost), the choices are::

    fused      t = 1:        u_x
    nothing    (eq. 24):     sum_j (t-j) u_{x+j}      (recompute from h_x for every step)
    hidden y   (eq. 21):     U(x, y) + C(x+y, t-y, E - s_{x+y}) + C(x, y, E),       1 <= y < t
    internal y (eq. 7/10):   U(x, y) + C(x+y, t-y, E - a) + C(x, y-1, E),           1 <= y <= t
                             a = i_p - s_p if y = 1 (input h_x already held) else i_p,
                             p = x + y - 1

with ``C(., 0, E) = 0`` for ``E >= 0`` and ``C = inf`` whenever ``E < 0``. The right part of
an internal push starts from the output state kept inside the internal state, so it adds
nothing for its base. With ``u = 1``, ``s = 1``, ``i = alpha`` this is BPTT-MSM with
``beta = alpha - 1`` and ``E = m - 1`` (tested). Unlike appendix C's ``K(x, y, m)``, the
working state is not charged, as in the paper's RNN sections and the simulator.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from ._dp import _leaf_rows, _split
from ._msm import _BIG
from ._schedule import _FUSED, _LOAD_H, Schedule

__all__ = ["plan_chain", "plan_chain_bytes"]

_NONE, _HID, _INT, _ONE = 0, 1, 2, 3  # choices: nothing, hidden push, internal push, fused
_MAX_CELLS = 30_000_000  # n^2 (E+1) / 2 table entries; beyond this planning takes minutes


def _sizes(fn: str, name: str, values, length: int, minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"{fn}: {name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(
                f"{fn}: {name} must hold ints, got {v!r} ({type(v).__name__}); express "
                "costs and sizes in integer units (e.g. multiples of the smallest state)"
            )
        if v < minimum:
            raise ValueError(f"{fn}: {name} entries must be >= {minimum}, got {int(v)}")
        out.append(int(v))
    if len(out) != length:
        raise ValueError(f"{fn}: {name} must have {length} entries, got {len(out)}")
    return tuple(out)


def _tables(u: tuple[int, ...], s: tuple[int, ...], i: tuple[int, ...], budget: int):
    """C, choice and split for every subproblem ``(x, t, E)``; arrays ``[x, t, E]``."""
    n = len(u)
    width = budget + 1
    cost = np.full((n + 1, n + 1, width), _BIG, dtype=np.int64)
    cost[:, 0, :] = 0  # empty part: free with any E >= 0
    choice = np.zeros((n + 1, n + 1, width), dtype=np.int8)
    split = np.zeros((n + 1, n + 1, width), dtype=np.int32)
    cum = np.concatenate([[0], np.cumsum(u)])  # U(x, y) = cum[x+y] - cum[x]
    es = np.arange(width)
    big = _BIG
    s_arr = np.asarray(s, dtype=np.int64)
    i_arr = np.asarray(i, dtype=np.int64)

    def shifted(rows: np.ndarray, by: np.ndarray) -> np.ndarray:
        # rows[k, E - by[k]], infeasible (BIG) where E - by[k] < 0.
        idx = es[None, :] - by[:, None]
        ok = idx >= 0
        out = np.take_along_axis(rows, np.where(ok, idx, 0), axis=1)
        return np.where(ok, out, big)

    for t in range(1, n + 1):
        for x in range(0, n - t + 1):
            if t == 1:
                cost[x, 1, :] = u[x]
                choice[x, 1, :] = _ONE
                continue
            # eq. 24: keep nothing, recompute from h_x for each step; step x+j is
            # evaluated once for each of the t - j steps at or after it.
            quad = int(sum((t - j) * u[x + j] for j in range(t)))
            best = np.full(width, quad, dtype=np.int64)
            ch = np.full(width, _NONE, dtype=np.int8)
            sp = np.zeros(width, dtype=np.int32)
            for label in (_HID, _INT):
                if label == _HID:  # hidden push at y: right part pays s_{x+y}
                    ys = np.arange(1, t)
                    size = s_arr[x + ys]
                    left = cost[x, ys, :]
                else:  # internal push of step p = x+y-1: i_p, less s_x when y = 1
                    ys = np.arange(1, t + 1)
                    size = i_arr[x + ys - 1] - np.where(ys == 1, s_arr[x], 0)
                    left = cost[x, ys - 1, :]
                q = (cum[x + ys] - cum[x])[:, None] + shifted(cost[x + ys, t - ys, :], size) + left
                k = q.argmin(0)
                v = q[k, es]
                take = v < best
                best = np.where(take, v, best)
                ch[take] = label
                sp[take] = k[take] + 1
            cost[x, t, :] = np.minimum(best, big)
            choice[x, t, :] = ch
            split[x, t, :] = sp
    return cost, choice, split, s, i


def _emit_chain(n: int, budget: int, tables) -> np.ndarray:
    """Unrolls the chain policy with an explicit stack (as `_dp._emit`)."""
    _, choice, split, s, i = tables
    out: list[int] = []
    ext = out.extend
    stack: list[tuple] = [(0, n, budget, 0, 0, _LOAD_H, -1)]
    while stack:
        node = stack.pop()
        if node[0] is None:
            ext(node[1])
            continue
        b, t, e, _, _, bop, barg = node
        kind = int(choice[b, t, e])
        if kind == _ONE:
            ext((_FUSED, 0, b))
            continue
        if kind == _NONE:  # eq. 24: recompute from the base for each step
            ext(_leaf_rows("quadratic", t, b, 0, bop, barg).ravel().tolist())
            continue
        y = int(split[b, t, e])
        if kind == _HID:  # the right part pays for h_{b+y}
            _split(ext, stack.append, node, y, True, e - s[b + y])
        else:  # internal state of step b+y-1, less its input when that is held (y = 1)
            _split(ext, stack.append, node, y, False, e - i[b + y - 1] + (s[b] if y == 1 else 0))
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def plan_chain(
    forward_costs: Sequence[int],
    hidden_sizes: Sequence[int],
    internal_sizes: Sequence[int],
    memory: int,
    *,
    internal: bool = True,
) -> Schedule:
    """Plans an optimal schedule for a chain of steps with different costs and sizes.

    For deep feed-forward chains or loops whose steps differ (appendix C of Gruslys et al.),
    choosing per push between a hidden state, an internal state or nothing (as BPTT-MSM).
    Minimises the total forward cost ``sum(forward_costs[p] for every evaluation of p)``.

    Sizes are integers in one common unit (bytes, or a multiple of the smallest state):

    - ``hidden_sizes[p]``, ``p = 0..n``: size of ``h_p``, the state before step p
      (``h_0`` is the input, counted in ``memory``; ``h_n`` is never stored).
    - ``internal_sizes[p]``, ``p = 0..n-1``: size of step p's internal state (the residuals
      its backward needs) *including its input* ``h_p`` and its output ``h_{p+1}``. When
      ``h_p`` is already held at the moment it is stored (as ``h_0``, in a hidden slot or
      inside the internal state of step p-1), it is stored without its input and takes
      ``internal_sizes[p] - hidden_sizes[p]`` (section 3.4's beta); so
      ``internal_sizes[p] > hidden_sizes[p]``.
    - The working state of the step being evaluated is not charged, as in the paper's
      recurrent model.

    With every cost 1, every hidden size 1 and every internal size ``alpha``, the cost is
    ``plan(n, memory, policy="msm", alpha=alpha, beta=alpha - 1).cost``.

    Args:
        forward_costs: n >= 1 positive integer costs, one per step.
        hidden_sizes: n + 1 positive integer sizes of ``h_0 .. h_n``.
        internal_sizes: n positive integer sizes, as above.
        memory: the budget, >= ``hidden_sizes[0]``.
        internal: whether pushes may store internal states. ``False`` restricts the plan
            to hidden states and recomputation (appendix C's HSM choices, eq. 21 and 24).

    Returns:
        A `Schedule` with ``policy="chain"`` whose ``cost`` is the weighted cost and whose
        replay uses at most ``memory`` units.

    Raises:
        TypeError: non-integer costs, sizes or memory.
        ValueError: wrong lengths, non-positive entries, a budget below ``hidden_sizes[0]``
            or a table too large to fill in reasonable time.
    """
    fn = "memento.plan_chain"
    if isinstance(forward_costs, (str, bytes)) or not hasattr(forward_costs, "__len__"):
        raise TypeError(f"{fn}: forward_costs must be a sequence of ints, got {forward_costs!r}")
    n = len(forward_costs)
    if n < 1:
        raise ValueError(f"{fn}: forward_costs is empty; pass one cost per step (n >= 1)")
    u = _sizes(fn, "forward_costs", forward_costs, n, 1)
    s = _sizes(fn, "hidden_sizes", hidden_sizes, n + 1, 1)
    i = _sizes(fn, "internal_sizes", internal_sizes, n, 1)
    for p in range(n):
        if i[p] <= s[p]:
            raise ValueError(
                f"{fn}: internal_sizes[{p}]={i[p]} must exceed hidden_sizes[{p}]={s[p]}: an "
                "internal state includes its input state (and its output state)"
            )
    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral):
        raise TypeError(f"{fn}: memory must be an int, got {memory!r} ({type(memory).__name__})")
    memory = int(memory)
    if memory < s[0]:
        raise ValueError(
            f"{fn}: memory={memory} is below the minimum, the size of h_0 "
            f"(hidden_sizes[0]={s[0]}); pass memory >= {s[0]}"
        )
    # More than keeping every state cannot help: cap the budget to keep the table small.
    budget = min(memory - s[0], sum(i) + sum(s))
    cells = n * n * (budget + 1) // 2
    if cells > _MAX_CELLS:
        raise ValueError(
            f"{fn}: {n} steps with a budget of {budget + 1} units is a table of {cells} "
            f"entries, minutes of work; express sizes in coarser units (so that "
            f"n^2 * memory / 2 <= {_MAX_CELLS})"
        )
    # HSM's choices only: internal states priced above any budget are never pushed
    # (eq. 7/10 become infeasible), while the schedule keeps the true sizes.
    tables = _tables(u, s, i if internal else tuple(budget + h + 1 for h in s[:n]), budget)
    cost = int(tables[0][0, n, budget])
    return Schedule(
        num_steps=n,
        memory=memory,
        policy="chain",
        cost=cost,
        actions=_emit_chain(n, budget, tables),
        counts_initial=True,
        hidden_sizes=s,
        internal_sizes=i,
        forward_costs=u,
    )


# Quantisation of measured chains (`plan_chain_bytes`). The most expensive layer costs
# this many units: finer than any measured difference that matters.
_COST_RESOLUTION = 1000
# The budget in size units, at most: the table has n^2 (E + 1) / 2 entries, about a
# second at 4e6. Fewer units for long chains, never fewer than 16.
_SIZE_RESOLUTION = 1000
_MAX_TABLE = 4_000_000


def plan_chain_bytes(
    costs: Sequence[float],
    hidden_bytes: Sequence[int],
    internal_bytes: Sequence[int],
    memory_bytes: int,
    *,
    internal: bool = True,
    name: str = "memento.planning.internals.plan_chain_bytes",
) -> tuple[Schedule, int]:
    """`plan_chain` for a measured chain: real-valued costs, sizes and budget in bytes.

    What the executors of chains (`memento.chain`, `memento.torch.checkpoint_sequential`)
    plan with. Costs are quantised to integers with the most expensive step at 1000
    units; sizes into units of ``unit_bytes`` (rounded up, the budget rounded down, so the
    plan never exceeds the budget in bytes), the budget at most about 1000 units (fewer
    for long chains) so that the table stays small. A budget above what storing every
    state takes is capped there.

    Args:
        costs: n > 0 measured costs (flops, seconds), one per step.
        hidden_bytes: n + 1 byte sizes of ``h_0 .. h_n``.
        internal_bytes: n byte sizes of each step's internal state, its input and output
            included (as `plan_chain`'s ``internal_sizes``).
        memory_bytes: the budget in bytes, ``h_0`` included.
        internal: as `plan_chain`.
        name: the public function named in error messages.

    Returns:
        ``(schedule, unit_bytes)``: the plan, its sizes in units of ``unit_bytes``.

    Raises:
        ValueError: a budget below the size of ``h_0`` (the message names the minimum).
    """
    n = len(costs)
    hidden = [int(h) for h in hidden_bytes]
    if memory_bytes < hidden[0]:
        raise ValueError(
            f"{name}: a budget of {memory_bytes} bytes cannot hold the input x_0 ({hidden[0]} "
            f"bytes); the minimum is {hidden[0]} bytes (recompute every layer from x_0), "
            "or memory=1 (one slot)."
        )
    useful = min(memory_bytes, sum(hidden[:-1]) + sum(int(i) for i in internal_bytes))
    resolution = max(16, min(_SIZE_RESOLUTION, 2 * _MAX_TABLE // (n * n)))
    unit = max(1, math.ceil(useful / resolution))
    s = [max(1, math.ceil(h / unit)) for h in hidden]
    i = [max(math.ceil(a / unit), s[p] + 1) for p, a in enumerate(internal_bytes)]
    memory = max(min(memory_bytes, useful + unit) // unit, s[0])
    top = max(max(float(c) for c in costs), 1e-300)
    u = [max(1, round(_COST_RESOLUTION * float(c) / top)) for c in costs]
    return plan_chain(u, s, i, memory, internal=internal), unit
