"""Schedules as plain data, and the simulator that replays them.

Index conventions (used everywhere in memento):

- position ``p`` (0 <= p <= t): the hidden state ``h_p`` after ``p`` steps; ``h_0`` is the
  initial carry.
- step ``p`` (0 <= p < t): the body applied to ``h_p`` (and ``xs[p]``), producing ``h_{p+1}``
  and ``ys[p]``.

A schedule is an ``(n, 3)`` integer array; each row is ``(op, arg, pos)``:

============== ===================================================================
op             meaning (``cur`` is the position of the current, working state)
============== ===================================================================
ADVANCE        ``arg`` primal steps from ``cur == pos``; then ``cur = pos + arg``.
SAVE_HIDDEN    store ``h_pos`` (``cur == pos``) in hidden slot ``arg``.
SAVE_INTERNAL  run step ``pos`` (``cur == pos``) keeping its residuals; store the
               internal state (residuals and output state ``h_{pos+1}``) in internal
               slot ``arg``; then ``cur = pos + 1``.
LOAD_HIDDEN    ``cur = pos`` from hidden slot ``arg``; ``arg == -1`` is the initial
               state ``h_0``, which the caller always holds.
LOAD_INTERNAL  ``cur = pos`` from the output state of internal slot ``arg``, which
               holds step ``pos - 1``.
BACKWARD_INTERNAL  back-propagate step ``pos`` from internal slot ``arg``.
BACKWARD_FUSED     run step ``pos`` (``cur == pos``) with its residuals and
                   back-propagate it at once (``arg`` unused, 0).
FREE_HIDDEN    release hidden slot ``arg`` (holding ``h_pos``).
FREE_INTERNAL  release internal slot ``arg`` (holding step ``pos``).
============== ===================================================================

Every forward evaluation of the body is one of: a step of ADVANCE, a SAVE_INTERNAL, or
a BACKWARD_FUSED. Their total is the schedule's cost, the paper's C(t, m).

Memory, in slots of one hidden state each (the paper's m): a hidden slot takes 1, an
internal slot ``alpha`` (``beta`` when its input state ``h_pos`` is held at that moment,
section 3.4 of Gruslys et al.). ``h_0`` takes 1 when the policy counts it (HSM, MSM,
chains), nothing for ISM (the paper's section 3.2 treats it as given). The working state
of a fused step is free, as in the paper.

Every schedule starts with a *first sweep*: ADVANCE / SAVE_* rows only, walking from
position 0 to step t-1 in order, ending with either BACKWARD_FUSED of step t-1 or
SAVE_INTERNAL of step t-1. Executors run that prefix in the forward pass (it produces
every ``ys[p]`` once) and the rest in the backward pass.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools

import numpy as np

__all__ = [
    "Op",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "first_backward",
    "stack_depths",
    "step_evaluations",
]


class Op(enum.IntEnum):
    """Opcodes of a schedule row ``(op, arg, pos)``; see the module docstring."""

    ADVANCE = 0
    SAVE_HIDDEN = 1
    SAVE_INTERNAL = 2
    LOAD_HIDDEN = 3
    LOAD_INTERNAL = 4
    BACKWARD_INTERNAL = 5
    BACKWARD_FUSED = 6
    FREE_HIDDEN = 7
    FREE_INTERNAL = 8


# Opcodes as plain ints, for the planners' emitters (their inner loops are hot).
_ADV = int(Op.ADVANCE)
_SAVE_H = int(Op.SAVE_HIDDEN)
_SAVE_I = int(Op.SAVE_INTERNAL)
_LOAD_H = int(Op.LOAD_HIDDEN)
_LOAD_I = int(Op.LOAD_INTERNAL)
_BACK_I = int(Op.BACKWARD_INTERNAL)
_FUSED = int(Op.BACKWARD_FUSED)
_FREE_H = int(Op.FREE_HIDDEN)
_FREE_I = int(Op.FREE_INTERNAL)


INITIAL = -1  # the hidden "slot" of h_0, always held by the caller


class ScheduleError(ValueError):
    """A schedule broke a rule of the replay (see `Schedule.simulate`)."""


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What an independent replay of a schedule counted.

    Attributes:
        forward_evaluations: body evaluations, first sweep included (the paper's C).
        peak_memory: most slots in use at once (h_0 included when the policy counts it).
        peak_hidden_slots: most hidden slots (excluding h_0) live at once.
        peak_internal_slots: most internal slots live at once.
        sweep_length: number of rows of the first sweep (the forward-pass prefix).
    """

    forward_evaluations: int
    peak_memory: int
    peak_hidden_slots: int
    peak_internal_slots: int
    sweep_length: int


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """An explicit checkpointing schedule for back-propagating through ``num_steps`` steps.

    Attributes:
        num_steps: the sequence length, the paper's t.
        memory: the budget in slots, the paper's m.
        policy: ``"hsm"``, ``"ism"``, ``"msm"``, ``"chain"`` or a baseline's name.
        cost: forward evaluations of the plan (first sweep included), the paper's C(t, m).
        actions: ``(n, 3)`` integer array of rows ``(op, arg, pos)``: int32 as the planner
            emits them (half the memory at millions of rows), else int64.
        alpha: slots taken by an internal state.
        beta: slots taken by an internal state whose input state is already held.
        counts_initial: whether ``h_0`` takes a slot of ``memory``.
        hidden_sizes, internal_sizes: per-position sizes for heterogeneous chains
            (``None`` for uniform loops); override ``1``/``alpha``/``beta``.
    """

    num_steps: int
    memory: int
    policy: str
    cost: int
    actions: np.ndarray
    alpha: int = 1
    beta: int = 1
    counts_initial: bool = True
    hidden_sizes: tuple[int, ...] | None = None
    internal_sizes: tuple[int, ...] | None = None
    forward_costs: tuple[int, ...] | None = None
    # Set by the planner, which counts it from the rows without a replay (`count_peak`);
    # ``None``: `peak_memory` replays the schedule.
    planned_peak: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        actions = np.asarray(self.actions)
        dtype = np.int32 if actions.dtype == np.int32 else np.int64
        actions = np.asarray(actions, dtype=dtype).reshape(-1, 3)
        actions.setflags(write=False)
        object.__setattr__(self, "actions", actions)

    def __repr__(self) -> str:
        return (
            f"Schedule(policy={self.policy!r}, num_steps={self.num_steps}, "
            f"memory={self.memory}, cost={self.cost}, peak_memory={self.peak_memory}, "
            f"actions={len(self.actions)})"
        )

    @property
    def cost_per_step(self) -> float:
        return self.cost / self.num_steps

    @functools.cached_property
    def _replay(self) -> SimulationResult:
        return simulate(self)

    @property
    def peak_memory(self) -> int:
        """Most slots in use at once: the planner's count, else the replay's.

        Planned schedules carry their peak (counted from the rows in vectorised NumPy,
        `count_peak`; the planner's tests check it against the replay), so reading it
        costs nothing; other schedules are replayed once (`simulate`).
        """
        if self.planned_peak is not None:
            return self.planned_peak
        return self._replay.peak_memory

    def simulate(self) -> SimulationResult:
        """Replay the schedule and check it; see `simulate`."""
        return simulate(self)

    def executable(self) -> np.ndarray:
        """The rows an executor runs: the schedule without FREE rows."""
        keep = (self.actions[:, 0] != Op.FREE_HIDDEN) & (self.actions[:, 0] != Op.FREE_INTERNAL)
        return self.actions[keep]


