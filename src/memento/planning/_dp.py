"""Optimal checkpointing plans: BPTT-HSM, BPTT-ISM and BPTT-MSM (Gruslys et al. 2016).

Notation (paper -> code): t = ``num_steps``, m = ``memory`` in slots of one hidden state
(ISM: in internal-state slots), C(t, m) = forward evaluations of an optimal policy, D(t, m)
= the position y of the first push, H(t, m) = what is pushed (hidden or internal state).

Every policy is a binary recursion on a *subproblem* ``(b, t, m)``: back-propagate the t
steps ``b .. b+t-1`` starting with the working state at ``h_b``, where ``h_b`` is held
(as ``h_0``, in a hidden slot, or as the output of the internal slot of step ``b-1``) and
``m`` counts the base's slot plus the slots the subproblem may add (HSM, MSM; ISM counts
internal slots only, the base being free). The plan is that recursion unrolled with an
explicit stack (t may be 10^5: no Python recursion) into rows of ``_schedule.py``.

Speed: HSM and ISM (and MSM with alpha = 1, which is ISM's recursion) have closed forms
for C and for an optimal split (``_closed.py``), so planning costs O(number of split
nodes) plus vectorised leaves. MSM with alpha >= 2 has neither: C(., m) is not convex in t
and the set of optimal y is not an interval (checked against the oracle). Its exact table
is filled column by column in O(t) vectorised work per column and certified against a
convex lower bound (``_msm.py``). Optimality is
within the paper's model, where a stored state is kept until its steps are
back-propagated; a schedule that frees a state early (reload h_y, free it, keep an
internal state in its room) can be cheaper for MSM, and the simulator accepts it
(tests/planning/test_brute.py).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Literal

import numpy as np

from ._auto import Policy, auto_uses_msm, check_policy, plan_auto
from ._budget import Percent, parse_memory
from ._closed import hsm_cost, hsm_split, ism_column, ism_cost, ism_split
from ._host import check_host, plan_two_level
from ._msm import _BIG, _HIDDEN, _INTERNAL, msm_estimate_s, msm_tables
from ._schedule import (
    _ADV,
    _BACK_I,
    _FREE_H,
    _FREE_I,
    _FUSED,
    _LOAD_H,
    _LOAD_I,
    _SAVE_H,
    _SAVE_I,
    Schedule,
    count_peak,
)

__all__ = ["cost_table", "plan", "plan_estimate"]

_MSM_BUDGET_S = 120.0  # refuse work (MSM tables, rows, cost tables) estimated longer
_MSM_BUDGET_BYTES = 4 * 2**30  # or larger than this (MSM tables: C, H, D, 13 B per cell)

# Unrolling, calibrated with benchmarks/long.py (t = 10^6 .. 5 * 10^6, m = 10 .. 1000): at
# most 5 rows per step, int32 rows of 12 B, about 36 B per row at the peak (the leaves'
# blocks and their concatenation); time per step grows for small m (more splits).
_ROWS_PER_STEP = 5
_PEAK_BYTES_PER_ROW = 40
_S_PER_STEP = 1.2e-6
# cost_table: float64 cells, and a closed-form column per m (about 5 ns per cell).
_S_PER_CELL = 5e-9

Progress = Callable[[float], None]


# --------------------------------------------------------------------------- validation


def _int(fn: str, name: str, value, hint: str) -> int:
    # bool is an int subclass; True steps or True slots are almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{fn}: {name} must be an int, got {value!r} ({type(value).__name__}); {hint}"
        )
    return int(value)


def _check(fn: str, num_steps, memory, policy, alpha, beta) -> tuple[int, int, Policy, int, int]:
    """Validates `plan`'s / `cost_table`'s arguments once; returns (t, m, policy, a, b)."""
    policy = check_policy(fn, policy)
    t = _int(fn, "num_steps", num_steps, "pass the number of loop steps, e.g. 1000")
    m = _int(
        fn,
        "memory",
        memory,
        "pass the budget in slots of one hidden state, e.g. 10, or a percentage such as "
        "'5%' (plan counts slots: for bytes, divide by the carry's size)",
    )
    if t < 1:
        raise ValueError(f"{fn}: num_steps must be >= 1, got {t}")
    if m < 1:
        raise ValueError(f"{fn}: memory must be >= 1 slot, got {m}")
    if policy == "hsm":
        if alpha is not None or beta is not None:
            raise ValueError(
                f"{fn}: alpha/beta (got alpha={alpha!r}, beta={beta!r}) apply to "
                "policy='ism' or 'msm'; HSM stores hidden states only, drop them or pass "
                "policy='msm'"
            )
        return t, m, policy, 1, 1
    if policy in ("ism", "auto"):  # alpha defaults to 1, beta is alpha
        if beta is not None:
            why = (
                " (ISM never stores an internal state next to its input)"
                if policy == "ism"
                else "; 'auto' plans MSM with beta = alpha, as memento.scan does"
            )
            raise ValueError(
                f"{fn}: beta={beta!r} applies to policy='msm' only{why}; drop beta or pass "
                "policy='msm'"
            )
        a = 1 if alpha is None else _int(fn, "alpha", alpha, "pass slots per internal state")
        if a < 1:
            raise ValueError(f"{fn}: alpha must be >= 1, got {a}")
        if policy == "ism" and m < a:
            raise ValueError(
                f"{fn}: memory={m} is below policy='ism''s minimum of one internal state "
                f"(alpha={a} slots); pass memory >= {a}"
            )
        return t, m, policy, a, a
    if alpha is None:
        raise ValueError(
            f"{fn}: policy='msm' needs alpha, the slots one internal state takes "
            "(an integer >= 1, e.g. alpha=5)"
        )
    a = _int(fn, "alpha", alpha, "pass the slots one internal state takes, e.g. 5")
    if a < 1:
        raise ValueError(f"{fn}: alpha must be >= 1, got {a}")
    b = a if beta is None else _int(fn, "beta", beta, "pass an integer 1 <= beta <= alpha")
    if b < 1 or b > a:
        raise ValueError(
            f"{fn}: beta must satisfy 1 <= beta <= alpha={a}, got {b}; beta is the size of "
            "an internal state whose input is already held"
        )
    return t, m, policy, a, b


# --------------------------------------------------------------------------- MSM tables


def _msm_check(fn: str, what: str, t: int, m: int, alpha: int, beta: int, hint: str) -> None:
    """Refuses exact MSM tables estimated to take more than two minutes or 4 GiB."""
    seconds = msm_estimate_s(t, m, alpha, beta)
    nbytes = 13 * (t + 1) * (m + 1 + alpha)
    _refuse_if_too_large(fn, f"the exact MSM table for {what} (O(t m))", seconds, nbytes, hint)


def plan_estimate(
    num_steps: int,
    memory: int,
    *,
    policy: Policy = "auto",
    alpha: int | None = None,
    beta: int | None = None,
) -> tuple[float, int]:
    """Seconds and peak bytes `plan` is expected to take for these arguments.

    A model fitted with `benchmarks/long.py`: about 1.2 us and 200 B per step to unroll
    the rows, plus the exact table's time and
    13 B per cell for MSM with alpha >= 2 (`msm_estimate_s`). `plan` refuses, before
    doing any work, what is estimated above two minutes or 4 GiB. ``policy="auto"``
    counts the rows of two plans and MSM's table when it plans MSM.

    Returns:
        ``(seconds, bytes)``.
    """
    t, m, policy, alpha, beta = _check(
        "memento.planning.plan_estimate", num_steps, memory, policy, alpha, beta
    )
    return _estimate(t, m, policy, alpha, beta)


def _estimate(t: int, m: int, policy: str, alpha: int, beta: int) -> tuple[float, int]:
    seconds = _S_PER_STEP * t
    nbytes = _PEAK_BYTES_PER_ROW * _ROWS_PER_STEP * t
    if policy == "auto" and auto_uses_msm(t, m, alpha):  # HSM or ISM, then MSM
        seconds *= 2
        policy = "msm"
    if policy == "msm" and alpha > 1:
        m_eff = min(m, 1 + (t - 1) * alpha)
        seconds += msm_estimate_s(t, m_eff, alpha, beta)
        nbytes = max(nbytes, 13 * (t + 1) * (m_eff + 1 + alpha))
    return seconds, nbytes


def _refuse_if_too_large(fn: str, what: str, seconds: float, nbytes: int, hint: str) -> None:
    if seconds > _MSM_BUDGET_S or nbytes > _MSM_BUDGET_BYTES:
        took = f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
        raise ValueError(
            f"{fn}: {what} would take about {took} and "
            f"{nbytes / 2**30:.1f} GiB (the limits are {_MSM_BUDGET_S / 60:.0f} min and "
            f"{_MSM_BUDGET_BYTES / 2**30:.0f} GiB); {hint}"
        )


# --------------------------------------------------------------------------- emission


_BASE = -2  # placeholder op/arg in leaf templates: "load the subproblem's base"


def _leaf_template(kind: str, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_build_leaf`, cached for the short leaves that recur (long ones are built once)."""
    return _cached_leaf(kind, t) if t <= 1024 else _build_leaf(kind, t)


