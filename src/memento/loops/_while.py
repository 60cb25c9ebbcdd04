"""`memento.while_loop`: a reverse-differentiable while loop, checkpointed online.

Forward pass: one ``lax.while_loop`` (bounded by ``max_steps`` when given) that keeps
carries in ``memory - 1`` slots as the online policy of `memento.planning._online` says:
its decisions depend on the step index only, so they are a small table of events (keep
``h_p`` in slot j) read by a pointer, one comparison per step.

Backward pass: once n is known, the kept carries, in position order, form a stack
(``h_0`` at the bottom). One loop back-propagates steps n-1 .. 0; before step e it looks
at the top of the stack, ``h_b`` with ``m = memory - depth`` slots for itself and what is
above, and while ``t = e - b + 1 >= 2`` and ``m >= 2`` it advances ``y = hsm_split(t, m)``
steps from ``h_b`` and pushes ``h_{b+y}``: Griewank-Walther's binomial recursion (the
paper's HSM, eq. (1)-(3)) unrolled one push at a time, the split computed on device from
its closed form. Then it advances to ``h_e`` and back-propagates step e fused; a carry is
popped once its own step has been. Forward evaluations: ``n + sum_i C_hsm(L_i, memory -
i)`` over the kept segments, exactly `memento.planning._online.online_evaluations`.

The program holds the body three times (primal loop forward, primal and VJP backward)
whatever ``max_steps``: the plan is data (the event table) or computed on device.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core as jax_core
from jax import lax

from ..planning import _online
from . import _pool
from ._body import (
    Body,
    Static,
    call_reverse_mode_only,
    instantiate,
    make_body,
    merge,
    nbytes,
    refuse_reverse_over_reverse,
    split,
)
from ._budget import Bytes, parse_memory, to_slots
from ._interpreter import advance_steps, apply_pullback

_NAME = "memento.while_loop"
# Above this many slots the policy's planning (Python, once per (memory, max_steps) at
# trace time) takes seconds for an unbounded loop (5 s at 64); budgets above it use 64
# slots unless they keep every carry. Extra slots gain little: C_hsm(n, m) falls slowly
# in m once m is far above the repetition number.
_MAX_POLICY_SLOTS = 64
_SAT = (1 << 31) - 1  # binomials saturate here (int32); every count compared is below


def while_loop(
    cond_fun: Callable,
    body_fun: Callable,
    init_val: Any,
    *,
    max_steps: int | None = None,
    memory: int | str | Bytes | None = None,
) -> Any:
    """``jax.lax.while_loop`` that is reverse-mode differentiable within a memory budget.

    The value is that of ``lax.while_loop(cond_fun, body_fun, init_val)``, stopped after
    ``max_steps`` steps if the predicate still holds then (``max_steps=None``: no bound).
    Its gradient with respect to ``init_val`` and to arrays the two functions close over
    equals that of the same computation unrolled for the n steps taken. The forward pass
    keeps carries *online* (n is unknown until the predicate fails) in ``memory`` slots;
    the backward pass re-plans the rest optimally (binomial checkpointing) from what was
    kept. The compiled program does not grow with ``max_steps``.

    Forward evaluations of ``body_fun`` for n steps are ``online_evaluations(memory, n)``
    of `memento.planning._online`: ``2n`` up to ``memory`` steps, the online optimum of
    Stumm and Walther's algorithm I (``3n - memory``) up to ``binom(memory + 2, 2) - 1``
    steps, and beyond within 6% of the offline optimum ``memento.plan(n, memory).cost``
    (measured for 20 <= n <= 10^4, memory in {8, 16, 30}); never more than Equinox's
    checkpointed while loop with as many checkpoints on the grids measured.

    Args:
        cond_fun, body_fun, init_val: as ``jax.lax.while_loop``.
        max_steps: at most this many steps (an ``int >= 0``), or ``None`` for no bound.
        memory: carry-sized slots (an ``int``, the initial carry included: the paper's m)
            or bytes (``"64MiB"``, ``memento.bytes_budget(n)``). ``None``: enough to keep
            every carry, ``max_steps + 1`` slots (needs ``max_steps``). Under ``vmap``,
            sizes are those of one batch member.

    Returns:
        The final carry, as ``lax.while_loop``.

    Raises:
        ValueError: ``max_steps < 0``; ``memory=None`` without ``max_steps``; a budget
            below one carry (the message names the minimum).
        TypeError: a body that changes the carry's structure, shapes or dtypes; a
            predicate that is not a scalar bool; a bad ``memory`` or ``max_steps``.

    Transformations: ``jit``, ``grad``/``vjp`` (a custom VJP), ``vmap`` (a batched
    predicate runs the batch until its last member stops; each member's gradient is its
    own), nesting; every dtype (keys, ints, bools in the carry; a weakly typed
    ``init_val`` takes the dtype the body gives it, as in ``lax.while_loop``). Only
    perturbed leaves are differentiated. Second order by forward over reverse
    (``jax.hessian``, ``jvp(grad)``) is exact. Forward mode (``jvp``) raises a
    ``TypeError`` (use ``lax.while_loop``), reverse over reverse a
    ``NotImplementedError``.

    Notes:
        The step counter is int32: at most 2**31 - 2 steps. A budget above 64 slots that
        does not keep every carry is used as 64 slots.

    Example:
        >>> def solve(x):  # doctest: +SKIP
        ...     return memento.while_loop(lambda s: s[1] > 1e-6, step, (x, 1.0),
        ...                               max_steps=10_000, memory=16)
    """
    steps = _check_max_steps(max_steps)
    if memory is None and steps is None:
        raise ValueError(
            f"{_NAME}: memory=None keeps every carry, which needs max_steps; pass a budget "
            "(e.g. memory=16 slots or memory='64MiB') or max_steps."
        )
    budget = None if memory is None else parse_memory(memory, name=_NAME)

    init_leaves, init_tree = jax.tree_util.tree_flatten(init_val)
    init_leaves = [jnp.asarray(c) for c in init_leaves]
    init = jax.tree_util.tree_unflatten(init_tree, init_leaves)

    def as_step(c, _):
        return body_fun(c), None

    body = make_body(as_step, init, None, name=_NAME)
    init_leaves = body.cast_carry(init_leaves)
    cond_jaxpr, cond_consts = _trace_cond(cond_fun, body)

    if budget is None:
        assert steps is not None  # memory=None without max_steps was refused above
        slots = steps + 1
    else:
        slots = to_slots(budget, nbytes(body.carry_avals), name=_NAME)
    if steps is not None:
        slots = min(slots, steps + 1)  # more than one slot per carry is never used
    store_all = steps is not None and slots == steps + 1
    if not store_all:
        slots = min(slots, _MAX_POLICY_SLOTS)
    cap = steps if steps is not None else _online.DEFAULT_CAP
    events = _online.online_events(slots, max(cap, 1))

    run = _differentiable_run(body, cond_jaxpr, cond_consts, slots, steps, events)
    carry = call_reverse_mode_only(
        run, (body.consts, cond_consts, init_leaves), name=_NAME, instead="lax.while_loop"
    )
    return jax.tree_util.tree_unflatten(body.carry_tree, carry)


def _check_max_steps(max_steps) -> int | None:
    if max_steps is None:
        return None
    if isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral):
        raise TypeError(
            f"{_NAME}: max_steps must be None or an int, got {max_steps!r}; pass the most "
            "steps the loop may take, e.g. max_steps=4096."
        )
    if max_steps < 0:
        raise ValueError(
            f"{_NAME}: max_steps must be >= 0, got {max_steps}; pass None for no bound."
        )
    return int(max_steps)


def _trace_cond(cond_fun, body: Body):
    def flat(c):
        return cond_fun(jax.tree_util.tree_unflatten(body.carry_tree, c))

    closed = jax.make_jaxpr(flat)(list(body.carry_avals))
    (out,) = closed.out_avals if len(closed.out_avals) == 1 else (None,)
    if out is None or out.shape != () or out.dtype != jnp.bool_:
        raise TypeError(
            f"{_NAME}: cond_fun must return a scalar bool, got "
            f"{[f'{a.dtype}{list(a.shape)}' for a in closed.out_avals]}."
        )
    return closed.jaxpr, list(closed.consts)


# ----------------------------------------------------------------------------------------
# The split of the binomial recursion, on device


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
    """`memento.planning._closed.hsm_split` (high=True) on int32 scalars; t >= 2, m >= 2.

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
    split = base_g + jnp.minimum(s - base_g - base_h, n_g)
    return 1 + jnp.where(s <= 0, 0, split)


# ----------------------------------------------------------------------------------------
# The custom VJP


def _differentiable_run(
    body: Body, cond_jaxpr, cond_consts_avals, slots: int, steps: int | None, events
):
    """The loop as a ``custom_vjp`` function of (consts, cond_consts, init), flat leaves."""
    num_slots = slots - 1  # physical slots; h_0 is the caller's
    store_pos, store_slot = events.store_rows
    # A sentinel row past every position keeps the pointer in bounds without a test.
    big = np.iinfo(np.int32).max
    store_pos = np.append(store_pos, big).astype(np.int32)
    store_slot = np.append(store_slot, 0).astype(np.int32)
    row_pos = events.pos.astype(np.int32)
    row_slot = events.slot.astype(np.int32)
    row_store = events.store

    def cond(cond_consts, c):
        return jax_core.eval_jaxpr(cond_jaxpr, list(cond_consts), *c)[0]

    def running(cond_consts, p, c):
        ok = cond(cond_consts, c)
        return ok if steps is None else jnp.logical_and(p < steps, ok)

    @jax.custom_vjp
    def run(consts, cond_consts, init):
        def body_fn(state):
            p, c = state
            return p + 1, body(consts, c, [])[0]

        _, c = lax.while_loop(
            lambda s: running(cond_consts, *s), body_fn, (jnp.int32(0), list(init))
        )
        return c

    def fwd(consts, cond_consts, init):
        # symbolic_zeros: only what is perturbed, or depends on it, is differentiated.
        b = body.restrict([a.perturbed for a in consts], [a.perturbed for a in init], [])
        consts, cond_consts, init = ([a.value for a in x] for x in (consts, cond_consts, init))
        hidden = [_pool.stack_of(a, num_slots) for a in body.carry_avals]
        sp, ss = jnp.asarray(store_pos), jnp.asarray(store_slot)

        def body_fn(state):
            p, ptr, c, hidden = state
            keep = sp[ptr] == p
            if num_slots:
                hidden = _write(hidden, ss[ptr], c, body.carry_avals, keep)
            c = body(consts, c, [])[0]
            return p + 1, ptr + keep.astype(jnp.int32), c, hidden

        state = (jnp.int32(0), jnp.int32(0), list(init), hidden)
        n, _, c, hidden = lax.while_loop(lambda s: running(cond_consts, s[0], s[2]), body_fn, state)
        stack_pos, stack_slot, depth = _stack(n, num_slots, row_pos, row_slot, row_store)
        res = (consts, init, hidden, n, stack_pos, stack_slot, depth)
        return c, (res, Static(b))

    def bwd(res, ct_final):
        refuse_reverse_over_reverse((res, ct_final), name=_NAME)
        (consts, init, hidden, n, stack_pos, stack_slot, depth), b = res[0], res[1].value
        ct_c = instantiate(ct_final, b.carry_avals, b.carry_mask)
        ct_k, ct_init = _backward(
            b, slots, consts, init, hidden, n, stack_pos, stack_slot, depth, ct_c
        )
        # None is a zero cotangent for custom_vjp: leaves not differentiated.
        return (
            merge(ct_k, [None] * (len(consts) - len(ct_k)), b.const_mask),
            [None] * len(cond_consts_avals),
            merge(ct_init, [None] * (len(init) - len(ct_init)), b.carry_mask),
        )

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


# ----------------------------------------------------------------------------------------
# Hidden slots: one typed buffer per carry leaf, with a leading slot axis. The while loop
# keeps carries only, all of one size, so it needs none of scan's word pool (`_pool`), which
# exists to let hidden and internal states of different sizes share one budget (the two
# cost about the same to write and read: benchmarks/pool.py).


def _write(buffers, index, values, avals, when=None):
    """``buffers[i][index] = values[i]`` (only where ``when``, a scalar bool, holds)."""
    index = jnp.maximum(index, 0)
    out = []
    for b, v, a in zip(buffers, values, avals):
        v = _pool.to_storage(v, a)
        if when is not None:
            v = jnp.where(when, v, b[index])
        out.append(lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), index, 0))
    return out


