"""The binomial (HSM) recursion run on the device, shared by `scan` and `while_loop`.

Carries are kept in per-leaf stacks of slots (a leading slot axis, each leaf its own shape,
dtype and sharding). The kept carries, in position order, form a stack with ``h_0`` (the
caller's, slot -1) at the bottom. To back-propagate step e, look at the top of the stack,
``h_b`` with ``m = slots - depth`` slots for itself and what is above; while
``t = e - b + 1 >= 3`` and ``m >= 2``, advance ``y = hsm_split(t, m)`` steps from ``h_b``
and push ``h_{b+y}`` (at ``t = 2`` a push saves no evaluation, so none is made). Then advance to ``h_e`` and back-propagate step e fused; a carry is
popped once its own step has been. This is Griewank and Walther's binomial recursion (the
paper's HSM, eq. (1)-(3)) unrolled one push at a time, with the split computed on the
device from its closed form (`memento.planning.hsm_split`). Nothing here grows with the
number of steps: no schedule rows are materialised, the state is O(slots).

`memento.while_loop` fills the stack online in its forward pass (n is unknown until the
predicate fails); `memento.scan` with the HSM policy fills it with the recursion's own
first pushes (`first_pushes`), so that its forward and backward together make exactly the
optimal HSM schedule's ``hsm_cost(t, m)`` evaluations.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..planning import hsm_split
from . import _pool
from ._body import Body, split
from ._interpreter import advance_steps, apply_pullback, x_at

_SAT = (1 << 31) - 1  # binomials saturate here (int32); every count compared is below


def _comb(n, k):
    """``binom(n, k)`` saturated at ``_SAT`` (int32 scalars, n >= 0; 0 for k < 0 or k > n)."""
    k = jnp.minimum(k, n - k)

    def body(i, v):
        f = n - k + i
        # v = binom(n-k+i-1, i-1); v * f / i is exact; saturation is sticky because the
        # remaining factors f / i are >= 1.
        big = v > _SAT // f
        return jnp.where(big, _SAT, jnp.minimum(v * f // i, _SAT))

    v = lax.fori_loop(1, jnp.maximum(k, 0) + 1, body, jnp.int32(1))
    return jnp.where(k < 0, 0, v)


def hsm_split_device(t, m):
    """`memento.planning.hsm_split` (high=True) on int32 scalars; t >= 2, m >= 2.

    The same closed form: ``1 + ism_split(t - 2, m)``, where the level w is the smallest
    with ``binom(m + w, w) - 2 >= s`` (found by stepping w up, the binomial updated in
    place), then the split takes every increment below level w and the ties from g first.
    """
    s = t - 2

    def cond(state):
        _w, v = state
        return v - 2 < s

    def step(state):
        w, v = state
        w = w + 1
        f = m + w
        return w, jnp.where(v > _SAT // f, _SAT, jnp.minimum(v * f // w, _SAT))

    w, _ = lax.while_loop(cond, step, (jnp.int32(1), m + 1))  # binom(m + 1, 1)
    base_g = jnp.where(w >= 2, _comb(m + w - 2, w - 2) - 1, 0)
    h_level = _comb(m + w - 2, w - 1)
    base_h = h_level - 1
    n_g = jnp.where(w >= 2, h_level, 0)
    split_ = base_g + jnp.minimum(s - base_g - base_h, n_g)
    return 1 + jnp.where(s <= 0, 0, split_)


def first_pushes(num_steps: int, slots: int) -> list[int]:
    """Positions the recursion pushes before the backward of step ``num_steps - 1``.

    Starting from ``h_0`` alone: the carries an optimal HSM schedule keeps in its first
    sweep, in position order (slot j holds the j-th). At most ``slots - 1`` of them.
    """
    out, b, m = [], 0, slots
    while num_steps - b >= 3 and m >= 2:
        b += hsm_split(num_steps - b, m)
        out.append(b)
        m -= 1
    return out


# ----------------------------------------------------------------------------------------
# Slots: one stack per carry leaf, with a leading slot axis.


def allocate(avals, num_slots: int) -> list:
    return [_pool.stack_of(a, num_slots) for a in avals]


def write(stacks, index, values, avals, when=None) -> list:
    """``stacks[i][index] = values[i]`` (only where ``when``, a scalar bool, holds)."""
    index = jnp.maximum(index, 0)
    out = []
    for b, v, a in zip(stacks, values, avals):
        v = _pool.to_storage(v, a)
        if when is not None:
            v = jnp.where(when, v, b[index])
        out.append(lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), index, 0))
    return out


def load_hidden(stacks, init, slot, avals) -> list:
    """``h`` held in slot ``slot``, or ``init`` for slot -1 (the caller's ``h_0``).

    Reads the stacks outside any conditional (see `backward`): a ``where`` picks (on the
    stored form: keys as key data).
    """
    if not stacks or stacks[0].shape[0] == 0:  # no slots: h_0 is the only carry kept
        return list(init)
    index = jnp.maximum(slot, 0)
    stored = [lax.dynamic_index_in_dim(b, index, 0, keepdims=False) for b in stacks]
    return [
        _pool.from_storage(jnp.where(slot < 0, _pool.to_storage(a, v), b), v)
        for a, b, v in zip(init, stored, avals)
    ]


# ----------------------------------------------------------------------------------------
# The backward pass


def _set(a, i, v):
    """``a.at[i].set(v)`` for a scalar ``i``, as an in-place update (not a scatter)."""
    return lax.dynamic_update_index_in_dim(a, jnp.asarray(v, a.dtype), i, 0)


def backward(
    body: Body,
    slots: int,
    consts,
    init,
    xs,
    stacks,
    last,
    stack_pos,
    stack_slot,
    depth,
    ct_c,
    ct_k,
    aux,
    take_cts: Callable,
    give_cts: Callable,
):
    """Back-propagates steps ``last`` .. 0 by the binomial recursion over the kept stack.

    Args:
        body: the step, already restricted to what is differentiated.
        slots: the budget in carries, ``h_0`` included (the stacks hold ``slots - 1``).
        consts, init, xs: the loop's inputs (``xs`` indexed by step; ``[]`` for none).
        stacks: the slot stacks; ``stack_pos[d]``, ``stack_slot[d]`` (``d <= depth``) the
            kept carries in position order (``stack_pos[0] = 0``, ``stack_slot[0] = -1``;
            int32 arrays of length ``slots``). A carry above step ``last`` is popped.
        last: the first step to back-propagate (a traced or static int; -1: none).
        ct_c, ct_k: cotangents of the carry ``h_{last+1}`` and accumulated ones of the
            float consts.
        aux: loop state of the caller's own cotangents, threaded through:
            ``take_cts(e, ys, aux) -> (ct_y, aux)`` gives step e's output cotangents and
            ``give_cts(e, ct_x, aux) -> aux`` takes its input ones.

    Returns:
        ``(ct_k, ct_init, aux)``.

    The slot stacks are only read outside conditionals and written unconditionally (the
    pushes happen in a loop of their own), so XLA updates them in place (see
    `memento.loops._interpreter.run_backward`).
    """
    num_slots = slots - 1

    # Free physical slots, as a stack: ``free[:fp]``. Found once (O(slots)); then a push
    # takes the top and a pop gives its slot back, O(1) each. (A search over the slots at
    # every push made 64 slots slower than 32 on a small body: issue 12.)
    ids = jnp.arange(num_slots, dtype=jnp.int32)
    target = jnp.where(ids + 1 <= depth, stack_slot[1:], num_slots)
    in_use = jnp.zeros(num_slots + 1, jnp.bool_).at[target].set(True)[:num_slots]
    free = jnp.argsort(in_use, stable=True).astype(jnp.int32)  # free slots first
    fp = (num_slots - depth).astype(jnp.int32)

    def push_cond(state):
        e, _stacks, stack_pos, _stack_slot, depth, _free, _fp = state
        t = e - stack_pos[depth] + 1
        # e >= 0: under vmap a member that is done keeps running this loop (its results
        # discarded) until the last member is; it must not push.
        return (e >= 0) & (t >= 3) & (slots - depth >= 2)

    def push(state):
        e, stacks, stack_pos, stack_slot, depth, free, fp = state
        b = stack_pos[depth]
        y = hsm_split_device(e - b + 1, slots - depth)
        c = load_hidden(stacks, init, stack_slot[depth], body.carry_avals)
        c = advance_steps(body, consts, c, xs, b, y)
        fp = fp - 1
        j = free[fp]  # there is one: slots - depth >= 2
        stacks = write(stacks, j, c, body.carry_avals)
        depth = depth + 1
        stack_pos = _set(stack_pos, depth, b + y)
        stack_slot = _set(stack_slot, depth, j)
        return e, stacks, stack_pos, stack_slot, depth, free, fp

    def step(state):
        e, stacks, stack_pos, stack_slot, depth, free, fp, ct_c, ct_k, aux = state
        # Pop the carry whose step was the last back-propagated; its slot is free again.
        popped = (stack_pos[depth] > e) & (depth > 0)
        if num_slots:
            top = jnp.minimum(fp, num_slots - 1)
            free = _set(free, top, jnp.where(popped, stack_slot[depth], free[top]))
            fp = fp + popped.astype(jnp.int32)
        depth = jnp.where(popped, depth - 1, depth)
        if num_slots:
            _, stacks, stack_pos, stack_slot, depth, free, fp = lax.while_loop(
                push_cond, push, (e, stacks, stack_pos, stack_slot, depth, free, fp)
            )
        b = stack_pos[depth]
        c = load_hidden(stacks, init, stack_slot[depth], body.carry_avals)
        c = advance_steps(body, consts, c, xs, b, e - b)
        _, ys, pullback = body.linearize(consts, c, x_at(xs, e))
        ct_y, aux = take_cts(e, ys, aux)
        d_k, ct_c, d_x = apply_pullback(pullback, ct_c, ct_y)
        aux = give_cts(e, d_x, aux)
        ct_k = [a + d for a, d in zip(ct_k, d_k)]
        return e - 1, stacks, stack_pos, stack_slot, depth, free, fp, ct_c, ct_k, aux

    state = (last, stacks, stack_pos, stack_slot, depth, free, fp, list(ct_c), list(ct_k), aux)
    state = lax.while_loop(lambda s: s[0] >= 0, step, state)
    return state[8], state[7], state[9]


# ----------------------------------------------------------------------------------------
# `memento.scan` under the HSM policy


def scan_forward(body: Body, spec, slots: int, consts, init, xs, num_steps: int, *, unroll=1):
    """The forward pass of a scan: its values, and the recursion's first pushes.

    Returns ``(carry, ys, stacks, working)``, ``working`` the residuals of the last step
    (the first sweep's fused step, back-propagated first, from them).
    """
    t = num_steps
    pushes = first_pushes(t, slots)
    stacks = allocate(body.carry_avals, slots - 1)
    # A sentinel past every position keeps the pointer in bounds without a test.
    at = jnp.asarray(np.array([*pushes, np.iinfo(np.int32).max], np.int32))

    def step(state, _):
        p, c, stacks, ptr = state
        keep = at[ptr] == p
        if slots > 1:
            stacks = write(stacks, ptr, c, body.carry_avals, keep)
        c, y = body(consts, c, x_at(xs, p))
        return (p + 1, c, stacks, ptr + keep.astype(jnp.int32)), y

    # The step number is carried, not scanned over: an ``arange`` would be O(t) memory.
    state = (jnp.int32(0), list(init), stacks, jnp.int32(0))
    (_, c, stacks, _), ys = lax.scan(step, state, None, length=t - 1, unroll=unroll)
    if pushes and pushes[-1] == t - 1:
        stacks = write(stacks, len(pushes) - 1, c, body.carry_avals)
    c, y_last, working = body.save(spec, consts, c, [x[t - 1] for x in xs])
    ys = [jnp.concatenate([a, b[None]]) for a, b in zip(ys, y_last)]
    return c, ys, stacks, working


def scan_backward(
    body: Body, spec, slots: int, num_steps: int, consts, init, xs, stacks, working, ct_c, ct_ys
):
    """The backward pass after `scan_forward`: ``(ct_consts_f, ct_init_f, ct_xs_f)``."""
    t = num_steps
    pushes = first_pushes(t, slots)
    xs_f, _ = split(xs, body.x_mask)

    def take_cts(e, ys, aux):
        return [lax.dynamic_index_in_dim(y, e, 0, keepdims=False) for y in ct_ys], aux

    def give_cts(e, d_x, ct_xs):
        return [
            lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), e, 0) for a, b in zip(ct_xs, d_x)
        ]

    # Step t-1 from the residuals the forward pass kept.
    pullback = body.restore(spec, working, consts, [x[t - 1] for x in xs])
    ct_k, ct_c, d_x = apply_pullback(pullback, ct_c, [y[t - 1] for y in ct_ys])
    ct_xs = give_cts(t - 1, d_x, [jnp.zeros_like(x) for x in xs_f])
    stack_pos = np.zeros(slots, np.int32)
    stack_slot = np.full(slots, -1, np.int32)
    stack_pos[1 : len(pushes) + 1] = pushes
    stack_slot[1 : len(pushes) + 1] = np.arange(len(pushes))
    ct_k, ct_init, ct_xs = backward(
        body, slots, consts, init, xs, stacks, jnp.int32(t - 2), jnp.asarray(stack_pos),
        jnp.asarray(stack_slot), jnp.int32(len(pushes)), ct_c, ct_k, ct_xs, take_cts, give_cts,
    )  # fmt: skip
    return ct_k, ct_init, ct_xs