def _build_leaf(kind: str, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of a regular leaf relative to base position 0 and slot 0, built vectorised.

    Returns ``(rows, slot_rows, base_rows)``: the ``(n, 3)`` rows, a mask of rows whose arg
    is a slot of the leaf (offset by the slots in use), a mask of rows that load the base.
    Leaves are where the recursion is regular (a few thousand of them in a 10^5-step plan
    carry most of the rows), so they are emitted as arrays, not row by row.
    """
    if kind == "quadratic":  # C(t, 1) = t(t+1)/2: recompute from the base for each step
        p = np.arange(t - 2, 0, -1, dtype=np.int32)
        mid = np.zeros((len(p), 3, 3), dtype=np.int32)
        mid[:, 0] = (_BASE, _BASE, 0)
        mid[:, 1, 0], mid[:, 1, 1] = _ADV, p
        mid[:, 2, 0], mid[:, 2, 2] = _FUSED, p
        rows = np.concatenate(
            [
                [(_ADV, t - 1, 0), (_FUSED, 0, t - 1)],
                mid.reshape(-1, 3),
                [(_BASE, _BASE, 0), (_FUSED, 0, 0)],
            ]
        ).astype(np.int32)
        slot = np.zeros(len(rows), dtype=bool)
    elif kind == "hidden_chain":  # C = 2t - 1: keep h_1 .. h_{t-2}, fuse the last step
        k = np.arange(1, t - 1, dtype=np.int32)
        fwd = np.zeros((len(k), 2, 3), dtype=np.int32)
        fwd[:, 0, 0], fwd[:, 0, 1], fwd[:, 0, 2] = _ADV, 1, k - 1
        fwd[:, 1, 0], fwd[:, 1, 1], fwd[:, 1, 2] = _SAVE_H, k - 1, k
        kr = k[::-1]
        back = np.zeros((len(k), 3, 3), dtype=np.int32)
        back[:, 0, 0], back[:, 0, 1], back[:, 0, 2] = _LOAD_H, kr - 1, kr
        back[:, 1, 0], back[:, 1, 2] = _FUSED, kr
        back[:, 2, 0], back[:, 2, 1], back[:, 2, 2] = _FREE_H, kr - 1, kr
        rows = np.concatenate(
            [
                fwd.reshape(-1, 3),
                [(_ADV, 1, t - 2), (_FUSED, 0, t - 1)],
                back.reshape(-1, 3),
                [(_BASE, _BASE, 0), (_FUSED, 0, 0)],
            ]
        ).astype(np.int32)
        slot = np.isin(rows[:, 0], (_SAVE_H, _LOAD_H, _FREE_H))
    else:  # "internal_chain", C = t: keep every step's internal state, then unwind
        k = np.arange(t, dtype=np.int32)
        kr = k[::-1]
        back = np.zeros((t, 2, 3), dtype=np.int32)
        back[:, 0, 0], back[:, 1, 0] = _BACK_I, _FREE_I
        back[:, :, 1] = back[:, :, 2] = kr[:, None]
        rows = np.concatenate([np.stack([np.full(t, _SAVE_I), k, k], 1), back.reshape(-1, 3)])
        rows = rows.astype(np.int32)
        slot = np.ones(len(rows), dtype=bool)
    base = rows[:, 0] == _BASE
    for a in (rows, slot, base):
        a.setflags(write=False)
    return rows, slot, base


_cached_leaf = functools.lru_cache(maxsize=2048)(_build_leaf)


def _leaf_rows(kind: str, t: int, b: int, slot0: int, base_op: int, base_arg: int) -> np.ndarray:
    """One leaf's rows at position ``b``, its slots from ``slot0``, its base loaded by
    ``(base_op, base_arg)``: `_assemble`'s placement of one leaf (for the chain planner)."""
    rows, slot, base = _leaf_template(kind, t)
    rows = rows.copy()
    rows[:, 2] += b
    rows[slot, 1] += slot0
    rows[base, 0] = base_op
    rows[base, 1] = base_arg
    return rows


def _emit(
    num_steps: int,
    memory: int,
    policy: str,
    alpha: int,
    beta: int,
    tables,
    progress: Progress | None = None,
) -> np.ndarray:
    """Unrolls the policy's recursion into schedule rows, depth first, with a stack.

    Stack entries are nodes ``(b, t, m, hd, idp, base_op, base_arg)`` (hd / idp: hidden /
    internal slots in use, which are also the next free slot numbers since slots are used
    as stacks, exactly as the paper's Algorithm 2 pushes and pops) or ``(None, rows)`` for
    rows to emit once the right part is done. Split nodes write a few rows to a Python
    list; regular leaves (`_leaf_template`) are written as NumPy blocks.
    """
    out: list[int] = []
    ext = out.extend
    stack: list[tuple] = [(0, num_steps, memory, 0, 0, _LOAD_H, -1)]
    pop, push = stack.pop, stack.append
    hsm, ism = policy == "hsm", policy == "ism"
    if tables is not None:
        kind_t, split_t = tables

    # Leaves are only recorded here (where they go, what they hold) and written at the end,
    # one vectorised block per (kind, length).
    leaves: list[tuple] = []

    def leaf(kind: str, t: int, b: int, slot0: int, bop: int, barg: int) -> None:
        leaves.append((kind, t, len(out) // 3, b, slot0, bop, barg))

    # Depth first, right part first: when node (b, t) is popped, every step from b + t on
    # has its rows, so 1 - (b + t) / num_steps is the fraction done.
    ticks = 0
    while stack:
        node = pop()
        b = node[0]
        if b is None:
            ext(node[1])
            continue
        _, t, m, hd, idp, bop, barg = node  # b is None for rows, see the docstring
        ticks += 1
        if progress is not None and ticks % 4096 == 0:
            progress(1.0 - (b + t) / num_steps)
        if ism:
            if t <= m:
                if t == 1:
                    ext((_SAVE_I, idp, b, _BACK_I, idp, b, _FREE_I, idp, b))
                else:
                    leaf("internal_chain", t, b, idp, bop, barg)
                continue
            kind = _INTERNAL
            y = t if m == 1 else 1 + ism_split(t - 1, m, True)
            mr = m - 1
        else:
            if t == 1:
                ext((_FUSED, 0, b))
                continue
            if m == 1:
                leaf("quadratic", t, b, 0, bop, barg)
                continue
            if hsm:
                if t <= m + 1:
                    leaf("hidden_chain", t, b, hd, bop, barg)
                    continue
                kind, y = _HIDDEN, hsm_split(t, m)
            elif tables is None:  # MSM with alpha = beta = 1 is ISM's recursion (see plan)
                kind, y = _INTERNAL, 1 + ism_split(t - 1, m, True)
            else:
                kind, y = int(kind_t[t, m]), int(split_t[t, m])
            mr = m - 1 if kind == _HIDDEN else m - (beta if y == 1 else alpha)
        _split(ext, push, node, y, kind == _HIDDEN, mr)
    return _assemble(np.array(out, dtype=np.int32).reshape(-1, 3), leaves)


def _split(ext: Callable, push: Callable, node: tuple, y: int, hidden: bool, m_right: int):
    """Emits the rows of a push at ``y`` and pushes its parts on the stack (right first).

    Shared by `_emit` and the chain planner's emitter. ``node = (b, t, m, hd, idp, base_op,
    base_arg)`` as in `_emit`; ``m_right`` is what the right part may use (``m`` less the
    pushed state), in the caller's units; the left part keeps ``m``.
    """
    b, t, m, hd, idp, bop, barg = node
    if hidden:
        # Q1 (eq. 1/6): advance y, push h_{b+y}, right part with m-1, pop, left part.
        p = b + y
        ext((_ADV, y, b, _SAVE_H, hd, p))
        push((b, y, m, hd, idp, bop, barg))
        push((None, (_FREE_H, hd, p, bop, barg, b)))
        push((p, t - y, m_right, hd + 1, idp, _LOAD_H, hd))
        return
    # Q2 (eq. 4/7/10): advance y-1, keep step b+y-1's internal state (it holds h_{b+y}),
    # right part, back-propagate that step from the slot, left part.
    p = b + y - 1
    if y > 1:
        ext((_ADV, y - 1, b))
    ext((_SAVE_I, idp, p))
    if y > 1:
        push((b, y - 1, m, hd, idp, bop, barg))
        push((None, (_BACK_I, idp, p, _FREE_I, idp, p, bop, barg, b)))
    else:
        push((None, (_BACK_I, idp, p, _FREE_I, idp, p)))
    if t > y:
        push((p + 1, t - y, m_right, hd, idp + 1, _LOAD_I, idp))


def _peak(rows: np.ndarray, policy: str, alpha: int, beta: int, counts_initial: bool) -> int:
    """The plan's peak memory. HSM and ISM plans number their slots by stack depth
    (`_emit`), so the peak is the deepest save's; MSM plans are counted (`count_peak`).
    The planner's tests check both against the replay."""
    if policy == "msm":
        return count_peak(rows, alpha, beta, counts_initial)
    op = _SAVE_H if policy == "hsm" else _SAVE_I
    size = 1 if policy == "hsm" else alpha
    deepest = int(rows[rows[:, 0] == op, 1].max(initial=-1))
    return int(counts_initial) + size * (deepest + 1)


def _assemble(small: np.ndarray, leaves: list[tuple]) -> np.ndarray:
    """Interleaves the split nodes' rows with the leaves' blocks, in depth-first order.

    ``leaves[i] = (kind, t, k, b, slot0, base_op, base_arg)`` goes right after the first
    ``k`` rows of ``small``.
    """
    if not leaves:
        return small
    groups: dict[tuple[str, int], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(leaf[:2], []).append(i)
    _, _, before, bs, slots, bops, bargs = (np.asarray(a) for a in zip(*leaves, strict=True))
    templates = {key: _leaf_template(*key) for key in groups}
    lengths = np.zeros(len(leaves), np.int64)
    for key, idx in groups.items():
        lengths[idx] = len(templates[key][0])
    # Where everything goes: leaf i starts after its ``before`` small rows and the leaves
    # before it; small row r after r small rows and the leaves placed before it.
    done = np.concatenate([[0], np.cumsum(lengths)])
    starts = before + done[:-1]
    out = np.empty((len(small) + int(done[-1]), 3), small.dtype)
    r = np.arange(len(small))
    out[r + done[np.searchsorted(before, r, side="right")]] = small
    for key, idx in groups.items():
        tmpl, slot, base = templates[key]
        idx = np.asarray(idx)
        block = np.broadcast_to(tmpl, (len(idx), *tmpl.shape)).copy()
        block[:, :, 2] += bs[idx, None]
        block[:, slot, 1] += slots[idx, None]
        block[:, base, 0] = bops[idx, None]
        block[:, base, 1] = bargs[idx, None]
        out[starts[idx, None] + np.arange(len(tmpl))] = block
    return out


# --------------------------------------------------------------------------- public API


def _slots_of_percent(fn: str, num_steps, memory, alpha):
    """``memory`` as given, or the slots of a percentage such as ``"5%"``: that share of
    ``num_steps * alpha`` (every internal state; ``num_steps`` without alpha)."""
    if not (isinstance(memory, str) and "%" in memory):
        return memory  # `_check` refuses anything but an int
    budget = parse_memory(memory, name=fn)
    assert isinstance(budget, Percent)
    t = _int(fn, "num_steps", num_steps, "pass the number of loop steps, e.g. 1000")
    a = 1 if alpha is None else _int(fn, "alpha", alpha, "pass slots per internal state")
    return budget.share(max(t, 0) * max(a, 1), name=fn, what="every step's internal state")


def plan(
    num_steps: int,
    memory: int | str,
    *,
    policy: Policy = "auto",
    alpha: int | None = None,
    beta: int | None = None,
    progress: Progress | None = None,
    host_memory: int | float | None = None,
    transfer_cost: float | tuple[float, float] | None = None,
    overlap: Literal["step", "none"] = "step",
) -> Schedule:
    """Plans an optimal checkpointing schedule for ``num_steps`` loop steps in ``memory`` slots.

    The plan minimises C, the number of forward evaluations of the loop body (first sweep
    included), under the memory budget, by the dynamic programs of Gruslys et al. (2016).
    Pick ``"hsm"`` when only the carry is cheap to keep, ``"msm"`` when the step's
    residuals are at most ``alpha`` times the carry (it is never worse than HSM), and
    ``"ism"`` to reproduce the paper's internal-state model. ``"auto"``, the default, is
    what `memento.scan` runs: of the three, the plan with the least predicted work
    (forward evaluations plus a small charge per internal state stored,
    `predicted_work`); give the ``alpha`` that `memento.scan` measures (slots per internal
    state) to get its plan.

    Args:
        num_steps: t, the number of steps (>= 1).
        memory: m, the budget in slots of one hidden state (the paper's m). For ``"hsm"``
            and ``"msm"`` it includes ``h_0``; for ``"ism"`` it counts ``memory // alpha``
            internal-state slots and ``h_0`` is free, as in the paper's section 3.2. A
            percentage such as ``"5%"``: ``floor(0.05 * num_steps * alpha)`` slots
            (alpha 1 when not given), a share of storing every internal state.
        policy: ``"auto"`` (the default, as `memento.scan`, below), ``"hsm"`` (section 3.1: hidden states only, C(t,m) = 2t-1 for m >= t-1),
            ``"ism"`` (section 3.2: internal states only, C(t,m) = t for m >= t) or
            ``"msm"`` (sections 3.3-3.4: either, per push), or ``"auto"``: the HSM, ISM
            or MSM (with ``beta = alpha``) plan of least `predicted_work`; MSM only
            with ``alpha >= 2`` and when its table takes about a second at most. The
            returned schedule's ``policy`` says which.
        alpha: slots one internal state takes; required for ``"msm"``, default 1 for
            ``"ism"`` and ``"auto"``, not accepted for ``"hsm"``.
        beta: slots an internal state takes when its input state is already held
            (section 3.4); ``"msm"`` only, ``1 <= beta <= alpha``, default ``alpha``.
        progress: called now and then with the fraction of the work done (0 to 1), for
            plans that take seconds (`plan_estimate` predicts how long); the CLI prints
            it to stderr. The library itself never prints.
        host_memory: a second storage level (host memory beside the accelerator), in
            slots of one hidden state; ``math.inf`` for unbounded. ``None`` or 0: the
            one-level plan, unchanged. ``"hsm"`` and ``"msm"`` only; hidden and (MSM)
            internal states may each go to the device or the host. See "Two levels".
        transfer_cost: required with ``host_memory``: the time to copy one slot to the
            host and back, in forward-step units (a number), or ``(write, read)``.
        overlap: how transfers meet compute (see "Two levels"): ``"step"`` (default),
            ``"none"``.

    Two levels:
        With ``host_memory``, a state may be kept on the device (``memory``) or copied to
        the host (``host_memory``), and the plan minimises forward evaluations plus the
        time transfers stall the computation. A hidden state takes 1 slot on either
        level, an internal state ``alpha`` (``beta`` on the device when its input is held
        there). Copying k slots to the host takes ``k * write``, back ``k * read``. With
        ``overlap="step"`` each copy runs beside one unit of compute: a store beside the
        step evaluated right after it, a load prefetched during the backward step right
        before it (assumed to take at least a forward step), so a copy adds
        ``max(0, k * write - 1)`` or ``max(0, k * read - 1)``: per step, the maximum of
        compute and transfer. With ``overlap="none"`` copies add ``k * write`` and
        ``k * read`` in full (H-Revolve's and disk-revolve's model). The plan is exact
        under this model (a dynamic program over device slots, host slots and where the
        current subproblem's base lies; the recursion is in
        ``memento/planning/_host.py``), in O(t^2 memory host_memory) time, so it is meant
        for thousands of steps (``math.inf`` host memory is the fastest). The schedule has
        host rows (``Op.HOST_*``), which ``memento.scan(..., host_memory=)`` runs.

    Returns:
        A `Schedule` whose ``cost`` is the paper's C(t, m) (an exact int) and whose replay
        (`Schedule.simulate`) counts exactly ``cost`` forward evaluations within ``memory``.
        With a host level, ``cost`` is forward evaluations plus transfer time (a float),
        the replay's ``SimulationResult.cost``, within both budgets.

    Raises:
        TypeError: a size that is not an int (bools included) or, for memory, a percentage.
        ValueError: a size below 1, an unknown policy, alpha/beta where they do not apply
            or out of range, a budget below the policy's minimum, or a problem too large to
            plan in reasonable time (the message gives the estimate).

    Examples:
        >>> import memento
        >>> s = memento.plan(10, 4, policy="hsm")
        >>> s.cost, s.simulate().forward_evaluations
        (24, 24)
        >>> memento.plan(10, 4).policy  # "auto" with alpha=1: internal states are cheap
        'ism'
        >>> memento.plan(1000, 50, policy="ism").cost_per_step
        1.95
        >>> memento.plan(1000, 50, policy="auto", alpha=3).policy
        'msm'

    Notes:
        Planning time: HSM and ISM use closed forms, and so does MSM with alpha = 1; MSM
        with alpha >= 2 fills an exact table in O(t m) vectorised work per budget. Sizes
        estimated to take more than two minutes or 4 GiB are refused up front
        (`plan_estimate`).

    References:
        A. Gruslys, R. Munos, I. Danihelka, M. Lanctot, A. Graves. Memory-Efficient
        Backpropagation Through Time. NeurIPS 2016, eq. (1)-(10).
    """
    fn = "memento.plan"
    memory = _slots_of_percent(fn, num_steps, memory, alpha)
    t, m, policy, alpha, beta = _check(fn, num_steps, memory, policy, alpha, beta)
    if policy == "auto" and host_memory:
        # Two-level plans are HSM or MSM: auto is MSM (never worse) when an internal
        # state takes two slots or more, HSM otherwise.
        policy = "msm" if (alpha or 1) >= 2 else "hsm"
        alpha = alpha or 1
        beta = (beta or alpha) if policy == "msm" else beta
    host, cost_pair, overlap = check_host(fn, policy, host_memory, transfer_cost, overlap)
    if host:  # 0 and None: the one-level plan below, unchanged
        schedule = plan_two_level(fn, t, m, policy, alpha, beta, host, cost_pair, overlap)
        if progress is not None:
            progress(1.0)
        return schedule
    if policy == "auto":

        def exact(p: str, a: int | None) -> Schedule:
            # Progress is shown for the HSM or ISM rows; MSM, when planned, is quick.
            shown = progress if p != "msm" else None
            return plan(t, m, policy=p, alpha=a, progress=shown)  # pyright: ignore[reportArgumentType]

        return plan_auto(t, m, alpha, exact)
    seconds, nbytes = _estimate(t, m, policy, alpha, beta)
    if policy != "msm" or alpha == 1:  # MSM's tables are checked below, with a hint
        _refuse_if_too_large(
            fn,
            f"unrolling num_steps={t} into about {_ROWS_PER_STEP * t} schedule rows",
            seconds,
            nbytes,
            "plan fewer steps, e.g. by checkpointing chunks of the loop",
        )
    tables = None
    m_plan = m // alpha if policy == "ism" else m  # the paper's m for the recursion
    if policy == "hsm":
        cost = hsm_cost(t, m)
    elif policy == "ism":
        cost = ism_cost(t, m // alpha)
    elif alpha == 1:
        # alpha = 1 (so beta = 1): Q2 at y equals Q1 at y-1 plus 1 - (C(t-y+1, m-1) -
        # C(t-y, m-1)) <= Q1, so MSM is ISM's recursion (eq. 4) on m slots; its C is
        # C_ism(t, m) (the fused last step frees the slot ISM spends on step t-1).
        cost = ism_cost(t, m)
    else:
        m_eff = min(m, 1 + (t - 1) * alpha)  # more slots than that cannot be used
        what = f"num_steps={t}, memory={m_eff}, alpha={alpha}, beta={beta}"
        hint = f"use policy='hsm' (closed form, cost {hsm_cost(t, m)} here) or plan fewer steps"
        _msm_check(fn, what, t, m_eff, alpha, beta, hint)
        c, kind, split = msm_tables(
            t,
            m_eff,
            alpha,
            beta,
            progress=None if progress is None else (lambda f: progress(0.9 * f)),
        )
        cost = int(c[t, m_eff])
        tables = (kind, split)
        m_plan = m_eff
    emit_progress = progress
    if progress is not None and tables is not None:
        emit_progress = lambda f: progress(0.9 + 0.1 * f)  # noqa: E731
    rows = _emit(t, m_plan, policy, alpha, beta, tables, emit_progress)
    if progress is not None:
        progress(1.0)
    counts_initial = policy != "ism"
    return Schedule(
        num_steps=t,
        memory=m,
        policy=policy,
        cost=cost,
        actions=rows,
        alpha=alpha,
        beta=beta,
        counts_initial=counts_initial,
        planned_peak=_peak(rows, policy, alpha, beta, counts_initial),
    )


def cost_table(
    max_steps: int,
    max_memory: int,
    *,
    policy: Policy = "hsm",
    alpha: int | None = None,
    beta: int | None = None,
) -> np.ndarray:
    """C(t, m) for every ``t <= max_steps`` and ``m <= max_memory``, for plotting curves.

    Args:
        max_steps, max_memory, policy, alpha, beta: as `plan`'s ``num_steps``, ``memory``,
            ``policy``, ``alpha``, ``beta``; ``memory`` units are `plan`'s.

    Returns:
        A float64 array of shape ``(max_steps + 1, max_memory + 1)`` whose entry ``[t, m]``
        is C(t, m) (exact below 2**53), ``np.inf`` where no schedule fits, row 0 zeros.

    Raises:
        ValueError: as `plan`'s, ``policy="auto"`` (no single table), and a table estimated to take more than two minutes or
            4 GiB (8 B per entry), refused before any work with the estimate.

    Examples:
        >>> import memento
        >>> memento.cost_table(3, 2)
        array([[ 0.,  0.,  0.],
               [inf,  1.,  1.],
               [inf,  3.,  3.],
               [inf,  6.,  5.]])
    """
    fn = "memento.cost_table"
    t, m, policy, alpha, beta = _check(fn, max_steps, max_memory, policy, alpha, beta)
    if policy == "auto":
        raise ValueError(
            f"{fn}: policy='auto' picks a policy per plan, so it has no single table of "
            "costs; pass policy='hsm', 'ism' or 'msm'"
        )
    cells = (t + 1) * (m + 1)
    _refuse_if_too_large(
        fn,
        f"a table of {t + 1} x {m + 1} costs",
        _S_PER_CELL * cells,
        8 * cells,
        "ask for fewer steps or slots, or use plan(num_steps, memory).cost for single entries",
    )
    out = np.full((t + 1, m + 1), np.inf)
    out[0, :] = 0.0
    if policy == "hsm" or (policy == "msm" and alpha == 1):
        for mm in range(1, m + 1):
            col = ism_column(t, mm)
            if policy == "hsm":  # C_hsm(t, m) = t + C_ism(t-1, m)
                out[1:, mm] = np.arange(1, t + 1) + col[:-1]
            else:
                out[1:, mm] = col[1:]
    elif policy == "ism":
        for mm in range(alpha, m + 1):
            out[1:, mm] = ism_column(t, mm // alpha)[1:]
    else:
        _msm_check(
            fn, f"max_steps={t}, max_memory={m}", t, m, alpha, beta, "ask for fewer steps or slots"
        )
        c = msm_tables(t, m, alpha, beta)[0].astype(np.float64)
        c[c >= _BIG] = np.inf
        out[1:, 1:] = c[1:, 1:]
    return out
