"""The binomial (HSM) recursion run on the device, shared by `scan` and `while_loop`.

Carries are kept in `memento.loops._pool`'s pools, the slot layout `scan`'s rows use too
(a leading entry axis; each leaf keeps its shape, dtype and sharding). The kept carries, in position order, form a stack with
``h_0`` (the caller's) at the bottom.
To back-propagate step e, look at the top of the stack, ``h_b`` with ``m = slots -
depth`` slots for itself and what is above; while ``t = e - b + 1 >= 3`` and ``m >= 2``,
advance ``y = hsm_split(t, m)`` steps from ``h_b`` and push ``h_{b+y}`` (at ``t = 2`` a
push saves no evaluation, so none is made). Then advance to ``h_e`` and back-propagate
step e fused; a carry is popped once its own step has been. This is Griewank and
Walther's binomial recursion (the paper's HSM, eq. (1)-(3)) unrolled one push at a time,
with the split computed on the device from its closed form (`memento.planning.internals.hsm_split`,
here from a table of binomials, `hsm_splitter`, or, in a loop that XLA:CPU can run in
order, from binomials stepped up a level at a time, `hsm_split_on_device`). No schedule
rows are materialised: the state is O(slots), and the table's size depends on the
budget only (`_binomials`).

`memento.while_loop` fills the stack online in its forward pass (n is unknown until the
predicate fails); `memento.scan` with the HSM policy fills it with the recursion's own
first pushes (`first_pushes`, the planner's first sweep), so that its forward and
backward passes together make exactly the optimal ``hsm_cost(t, m)`` evaluations.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from ..planning.internals import hsm_split
from . import _pool
from ._body import Body, split
from ._interpreter import advance_steps, apply_pullback, read_index, x_at

_SAT = (1 << 31) - 1  # binomials saturate here (int32); every count compared is below


# Every index here is in range by construction: reading and writing with lax's dynamic
# slices, negative indices not wrapped and conditions selected by `lax.select`, keeps
# the loops' programs (and their tracing) smaller than ``a[i]`` and ``jnp.where`` do.
_get = read_index  # ``a[i]`` along the first axis, for ``0 <= i < len(a)``


def _put(a, i, v):
    """``a.at[i].set(v)`` along the first axis, as an in-place update.

    Under explicit mesh axes (``jax.set_mesh``) every op types its result on the mesh,
    the update here included, but a constant (an array made from NumPy, such as a table
    of positions) has no mesh, and ``dynamic_update_slice`` wants both alike: such an
    ``a`` is first typed on the mesh, replicated (no data moves).
    """
    v = jnp.asarray(v).astype(a.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if (
        not mesh.empty
        and AxisType.Explicit in mesh.axis_types
        and jax.typeof(a).sharding.mesh.empty
    ):
        a = jax.sharding.reshard(a, P(*[None] * a.ndim))
    return lax.dynamic_update_index_in_dim(a, v, i, 0, allow_negative_indices=False)


def _pick(when, yes, no):
    """``jnp.where`` for a scalar ``when`` and values of one type.

    ``lax.select`` takes the scalar as it is: broadcast to the values' shape it would be
    replicated, and under explicit mesh axes a select refuses a predicate sharded
    otherwise than its cases.
    """
    dtype = jnp.result_type(yes, no)  # a Python int takes the other's type
    yes, no = jnp.asarray(yes, dtype), jnp.asarray(no, dtype)
    return lax.select(when, yes, no)


_TOP = _SAT  # splits are tabulated for every t an int32 step counter allows (the same bound)


@functools.lru_cache(maxsize=32)
def _binomials(slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``B(m, w) = binom(m + w, w)`` for ``4 <= m <= slots``, as far as splits of any
    int32 length look: a flat int32 table (saturated at ``_SAT``) and row offsets.

    Row m runs to the level ``W(m)``, the smallest w with ``B(m, w) >= 2^31 - 1``, so the
    table depends on the budget only, never on the number of steps: the program of a
    scan of 10^3 steps and of 10^8 is the same (XLA:GPU compiles large constants
    slowly). Rows 1 to 3 have closed forms (`_binomial`), and rows from 4 on
    are short: about 1.9 thousand entries at 100 slots, 6.9 thousand at 1000.
    """
    # Rows m >= 4 column by column (NumPy over m; a row ends at its first entry >= _TOP,
    # so the rows still open shrink fast).
    ms = np.arange(4, max(slots, 3) + 1, dtype=np.int64)
    lengths = np.ones(len(ms), np.int64)  # B(m, 0) = 1
    last = np.ones(len(ms), np.int64)
    columns = []
    open_ = np.flatnonzero(last < _TOP)
    w = 0
    while len(open_):
        w += 1
        last[open_] = np.minimum(last[open_] * (ms[open_] + w) // w, _SAT)
        lengths[open_] += 1
        columns.append((w, open_, last[open_]))
        open_ = open_[last[open_] < _TOP]
    offsets = np.zeros(max(slots, 3) + 1, np.int64)  # offsets[m], m = 0..slots (0 for m < 4)
    offsets[4:] = np.cumsum(np.array([0, *lengths]))[:-1]
    table = np.ones(max(int(lengths.sum()), 1), np.int64)  # column 0: B(m, 0) = 1
    for w, rows, values in columns:
        table[offsets[rows + 4] + w] = values
    return table.astype(np.int32), offsets.astype(np.int32)


def _binomial(tab, off, m, w):
    """``B(m, w) = binom(m + w, w)`` on int32 scalars, ``m >= 1``, ``w >= 0``, saturated
    at ``_SAT``: closed forms for m = 1 (``w + 1``), m = 2 (``(w + 1)(w + 2) / 2``) and
    m = 3 (that times ``(w + 3) / 3``), the table (`_binomials`) from m = 4 on.

    No product wraps: row 2 is computed for ``w <= 65534`` (halving the even factor
    first) and row 3 for ``w <= 2342`` (dividing by 3 before the last product), the last
    levels below 2^31 - 1; past them the value saturates.
    """
    small = jnp.minimum(w, 65534)
    s1, s2 = small + 1, small + 2
    tri = _pick(s1 % 2 == 0, (s1 // 2) * s2, s1 * (s2 // 2))
    tri = _pick(w >= 65535, jnp.int32(_SAT), tri)
    # binom(w + 3, 3) = tri * (w + 3) / 3 with tri = (q * 3 + r): q * (w + 3) is at most
    # the result, and r * (w + 3), a multiple of 3, is small.
    small3 = jnp.minimum(w, 2342)
    tri3 = ((small3 + 1) * (small3 + 2)) // 2
    q, r = tri3 // 3, tri3 % 3
    tet = _pick(w >= 2343, jnp.int32(_SAT), q * (small3 + 3) + (r * (small3 + 3)) // 3)
    row = _get(tab, _pick(m >= 4, _get(off, m) + w, 0))
    return _pick(m == 1, w + 1, _pick(m == 2, tri, _pick(m == 3, tet, row)))


def hsm_splitter(slots: int) -> Callable:
    """`memento.planning.internals.hsm_split` (high=True) on int32 scalars, for
    ``2 <= t < 2^31 - 1`` and ``2 <= m <= slots``, from closed forms and a table of
    binomials whose size depends on ``slots`` only (`_binomials`).

    The same closed form: ``1 + ism_split(t - 2, m)``, where the level w is the smallest
    with ``B(m, w) >= t`` (a search from w = 1, short but for the smallest m), then the
    split takes every increment below level w and the ties from g first. Three binomials
    and a few integer ops: the recursion runs it once per push, inside loops that XLA:CPU
    compiles as one kernel only while small (see `backward`).
    """
    table, offsets = _binomials(max(slots, 2))

    def split(t, m):
        tab, off = jnp.asarray(table), jnp.asarray(offsets)

        def b(m, w):  # binom(m + w, w), w >= 0
            return _binomial(tab, off, m, w)

        s = t - 2
        w = lax.while_loop(lambda w: b(m, w) < t, lambda w: w + 1, jnp.int32(1))
        base_g = _pick(w >= 2, b(m, jnp.maximum(w - 2, 0)) - 1, 0)
        h_level = b(m - 1, w - 1)  # binom(m + w - 2, w - 1)
        n_g = _pick(w >= 2, h_level, 0)
        taken = base_g + jnp.minimum(s - base_g - (h_level - 1), n_g)
        return 1 + _pick(s <= 0, 0, taken)

    return split


def _next_binomial(b, m, w):
    """``B(m, w) = binom(m + w, w)`` from ``b = B(m, w - 1) < 2^31 - 1``, saturated at
    ``_SAT``: ``b (m + w) / w = b + b m / w``, exact with no product wrapping.

    With ``q, r = divmod(b, w)``, ``b m / w = q m + r m / w``, all three integers. The
    level w and m are small together (``B(m, w - 1) < 2^31`` needs ``min(m, w) <= 17``,
    and w < 65536 for m >= 2), so ``r m < w m`` fits int32 for m below 10^8; ``q m`` is
    taken only where the sum stays below ``_SAT``.
    """
    q, r = b // w, b % w
    room = (_SAT - b) // m  # the largest q with b + q m <= _SAT
    base = b + jnp.minimum(q, room) * m
    exact = base + jnp.minimum((r * m) // w, _SAT - base)
    return _pick(q > room, jnp.int32(_SAT), exact)


def hsm_split_on_device(t, m):
    """`memento.planning.internals.hsm_split` (high=True) on int32 scalars, for
    ``2 <= t < 2^31 - 1`` and ``2 <= m < 10^8``.

    The same closed form: ``1 + ism_split(t - 2, m)``, where the level w is the smallest
    with ``B(m, w) = binom(m + w, w) >= t``, then the split takes every increment below
    level w and the ties from g first. The search from w = 1 (short but for the smallest
    m) steps ``B(m, w)`` by `_next_binomial`, keeping the two binomials below level w,
    which give the two the split needs: ``B(m, w - 2)`` and, by Pascal's rule,
    ``B(m - 1, w - 1) = B(m, w - 1) - B(m, w - 2)``. No table: a loop that splits reads
    no constant array, which on XLA:CPU would make it a dataflow graph (see `backward`).
    """
    t, m = jnp.asarray(t, jnp.int32), jnp.asarray(m, jnp.int32)

    # The loop's state is (w, B(m, w - 2), B(m, w - 1)): fewer values than with B(m, w)
    # carried too, which on XLA:CPU costs ops around the loop (Diffrax's save loop).
    def below(state):  # B(m, w) < t
        w, _, b1 = state
        return _next_binomial(b1, m, w) < t

    def up(state):
        w, _, b1 = state
        return w + 1, b1, _next_binomial(b1, m, w)

    # At w = 1: B(m, -1) = 0 (binom(m - 1, -1)) and B(m, 0) = 1.
    w, b2, b1 = lax.while_loop(below, up, (jnp.int32(1), jnp.int32(0), jnp.int32(1)))
    s = t - 2
    base_g = _pick(w >= 2, b2 - 1, 0)
    h_level = b1 - b2  # B(m - 1, w - 1)
    n_g = _pick(w >= 2, h_level, 0)
    taken = base_g + jnp.minimum(s - base_g - (h_level - 1), n_g)
    return 1 + _pick(s <= 0, 0, taken)


def first_pushes(num_steps: int, slots: int) -> list[int]:
    """Positions the recursion pushes before the backward of step ``num_steps - 1``.

    Starting from ``h_0`` alone: the carries an optimal HSM schedule keeps in its first
    sweep, in position order (slot j holds the j-th). At most ``slots - 1`` of them.
    """
    return list(_first_pushes(num_steps, slots))


@functools.lru_cache(maxsize=32)
def _first_pushes(num_steps: int, slots: int) -> tuple[int, ...]:
    # Cached: the forward and backward passes both ask, and a large budget makes it a
    # loop of as many closed-form splits.
    out, b, m = [], 0, slots
    while num_steps - b >= 3 and m >= 2:
        b += hsm_split(num_steps - b, m)
        out.append(b)
        m -= 1
    return tuple(out)


# ----------------------------------------------------------------------------------------
# Slots: one stack per carry leaf, with a leading slot axis


@dataclasses.dataclass(frozen=True)
class CarrySlots:
    """How the recursion's slots hold carries of ``avals``: `memento.loops._pool`'s one
    slot layout with hidden states only (slot j of a pool holds its leaves at
    ``j * h_g ...``), a pool per dtype, or with ``per_leaf`` a pool per carry leaf
    (`_pool.Pools.of`); tagged with their positions in debug mode
    (`_pool.checks_enabled`). One value for the allocation and every write, read and
    reordering of the same slots, so that they cannot disagree on the layout."""

    avals: tuple
    per_leaf: bool = False

    def pools(self, num_slots: int, *, host: bool = False) -> _pool.Pools:
        return _pool.Pools.of(
            self.avals,
            (),
            np.array([[num_slots, 0]]),
            tagged=_pool.checks_enabled(),
            host=host,
            per_leaf=self.per_leaf,
        )

    def allocate(self, num_slots: int, *, host: bool = False, place: bool = True) -> list:
        """Zeroed pools for ``num_slots`` carries (`_pool.Pools`); ``host``: in host memory
        where there is one and ``place`` (`_pool.Pools.allocate`). `write` and `load`
        copy to and from pools that lie on the host."""
        return self.pools(num_slots, host=host).allocate(place=place)

    def write(self, stacks, index, values, when=None, *, pos: int | jax.Array = 0) -> list:
        """Stores the carry ``values``, ``h_pos``, in slot ``index`` (only where ``when``, a
        scalar bool, holds)."""
        pools = self.pools(0)
        if pools.tagged:
            values = [*values, jnp.asarray(2 * pos, jnp.int32)]
        return pools.write(stacks, index, 0, values, "h", when)

    def load(self, stacks, init, slot, num_slots: int, *, pos: int | jax.Array = 0) -> list:
        """``h`` held in slot ``slot``, or ``init`` for slot -1 (the caller's ``h_0``); in
        debug mode checked to be ``h_pos``.

        Reads the pools outside any conditional (see `backward`): a select picks (on the
        stored form: keys as key data).
        """
        if num_slots == 0:  # no slots: h_0 is the only carry kept
            return list(init)
        pools = self.pools(num_slots)
        stored = pools.read(stacks, slot, 0, "h", stored=True)
        if pools.tagged:
            ok = (stored[-1] == 2 * pos) & (slot < num_slots)
            _pool.check((slot < 0) | ok, "a carry loaded by the recursion is not h_pos")
            stored = stored[:-1]
        return [
            _pool.from_storage(_pool.pick(slot < 0, _pool.to_storage(a, v), b), v)
            for a, b, v in zip(init, stored, self.avals)
        ]

    def reorder(self, stacks, order) -> list:
        """The pools with slot ``j`` holding what slot ``order[j]`` held (a gather, once)."""
        out = []
        for b, h in zip(stacks, self.pools(0).hidden_size):
            entries = (order[:, None] * h + jnp.arange(h, dtype=order.dtype)[None, :]).reshape(-1)
            out.append(jnp.take(b, entries, axis=0, mode="clip"))
        return out


# ----------------------------------------------------------------------------------------
# The backward pass


class Stack(NamedTuple):
    """The recursion's kept carries (loop state): ``pools``, slot ``d - 1`` holding the
    carry at stack depth ``d`` (`CarrySlots`' layout); ``positions``, an int32 array of
    length ``slots``, the step of the carry at each depth (``positions[0]`` is the first
    step's, whose carry is the caller's); ``depth``, how many are kept (depth 0 is the
    caller's carry alone)."""

    pools: list
    positions: jax.Array
    depth: jax.Array


class CotangentIO(NamedTuple):
    """The caller's own cotangents, as the recursion back-propagates step ``e``:
    ``take(e, ys, aux) -> (ct_y, aux)`` gives the step's output cotangents and
    ``give(e, ct_x, aux) -> aux`` takes its input ones; ``aux`` is their loop state."""

    take: Callable
    give: Callable


@dataclasses.dataclass(frozen=True)
class Recursion:
    """HSM's binomial recursion for one loop: ``body``, the step already restricted to
    what is differentiated; ``slots``, the budget in carries (``h_0`` included: the
    stack holds ``slots - 1``); ``carry_slots``, the slots' layout as the caller
    allocated and wrote them; ``unroll``, steps per iteration of the loops that
    advance."""

    body: Body
    slots: int
    carry_slots: CarrySlots
    unroll: int = 1

    def backward(
        self,
        consts,
        init,
        xs,
        stack: Stack,
        last,
        ct_c,
        ct_k,
        aux,
        io: CotangentIO,
        first: int | jax.Array = 0,
    ):
        """Back-propagates steps ``last`` .. ``first`` by the binomial recursion over the
        kept ``stack`` (a carry above step ``last`` is popped).

        Args:
            consts, init, xs: the loop's inputs (``xs`` indexed by step; ``[]`` for none);
                ``init`` is ``h_first``.
            stack: the kept carries (`Stack`), ``stack.positions[0] = first``.
            last: the first step to back-propagate (a traced or static int; -1: none).
            ct_c, ct_k: cotangents of the carry ``h_{last+1}`` and accumulated ones of
                the float consts.
            aux, io: the caller's own cotangents (`CotangentIO`), threaded through.
            first: the last step to back-propagate (a traced or static int): ``h_first``
                is ``init``. `memento.while_loop` with a host level runs the recursion
                once per interval between host checkpoints, from the interval's first
                carry.

        Returns:
            ``(ct_k, ct_init, aux)``.

        Each step pops, then walks from the top of the stack ``h_b`` to ``h_e`` in
        segments: from push to push (each computed from the last, written once) and on
        to ``h_e``. Slot d - 1 holds depth d (pushes and pops are last in, first out), so
        no free list is kept. The stacks are read outside conditionals and written by
        masked updates, so XLA updates them in place (see
        `memento.loops._interpreter.run_backward`).

        On XLA:CPU a loop runs as one compiled kernel, rather than an op at a time, only
        while one iteration's cost model accesses under 1 KiB and holds no sort or
        scatter. The loop is kept that small: splits come from a table (three reads), no
        slot array but the positions, no ``cond``. A tiny body's backward (a 4-float
        carry) then runs as one kernel at any budget. A loop run an op at a time runs
        them in order in the calling thread only while no array it touches exceeds 512
        bytes (`memento.loops._interpreter.SMALL_ARRAY_BYTES`): with
        ``carry_slots.per_leaf`` the slots of each carry leaf are a pool of their own and
        the splits read no table.
        """
        body, slots, unroll, take_cts, give_cts = self.body, self.slots, self.unroll, *io
        stacks, stack_pos, depth = stack
        never = jnp.int32(np.iinfo(np.int32).max)
        layout = self.carry_slots
        # Where the loop can run in order (``per_leaf``), splits with no table; else from the
        # table, which keeps a tiny scan's backward one compiled kernel (the table-free search
        # does not fit XLA:CPU's one-kernel loop size).
        split = hsm_split_on_device if layout.per_leaf else hsm_splitter(slots)

        def next_push(e, p, depth):
            # Where the recursion pushes next from h_p with the stack at ``depth``: only while
            # three or more steps remain (at two a push saves no evaluation) and a slot is
            # free. Before step e, e >= first: under vmap a member that is done keeps running
            # (its results discarded) until the last member is; it must not push.
            ok = (e >= first) & (e - p + 1 >= 3) & (slots - depth >= 2)
            # Where not ok, split a harmless (3, 2) instead (cheaper than a cond here).
            y = split(_pick(ok, e - p + 1, 3), _pick(ok, slots - depth, 2))
            return _pick(ok, p + y, never)

        def step(state):
            e, stacks, stack_pos, depth, ct_c, ct_k, aux = state
            # Pop the carry whose step was the last back-propagated.
            depth = depth - ((_get(stack_pos, depth) > e) & (depth > 0)).astype(jnp.int32)
            b = _get(stack_pos, depth)
            c = layout.load(stacks, init, depth - 1, slots - 1, pos=b)
            if slots > 1:
                # Advance from push to push, writing each, then on to h_e: one loop.
                def segment(state):
                    c, stacks, stack_pos, depth, p, _ = state
                    q = next_push(e, p, depth)
                    to = jnp.minimum(q, e)
                    c = advance_steps(body, consts, c, xs, p, to - p, unroll)
                    push = q < e
                    # At depth + 1.
                    stacks = layout.write(stacks, depth, c, push, pos=to)
                    above = _pick(push, q, _get(stack_pos, depth + 1))
                    stack_pos = _put(stack_pos, depth + 1, above)
                    return c, stacks, stack_pos, depth + push.astype(jnp.int32), to, push

                state = (c, stacks, stack_pos, depth, b, jnp.bool_(True))
                c, stacks, stack_pos, depth, _, _ = lax.while_loop(
                    lambda s: s[5] & (s[4] < e), segment, state
                )
            else:
                c = advance_steps(body, consts, c, xs, b, e - b, unroll)
            _, ys, pullback = body.linearize(consts, c, x_at(xs, e))
            ct_y, aux = take_cts(e, ys, aux)
            d_k, ct_c, d_x = apply_pullback(pullback, ct_c, ct_y)
            aux = give_cts(e, d_x, aux)
            ct_k = [a + d for a, d in zip(ct_k, d_k)]
            return e - 1, stacks, stack_pos, depth, ct_c, ct_k, aux

        state = (last, stacks, stack_pos, depth, list(ct_c), list(ct_k), aux)
        state = lax.while_loop(lambda s: s[0] >= first, step, state)
        return state[5], state[4], state[6]


# ----------------------------------------------------------------------------------------
# `memento.scan` under the HSM policy


def scan_slots(body: Body) -> CarrySlots:
    """The slots of `memento.scan`'s recursion: a pool per dtype (its forward and backward
    share them)."""
    return CarrySlots(tuple(body.carry_avals))


def scan_forward(body: Body, spec, slots: int, consts, init, xs, num_steps: int, *, unroll=1):
    """The forward pass of a scan: its values, and the recursion's first pushes.

    Returns ``(carry, ys, stacks, working)``, ``working`` the residuals of the last step
    (the first sweep's fused step, back-propagated first, from them).
    """
    t = num_steps
    pushes = first_pushes(t, slots)
    layout = scan_slots(body)
    stacks = layout.allocate(slots - 1)
    # A sentinel past every position keeps the pointer in bounds without a test.
    at = jnp.asarray(np.array([*pushes, np.iinfo(np.int32).max], np.int32))

    def step(state, _):
        p, c, stacks, ptr = state
        keep = _get(at, ptr) == p
        if slots > 1:
            stacks = layout.write(stacks, ptr, c, keep, pos=p)
        c, y = body(consts, c, x_at(xs, p))
        return (p + 1, c, stacks, ptr + keep.astype(jnp.int32)), y

    # The step number is carried, not scanned over: an ``arange`` would be O(t) memory.
    state = (jnp.int32(0), list(init), stacks, jnp.int32(0))
    (_, c, stacks, _), ys = lax.scan(step, state, None, length=t - 1, unroll=unroll)
    if pushes and pushes[-1] == t - 1:
        stacks = layout.write(stacks, len(pushes) - 1, c, pos=t - 1)
    c, y_last, working = body.save(spec, consts, c, [x[t - 1] for x in xs])
    ys = [jnp.concatenate([a, b[None]]) for a, b in zip(ys, y_last)]
    return c, ys, stacks, working


def scan_backward(
    body: Body,
    spec,
    slots: int,
    num_steps: int,
    consts,
    init,
    xs,
    stacks,
    working,
    ct_c,
    ct_ys,
    *,
    unroll: int = 1,
):
    """The backward pass after `scan_forward`: ``(ct_consts_f, ct_init_f, ct_xs_f)``."""
    t = num_steps
    pushes = first_pushes(t, slots)
    xs_f, _ = split(xs, body.x_mask)

    def take_cts(e, ys, aux):
        return [_get(y, e) for y in ct_ys], aux

    def give_cts(e, d_x, ct_xs):
        return [_put(a, e, b.astype(a.dtype)) for a, b in zip(ct_xs, d_x)]

    # Step t-1 from the residuals the forward pass kept.
    pullback = body.restore(spec, working, consts, [x[t - 1] for x in xs])
    ct_k, ct_c, d_x = apply_pullback(pullback, ct_c, [y[t - 1] for y in ct_ys])
    ct_xs = give_cts(t - 1, d_x, [jnp.zeros_like(x) for x in xs_f])
    stack_pos = np.zeros(slots, np.int32)
    stack_pos[1 : len(pushes) + 1] = pushes  # pushed in order: slot j holds the j-th
    stack = Stack(stacks, jnp.asarray(stack_pos), jnp.int32(len(pushes)))
    recursion = Recursion(body, slots, scan_slots(body), unroll)
    ct_k, ct_init, ct_xs = recursion.backward(
        consts,
        init,
        xs,
        stack,
        jnp.int32(t - 2),
        ct_c,
        ct_k,
        ct_xs,
        CotangentIO(take_cts, give_cts),
    )
    return ct_k, ct_init, ct_xs
