"""Two-level checkpointing: device slots and host slots, transfers against recomputation.

The model (what `memento.plan` optimises with ``host_memory=``). Time is counted in
forward-step units: one evaluation of the body costs 1, as in the one-level planner.

- Two storage levels. The device has ``memory`` slots (the paper's m, ``h_0`` included,
  as for HSM and MSM today); the host has ``host_memory`` slots (``math.inf``: unbounded).
  A hidden state takes 1 slot on either level; an internal state ``alpha`` on the host
  and ``alpha`` on the device (``beta`` there when its input state is held on the device,
  section 3.4 of Gruslys et al.). The working state is free, as in the paper; that
  includes a state being copied back from the host and the residuals of the step being
  back-propagated.
- Transfers. Copying one slot to the host takes ``w`` (``transfer_cost``, or its first
  entry), copying one back ``r`` (its second entry); a state of s slots takes ``s w`` /
  ``s r``. With ``overlap="step"`` (the default) a transfer runs on a copy engine beside
  one unit of compute and only what exceeds it stalls the computation: a store to the
  host overlaps the step evaluated right after it (the step computed from the stored
  state: the state stays readable meanwhile), a load from the host is prefetched during
  the backward step right before it (every load follows one; a backward step is assumed
  to take at least a forward step's time). So a transfer of s slots costs
  ``max(0, s w - 1)`` (store) or ``max(0, s r - 1)`` (load). With ``overlap="none"``
  transfers are added in full (``s w``, ``s r``): the model of H-Revolve and disk-revolve.
  The plan never attaches two transfers to one unit of compute: it never stores a state
  on the host that it back-propagates or reloads next (that pair would find no compute
  between its two copies).
- What moves. A host store copies the working state (a hidden state, or the internal
  state of the step just evaluated); a host load makes a host state the working state
  (a hidden state, or the output state of a host internal state: 1 slot); a backward step
  from a host internal state copies its ``alpha`` slots back. Loading a host state and
  saving it in a device slot (promotion) is a host load and a device save.
- Cost = forward evaluations (first sweep included) + the transfer charges above.

The dynamic program. A subproblem ``(t, d, h, L)``: back-propagate t steps whose first
input state (the base) is the working state on entry and is held on level L (device or
host), with d free device slots and h free host slots besides what is already held.
Reloading the base costs ``rho_L`` (0 on the device, the load charge on the host). With
C_L(0) = 0, C_L(1) = 1 (one fused step) and, for t >= 2, the minimum of:

======= =================================================================================
Q0      ``t + rho_L + C_L(t-1, d, h)``: advance to the last step, fuse it, reload the base
        (no slot: the paper's C(t, 1) = t(t+1)/2 when nothing else is allowed)
Q1      ``y + C_dev(t-y, d-1, h) + rho_L + C_L(y, d, h)``: keep h_y on the device
Q1h     ``y + W_h + C_host(t-y, d, h-1) + rho_L + C_L(y, d, h)``: keep h_y on the host
Q2      ``y + C_dev(t-y, d-s, h) + [y>1] (rho_L + C_L(y-1, d, h))``: keep step y-1's
        internal state on the device, s = beta at y = 1 on a device base, else alpha
Q2h     ``y + W_i + C_host(t-y, d, h-alpha) + R_i + [y>1] (rho_L + C_L(y-1, d, h))``,
        y < t: keep it on the host, copy it back for its backward step
Q3      ``C_dev(t, d-1, h)`` (host base only): keep a device copy of the base too
======= =================================================================================

(1 <= y < t for Q1/Q1h/Q2h, 1 <= y <= t for Q2; MSM only for Q2/Q2h.) The plan is
``C_dev(t, memory - 1, host_memory)``: ``h_0`` is held on the device by the caller. With
no host slots this is the one-level recursion of eq. (1)-(10) (`memento.plan` then runs the
one-level planner itself, unchanged). The tables are filled row by row in t, vectorised
over (y, d, h): O(t^2 d h) work, exact for any costs (float64 sums of the charges).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from ._schedule import (
    _ADV,
    _BACK_I,
    _FREE_H,
    _FREE_I,
    _FUSED,
    _HOST_BACK_I,
    _HOST_FREE_H,
    _HOST_FREE_I,
    _HOST_LOAD_H,
    _HOST_LOAD_I,
    _HOST_SAVE_H,
    _HOST_SAVE_I,
    _LOAD_H,
    _LOAD_I,
    _SAVE_H,
    _SAVE_I,
    Schedule,
    charges_of,
    transfer_charges,
    transfer_time,
)

__all__ = ["TransferCharges", "check_host", "emit_two_level", "host_tables", "plan_two_level"]

# Choices, in the order ties are broken (the first wins).
Q1, Q2, Q0, Q1H, Q2H, Q3 = range(6)
_DEV, _HOST = 0, 1
# Calibrated on CPU: seconds per t^2 (d + 1) (h + 1) for HSM; MSM's two more options
# about double it.
_S_PER_CELL = 1.3e-8


@dataclasses.dataclass(frozen=True)
class TransferCharges:
    """What each transfer adds to the cost, in forward-step units (module docstring).

    Attributes:
        store_hidden, load_hidden: a hidden state (1 slot) to / from the host; loading
            the output state of a host internal state costs ``load_hidden`` too.
        store_internal, load_internal: an internal state (``alpha`` slots).
    """

    store_hidden: float
    load_hidden: float
    store_internal: float
    load_internal: float

    @classmethod
    def of(cls, write: float, read: float, alpha: int, overlap: str) -> TransferCharges:
        return cls(*charges_of(write, read, alpha, overlap))


def two_level_estimate_s(t: int, d: int, h: int | None, msm: bool) -> float:
    """Seconds `host_tables` is expected to take (2 shared CPU cores)."""
    cols = (d + 1) * (1 if h is None else h + 1)
    return _S_PER_CELL * (2 if msm else 1) * t * t * cols


def host_tables(
    num_steps: int,
    device_free: int,
    host_free: int | None,
    alpha: int,
    beta: int,
    msm: bool,
    ch: TransferCharges,
):
    """C, choice and y of the two-level recursion for every t <= num_steps.

    Args:
        num_steps: T.
        device_free: D, free device slots (``memory - 1``: h_0 holds one).
        host_free: H, host slots, or ``None`` for unbounded (one host column that reads
            itself: an unbounded host stays unbounded after a push).
        alpha, beta: internal-state sizes; msm: whether Q2/Q2h are allowed.
        ch: the transfer charges.

    Returns:
        ``(C, kind, split)``, each of shape ``(2, T+1, D+1, nh)`` (``nh = H + 1``, or 1 when
        unbounded): float64 costs, int8 choices (``Q0`` .. ``Q3``), int32 ``y``; index 0 of
        the first axis is a device base, 1 a host base.
    """
    T, D = num_steps, device_free
    nh = 1 if host_free is None else host_free + 1
    bounded = host_free is not None
    C = np.full((2, T + 1, D + 1, nh), np.inf)
    kind = np.zeros((2, T + 1, D + 1, nh), np.int8)
    split = np.zeros((2, T + 1, D + 1, nh), np.int32)
    C[:, 0] = 0.0
    if T >= 1:
        C[:, 1] = 1.0
    rho = (0.0, ch.load_hidden)
    wi_ri = 1.0 + ch.store_internal + ch.load_internal

    def take(L, t, best, arg, code, values, y, dk, dh):
        """Writes option ``code`` where it beats the best so far, in the region d >= dk,
        h >= dh (the cells the option is feasible in); ``values``/``y`` cover that region."""
        sl = (slice(dk, None), slice(dh, None))
        cur = best[sl]
        better = values < cur
        cur[better] = values[better]
        arg[0][sl][better] = code
        arg[1][sl][better] = y[better] if np.ndim(y) else y

    def conv(left, right, dk, dh, extra):
        """min over the y axis of left[y, d, h] + right[y, d-dk, h-dh] + extra, for the
        cells d >= dk, h >= dh; returns (values, argmin) or None if no cell qualifies."""
        if dk > D or (bounded and dh >= nh):
            return None
        dh = dh if bounded else 0
        # One preallocated buffer (no page faults per row); extra is added after the min.
        n = len(left)
        s = buf[: n * (D + 1 - dk) * (nh - dh)].reshape(n, D + 1 - dk, nh - dh)
        np.add(left[:, dk:, dh:], right[:, : D + 1 - dk, : nh - dh], out=s)
        i = s.argmin(0)
        v = np.take_along_axis(s, i[None], 0)[0]
        return (v + extra if extra else v), i

    buf = np.empty(max(T - 1, 1) * (D + 1) * nh)
    for t in range(2, T + 1):
        ys = np.arange(1, t, dtype=np.float64)[:, None, None]
        cd, chost = C[0], C[1]
        for L in (_DEV, _HOST):
            cl = C[L]
            best = np.full((D + 1, nh), np.inf)
            arg = (np.zeros((D + 1, nh), np.int8), np.zeros((D + 1, nh), np.int32))
            left = ys + rho[L] + cl[1:t]  # y + rho_L + C_L(y), y = 1..t-1
            r = conv(left, cd[t - 1 : 0 : -1], 1, 0, 0.0)  # Q1
            if r is not None:
                take(L, t, best, arg, Q1, r[0], r[1] + 1, 1, 0)
            if msm:
                s1 = beta if L == _DEV else alpha
                if s1 <= D:  # Q2 at y = 1
                    v = 1.0 + cd[t - 1, : D + 1 - s1]
                    take(L, t, best, arg, Q2, v, 1, s1, 0)
                # Q2 at y = u + 1, u = 1..t-1: left(u) + 1 + C_dev(t-1-u, d-alpha)
                r = conv(left, cd[t - 2 :: -1], alpha, 0, 1.0)
                if r is not None:
                    take(L, t, best, arg, Q2, r[0], r[1] + 2, alpha, 0)
            take(L, t, best, arg, Q0, t + rho[L] + cl[t - 1], t - 1, 0, 0)
            r = conv(left, chost[t - 1 : 0 : -1], 0, 1, ch.store_hidden)  # Q1h
            if r is not None:
                take(L, t, best, arg, Q1H, r[0], r[1] + 1, 0, 1 if bounded else 0)
            if msm and (not bounded or alpha < nh):
                dh = alpha if bounded else 0
                v = wi_ri + chost[t - 1, :, : nh - dh]  # Q2h at y = 1
                take(L, t, best, arg, Q2H, v, 1, 0, dh)
                if t >= 3:  # y = u + 1 < t, u = 1..t-2
                    r = conv(left[: t - 2], chost[t - 2 : 0 : -1], 0, alpha, wi_ri)
                    if r is not None:
                        take(L, t, best, arg, Q2H, r[0], r[1] + 2, 0, dh)
            if L == _HOST and D >= 1:  # Q3: C_dev(t) is complete (L = _DEV ran first)
                take(L, t, best, arg, Q3, cd[t, :D], t, 1, 0)
            C[L, t], kind[L, t], split[L, t] = best, arg[0], arg[1]
    return C, kind, split


def emit_two_level(
    num_steps: int,
    device_free: int,
    host_free: int | None,
    alpha: int,
    beta: int,
    tables,
) -> np.ndarray:
    """Unrolls the two-level recursion into schedule rows, depth first, with a stack.

    Nodes are ``(b, t, d, h, L, base_op, base_arg, hd, idv, hh, ih)``: the subproblem, how
    to reload its base, and the slots in use of each kind (device hidden / internal, host
    hidden / internal), which are also the next free slot numbers (slots are stacks). A
    ``(None, rows)`` entry emits rows once the parts pushed above it are done.
    """
    _, kind_t, split_t = tables
    bounded = host_free is not None
    out: list[int] = []
    ext = out.extend
    stack: list[tuple] = [(0, num_steps, device_free, host_free, _DEV, _LOAD_H, -1, 0, 0, 0, 0)]
    while stack:
        node = stack.pop()
        if node[0] is None:
            ext(node[1])
            continue
        b, t, d, h, L, bop, barg, hd, idv, hh, ih = node
        if t == 1:
            ext((_FUSED, 0, b))
            continue
        hc = h if bounded else 0
        k, y = int(kind_t[L, t, d, hc]), int(split_t[L, t, d, hc])
        reload = (bop, barg, b)
        if k == Q0:
            ext((_ADV, t - 1, b, _FUSED, 0, b + t - 1))
            stack.append((b, t - 1, d, h, L, bop, barg, hd, idv, hh, ih))
            stack.append((None, reload))
        elif k in (Q1, Q1H):
            p = b + y
            stack.append((b, y, d, h, L, bop, barg, hd, idv, hh, ih))
            if k == Q1:
                ext((_ADV, y, b, _SAVE_H, hd, p))
                stack.append((None, (_FREE_H, hd, p, *reload)))
                stack.append((p, t - y, d - 1, h, _DEV, _LOAD_H, hd, hd + 1, idv, hh, ih))
            else:
                ext((_ADV, y, b, _HOST_SAVE_H, hh, p))
                stack.append((None, (_HOST_FREE_H, hh, p, *reload)))
                hr = h - 1 if bounded else None
                stack.append((p, t - y, d, hr, _HOST, _HOST_LOAD_H, hh, hd, idv, hh + 1, ih))
        elif k in (Q2, Q2H):
            p = b + y - 1
            if y > 1:
                ext((_ADV, y - 1, b))
                stack.append((b, y - 1, d, h, L, bop, barg, hd, idv, hh, ih))
            after = reload if y > 1 else ()
            if k == Q2:
                size = beta if (y == 1 and L == _DEV) else alpha
                ext((_SAVE_I, idv, p))
                stack.append((None, (_BACK_I, idv, p, _FREE_I, idv, p, *after)))
                if t > y:
                    right = (p + 1, t - y, d - size, h, _DEV, _LOAD_I, idv)
                    stack.append((*right, hd, idv + 1, hh, ih))
            else:
                ext((_HOST_SAVE_I, ih, p))
                stack.append((None, (_HOST_BACK_I, ih, p, _HOST_FREE_I, ih, p, *after)))
                hr = h - alpha if bounded else None
                right = (p + 1, t - y, d, hr, _HOST, _HOST_LOAD_I, ih)
                stack.append((*right, hd, idv, hh, ih + 1))
        else:  # Q3: a device copy of the base (the working state on entry)
            ext((_SAVE_H, hd, b))
            stack.append((None, (_FREE_H, hd, b)))
            stack.append((b, t, d - 1, h, _DEV, _LOAD_H, hd, hd + 1, idv, hh, ih))
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def unbounded(host_memory, num_steps: int, alpha: int) -> bool:
    """Whether ``host_memory`` slots can hold every state a plan could keep there: at most
    one hidden and one internal state per step (an unbounded table may plan either)."""
    return math.isinf(host_memory) or host_memory >= (alpha + 1) * num_steps


# --------------------------------------------------------------------------- planning

_BUDGET_S = 120.0  # as the one-level planner: refuse work estimated longer, or larger
_BUDGET_BYTES = 4 * 2**30


def check_host(fn: str, policy: str, host_memory, transfer_cost, overlap):
    """Validates the second level's arguments; returns ``(host, (write, read), overlap)``
    with ``host`` an int or ``math.inf``, or ``None`` when there is no second level."""
    if host_memory is None:
        if transfer_cost is not None or overlap != "step":
            raise ValueError(
                f"{fn}: transfer_cost/overlap (got transfer_cost={transfer_cost!r}, "
                f"overlap={overlap!r}) apply to a host level; pass host_memory= too "
                "(slots, or math.inf for unbounded)"
            )
        return None, (0.0, 0.0), overlap
    if isinstance(host_memory, bool) or not isinstance(host_memory, numbers.Real):
        raise TypeError(
            f"{fn}: host_memory must be an int number of host slots or math.inf, got "
            f"{host_memory!r} ({type(host_memory).__name__})"
        )
    if not isinstance(host_memory, numbers.Integral) and host_memory != math.inf:
        raise TypeError(
            f"{fn}: host_memory must be an int number of host slots or math.inf, got "
            f"{host_memory!r}; round it down to whole slots"
        )
    if host_memory < 0:
        raise ValueError(f"{fn}: host_memory must be >= 0 slots, got {host_memory}")
    host = int(host_memory) if isinstance(host_memory, numbers.Integral) else math.inf
    if overlap not in ("step", "none"):
        raise ValueError(
            f"{fn}: overlap must be 'step' (a transfer hides behind one step of compute) "
            f"or 'none' (transfers add in full), got {overlap!r}"
        )
    if transfer_cost is None:
        if host == 0:
            return 0, (0.0, 0.0), overlap
        raise ValueError(
            f"{fn}: host_memory={host_memory} needs transfer_cost, the time to copy one "
            "slot to the host (and back) in forward-step units, e.g. transfer_cost=0.5 "
            "or (write, read) = (0.5, 0.5)"
        )
    pair = transfer_cost if isinstance(transfer_cost, tuple | list) else (transfer_cost,) * 2
    if len(pair) != 2:
        raise ValueError(
            f"{fn}: transfer_cost must be one number or a (write, read) pair, got {transfer_cost!r}"
        )
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(
                f"{fn}: transfer_cost must be numbers of forward-step units, got {transfer_cost!r}"
            )
        if not (math.isfinite(v) and float(v) >= 0):
            raise ValueError(
                f"{fn}: transfer_cost must be finite and >= 0 forward-step units, got "
                f"{transfer_cost!r}"
            )
    if host and policy not in ("hsm", "msm"):
        raise NotImplementedError(
            f"{fn}: host_memory= plans policy='hsm' or 'msm' (hidden and internal states "
            f"on both levels), got policy={policy!r}; pass policy='hsm', or 'msm' with alpha"
        )
    return host, (float(pair[0]), float(pair[1])), overlap


def plan_two_level(
    fn: str,
    t: int,
    m: int,
    policy: str,
    alpha: int,
    beta: int,
    host,
    cost_pair: tuple[float, float],
    overlap: str,
) -> Schedule:
    """`memento.plan` with a host level (arguments validated by the caller)."""
    msm = policy == "msm"
    d = min(m - 1, alpha * t)  # free device slots; more than alpha * t cannot be used
    h = None if unbounded(host, t, alpha) else int(host)
    seconds = two_level_estimate_s(t, d, h, msm)
    nbytes = 2 * 13 * (t + 1) * (d + 1) * (1 if h is None else h + 1)
    if seconds > _BUDGET_S or nbytes > _BUDGET_BYTES:
        took = f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
        raise ValueError(
            f"{fn}: the two-level table for num_steps={t}, memory={m}, host_memory={host} "
            f"(O(t^2 memory host_memory)) would take about {took} and "
            f"{nbytes / 2**30:.1f} GiB (the limits are {_BUDGET_S / 60:.0f} min and "
            f"{_BUDGET_BYTES / 2**30:.0f} GiB); plan fewer steps or fewer slots, or pass "
            "host_memory=math.inf (one host column)"
        )
    ch = TransferCharges.of(*cost_pair, alpha, overlap)
    tables = host_tables(t, d, h, alpha, beta, msm, ch)
    rows = emit_two_level(t, d, h, alpha, beta, tables)
    s = Schedule(
        num_steps=t,
        memory=m,
        policy=policy,
        cost=0,
        actions=rows,
        alpha=alpha,
        beta=beta,
        host_memory=host,
        transfer_cost=cost_pair,
        overlap=overlap,
    )
    return dataclasses.replace(s, cost=_counted_cost(s))


def _counted_cost(s: Schedule) -> float:
    """Forward evaluations plus transfer time, counted from the rows as `simulate` does."""
    op = s.actions[:, 0]
    evals = int(s.actions[op == _ADV, 1].sum())
    evals += int(np.isin(op, (_SAVE_I, _FUSED, _HOST_SAVE_I)).sum())
    counts = (
        int((op == _HOST_SAVE_H).sum()),
        int(np.isin(op, (_HOST_LOAD_H, _HOST_LOAD_I)).sum()),
        int((op == _HOST_SAVE_I).sum()),
        int((op == _HOST_BACK_I).sum()),
    )
    return evals + transfer_time(transfer_charges(s), counts)
