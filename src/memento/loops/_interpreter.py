"""The schedule interpreter shared by `memento.scan` and `memento.while_loop`.

`memento.scan` runs a `Program` (below); `memento.while_loop` plans at run time, once the
number of steps is known, and runs the same building blocks (`advance_steps`,
`apply_pullback`) from its own loop.

A schedule (see `memento.planning`) is turned into a `Program`: small integer arrays that
the compiled code reads as data. The program size therefore does not depend on the number
of steps: the body is traced once for each kind of work (primal step, step with residuals,
pullback), whatever the schedule.

The backward pass is two nested ``while_loop``s. The outer one walks the steps to
back-propagate, t-1 down to 0. For each, the inner one runs the *primal* rows the
schedule puts before that step's backward (advance, save, load; dispatched by
``lax.switch`` on an unbatched opcode), then the step is back-propagated once, either from
its stored internal state or fused with one more forward evaluation. Cotangents of the
consts are accumulated once per step, as ``lax.scan``'s own transpose does.

Slots live in preallocated typed pools, one per dtype (`_pool`), shared by hidden states
and internal states (the stored residual leaves, plus the output carry when the schedule
loads it) at offsets fixed by the state's place on the schedule's stack.

Two-level plans (`memento.plan` with ``host_memory=``) keep a second set of pools for the
host slots, a stack of its own (`memento.planning.internals.two_level_depths`), placed in host
memory where JAX has it (`_pool.host_space`). A host row runs as its device counterpart on
those pools: a store copies the state out (a write into a host pool), a load copies it
back inside the ``switch`` branch that takes it as the working state, a backward step
from a host internal state copies it back inside its own branch. Each copy is issued by
the row that needs it; XLA may overlap it with the compute of the same row, but nothing
is prefetched a row ahead (the planner's ``overlap="step"`` model assumes a load is
prefetched during the backward step before it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..planning import Op, Schedule
from . import _pool
from ._body import Body, ResidualSpec, split

Index = int | jax.Array  # a position, static or traced

# Indices of the primal branches of the inner switch.
_PRIMAL_OPS = (
    Op.ADVANCE,
    Op.SAVE_HIDDEN,
    Op.SAVE_INTERNAL,
    Op.LOAD_HIDDEN,
    Op.LOAD_INTERNAL,
    Op.HOST_SAVE_HIDDEN,
    Op.HOST_SAVE_INTERNAL,
    Op.HOST_LOAD_HIDDEN,
    Op.HOST_LOAD_INTERNAL,
)
_BRANCH = np.full(max(Op) + 1, -1, dtype=np.int32)
for _i, _op in enumerate(_PRIMAL_OPS):
    _BRANCH[_op] = _i


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A schedule compiled to arrays (all NumPy; handed to the compiled program at run
    time by `runtime_arrays`, never embedded in it).

    A stored state is placed by ``(nh, ni)``, the hidden and internal states below it on
    the schedule's stack (`_pool`); the two counts have a column each.

    Attributes:
        num_steps: t.
        save_hidden: ``(t, 2)``: ``(nh, ni)`` of the hidden state ``h_p`` saved during the
            first sweep, or ``(-1, -1)``.
        save_internal: ``(t, 2)``: ``(nh, ni)`` of step ``p``'s internal state saved in the
            sweep, or ``(-1, -1)``.
        fused_last: whether step t-1 is back-propagated fused (its residuals then go from
            the forward pass to the backward pass as the working state).
        primal_rows: ``(n, 4)`` rows ``(branch, a, b, pos)`` run in the backward pass:
            ``(a, b) = (nh, ni)`` for saves and loads (``(-1, 0)``: ``h_0``), ``a`` the
            count of an advance.
        segment_end: ``(t,)``: for the k-th backward (step t-1-k), primal rows
            ``[segment_end[k-1], segment_end[k])`` run before it.
        backward_rows: ``(t, 4)``: ``(fused?, nh, ni, host?)`` of the k-th backward.
        tops: ``(k, 2)`` distinct ``(nh, ni)`` on the stack after a save; they size the
            pools.
        loads_internal: whether the internal slots must also hold the output carry.
        host_save_hidden, host_save_internal: as ``save_hidden``/``save_internal``, for
            the host slots of a two-level plan (all ``-1`` for one level).
        host_tops: as ``tops``, for the host stack (no rows: no host slots).
    """

    num_steps: int
    save_hidden: np.ndarray
    save_internal: np.ndarray
    fused_last: bool
    primal_rows: np.ndarray
    segment_end: np.ndarray
    backward_rows: np.ndarray
    tops: np.ndarray
    loads_internal: bool
    host_save_hidden: np.ndarray
    host_save_internal: np.ndarray
    host_tops: np.ndarray

    @property
    def runtime_bytes(self) -> int:
        """Bytes of the rows the passes read at run time (`runtime_arrays`): device memory
        outside the slots' budget (a few tens of bytes a step), and the first sweep's
        tables of saves (three int32 per save and per kind, and a sentinel: O(slots),
        which a large budget makes O(t))."""
        kinds = (self.save_hidden, self.save_internal, self.host_save_hidden)
        saves = sum(int((a[:, 0] >= 0).sum()) + 1 for a in (*kinds, self.host_save_internal))
        rows = self.primal_rows.nbytes + self.segment_end.nbytes + self.backward_rows.nbytes
        return rows + 3 * 4 * saves

    @property
    def has_host(self) -> bool:
        """Whether the program uses host slots (a two-level plan)."""
        return len(self.host_tops) > 0

    @property
    def any_fused(self) -> bool:
        """Whether a backward after the first is fused (the first is special-cased)."""
        return bool(self.backward_rows[1:, 0].any())

    @property
    def any_internal(self) -> bool:
        """Whether a backward after the first reads a device internal slot."""
        rest = self.backward_rows[1:]
        return bool(((rest[:, 0] == 0) & (rest[:, 3] == 0)).any())

    @property
    def any_host_internal(self) -> bool:
        """Whether a backward after the first reads a host internal slot."""
        return bool((self.backward_rows[1:, 3] == 1).any())

    @property
    def sweep_saves_internal(self) -> bool:
        return bool((self.save_internal[:, 0] >= 0).any())

    @property
    def sweep_saves_hidden(self) -> bool:
        return bool((self.save_hidden[:, 0] >= 0).any())

    @property
    def sweep_host_saves_internal(self) -> bool:
        return bool((self.host_save_internal[:, 0] >= 0).any())

    @property
    def sweep_host_saves_hidden(self) -> bool:
        return bool((self.host_save_hidden[:, 0] >= 0).any())