def first_backward(actions: np.ndarray) -> int:
    """Index of the first backward row (BACKWARD_FUSED or BACKWARD_INTERNAL) of ``actions``.

    The rows before it are the first sweep, which executors run in the forward pass; that
    row and the rest run in the backward pass (see the module docstring).

    Raises:
        ScheduleError: no row back-propagates a step.
    """
    actions = np.asarray(actions).reshape(-1, 3)
    back = np.flatnonzero(
        (actions[:, 0] == Op.BACKWARD_FUSED) | (actions[:, 0] == Op.BACKWARD_INTERNAL)
    )
    if len(back) == 0:
        raise ScheduleError("memento.planning.first_backward: the rows back-propagate no step")
    return int(back[0])


def step_evaluations(schedule: Schedule) -> np.ndarray:
    """How many times ``schedule`` evaluates each step: its ADVANCE, SAVE_INTERNAL and
    BACKWARD_FUSED rows, first sweep included. Sums to ``schedule.cost`` for uniform steps.
    """
    counts = np.zeros(schedule.num_steps + 1, dtype=np.int64)
    a = schedule.actions
    op, arg, pos = a[:, 0], a[:, 1].astype(np.int64), a[:, 2].astype(np.int64)
    adv = op == Op.ADVANCE  # steps pos .. pos+arg-1, as a difference array
    np.add.at(counts, pos[adv], 1)
    np.add.at(counts, pos[adv] + arg[adv], -1)
    one = (op == Op.SAVE_INTERNAL) | (op == Op.BACKWARD_FUSED)
    np.add.at(counts, pos[one], 1)
    np.add.at(counts, pos[one] + 1, -1)
    return np.cumsum(counts)[:-1]