def _read(buffers, index):
    """``[b[index] for b in buffers]``."""
    index = jnp.maximum(index, 0)
    return [lax.dynamic_index_in_dim(b, index, 0, keepdims=False) for b in buffers]


def load_hidden(hidden, init, slot, avals):
    """``h`` held in hidden slot ``slot``, or ``init`` for slot -1 (the caller's ``h_0``).

    Reads the buffers outside any conditional (see `_backward`): a ``where`` picks.
    """
    if not hidden or hidden[0].shape[0] == 0:  # no slots: h_0 is the only carry kept
        return list(init)
    stored = _read(hidden, slot)
    return [
        _pool.from_storage(jnp.where(slot < 0, _pool.to_storage(a, v), b), v)
        for a, b, v in zip(init, stored, avals)
    ]


def _stack(n, num_slots, row_pos, row_slot, row_store):
    """The kept carries when the loop stopped after n steps, as a stack in position order.

    Returns ``(pos, slot, depth)``: ``pos[d]``, ``slot[d]`` for ``d <= depth`` (int32
    arrays of length ``num_slots + 1``), ``pos[0] = 0`` and ``slot[0] = -1`` (``h_0``).
    A physical slot holds a carry if its last event before position n is a store.
    """
    size = num_slots + 1
    if num_slots == 0 or len(row_pos) == 0:
        return jnp.zeros(size, jnp.int32), jnp.full(size, -1, jnp.int32), jnp.int32(0)
    pos, slot = jnp.asarray(row_pos), jnp.asarray(row_slot)
    time = jnp.arange(len(row_pos), dtype=jnp.int32)
    live = pos < n
    last_store = jax.ops.segment_max(
        jnp.where(live & row_store, time, -1), slot, num_segments=num_slots
    )
    last_free = jax.ops.segment_max(
        jnp.where(live & ~row_store, time, -1), slot, num_segments=num_slots
    )
    held = last_store > last_free
    big = jnp.iinfo(jnp.int32).max
    where = jnp.where(held, pos[jnp.maximum(last_store, 0)], big)
    order = jnp.argsort(where).astype(jnp.int32)
    stack_pos = jnp.concatenate([jnp.zeros(1, jnp.int32), where[order]])
    stack_slot = jnp.concatenate([jnp.full(1, -1, jnp.int32), order])
    return stack_pos, stack_slot, jnp.sum(held).astype(jnp.int32)