@dataclasses.dataclass(frozen=True)
class RowsFloor:
    """The least any one-level schedule of ``num_steps`` steps that saves at most
    ``internal`` internal states in its first sweep costs, compiled to a `Program`
    (`rows_floor`): ``evaluations`` of the step, ``primal_rows``, and the rows'
    ``runtime_bytes`` (`Program.runtime_bytes`)."""

    evaluations: int
    primal_rows: int
    runtime_bytes: int


# A primal row, and a step's backward row with its entry in ``segment_end`` (int32 each).
_PRIMAL_ROW_BYTES = 16
_BACKWARD_ROW_BYTES = 20


def rows_floor(num_steps: int, internal: int) -> RowsFloor:
    """What every schedule of ``num_steps`` steps saving at most ``internal`` internal
    states in its first sweep takes at least, so the rows can be ruled out before a
    schedule is planned (at 10^6 steps that takes seconds).

    Each step's backward needs its internal state: saved in the sweep, or computed once
    more after it (one evaluation, after a primal row that loads a state or advances to
    it), but for the last step's, which the sweep may hand to its backward as it is. Each
    step has a backward row; the tables of saves have a sentinel per kind."""
    again = max(0, num_steps - 1 - max(0, internal))
    runtime = _BACKWARD_ROW_BYTES * num_steps + _PRIMAL_ROW_BYTES * again + 3 * 4 * 4
    return RowsFloor(num_steps + again, again, runtime)


def compile_schedule(schedule: Schedule) -> Program:
    """Turns a schedule into a `Program`, in vectorised NumPy (O(rows), no Python loop).

    The schedule is not replayed here (a replay is a Python loop over millions of rows at
    T = 10^6): the planner's schedules are replayed by its tests, and a handmade schedule
    can be checked with `Schedule.simulate` first. Stack order is checked (`_pool`).

    Args:
        schedule: a schedule whose slots are used as a stack (the planner's are).
    """
    t = schedule.num_steps
    rows, tops, host_tops = _pool.stack_rows(schedule)
    # One contiguous copy of each column: at 10^7 steps (5 * 10^7 rows) every pass over a
    # strided column costs a tenth of a second.
    op, a, b, pos = (np.ascontiguousarray(rows[:, k]) for k in range(4))
    is_bw = (op == Op.BACKWARD_FUSED) | (op == Op.BACKWARD_INTERNAL)
    is_bw |= op == Op.HOST_BACKWARD_INTERNAL
    first_bw = int(np.argmax(is_bw))

    save_hidden = np.full((t, 2), -1, np.int32)
    save_internal = np.full((t, 2), -1, np.int32)
    host_save_hidden = np.full((t, 2), -1, np.int32)
    host_save_internal = np.full((t, 2), -1, np.int32)
    sweep_op = op[:first_bw]
    for code, out in (
        (Op.SAVE_HIDDEN, save_hidden),
        (Op.SAVE_INTERNAL, save_internal),
        (Op.HOST_SAVE_HIDDEN, host_save_hidden),
        (Op.HOST_SAVE_INTERNAL, host_save_internal),
    ):
        saves = np.flatnonzero(sweep_op == code)
        out[pos[saves], 0] = a[saves]
        out[pos[saves], 1] = b[saves]

    bw_mask = is_bw[first_bw:]
    bw = np.flatnonzero(bw_mask) + first_bw
    prim = np.flatnonzero(~bw_mask) + first_bw
    # Number of primal rows before each backward row (after the first): its index in the
    # rest of the rows less the backward rows before it.
    segment_end = (bw - first_bw - np.arange(len(bw))).astype(np.int32)
    primal_rows = np.empty((len(prim), 4), np.int32)
    primal_rows[:, 0] = _BRANCH[op[prim]]
    primal_rows[:, 1] = a[prim]
    primal_rows[:, 2] = b[prim]
    primal_rows[:, 3] = pos[prim]
    backward_rows = np.empty((len(bw), 4), np.int32)
    backward_rows[:, 0] = op[bw] == Op.BACKWARD_FUSED
    backward_rows[:, 1] = a[bw]
    backward_rows[:, 2] = b[bw]
    backward_rows[:, 3] = op[bw] == Op.HOST_BACKWARD_INTERNAL
    return Program(
        num_steps=t,
        save_hidden=save_hidden,
        save_internal=save_internal,
        fused_last=bool(op[first_bw] == Op.BACKWARD_FUSED),
        primal_rows=primal_rows,
        segment_end=segment_end,
        backward_rows=backward_rows,
        tops=tops,
        loads_internal=bool(((op == Op.LOAD_INTERNAL) | (op == Op.HOST_LOAD_INTERNAL)).any()),
        host_save_hidden=host_save_hidden,
        host_save_internal=host_save_internal,
        host_tops=host_tops,
    )