def _hidden_size(s: Schedule, pos: int) -> int:
    return 1 if s.hidden_sizes is None else s.hidden_sizes[pos]


def simulate(s: Schedule) -> SimulationResult:
    """Replays ``s`` step by step, independently of how it was planned, and checks it.

    Checks: every step is back-propagated exactly once, in reverse order (t-1 first), each
    from a state that the replay itself restored or computed; every load reads a live slot
    that holds what the row claims; no live slot is overwritten; the schedule starts with
    a first sweep (see the module docstring); slots in use never exceed ``s.memory``.

    Returns:
        The counted forward evaluations and memory (`SimulationResult`).

    Raises:
        ScheduleError: on the first broken rule, naming the row.
    """
    t = s.num_steps
    cur: int | None = 0  # position of the working state; None when there is none
    hidden: dict[int, int] = {}  # slot -> position
    internal: dict[int, tuple[int, int]] = {}  # slot -> (step, size)
    used = (
        s.hidden_sizes[0]
        if (s.hidden_sizes is not None and s.counts_initial)
        else int(s.counts_initial)
    )
    peak = used
    peak_h = peak_i = 0
    evals = 0
    expect = t - 1  # next step to back-propagate
    sweep_end: int | None = None
    sweep_pos = 0  # first-sweep frontier: every step < sweep_pos was evaluated once

    def fail(i: int, msg: str):
        raise ScheduleError(
            f"memento.simulate: row {i} {tuple(int(v) for v in s.actions[i])}: {msg}"
        )

    # Positions held right now, counted so that each check is O(1): h_p in a hidden slot,
    # or h_{p} as the output of an internal slot holding step p-1.
    held: collections.Counter[int] = collections.Counter()

    def is_held(pos: int) -> bool:
        return pos == 0 or held[pos] > 0

    # An internal state stored at the reduced size relies on the state that holds its input;
    # freeing that state first would lose the input (section 3.4). slot -> input position.
    relies: dict[int, int] = {}
    relied_on: collections.Counter[int] = collections.Counter()

    def check_released(i: int, pos: int) -> None:
        if relied_on[pos] and not is_held(pos):
            slot = next(k for k, v in relies.items() if v == pos)
            fail(i, f"frees h_{pos}, the input of internal slot {slot} stored without it")

    def internal_size(pos: int) -> int:
        # beta when the input state h_pos is held at this moment (section 3.4).
        held = is_held(pos)
        if s.internal_sizes is not None:
            full = s.internal_sizes[pos]
            return full - _hidden_size(s, pos) if held else full
        return s.beta if held else s.alpha

    def internal_size_full(pos: int) -> int:
        return s.internal_sizes[pos] if s.internal_sizes is not None else s.alpha

    for i, (op, arg, pos) in enumerate(s.actions.tolist()):
        in_sweep = sweep_end is None
        if op == Op.ADVANCE:
            # Advancing to h_t is never needed: the last step is always fused or saved.
            if arg < 1 or cur != pos or pos + arg > t - 1:
                fail(i, f"cannot advance {arg} from position {pos} (current {cur}, t={t})")
            cur = pos + arg
            if s.forward_costs is None:
                evals += arg
            else:
                evals += sum(s.forward_costs[pos : pos + arg])
        elif op == Op.SAVE_HIDDEN:
            if cur != pos or arg in hidden or arg < 0:
                fail(i, f"cannot save h_{pos} in hidden slot {arg} (current {cur})")
            hidden[arg] = pos
            held[pos] += 1
            used += _hidden_size(s, pos)
            peak_h = max(peak_h, len(hidden))
        elif op == Op.SAVE_INTERNAL:
            if cur != pos or arg in internal or arg < 0 or pos >= t:
                fail(i, f"cannot save step {pos} in internal slot {arg} (current {cur})")
            size = internal_size(pos)
            if size < internal_size_full(pos):
                relies[arg] = pos
                relied_on[pos] += 1
            internal[arg] = (pos, size)
            held[pos + 1] += 1
            used += size
            peak_i = max(peak_i, len(internal))
            cur = pos + 1
            evals += 1 if s.forward_costs is None else s.forward_costs[pos]
        elif op == Op.LOAD_HIDDEN:
            ok = (arg == INITIAL and pos == 0) or hidden.get(arg) == pos
            if not ok:
                fail(i, f"hidden slot {arg} does not hold h_{pos}")
            cur = pos
        elif op == Op.LOAD_INTERNAL:
            if arg not in internal or internal[arg][0] != pos - 1:
                fail(i, f"internal slot {arg} does not hold step {pos - 1}")
            cur = pos
        elif op == Op.BACKWARD_INTERNAL:
            if arg not in internal or internal[arg][0] != pos or pos != expect:
                fail(
                    i,
                    f"cannot back-propagate step {pos} from internal slot {arg}; "
                    f"expected step {expect}",
                )
            expect -= 1
            cur = None
        elif op == Op.BACKWARD_FUSED:
            if cur != pos or pos != expect:
                fail(
                    i,
                    f"cannot back-propagate step {pos} fused (current {cur}, "
                    f"expected step {expect})",
                )
            expect -= 1
            cur = None
            evals += 1 if s.forward_costs is None else s.forward_costs[pos]
        elif op == Op.FREE_HIDDEN:
            if hidden.get(arg) != pos:
                fail(i, f"hidden slot {arg} does not hold h_{pos}")
            del hidden[arg]
            held[pos] -= 1
            used -= _hidden_size(s, pos)
            check_released(i, pos)
        elif op == Op.FREE_INTERNAL:
            if arg not in internal or internal[arg][0] != pos:
                fail(i, f"internal slot {arg} does not hold step {pos}")
            used -= internal.pop(arg)[1]
            held[pos + 1] -= 1
            if arg in relies:
                relied_on[relies.pop(arg)] -= 1
            check_released(i, pos + 1)
        else:
            fail(i, f"unknown op {op}")
        if in_sweep:
            if op in (Op.ADVANCE, Op.SAVE_INTERNAL):
                if pos != sweep_pos:
                    fail(i, f"the first sweep must walk the steps in order (at {sweep_pos})")
                sweep_pos = cur if cur is not None else sweep_pos
            elif op == Op.BACKWARD_FUSED:
                if pos != t - 1 or sweep_pos != t - 1:
                    fail(i, "the first sweep must end at step t-1")
                sweep_end = i
            elif op == Op.BACKWARD_INTERNAL:
                if sweep_pos != t:
                    fail(i, "the first sweep must end at step t-1")
                sweep_end = i
            elif op not in (Op.SAVE_HIDDEN, Op.FREE_HIDDEN, Op.FREE_INTERNAL):
                fail(i, "only ADVANCE and SAVE rows may come before the first backward")
        peak = max(peak, used)
        if used > s.memory:
            fail(i, f"{used} slots in use, over the budget of {s.memory}")
    if expect != -1:
        raise ScheduleError(f"memento.simulate: steps 0..{expect} were never back-propagated")
    assert sweep_end is not None
    return SimulationResult(
        forward_evaluations=evals,
        peak_memory=peak,
        peak_hidden_slots=peak_h,
        peak_internal_slots=peak_i,
        sweep_length=sweep_end,
    )