def _backward(body: Body, slots, consts, init, hidden, n, stack_pos, stack_slot, depth, ct_c):
    """Back-propagates steps n-1 .. 0 by the binomial recursion over the kept stack.

    The slot buffers are only read outside conditionals and written unconditionally (the
    pushes happen in a loop of their own), so XLA updates them in place (see
    `memento.loops._interpreter.run_backward`).
    """
    kf, _ = split(consts, body.const_mask)
    num_slots = slots - 1
    ids = jnp.arange(num_slots, dtype=jnp.int32)

    def free_slot(stack_slot, depth):
        # A physical slot that no carry on the stack holds (there is one: m >= 2 below).
        in_use = (ids[None, :] == stack_slot[1:, None]) & (
            jnp.arange(1, num_slots + 1)[:, None] <= depth
        )
        return jnp.argmin(jnp.any(in_use, axis=0)).astype(jnp.int32)

    def push_cond(state):
        e, _hidden, stack_pos, _stack_slot, depth = state
        t = e - stack_pos[depth] + 1
        # e >= 0: under vmap a member that is done keeps running this loop (its results
        # discarded) until the last member is; it must not push.
        return (e >= 0) & (t >= 2) & (slots - depth >= 2)

    def push(state):
        e, hidden, stack_pos, stack_slot, depth = state
        b = stack_pos[depth]
        y = hsm_split_device(e - b + 1, slots - depth)
        c = load_hidden(hidden, init, stack_slot[depth], body.carry_avals)
        c = advance_steps(body, consts, c, [], b, y)
        j = free_slot(stack_slot, depth)
        hidden = _write(hidden, j, c, body.carry_avals)
        depth = depth + 1
        stack_pos = stack_pos.at[depth].set(b + y)
        stack_slot = stack_slot.at[depth].set(j)
        return e, hidden, stack_pos, stack_slot, depth

    def step(state):
        e, hidden, stack_pos, stack_slot, depth, ct_c, ct_k = state
        # Pop the carry whose step was the last back-propagated.
        depth = jnp.where((stack_pos[depth] > e) & (depth > 0), depth - 1, depth)
        if num_slots:
            _, hidden, stack_pos, stack_slot, depth = lax.while_loop(
                push_cond, push, (e, hidden, stack_pos, stack_slot, depth)
            )
        b = stack_pos[depth]
        c = load_hidden(hidden, init, stack_slot[depth], body.carry_avals)
        c = advance_steps(body, consts, c, [], b, e - b)
        pullback = body.linearize(consts, c, [])[2]
        d_k, ct_c, _ = apply_pullback(pullback, ct_c, [])
        ct_k = [a + d for a, d in zip(ct_k, d_k)]
        return e - 1, hidden, stack_pos, stack_slot, depth, ct_c, ct_k

    state = (
        n - 1,
        hidden,
        stack_pos,
        stack_slot,
        depth,
        list(ct_c),
        [jnp.zeros_like(k) for k in kf],
    )
    state = lax.while_loop(lambda s: s[0] >= 0, step, state)
    return state[6], state[5]