def runtime_arrays(arrays) -> list:
    """NumPy arrays as values the compiled program receives when it runs, not constants.

    A schedule has O(t) rows. As constants they would make the program grow with the
    number of steps, and XLA:GPU compiles a large constant slowly. They come instead from
    one ``jax.pure_callback`` with no operands, which hands the host's arrays to the
    device each time the program runs (a copy of the rows, once per pass). With no
    operands it is bound outside every transformation: never batched under ``vmap``, no
    tangent under ``jvp`` (so Hessians are unaffected), one
    call per device under ``shard_map``, and under ``jit`` with sharded inputs one call
    whose result XLA broadcasts to the other devices, outside the loops.

    The cost: ``jax.export`` cannot serialise a host callback, so a program that runs
    schedule rows cannot be exported (JAX raises ``NotImplementedError``; see
    docs/limitations.md). The recursion (HSM) has no rows and exports.
    """
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    if not arrays:
        return []
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    out = jax.pure_callback(lambda: arrays, shapes, vmap_method="broadcast_all")
    return list(out)


# ----------------------------------------------------------------------------------------
# Slot buffers


@dataclasses.dataclass
class Slots:
    """The slot pools: typed arrays (see `_pool`); ``host``: the host level's."""

    pools: list
    host: list = dataclasses.field(default_factory=list)


jax.tree_util.register_dataclass(Slots, data_fields=["pools", "host"], meta_fields=[])


@dataclasses.dataclass(frozen=True, eq=False)
class _Layout:
    """How one body's states are laid out in the pools for one program.

    A place ``at`` is ``(nh, ni)``: the hidden and internal states below the state on the
    schedule's stack, which fixes its entry in every pool (`_pool.Pools`); ``nh = -1``
    on a hidden load is the caller's ``h_0``.
    """

    pools: _pool.Pools
    has_hidden: bool  # whether any hidden state is stored (else h_0 is the only one)

    @staticmethod
    def of(
        prog: Program,
        body: Body,
        spec: ResidualSpec,
        tagged: bool | None = None,
        *,
        host: bool = False,
    ) -> _Layout:
        """The device level's layout, or with ``host`` the host level's."""
        extra = tuple(body.carry_avals) if prog.loads_internal else ()
        internal = tuple(spec.stored) + extra
        tagged = _pool.checks_enabled() if tagged is None else tagged
        tops = prog.host_tops if host else prog.tops
        pools = _pool.Pools.of(body.carry_avals, internal, tops, tagged=tagged, host=host)
        return _Layout(pools, bool((tops[:, 0] > 0).any()))

    @property
    def tagged(self) -> bool:
        return self.pools.tagged

    def _get(self, slots: Slots) -> list:
        return slots.host if self.pools.host else slots.pools

    def _set(self, slots: Slots, pools: list) -> Slots:
        return Slots(slots.pools, pools) if self.pools.host else Slots(pools, slots.host)

    def _tag(self, leaves, tag) -> list:
        return [*leaves, jnp.asarray(tag, jnp.int32)] if self.tagged else list(leaves)

    def _untag(self, stored, at, kind, want, active, what) -> list:
        """The leaves without their tag, checking it against ``want`` (debug mode)."""
        if not self.tagged:
            return stored
        ok = (stored[-1] == want) & self.pools.in_bounds(at[0], at[1], kind)
        _pool.check(jnp.logical_not(active) | ok, what)
        return stored[:-1]

    def save_hidden(self, slots: Slots, at, c, when=None, *, pos: Index = 0) -> Slots:
        """Stores ``c = h_pos`` at ``at`` (where ``when`` holds)."""
        if self.tagged:
            ok = self.pools.in_bounds(at[0], at[1], "h")
            _pool.check(
                ok if when is None else jnp.logical_not(when) | ok, "a hidden save out of the pools"
            )
        pools = self.pools.write(self._get(slots), at[0], at[1], self._tag(c, 2 * pos), "h", when)
        return self._set(slots, pools)

    def load_hidden(self, slots: Slots, init, at, *, pos: Index = 0, active=True):
        """``h`` stored at ``at``, or ``init`` for ``nh = -1`` (the caller's ``h_0``);
        in debug mode, checked to be ``h_pos`` where ``active``."""
        if not self.has_hidden:
            return list(init)
        avals = self.pools.hidden_avals
        stored = self.pools.read(self._get(slots), at[0], at[1], "h", stored=True)
        stored = self._untag(
            stored, at, "h", 2 * pos, active & (at[0] >= 0), "a hidden state loaded is not h_pos"
        )
        return [
            _pool.from_storage(_pool.pick(at[0] < 0, _pool.to_storage(a, v), b), v)
            for a, b, v in zip(init, stored, avals)
        ]

    def save_internal(self, slots: Slots, at, leaves, when=None, *, pos: Index = 0) -> Slots:
        """Stores step ``pos``'s internal state at ``at`` (where ``when`` holds)."""
        if self.tagged:
            ok = self.pools.in_bounds(at[0], at[1], "i")
            _pool.check(
                ok if when is None else jnp.logical_not(when) | ok,
                "an internal save out of the pools",
            )
        tagged = self._tag(leaves, 2 * pos + 1)
        return self._set(slots, self.pools.write(self._get(slots), at[0], at[1], tagged, "i", when))

    def load_internal(self, slots: Slots, at, *, step: Index = 0, active=True):
        """The internal state stored at ``at``; in debug mode checked to be step
        ``step``'s where ``active``."""
        stored = self.pools.read(self._get(slots), at[0], at[1], "i")
        return self._untag(
            stored, at, "i", 2 * step + 1, active, "an internal state loaded is not the step's"
        )