# ---------------------------------------------------------------------------------------
# Vectorised counts over the rows (no replay): what executors and `plan` need at O(n) NumPy
# cost, for schedules of millions of rows.


def _lut(*ops) -> np.ndarray:
    """A table ``t[op]`` that is True for ``ops`` (much faster than ``np.isin`` per row)."""
    table = np.zeros(max(Op) + 1, dtype=bool)
    table[list(ops)] = True
    return table


_IS_SAVE = _lut(Op.SAVE_HIDDEN, Op.SAVE_INTERNAL)
_IS_FREE = _lut(Op.FREE_HIDDEN, Op.FREE_INTERNAL)
_HIDDEN_OPS = _lut(Op.SAVE_HIDDEN, Op.LOAD_HIDDEN, Op.FREE_HIDDEN)
_INTERNAL_OPS = _lut(Op.SAVE_INTERNAL, Op.LOAD_INTERNAL, Op.BACKWARD_INTERNAL, Op.FREE_INTERNAL)


def _matching_save(actions: np.ndarray, kind_of_row: np.ndarray, refers: np.ndarray):
    """For every row that refers to a slot, the index of the latest save of that slot.

    ``kind_of_row``: 0 hidden, 1 internal, -1 no slot. ``refers``: rows whose slot is the
    one of an earlier save (loads, backwards from a slot, frees). Returns an int64 array,
    -1 where the row refers to no slot or no earlier save exists (a broken schedule).
    """
    n = len(actions)
    is_save = _IS_SAVE[actions[:, 0]]
    involved = np.flatnonzero(is_save | refers)
    out = np.full(n, -1, np.int64)
    if len(involved) == 0:
        return out
    key = kind_of_row[involved] + 3 * actions[involved, 1]  # (kind, slot) as one integer
    key -= key.min()
    # A stable sort groups rows by slot, in row order; small keys (slots are few) sort in
    # linear time (NumPy's radix sort for 16-bit integers).
    if key.max() < 2**15:
        key = key.astype(np.int16)
    perm = np.argsort(key, kind="stable")
    order, key_sorted = involved[perm], key[perm]
    # Forward-fill the latest save within each group.
    pos = np.where(is_save[order], np.arange(len(order)), -1)
    last = np.maximum.accumulate(pos)
    ok = last >= 0
    ok[ok] = key_sorted[last[ok]] == key_sorted[ok]
    out[order[ok]] = order[last[ok]]
    out[is_save] = -1
    return out


