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

Two-level plans (`memento.plan` with ``host_memory=``) also use host slots, numbered
apart from the device's, with these rows (the cost model is in ``_host.py``):

====================== ===========================================================
HOST_SAVE_HIDDEN       copy ``h_pos`` (``cur == pos``) to host hidden slot ``arg``.
HOST_SAVE_INTERNAL     run step ``pos`` keeping its residuals and copy the internal
                       state to host internal slot ``arg``; then ``cur = pos + 1``.
HOST_LOAD_HIDDEN       ``cur = pos`` copied back from host hidden slot ``arg``.
HOST_LOAD_INTERNAL     ``cur = pos`` copied back from the output state of host
                       internal slot ``arg`` (holding step ``pos - 1``).
HOST_BACKWARD_INTERNAL copy host internal slot ``arg`` back and back-propagate step
                       ``pos`` from it.
HOST_FREE_HIDDEN,      release a host slot.
HOST_FREE_INTERNAL
====================== ===========================================================

`walk` (hence `simulate`) checks these rows like the device's. Each level's slots are a
stack of their own: `two_level_depths` places them (`stack_depths`, for one-level
schedules, refuses host rows); `memento.scan(..., host_memory=)` runs them.

Every forward evaluation of the body is one of: a step of ADVANCE, a SAVE_INTERNAL (or
HOST_SAVE_INTERNAL), or a BACKWARD_FUSED. Their total is the schedule's cost, the paper's
C(t, m) (a two-level plan's cost adds its transfer time).

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
import itertools
from collections.abc import Iterator
from typing import NamedTuple, NoReturn

import numpy as np

__all__ = [
    "INITIAL",
    "Op",
    "Row",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "Walk",
    "backward_runs",
    "first_backward",
    "stack_depths",
    "step_evaluations",
    "two_level_depths",
    "walk",
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
    HOST_SAVE_HIDDEN = 9
    HOST_SAVE_INTERNAL = 10
    HOST_LOAD_HIDDEN = 11
    HOST_LOAD_INTERNAL = 12
    HOST_BACKWARD_INTERNAL = 13
    HOST_FREE_HIDDEN = 14
    HOST_FREE_INTERNAL = 15


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
_HOST_SAVE_H = int(Op.HOST_SAVE_HIDDEN)
_HOST_SAVE_I = int(Op.HOST_SAVE_INTERNAL)
_HOST_LOAD_H = int(Op.HOST_LOAD_HIDDEN)
_HOST_LOAD_I = int(Op.HOST_LOAD_INTERNAL)
_HOST_BACK_I = int(Op.HOST_BACKWARD_INTERNAL)
_HOST_FREE_H = int(Op.HOST_FREE_HIDDEN)
_HOST_FREE_I = int(Op.HOST_FREE_INTERNAL)
_FIRST_HOST_OP = _HOST_SAVE_H  # every op from here on is a host op


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
        peak_host_memory: most host slots in use at once (two-level plans).
        host_stores, host_loads: rows that copy a state to the host / back (a backward
            step from a host internal state is a load).
        transfer_time: what the transfers add under the schedule's cost model
            (``_host.py``: the part of each copy that compute does not hide).
    """

    forward_evaluations: int
    peak_memory: int
    peak_hidden_slots: int
    peak_internal_slots: int
    sweep_length: int
    peak_host_memory: int = 0
    host_stores: int = 0
    host_loads: int = 0
    transfer_time: float = 0.0

    @property
    def cost(self) -> float:
        """Forward evaluations plus transfer time: a two-level plan's ``cost``."""
        return self.forward_evaluations + self.transfer_time


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """An explicit checkpointing schedule for back-propagating through ``num_steps`` steps.

    Attributes:
        num_steps: the sequence length, the paper's t.
        memory: the budget in slots, the paper's m.
        policy: ``"hsm"``, ``"ism"``, ``"msm"``, ``"chain"`` or a baseline's name.
        cost: forward evaluations of the plan (first sweep included), the paper's C(t, m);
            for a two-level plan, plus the transfer time of its model (a float).
        actions: ``(n, 3)`` integer array of rows ``(op, arg, pos)``: int32 as the planner
            emits them (half the memory at millions of rows), else int64.
        alpha: slots taken by an internal state.
        beta: slots taken by an internal state whose input state is already held.
        counts_initial: whether ``h_0`` takes a slot of ``memory``.
        hidden_sizes, internal_sizes: per-position sizes for heterogeneous chains
            (``None`` for uniform loops); override ``1``/``alpha``/``beta``.
        host_memory: host slots of a two-level plan (``math.inf``: unbounded; 0: none).
        transfer_cost: ``(write, read)``: forward-step units to copy one slot to the host
            and back.
        overlap: ``"step"`` (a transfer hides behind one step of compute) or ``"none"``
            (transfers add in full); see `memento.plan`.
    """

    num_steps: int
    memory: int
    policy: str
    cost: float
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
    host_memory: float = 0
    transfer_cost: tuple[float, float] = (0.0, 0.0)
    overlap: str = "step"

    def __post_init__(self):
        actions = np.asarray(self.actions)
        dtype = np.int32 if actions.dtype == np.int32 else np.int64
        actions = np.asarray(actions, dtype=dtype).reshape(-1, 3)
        actions.setflags(write=False)
        object.__setattr__(self, "actions", actions)

    def __repr__(self) -> str:
        host = ""
        if self.host_memory:
            host = (
                f"host_memory={self.host_memory}, transfer_cost={self.transfer_cost}, "
                f"overlap={self.overlap!r}, "
            )
        return (
            f"Schedule(policy={self.policy!r}, num_steps={self.num_steps}, "
            f"memory={self.memory}, {host}cost={self.cost}, "
            f"peak_memory={self.peak_memory}, actions={len(self.actions)})"
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
        return self.actions[~_IS_ANY_FREE[self.actions[:, 0]]]


class Row(NamedTuple):
    """One row of a schedule as `walk` yields it, checked against the rows before it.

    Attributes:
        index: the row's index in ``Schedule.actions``.
        op, arg, pos: the row (see the module docstring).
        steps: the steps the row evaluates forward, in order: ``range(pos, pos + arg)``
            for ADVANCE, ``range(pos, pos + 1)`` for SAVE_INTERNAL, HOST_SAVE_INTERNAL
            and BACKWARD_FUSED, empty otherwise.
        sweep: whether the row belongs to the first sweep, which ends with (and
            includes) the first backward row; an executor runs the sweep in its forward
            pass and the rest, from that backward row on, in its backward pass.
    """

    index: int
    op: Op
    arg: int
    pos: int
    steps: range
    sweep: bool


_NO_STEPS = range(0)
_OPS = tuple(Op)  # Op(op) by index: faster than the enum's lookup, per row
# Rows, other than those that evaluate steps, that may come before the first backward.
_SWEEP_OTHERS = (_SAVE_H, _FREE_H, _FREE_I, _HOST_SAVE_H, _HOST_FREE_H, _HOST_FREE_I)


class Walk:
    """A replay of a schedule's rows, in order, that checks each against those before it.

    Iterating yields every row as a `Row` once it is checked and applied; meanwhile the
    walk's state is readable: ``cur`` (position of the working state, ``None`` after a
    backward step), ``hidden`` (slot -> position it holds), ``internal`` (slot -> step
    it holds), ``host_hidden`` and ``host_internal`` (the same for the host slots of a
    two-level plan), `holds` and, at the end, ``sweep_length``. Executors follow the
    rows and keep their own values per slot; `simulate` adds the memory model (both
    levels) and the transfer charges; `step_evaluations` counts. Pure Python over NumPy
    rows, no tracing: one walk serves every executor.

    Checks: every step is back-propagated exactly once, in reverse order (t-1 first),
    from a state restored or computed before it; every load reads a live slot (device or
    host) that holds what the row claims; no live slot is overwritten; the rows start
    with a first sweep. Memory is not checked here (`simulate` does).

    Raises (while iterating):
        ScheduleError: on the first broken rule, naming the row and ``name``.
    """

    def __init__(self, schedule: Schedule, *, name: str = "memento.planning.walk"):
        self.schedule = schedule
        self.name = name
        self.cur: int | None = 0
        self.hidden: dict[int, int] = {}
        self.internal: dict[int, int] = {}
        self.host_hidden: dict[int, int] = {}
        self.host_internal: dict[int, int] = {}
        self.sweep_length: int | None = None
        # Positions held on the device right now, counted so that `holds` is O(1): h_p in
        # a hidden slot, or h_p as the output of an internal slot holding step p-1.
        self._held: collections.Counter[int] = collections.Counter()

    def holds(self, pos: int) -> bool:
        """Whether ``h_pos`` is held on the device right now (``h_0`` always is); a copy
        in a host slot does not count (it must be copied back before it is read)."""
        return pos == 0 or self._held[pos] > 0

    def fail(self, i: int, msg: str) -> NoReturn:
        row = tuple(int(v) for v in self.schedule.actions[i])
        raise ScheduleError(f"{self.name}: row {i} {row}: {msg}")

    def __iter__(self) -> Iterator[Row]:
        t = self.schedule.num_steps
        hidden, internal, held, fail = self.hidden, self.internal, self._held, self.fail
        host_hidden, host_internal = self.host_hidden, self.host_internal
        expect = t - 1  # next step to back-propagate
        sweep_pos = 0  # first-sweep frontier: every step < sweep_pos was evaluated once
        for i, (op, arg, pos) in enumerate(self.schedule.actions.tolist()):
            cur = self.cur
            in_sweep = self.sweep_length is None
            steps = _NO_STEPS
            if op == _ADV:
                # Up to h_t at most: a static nest runs its last segment forward for the
                # outputs and again in the backward pass (the optimal plans fuse or save
                # the last step instead).
                if arg < 1 or cur != pos or pos + arg > t:
                    fail(i, f"cannot advance {arg} from position {pos} (current {cur}, t={t})")
                steps = range(pos, pos + arg)
                cur = pos + arg
            elif op == _SAVE_H:
                if cur != pos or arg in hidden or arg < 0:
                    fail(i, f"cannot save h_{pos} in hidden slot {arg} (current {cur})")
                hidden[arg] = pos
                held[pos] += 1
            elif op == _SAVE_I:
                if cur != pos or arg in internal or arg < 0 or pos >= t:
                    fail(i, f"cannot save step {pos} in internal slot {arg} (current {cur})")
                internal[arg] = pos
                held[pos + 1] += 1
                steps = range(pos, pos + 1)
                cur = pos + 1
            elif op == _LOAD_H:
                if not ((arg == INITIAL and pos == 0) or hidden.get(arg) == pos):
                    fail(i, f"hidden slot {arg} does not hold h_{pos}")
                cur = pos
            elif op == _LOAD_I:
                if internal.get(arg) != pos - 1:
                    fail(i, f"internal slot {arg} does not hold step {pos - 1}")
                cur = pos
            elif op == _BACK_I:
                if internal.get(arg) != pos or pos != expect:
                    fail(
                        i,
                        f"cannot back-propagate step {pos} from internal slot {arg}; "
                        f"expected step {expect}",
                    )
                expect -= 1
                cur = None
            elif op == _FUSED:
                if cur != pos or pos != expect:
                    fail(
                        i,
                        f"cannot back-propagate step {pos} fused (current {cur}, "
                        f"expected step {expect})",
                    )
                expect -= 1
                steps = range(pos, pos + 1)
                cur = None
            elif op == _FREE_H:
                if hidden.get(arg) != pos:
                    fail(i, f"hidden slot {arg} does not hold h_{pos}")
                del hidden[arg]
                held[pos] -= 1
            elif op == _FREE_I:
                if internal.get(arg) != pos:
                    fail(i, f"internal slot {arg} does not hold step {pos}")
                del internal[arg]
                held[pos + 1] -= 1
            elif op == _HOST_SAVE_H:
                if cur != pos or arg in host_hidden or arg < 0:
                    fail(i, f"cannot copy h_{pos} to host hidden slot {arg} (current {cur})")
                host_hidden[arg] = pos
            elif op == _HOST_SAVE_I:
                if cur != pos or arg in host_internal or arg < 0 or pos >= t:
                    fail(i, f"cannot save step {pos} in host internal slot {arg} (current {cur})")
                host_internal[arg] = pos
                steps = range(pos, pos + 1)
                cur = pos + 1
            elif op == _HOST_LOAD_H:
                if host_hidden.get(arg) != pos:
                    fail(i, f"host hidden slot {arg} does not hold h_{pos}")
                cur = pos
            elif op == _HOST_LOAD_I:
                if host_internal.get(arg) != pos - 1:
                    fail(i, f"host internal slot {arg} does not hold step {pos - 1}")
                cur = pos
            elif op == _HOST_BACK_I:
                if host_internal.get(arg) != pos or pos != expect:
                    fail(
                        i,
                        f"cannot back-propagate step {pos} from host internal slot {arg}; "
                        f"expected step {expect}",
                    )
                expect -= 1
                cur = None
            elif op == _HOST_FREE_H:
                if host_hidden.get(arg) != pos:
                    fail(i, f"host hidden slot {arg} does not hold h_{pos}")
                del host_hidden[arg]
            elif op == _HOST_FREE_I:
                if host_internal.get(arg) != pos:
                    fail(i, f"host internal slot {arg} does not hold step {pos}")
                del host_internal[arg]
            else:
                fail(i, f"unknown op {op}")
            self.cur = cur
            if in_sweep:
                if op in (_ADV, _SAVE_I, _HOST_SAVE_I):
                    if pos != sweep_pos:
                        fail(i, f"the first sweep must walk the steps in order (at {sweep_pos})")
                    sweep_pos = cur
                    if op == _ADV and cur == t:  # the sweep ran every step: it ends here
                        self.sweep_length = i + 1
                elif op == _FUSED:
                    if pos != t - 1 or sweep_pos != t - 1:
                        fail(i, "the first sweep must end at step t-1")
                    self.sweep_length = i
                elif op in (_BACK_I, _HOST_BACK_I):
                    if sweep_pos != t:
                        fail(i, "the first sweep must end at step t-1")
                    self.sweep_length = i
                elif op not in _SWEEP_OTHERS:
                    fail(i, "only ADVANCE and SAVE rows may come before the first backward")
            yield Row(i, _OPS[op], arg, pos, steps, in_sweep)
        if expect != -1:
            raise ScheduleError(f"{self.name}: steps 0..{expect} were never back-propagated")


def walk(schedule: Schedule) -> Walk:
    """The rows of ``schedule`` in order, each checked and annotated (see `Walk`).

    The one row walk that `simulate`, `step_evaluations` and `memento.chain` share, for
    any executor that runs a schedule's rows one by one::

        for row in memento.planning.walk(schedule):
            if row.op == Op.ADVANCE:
                for p in row.steps: ...  # evaluate step p

    Raises (while iterating):
        ScheduleError: the first row that breaks a rule of the replay (see `Walk`).
    """
    return Walk(schedule)


def step_evaluations(schedule: Schedule) -> np.ndarray:
    """How many times ``schedule`` evaluates each step forward, first sweep included.

    ADVANCE, SAVE_INTERNAL, HOST_SAVE_INTERNAL and BACKWARD_FUSED rows evaluate steps
    (`Row.steps`); the total is the schedule's forward evaluations (its cost, less the
    transfer time of a two-level plan) when every step costs 1, and ``forward_costs``
    weighs it otherwise. Returns an int64 array of length ``num_steps``.

    Raises:
        ScheduleError: a schedule that breaks a rule of the replay (see `Walk`).
    """
    counts = np.zeros(schedule.num_steps, dtype=np.int64)
    for row in walk(schedule):
        if row.steps:
            counts[row.steps.start : row.steps.stop] += 1
    return counts


def backward_runs(schedule: Schedule) -> np.ndarray:
    """Which rows may record their step on top of the previous step's record, so that an
    eager executor back-propagates a whole run of steps in one reverse pass.

    A row that keeps a step's residuals (SAVE_INTERNAL, BACKWARD_FUSED) at step ``p`` is
    marked when the state it starts from is the output of the internal state of step
    ``p - 1`` (stored by the SAVE_INTERNAL just before it, or loaded by a LOAD_INTERNAL),
    and that internal state is back-propagated right after step ``p`` (only FREE rows
    between the two backward rows). An executor with a tape (PyTorch's autograd) may
    then build step ``p``'s graph on step ``p - 1``'s instead of on a detached copy of
    its output, and back-propagate a maximal run of marked steps, with the unmarked step
    below it, in one call: the same evaluations, the same residuals alive at each moment
    (each step's are released as the reverse pass leaves it), fewer calls. Walking the
    rows with every mark ignored is the schedule itself.

    Returns:
        A bool array, one entry per row of ``schedule.actions``.

    Raises:
        ScheduleError: a schedule that breaks a rule of the replay (see `Walk`).
    """
    rows = schedule.actions
    origin_of = np.full(len(rows), -1, dtype=np.int64)  # record row -> record row below
    slot_row: dict[int, int] = {}  # internal slot -> the row that stored it
    order: list[tuple[int, int]] = []  # (backward row, the row that recorded its step)
    origin = -1  # the row whose record's output is the working state, or -1
    for i, op, arg, _, _, _ in walk(schedule):
        if op == _SAVE_I:
            origin_of[i] = origin
            slot_row[arg] = origin = i
        elif op == _LOAD_I:
            origin = slot_row[arg]
        elif op == _BACK_I:
            order.append((i, slot_row[arg]))
            origin = -1
        elif op == _FUSED:
            origin_of[i] = origin
            order.append((i, i))
            origin = -1
        elif op == _HOST_BACK_I:
            order.append((i, -1))
            origin = -1
        elif op not in (_SAVE_H, _FREE_H, _FREE_I, _HOST_FREE_H, _HOST_FREE_I):
            origin = -1  # ADVANCE, LOAD_HIDDEN, host copies: a state with no record
    marked = np.zeros(len(rows), dtype=bool)
    free = _IS_ANY_FREE[rows[:, 0]]
    for (b_hi, r_hi), (b_lo, r_lo) in itertools.pairwise(order):
        if r_hi >= 0 and r_lo >= 0 and origin_of[r_hi] == r_lo and free[b_hi + 1 : b_lo].all():
            marked[r_hi] = True
    return marked


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
        raise ScheduleError(
            "memento.planning.internals.first_backward: the rows back-propagate no step"
        )
    return int(back[0])


def _hidden_size(s: Schedule, pos: int) -> int:
    return 1 if s.hidden_sizes is None else s.hidden_sizes[pos]


def simulate(s: Schedule) -> SimulationResult:
    """Replays ``s`` step by step, independently of how it was planned, and checks it.

    Checks: every step is back-propagated exactly once, in reverse order (t-1 first), each
    from a state that the replay itself restored or computed; every load reads a live slot
    that holds what the row claims; no live slot is overwritten; the schedule starts with
    a first sweep (see the module docstring) (all of these by `walk`, host slots
    included); slots in use never exceed ``s.memory``, and no state is freed while an
    internal state stored without its input relies on it. Two-level schedules: host
    slots in use never exceed ``s.host_memory`` (a hidden state takes 1, an internal
    state ``alpha``), and each copy to or from the host is charged per the schedule's
    cost model (``transfer_time``; `memento.plan` states the model).

    Returns:
        The counted forward evaluations and memory (`SimulationResult`).

    Raises:
        ScheduleError: on the first broken rule, naming the row.
    """
    w = Walk(s, name="memento.simulate")
    used = (
        s.hidden_sizes[0]
        if (s.hidden_sizes is not None and s.counts_initial)
        else int(s.counts_initial)
    )
    peak = used
    peak_h = peak_i = 0
    evals = 0
    sizes: dict[int, int] = {}  # internal slot -> the size it was stored at
    # The second level: host slots in use (a hidden state 1, an internal state alpha).
    host_used = host_peak = 0
    # Transfers by kind: stores of hidden / internal states, loads of a hidden state (or of
    # an internal state's output), copies back of an internal state for its backward step.
    n_sh = n_si = n_lh = n_li = 0

    # An internal state stored at the reduced size relies on the state that holds its input;
    # freeing that state first would lose the input (section 3.4). slot -> input position.
    relies: dict[int, int] = {}
    relied_on: collections.Counter[int] = collections.Counter()

    def check_released(i: int, pos: int) -> None:
        if relied_on[pos] and not w.holds(pos):
            slot = next(k for k, v in relies.items() if v == pos)
            w.fail(i, f"frees h_{pos}, the input of internal slot {slot} stored without it")

    def internal_size(pos: int) -> int:
        # beta when the input state h_pos is held at this moment (section 3.4).
        held = w.holds(pos)
        if s.internal_sizes is not None:
            full = s.internal_sizes[pos]
            return full - _hidden_size(s, pos) if held else full
        return s.beta if held else s.alpha

    def internal_size_full(pos: int) -> int:
        return s.internal_sizes[pos] if s.internal_sizes is not None else s.alpha

    for i, op, arg, pos, steps, _ in w:
        if steps:
            if s.forward_costs is None:
                evals += len(steps)
            else:
                evals += sum(s.forward_costs[steps.start : steps.stop])
        if op == _SAVE_H:
            used += _hidden_size(s, pos)
            peak_h = max(peak_h, len(w.hidden))
        elif op == _SAVE_I:
            size = sizes[arg] = internal_size(pos)
            if size < internal_size_full(pos):
                relies[arg] = pos
                relied_on[pos] += 1
            used += size
            peak_i = max(peak_i, len(w.internal))
        elif op == _FREE_H:
            used -= _hidden_size(s, pos)
            check_released(i, pos)
        elif op == _FREE_I:
            used -= sizes.pop(arg)
            if arg in relies:
                relied_on[relies.pop(arg)] -= 1
            check_released(i, pos + 1)
        elif op >= _FIRST_HOST_OP:
            if op == _HOST_SAVE_H:
                host_used += 1
                n_sh += 1
            elif op == _HOST_SAVE_I:
                host_used += s.alpha
                n_si += 1
            elif op in (_HOST_LOAD_H, _HOST_LOAD_I):
                n_lh += 1
            elif op == _HOST_BACK_I:
                n_li += 1
            elif op == _HOST_FREE_H:
                host_used -= 1
            elif op == _HOST_FREE_I:
                host_used -= s.alpha
            if host_used > host_peak:
                host_peak = host_used
                if host_used > s.host_memory:
                    w.fail(
                        i, f"{host_used} host slots in use, over the host budget of {s.host_memory}"
                    )
        peak = max(peak, used)
        if used > s.memory:
            w.fail(i, f"{used} slots in use, over the budget of {s.memory}")
    assert w.sweep_length is not None
    return SimulationResult(
        forward_evaluations=evals,
        peak_memory=peak,
        peak_hidden_slots=peak_h,
        peak_internal_slots=peak_i,
        sweep_length=w.sweep_length,
        peak_host_memory=host_peak,
        host_stores=n_sh + n_si,
        host_loads=n_lh + n_li,
        transfer_time=transfer_time(transfer_charges(s), (n_sh, n_lh, n_si, n_li)),
    )


def transfer_charges(s: Schedule) -> tuple[float, float, float, float]:
    """What one transfer adds to the cost, by kind: ``(store hidden, load hidden, store
    internal, load internal)``; the model is `memento.plan`'s (``_host.py``): a copy of
    ``k`` slots takes ``k`` times the per-slot cost, less one step of compute that hides
    it under ``overlap="step"``, never below 0."""
    return charges_of(*s.transfer_cost, s.alpha, s.overlap)


def charges_of(
    write: float, read: float, alpha: int, overlap: str
) -> tuple[float, float, float, float]:
    """`transfer_charges` from the per-slot costs, internal-state size and overlap."""
    hidden = 1.0 if overlap == "step" else 0.0

    def charge(x: float) -> float:
        return max(0.0, float(x) - hidden)

    return charge(write), charge(read), charge(alpha * write), charge(alpha * read)


def transfer_time(charges, counts) -> float:
    """The transfer time of ``counts`` transfers by kind (`transfer_charges`' order),
    summed in one fixed order so that planner and replay agree to the last bit."""
    return float(sum(c * n for c, n in zip(charges, counts, strict=True) if n))


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
_IS_ANY_FREE = _lut(Op.FREE_HIDDEN, Op.FREE_INTERNAL, Op.HOST_FREE_HIDDEN, Op.HOST_FREE_INTERNAL)
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
        NotImplementedError: host-memory rows (a two-level plan): use `two_level_depths`.
    """
    actions = np.asarray(actions).reshape(-1, 3)
    if len(actions) and int(actions[:, 0].max()) >= _FIRST_HOST_OP:
        row = int(np.argmax(actions[:, 0] >= _FIRST_HOST_OP))
        raise NotImplementedError(
            f"memento.planning.internals.stack_depths: row {row} "
            f"{tuple(int(v) for v in actions[row])} is a host-memory row "
            f"({Op(int(actions[row, 0])).name}); a two-level schedule keeps a stack per "
            "level: use memento.planning.internals.two_level_depths"
        )
    nh, ni, bad = _depths(actions)
    if bad >= 0:
        raise ScheduleError(
            f"memento.planning.internals.stack_depths: row {bad} {tuple(int(v) for v in actions[bad])} "
            "releases a slot out of stack order or uses a slot never saved; the slots of "
            "a schedule must be used as a stack (the planner's are)"
        )
    keep = ~_IS_FREE[actions[:, 0]]
    return nh[keep], ni[keep]


# A host row's device counterpart: a host level's slots are a stack of their own.
_AS_DEVICE = np.arange(max(Op) + 1)
_AS_DEVICE[[_HOST_SAVE_H, _HOST_SAVE_I, _HOST_LOAD_H, _HOST_LOAD_I, _HOST_BACK_I]] = [
    _SAVE_H,
    _SAVE_I,
    _LOAD_H,
    _LOAD_I,
    _BACK_I,
]
_AS_DEVICE[[_HOST_FREE_H, _HOST_FREE_I]] = [_FREE_H, _FREE_I]
_DEVICE_SLOT_OPS = _lut(
    Op.SAVE_HIDDEN,
    Op.SAVE_INTERNAL,
    Op.LOAD_HIDDEN,
    Op.LOAD_INTERNAL,
    Op.BACKWARD_INTERNAL,
    Op.FREE_HIDDEN,
    Op.FREE_INTERNAL,
)


def two_level_depths(actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`stack_depths` for two-level schedules: each level's slots are a stack of their own.

    The two-level planner's schedules release the slots of each level in the reverse order
    of their saves (a subproblem frees what it stored before its parent does), so an
    executor keeps device states and host states in two stacks, each placed by the hidden
    and internal states below it on its own level.

    Args:
        actions: a schedule's ``(n, 3)`` rows, FREE rows included; host rows allowed.

    Returns:
        ``(on_host, n_hidden_below, n_internal_below)`` aligned with the rows without FREE
        rows: ``on_host`` is True for host rows, whose counts are those of the host stack;
        the other rows' counts are those of `stack_depths` on the device stack.

    Raises:
        ScheduleError: a release out of stack order on either level, or a slot used
            before it was saved.
    """
    actions = np.asarray(actions).reshape(-1, 3)
    op = actions[:, 0]
    host = op >= _FIRST_HOST_OP
    # Each level seen alone: the other level's slot rows become empty advances.
    device_view = actions.copy()
    device_view[host] = (_ADV, 0, 0)
    host_view = actions.copy()
    host_view[:, 0] = _AS_DEVICE[op]
    host_view[~host & _DEVICE_SLOT_OPS[op]] = (_ADV, 0, 0)
    nh_d, ni_d, bad_d = _depths(device_view)
    nh_h, ni_h, bad_h = _depths(host_view)
    bad = min(b for b in (bad_d, bad_h, len(actions)) if b >= 0)
    if bad < len(actions):
        raise ScheduleError(
            f"memento.planning.internals.two_level_depths: row {bad} "
            f"{tuple(int(v) for v in actions[bad])} releases a slot out of stack order on "
            "its level or uses a slot never saved; each level's slots must be used as a "
            "stack (the planner's are)"
        )
    keep = ~_IS_ANY_FREE[op]
    return host[keep], np.where(host, nh_h, nh_d)[keep], np.where(host, ni_h, ni_d)[keep]


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