def pool_bytes(prog: Program, body: Body, spec: ResidualSpec, *, host: bool = False) -> int:
    """Bytes of the slot pools that running ``prog`` on ``body`` allocates (``host``: of
    the host level's pools)."""
    # tags are not the budget's
    return _Layout.of(prog, body, spec, tagged=False, host=host).pools.nbytes


def _layouts(prog: Program, body: Body, spec: ResidualSpec, place: bool):
    """The device level's layout, the host level's (None for one level), and the slots
    both allocate (the host's in host memory if ``place`` and there is one)."""
    layout = _Layout.of(prog, body, spec)
    host = _Layout.of(prog, body, spec, host=True) if prog.has_host else None
    host_pools = host.pools.allocate(place=place) if host is not None else []
    return layout, host, Slots(layout.pools.allocate(), host_pools)


def read_index(a, i):
    """``a[i]`` along the first axis, for ``0 <= i < len(a)`` (in range by construction;
    shared with `_recursion`)."""
    return lax.dynamic_index_in_dim(a, i, 0, keepdims=False, allow_negative_indices=False)


# XLA:CPU runs the ops of a computation (a loop body, a branch, the program) one after
# the other in the calling thread only while every array they touch, those of the loops
# and conditionals they hold included, has at most this many bytes (its ThunkExecutor's
# ``execute_sequential_buffer_threshold``); otherwise as a dataflow graph over its thread
# pool, which costs a tiny step microseconds more. `memento.while_loop` keeps its loops
# under it where the carry is small.
SMALL_ARRAY_BYTES = 512