def _depths(actions: np.ndarray):
    """``(nh, ni, first_bad)`` over all rows; see `stack_depths`; ``first_bad`` is the first
    row that breaks stack order (or refers to a slot never saved), -1 if none."""
    op = actions[:, 0]
    kind = np.where(_HIDDEN_OPS[op], 0, np.where(_INTERNAL_OPS[op], 1, -1))
    kind[(op == Op.LOAD_HIDDEN) & (actions[:, 1] == INITIAL)] = -1  # h_0: no slot
    refers = (kind >= 0) & ~_IS_SAVE[op]
    dh = (op == Op.SAVE_HIDDEN).astype(np.int64) - (op == Op.FREE_HIDDEN)
    di = (op == Op.SAVE_INTERNAL).astype(np.int64) - (op == Op.FREE_INTERNAL)
    # States live just before each row (exclusive cumulative sums).
    nh = np.concatenate([[0], np.cumsum(dh)[:-1]]).astype(np.int64)
    ni = np.concatenate([[0], np.cumsum(di)[:-1]]).astype(np.int64)
    # Fast path, no sort: one kind of slot, numbered by depth (the planner numbers its
    # slots so: HSM and ISM). Then slot j always holds the state at depth j, so stack order
    # holds when every save takes the next slot, every free the top one, every use a
    # live one.
    if not ((kind == 0).any() and (kind == 1).any()):
        arg, depth = actions[:, 1], nh + ni
        is_save = _IS_SAVE[op]
        ok = np.where(is_save, arg == depth, True)
        ok &= np.where(_IS_FREE[op], arg == depth - 1, True)
        ok &= np.where(refers, (arg >= 0) & (arg < depth), True)
        if ok.all():
            slot = kind >= 0
            if (kind == 0).any():
                nh = np.where(slot, arg, nh)
            else:
                ni = np.where(slot, arg, ni)
            return nh, ni, -1
    save = _matching_save(actions, kind, refers)
    bad = refers & (save < 0)
    has = save >= 0
    # A state lies on top of the nh + ni states live when it was saved.
    nh[has], ni[has] = nh[save[has]], ni[save[has]]
    # Stack order: a free releases the top, i.e. the state saved with depth (nh, ni) is
    # freed while exactly nh + ni + 1 states are live.
    live = np.concatenate([[0], np.cumsum(dh + di)[:-1]])
    frees = _IS_FREE[op] & has
    bad |= frees & (nh + ni + 1 != live)
    first_bad = int(np.argmax(bad)) if bad.any() else -1
    return nh, ni, first_bad


def stack_depths(actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How many hidden and internal states lie below each executable row's state.

    The planner's schedules use their slots as a stack (Algorithm 2 of Gruslys et al.: a
    state is released before any state stored before it), so an executor can keep hidden
    and internal states in two stacks (or one pool) at offsets fixed from these counts.
    Vectorised NumPy, O(n log n) for n rows.

    Args:
        actions: a schedule's ``(n, 3)`` rows, FREE rows included (``Schedule.actions``).

    Returns:
        ``(n_hidden_below, n_internal_below)``: int64 arrays aligned with the rows without
        FREE rows (`Schedule.executable`). For a row that stores, loads or back-propagates
        from a slot: the hidden and internal states stored below that slot's state. For
        other rows (ADVANCE, BACKWARD_FUSED, a load of ``h_0``): the states live then.

    Raises:
        ScheduleError: a release out of stack order, or a slot used before it was saved.
    """
    actions = np.asarray(actions).reshape(-1, 3)
    nh, ni, bad = _depths(actions)
    if bad >= 0:
        raise ScheduleError(
            f"memento.planning.stack_depths: row {bad} {tuple(int(v) for v in actions[bad])} "
            "releases a slot out of stack order or uses a slot never saved; the slots of "
            "a schedule must be used as a stack (the planner's are)"
        )
    keep = ~_IS_FREE[actions[:, 0]]
    return nh[keep], ni[keep]


def count_peak(actions: np.ndarray, alpha: int, beta: int, counts_initial: bool) -> int:
    """Most slots in use at once, counted from the rows in vectorised NumPy (no replay).

    For uniform schedules whose reduced-size internal states (``beta``) are stored right
    where their input state was just saved or loaded (the planner's are: a push at the
    base of a subproblem, or the next step of a chain of pushes); `simulate` checks any
    schedule, and the planner's tests check that both counts agree.
    """
    op = actions[:, 0]
    size = np.zeros(len(actions), np.int64)
    size[op == Op.SAVE_HIDDEN] = 1
    size[op == Op.FREE_HIDDEN] = -1
    si = op == Op.SAVE_INTERNAL
    fi = op == Op.FREE_INTERNAL
    if beta == alpha:
        size[si], size[fi] = alpha, -alpha
    else:
        # The input h_pos of a save is held when the row before stored, loaded or
        # produced (as an internal state's output) h_pos, or pos == 0.
        prev = np.concatenate([[(-1, -1, -1)], actions[:-1]])
        pos = actions[:, 2]
        held = (pos == 0) | (
            _lut(Op.SAVE_HIDDEN, Op.LOAD_HIDDEN, Op.LOAD_INTERNAL)[prev[:, 0]] & (prev[:, 2] == pos)
        )
        held |= (prev[:, 0] == Op.SAVE_INTERNAL) & (prev[:, 2] == pos - 1)
        size[si] = np.where(held[si], beta, alpha)
        # A free releases what its save took: match each free with its save.
        kind = np.where(si | fi, 1, -1)
        save = _matching_save(actions, kind, fi)
        size[fi] = -size[save[fi]]
    changes = size[size != 0]  # memory only changes at saves and frees
    used = int(counts_initial) + np.cumsum(changes)
    return int(max(int(counts_initial), int(used.max(initial=0))))