def read_table(table: np.ndarray, i, pieces: int):
    """``table[i]`` for a constant 1-D NumPy ``table`` and ``0 <= i < len(table)``.

    Where ``pieces`` constants of equal length hold it within `SMALL_ARRAY_BYTES` each,
    it is split so, each piece read at ``i`` (clamped) and the right one selected: one
    fusion, and a loop that reads it stays one that XLA:CPU runs op after op. A longer
    table is read whole. The number of pieces is fixed, not their length, so tables of
    any length up to that bound are read by the same program (but for the constants'
    shapes): it does not grow with the table.
    """
    n = max(1, -(-len(table) // pieces))  # rows per piece
    if n * table.itemsize > SMALL_ARRAY_BYTES:
        return read_index(jnp.asarray(table), i)
    padded = np.resize(table, n * pieces)  # the pad repeats rows, never read
    out = read_index(jnp.asarray(padded[:n]), i)
    for start in range(n, n * pieces, n):
        # A negative offset clamps to 0 (not wrapped); that piece is not selected.
        v = read_index(jnp.asarray(padded[start : start + n]), i - start)
        out = lax.select(i >= start, v, out)
    return out


def x_at(xs, p) -> list:
    """Step p's slice of ``xs``; ``xs`` may be a function of p (`memento.while_loop`'s
    ``active`` input)."""
    if callable(xs):
        return xs(p)  # pyright: ignore[reportReturnType]
    return [
        lax.dynamic_index_in_dim(x, p, 0, keepdims=False, allow_negative_indices=False) for x in xs
    ]


# ----------------------------------------------------------------------------------------
# Building blocks shared with `memento.while_loop`, whose plan is made at run time.


def advance_steps(body: Body, consts, c, xs, pos, count, unroll: int = 1):
    """``count`` primal steps from the state ``c = h_pos`` (both may be traced values).

    ``unroll`` steps per loop iteration, as ``lax.scan``'s ``unroll``: ``count // unroll``
    iterations of ``unroll`` steps, then the rest (fewer than ``unroll``) one per
    iteration. A loop iteration has a fixed cost (on a GPU a launch and a predicate read
    back, several microseconds), which a small body does not hide.
    """

    def one(i, c):
        return body(consts, c, x_at(xs, pos + i))[0]

    if unroll <= 1:
        return lax.fori_loop(0, count, one, c)

    def block(state):
        i, c = state
        for j in range(unroll):
            c = one(i + j, c)
        return i + unroll, c

    # ``count - i >= unroll``, not ``i + unroll <= count``: nothing wraps near 2^31.
    start = (jnp.zeros((), jnp.result_type(count)), c)
    i, c = lax.while_loop(lambda s: count - s[0] >= unroll, block, start)
    return lax.fori_loop(i, count, one, c)


def unroll_factor(unroll: int | bool, num_steps: int) -> int:
    """Steps per loop iteration for ``lax.scan``'s ``unroll`` argument: ``True`` is every
    step (``num_steps``), ``False`` one; an int at least 1, at most ``num_steps``."""
    k = num_steps if unroll is True else 1 if unroll is False else int(unroll)
    return max(1, min(k, num_steps))


def apply_pullback(pullback, ct_c, ct_y):
    """``(ct_consts_f, ct_carry_f, ct_x_f)`` of one step from its pullback (float leaves)."""
    d_k, d_c, d_x = pullback((list(ct_c), list(ct_y)))
    return list(d_k), list(d_c), list(d_x)


# ----------------------------------------------------------------------------------------
# The forward pass: the first sweep


def run_sweep(prog: Program, body: Body, spec: ResidualSpec, consts, init, xs, *, unroll=1):
    """Runs the first sweep, filling the slots the schedule saves on the way.

    Returns:
        ``(carry, ys, slots, working)``: the final carry and all outputs, as ``lax.scan``;
        the slots; and, when the last step is back-propagated fused, its stored residuals
        (the paper's working internal state, kept from the forward to the backward pass),
        else ``None``.
    """
    t = prog.num_steps
    place = not _pool.under_forward_mode(jax.tree_util.tree_leaves((consts, init, xs)))
    layout, host, slots = _layouts(prog, body, spec, place)
    n_sweep = t - 1 if prog.fused_last else t
    has_internal = prog.sweep_saves_internal
    has_host_internal = prog.sweep_host_saves_internal

    def save_step(c, slots, x, at, p):
        """The step, its internal state stored on the level whose place ``at`` names
        (``(device place, host place)``; ``-1`` where that level stores nothing)."""
        c_new, y, res = body.save(spec, consts, c, x)
        leaves = res + (c_new if prog.loads_internal else [])
        both = None not in at  # then each level writes where its place is set
        for level, si in zip((layout, host), at):
            if si is not None:
                slots = level.save_internal(slots, si, leaves, si[0] >= 0 if both else None, pos=p)
        return c_new, y, slots

    def primal_step(c, slots, x, si, p):
        c_new, y = body(consts, c, x)
        return c_new, y, slots

    # The sweep's saves are few (each slot is written at most once in the first sweep):
    # per kind (device hidden, device internal, host hidden, host internal) the positions
    # that save, in order, with their places (nh, ni), and a sentinel position past every
    # step. A pointer per kind walks them. So the sweep reads O(slots) run-time data
    # (`runtime_arrays`, one callback), not O(t) columns, and carries the step number
    # rather than scanning an ``arange`` (O(t) memory both).
    never = np.iinfo(np.int32).max
    columns = []
    for a in (prog.save_hidden, prog.save_internal, prog.host_save_hidden, prog.host_save_internal):
        at = np.flatnonzero(a[:n_sweep, 0] >= 0)
        columns += [np.append(at, never), np.append(a[at, 0], -1), np.append(a[at, 1], -1)]
    tables = runtime_arrays([t.astype(np.int32) for t in columns]) if n_sweep else []

    def save_at(kind, ptr, p):
        """``(nh, ni)`` where the sweep saves ``kind`` at step p, ``(-1, -1)`` if not,
        and whether it does."""
        pos, nh, ni = tables[3 * kind : 3 * kind + 3]
        hit = read_index(pos, ptr) == p
        return jnp.where(hit, read_index(nh, ptr), -1), jnp.where(hit, read_index(ni, ptr), -1), hit

    def step(state, _):
        p, c, slots, ptrs = state
        (sh_h, sh_i, h0), (si_h, si_i, h1), (hh_h, hh_i, h2), (hi_h, hi_i, h3) = (
            save_at(k, ptrs[k], p) for k in range(4)
        )
        ptrs = [q + hit.astype(jnp.int32) for q, hit in zip(ptrs, (h0, h1, h2, h3))]
        x = x_at(xs, p)
        if prog.sweep_saves_hidden:
            slots = layout.save_hidden(slots, (sh_h, sh_i), c, sh_h >= 0, pos=p)
        if host is not None and prog.sweep_host_saves_hidden:
            slots = host.save_hidden(slots, (hh_h, hh_i), c, hh_h >= 0, pos=p)
        if has_internal or has_host_internal:
            # Write-or-identity: the pools stay in place, and steps that store nothing
            # run the primal only. One conditional for both levels: a switch with a branch
            # per level hands each branch the other's pool, and XLA copies them.
            at = (
                (si_h, si_i) if has_internal else None,
                (hi_h, hi_i) if has_host_internal else None,
            )
            store = [si >= 0 for si, on in ((si_h, has_internal), (hi_h, has_host_internal)) if on]
            store = store[0] | store[1] if len(store) == 2 else store[0]
            c_new, y, slots = lax.cond(store, save_step, primal_step, c, slots, x, at, p)
        else:
            c_new, y, slots = primal_step(c, slots, x, None, p)
        return (p + 1, c_new, slots, ptrs), y

    if n_sweep > 0:
        state = (jnp.int32(0), list(init), slots, [jnp.int32(0)] * 4)
        (_, c, slots, _), ys = lax.scan(step, state, None, length=n_sweep, unroll=unroll)
    else:
        c, ys = list(init), [jnp.zeros((0, *a.shape), a.dtype) for a in body.y_avals]
    working = None
    if prog.fused_last:
        x_last = [x[t - 1] for x in xs]
        if prog.save_hidden[t - 1, 0] >= 0:
            at = tuple(int(v) for v in prog.save_hidden[t - 1])
            slots = layout.save_hidden(slots, at, c, pos=t - 1)
        if host is not None and prog.host_save_hidden[t - 1, 0] >= 0:
            at = tuple(int(v) for v in prog.host_save_hidden[t - 1])
            slots = host.save_hidden(slots, at, c, pos=t - 1)
        c, y_last, working = body.save(spec, consts, c, x_last)
        ys = [jnp.concatenate([a, b[None]]) for a, b in zip(ys, y_last)]
    return c, ys, slots, working


# ----------------------------------------------------------------------------------------
# The backward pass


def run_backward(
    prog: Program,
    body: Body,
    spec: ResidualSpec,
    consts,
    init,
    xs,
    slots,
    working,
    ct_carry,
    ct_ys,
    *,
    need_consts=None,
    need_xs=None,
    unroll: int = 1,
):
    """Back-propagates through all steps following the program.

    Args:
        ct_carry: cotangent of the final carry (float leaves only).
        ct_ys: cotangents of the stacked outputs (float leaves only).
        need_consts, need_xs: which float leaves of consts and xs need a cotangent
            (default all). The others are neither accumulated nor stored: a cotangent of
            ``xs`` alone is as large as ``xs``.
        unroll: steps per iteration of the recomputation loops (`advance_steps`).

    Returns:
        ``(ct_consts_f, ct_init_f, ct_xs_f)``, float leaves only; ``None`` where not needed.
    """
    kf, _ = split(consts, body.const_mask)
    xs_f, _ = split(xs, body.x_mask)
    need_k = list(need_consts) if need_consts is not None else [True] * len(kf)
    need_x = list(need_xs) if need_xs is not None else [True] * len(xs_f)
    walk = _Backward(prog, body, spec, consts, init, xs, working, ct_ys, need_k, need_x, unroll)
    ct_k0 = [jnp.zeros_like(k) for k, n in zip(kf, need_k) if n]
    ct_xs0 = [jnp.zeros_like(x) for x, n in zip(xs_f, need_x) if n]
    ct_c, ct_k, ct_xs = walk.run(slots, list(ct_carry), ct_k0, ct_xs0)
    ct_k, ct_xs = iter(ct_k), iter(ct_xs)
    return (
        [next(ct_k) if n else None for n in need_k],
        ct_c,
        [next(ct_xs) if n else None for n in need_x],
    )


class _Backward:
    """`run_backward`'s walk: the outer loop over the steps to back-propagate, t-1 down
    to 0, and for each the primal rows before it (`primal`), then its backward step.

    Debug mode (`_pool.checks_enabled`) also tracks ``cur``, the working state's
    position: a row that runs from the working state must find it at its position.
    """

    def __init__(self, prog, body, spec, consts, init, xs, working, ct_ys, need_k, need_x, unroll):
        self.prog, self.body, self.spec = prog, body, spec
        self.consts, self.init, self.xs, self.working, self.ct_ys = consts, init, xs, working, ct_ys
        self.need_k, self.need_x, self.unroll = need_k, need_x, unroll
        self.layout = _Layout.of(prog, body, spec)
        self.host = _Layout.of(prog, body, spec, host=True) if prog.has_host else None
        self.n_stored = len(spec.stored)
        self.track = self.layout.tagged
        # The rows are run-time data (`runtime_arrays`), one callback for the backward.
        self.primal_rows, self.segment_end, self.backward_rows = runtime_arrays(
            (prog.primal_rows, prog.segment_end, prog.backward_rows)
        )
        branches = set(prog.primal_rows[:, 0].tolist())
        self.has = {op for op in _PRIMAL_OPS if _BRANCH[op] in branches}  # the row kinds present

    def run(self, slots, ct_c, ct_k, ct_xs):
        """``(ct_c, ct_k, ct_xs)`` after every step's backward."""
        prog, t = self.prog, self.prog.num_steps
        # The first backward: step t-1, from the working state or from its internal slot.
        first_slot = (int(prog.backward_rows[0, 1]), int(prog.backward_rows[0, 2]))
        ct_c, ct_k, ct_xs = self.step(
            self._first_bw(), self.init, slots, first_slot, t - 1, ct_c, ct_k, ct_xs
        )
        # The working state starts as h_0 (unused until a row loads or advances from
        # it), so cur starts at 0.
        state = (jnp.int32(1), list(self.init), slots, ct_c, ct_k, ct_xs, jnp.int32(0))
        if t > 1:
            state = lax.while_loop(lambda s: s[0] < t, self._segment, state)
        return state[3], state[4], state[5]

    def _segment(self, state):
        """The primal rows before the ``k``-th backward step, then that step."""
        k, c, slots, ct_c, ct_k, ct_xs, cur = state
        c, slots, cur = self.primal(c, slots, self.segment_end[k - 1], self.segment_end[k], cur)
        rows = self.backward_rows
        fused, slot = rows[k, 0], (rows[k, 1], rows[k, 2])
        p = self.prog.num_steps - 1 - k
        if self.track:
            _pool.check((fused == 0) | (cur == p), "a fused backward's state is not h_p")
        bw = self._bw_of(fused, rows[k, 3])
        ct_c, ct_k, ct_xs = self.step(bw, c, slots, slot, p, ct_c, ct_k, ct_xs)
        return k + 1, c, slots, ct_c, ct_k, ct_xs, cur

    # -- one backward --------------------------------------------------------------------
    # The pool may be *read* inside a conditional (only handing it back copies it), so a
    # stored backward reads its slot in its own branch and fused ones read nothing.

    def step(self, bw, c, slots, slot, p, ct_c, ct_k, ct_xs):
        """Step ``p``'s backward by ``bw``, its cotangents added to the running ones."""
        ct_y = [lax.dynamic_index_in_dim(y, p, 0, keepdims=False) for y in self.ct_ys]
        d_k, d_c, d_x = bw(c, slots, slot, p, ct_c, ct_y)
        d_k = [d for d, n in zip(d_k, self.need_k) if n]  # the rest is dead code for XLA
        d_x = [d for d, n in zip(d_x, self.need_x) if n]
        ct_k = [a + b for a, b in zip(ct_k, d_k)]
        ct_xs = [
            lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), p, 0) for a, b in zip(ct_xs, d_x)
        ]
        return d_c, ct_k, ct_xs

    def _fused_bw(self, c, slots, slot, p, ct_c, ct_y):
        b = self.body
        return apply_pullback(b.linearize(self.consts, c, x_at(self.xs, p))[2], ct_c, ct_y)

    def _stored_from(self, level):
        def stored_bw(c, slots, slot, p, ct_c, ct_y):
            stored = level.load_internal(slots, slot, step=p)[: self.n_stored]  # (nh, ni)
            pullback = self.body.restore(self.spec, stored, self.consts, x_at(self.xs, p))
            return apply_pullback(pullback, ct_c, ct_y)

        return stored_bw

    def _first_bw(self):
        if self.prog.fused_last:

            def first_bw(c, slots, slot, p, ct_c, ct_y):
                b, x = self.body, x_at(self.xs, p)
                return apply_pullback(
                    b.restore(self.spec, self.working, self.consts, x), ct_c, ct_y
                )

            return first_bw
        return self._stored_from(self.host if self.prog.backward_rows[0, 3] else self.layout)

    def _bw_of(self, fused, on_host):
        """The backward of a step whose row says ``fused`` and ``on_host``: a switch over
        the kinds this program has, fused (code 0), from a device internal state (1), from
        a host one (2); the pullbacks' results are plain arrays, so the branches agree."""
        prog, host = self.prog, self.host
        kinds = [
            (code, fn)
            for code, has, fn in (
                (0, prog.any_fused, self._fused_bw),
                (1, prog.any_internal, self._stored_from(self.layout)),
                (2, prog.any_host_internal, self._stored_from(host) if host is not None else None),
            )
            if has and fn is not None
        ]
        if not kinds:
            return self._stored_from(self.layout)
        if len(kinds) == 1:
            return kinds[0][1]
        code = jnp.where(fused == 1, 0, jnp.where(on_host == 1, 2, 1))
        branch_of = np.zeros(3, np.int32)
        for i, (c_, _) in enumerate(kinds):
            branch_of[c_] = i
        kind, branches = jnp.asarray(branch_of)[code], [fn for _, fn in kinds]

        def bw(c, slots, slot, p, ct_c, ct_y):
            return lax.switch(kind, branches, c, slots, slot, p, ct_c, ct_y)

        return bw

    # -- the primal rows -----------------------------------------------------------------
    # XLA copies a buffer that goes through a conditional whose branches both read it
    # and hand it back; a branch that writes it, against one that passes it unchanged,
    # stays in place. So slot reads happen outside any conditional, hidden saves are
    # masked writes, internal saves a write-or-identity ``cond``, and the ``switch``
    # only sees the (small) working carry.

    def primal(self, c, slots, lo, hi, cur):
        """Runs the primal rows ``lo`` to ``hi``: ``(c, slots, cur)`` after them."""
        if len(self.prog.primal_rows) == 0:  # e.g. everything stored: nothing to recompute
            return c, slots, cur
        _, c, slots, cur = lax.while_loop(
            lambda state: state[0] < hi, self._primal_row, (lo, c, slots, cur)
        )
        return c, slots, cur

    def _primal_row(self, state):
        pc, c, slots, cur = state
        rows, has, layout, host = self.primal_rows, self.has, self.layout, self.host
        # Each entry read on its own, as the sweep scans its columns one by one.
        branch, arg, pos = rows[pc, 0], rows[pc, 1], rows[pc, 3]
        at = (arg, rows[pc, 2])  # (nh, ni) of a save or load; arg: a count

        def is_(*ops):  # whether this row is one of ``ops``
            return functools.reduce(jnp.logical_or, [branch == _BRANCH[op] for op in ops])

        for op, level in ((Op.SAVE_INTERNAL, layout), (Op.HOST_SAVE_INTERNAL, host)):
            if op in has:
                keep = lambda c, s, *_: (c, s)  # noqa: E731
                saver = self._internal_saver(level)
                c, slots = lax.cond(is_(op), saver, keep, c, slots, at, pos)
        if Op.SAVE_HIDDEN in has:
            slots = layout.save_hidden(slots, at, c, is_(Op.SAVE_HIDDEN), pos=pos)
        if Op.HOST_SAVE_HIDDEN in has:
            assert host is not None
            slots = host.save_hidden(slots, at, c, is_(Op.HOST_SAVE_HIDDEN), pos=pos)
        loaded_h = loaded_i = c
        if Op.LOAD_HIDDEN in has:
            loaded_h = layout.load_hidden(slots, self.init, at, pos=pos, active=is_(Op.LOAD_HIDDEN))
        if Op.LOAD_INTERNAL in has:
            # LOAD_INTERNAL at pos: the output state of step pos - 1.
            loaded = layout.load_internal(slots, at, step=pos - 1, active=is_(Op.LOAD_INTERNAL))
            loaded_i = loaded[self.n_stored :]
        switch = jnp.asarray(_SWITCH_OF)[branch]
        c = lax.switch(switch, self._branches(), c, loaded_h, loaded_i, slots.host, *at, pos)
        if self.track:
            loads = is_(
                Op.LOAD_HIDDEN, Op.LOAD_INTERNAL, Op.HOST_LOAD_HIDDEN, Op.HOST_LOAD_INTERNAL
            )
            _pool.check(loads | (cur == pos), "a row's working state is not at its position")
            saves_i = is_(Op.SAVE_INTERNAL, Op.HOST_SAVE_INTERNAL)
            cur = jnp.select([is_(Op.ADVANCE), saves_i, loads], [pos + arg, pos + 1, pos], cur)
        return pc + 1, c, slots, cur

    def _internal_saver(self, level):
        def save_internal(c, slots, at, pos):
            c_new, _, res = self.body.save(self.spec, self.consts, c, x_at(self.xs, pos))
            extra = c_new if self.prog.loads_internal else []
            return c_new, level.save_internal(slots, at, res + extra, pos=pos)

        return save_internal

    def _branches(self) -> tuple:
        """The ``switch``'s branches (`_SWITCH_OF`), each ``(c, loaded_h, loaded_i,
        host_pools, arg, b, pos) -> c``: advance, keep, take the loaded hidden or internal
        state, load a host one. Host loads read the host pools inside their branch: the
        copy back runs only on the row that loads (a read in a branch leaves the pools in
        place). Every branch is traced: absent host loads keep the state."""
        host, n_stored = self.host, self.n_stored

        def advance(c, loaded_h, loaded_i, hpools, arg, b, pos):
            return advance_steps(self.body, self.consts, c, self.xs, pos, arg, self.unroll)

        def keep(c, loaded_h, loaded_i, hpools, arg, b, pos):
            return c

        def take_hidden(c, loaded_h, loaded_i, hpools, arg, b, pos):
            return loaded_h

        def take_internal(c, loaded_h, loaded_i, hpools, arg, b, pos):
            return loaded_i

        def take_host_hidden(c, loaded_h, loaded_i, hpools, arg, b, pos):
            assert host is not None  # host rows come with host slots
            return host.load_hidden(Slots([], hpools), self.init, (arg, b), pos=pos)

        def take_host_internal(c, loaded_h, loaded_i, hpools, arg, b, pos):
            assert host is not None  # host rows come with host slots
            return host.load_internal(Slots([], hpools), (arg, b), step=pos - 1)[n_stored:]

        return (
            advance,
            keep,
            take_hidden,
            take_internal,
            take_host_hidden if Op.HOST_LOAD_HIDDEN in self.has else keep,
            take_host_internal if Op.HOST_LOAD_INTERNAL in self.has else keep,
        )


# The switch index of each primal branch (`_PRIMAL_OPS`): ADVANCE, SAVE_H, SAVE_I,
# LOAD_H, LOAD_I, and the host's SAVE_H, SAVE_I, LOAD_H, LOAD_I (`_Backward._branches`).
_SWITCH_OF = np.asarray([0, 1, 1, 2, 3, 1, 1, 4, 5], np.int32)
