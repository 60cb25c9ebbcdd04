"""`memento.while_loop`: a reverse-differentiable while loop, checkpointed online.

Forward pass: one ``lax.while_loop`` (bounded by ``max_steps`` when given) that keeps
carries in ``memory - 1`` slots as the online policy of `memento.planning.online_events` says:
its decisions depend on the step index only, so they are a small table of events (keep
``h_p`` in slot j) read by a pointer, one comparison per step.

Backward pass: once n is known, the kept carries, in position order, form a stack
(``h_0`` at the bottom), and `memento.loops._recursion.Recursion.backward` back-propagates steps
n-1 .. 0 by the binomial recursion over it (HSM, the split computed on device). Forward
evaluations: ``n + sum_i C_hsm(L_i, memory - i)`` over the kept segments, exactly
`memento.planning.online_evaluations`.

With a host level (``host_memory=H``) the forward keeps its carries in H host slots by the
same online policy (for ``H + 1`` slots, ``h_0`` the caller's) and writes no device slot;
the backward walks the host intervals last first, copying each one's first carry back to
the device and back-propagating it by the same recursion from an empty stack in the
``memory`` device slots: ``n + sum_i C_hsm(L_i, memory)`` evaluations over the host
segments, `memento.planning.online_evaluations` with ``host_memory=H``.

The program holds the body three times (primal loop forward, primal and VJP backward)
whatever ``max_steps``: the plan is data (the event table) or computed on device.

Forward mode and derivatives beyond the first come from `memento.loops._linear`, as for
`memento.scan`: the loop is a `_WhileLoop`, whose loop of the step's JVP is this same
`while_loop` over the carry and its tangent, each buffer's writes doubled onto a tangent
buffer (same index and predicate, the value's tangent).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core as jax_core, lax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from ..planning import online_events
from ..planning.internals import Request, host_slots, read_request
from . import _recursion
from ._body import (
    Body,
    inputs_to_consts,
    is_float,
    make_body,
    merge,
    nbytes,
    no_tangent_if_int,
    of_floats,
    platform,
    split,
    structure_error,
    to_floats,
    varying_in_step,
)
from ._budget import Bytes, to_slots
from ._interpreter import SMALL_ARRAY_BYTES, read_index, read_table
from ._linear import Loop, differentiable
from ._pool import _convert_element_type, under_forward_mode, varying

_NAME = "memento.while_loop"
# Above this many slots the online policy's planning (Python, once per (memory,
# max_steps) per process, at trace time) grows as about m^3 for an unbounded loop, and
# takes seconds. Budgets above it that do not keep every carry use this many slots, with
# a warning; the extra slots would save little (HSM's C(n, m) / n at n = 10^5: 3.92 at
# 128 slots, 3.67 at 256).
_MAX_POLICY_SLOTS = 128
# The forward pass reads each column of its event table (int32) from this many constants
# (`_interpreter.read_table`): every table up to 2048 rows, all those of budgets up to 16
# slots (1102 rows unbounded) and of 32 slots up to 10^5 steps (933), in pieces of at
# most 512 bytes, so that XLA:CPU runs the loop op after op where its carry is small
# rather than as a dataflow graph; longer tables are read whole.
_TABLE_PIECES = 16


def while_loop(
    cond_fun: Callable,
    body_fun: Callable,
    init_val: Any,
    *,
    max_steps: int | None = None,
    memory: int | str | Bytes | None = None,
    buffers: Callable[[Any], Any] | None = None,
    return_truncated: bool = False,
    host_memory: int | float | str | Bytes | None = None,
    transfer_cost: float | tuple[float, float] | None = None,
    jvp_body_fun: Callable | None = None,
) -> Any:
    """``jax.lax.while_loop`` that is reverse-mode differentiable within a memory budget.

    The value is that of ``lax.while_loop(cond_fun, body_fun, init_val)``, stopped after
    ``max_steps`` steps if the predicate still holds then (``max_steps=None``: no bound).
    Its gradient with respect to ``init_val`` and to arrays the two functions close over
    equals that of the same computation unrolled for the n steps taken. The forward pass
    keeps carries *online* (n is unknown until the predicate fails) in ``memory`` slots;
    the backward pass re-plans the rest optimally (binomial checkpointing) from what was
    kept. The compiled program does not grow with ``max_steps``.

    Forward evaluations of ``body_fun`` for n steps are ``online_evaluations(memory, n,
    host_memory=H)`` of `memento.planning`: ``2n`` up to ``memory`` steps, the online
    optimum ``3n - memory`` (Stumm and Walther's algorithm I) up to
    ``binom(memory + 2, 2) - 1`` steps, and beyond within 6% of the offline optimum
    ``memento.plan(n, memory).cost`` on the sizes tested; with every carry on the host,
    ``2n``. For 1000 steps at ``memory=4``: 9376 one-level, 7146 with ``H=8``, 2000 with
    ``math.inf``.

    Args:
        cond_fun, body_fun, init_val: as ``jax.lax.while_loop``.
        max_steps: at most this many steps (an ``int >= 0``), or ``None`` for no bound.
        memory: carry-sized slots (an ``int``, the initial carry included: the paper's m)
            or bytes (``"64MiB"``, ``memento.bytes_budget(n)``), or a percentage
            (``"5%"``) of every carry, ``floor(0.05 * (max_steps + 1))`` slots (needs
            ``max_steps``). ``None``: enough to keep every carry, ``max_steps + 1`` slots
            (needs ``max_steps``). Under ``vmap``,
            sizes are those of one batch member. Buffers (below) take no slots, nor do
            carry leaves that ``body_fun`` returns unchanged: as in ``lax.while_loop``,
            they are constants of the loop (and keep their batching under ``vmap``).
        buffers: as Equinox's ``while_loop(..., buffers=)``: a function of the carry that
            returns the arrays (a node or a sequence of nodes of ``init_val``) the body
            only writes to, ``buf.at[i].set(x)``, like the output array of an ODE solve
            saved at given times. Inside ``body_fun`` they are write-only stand-ins
            (`memento.loops.Buffer`, a ``jax.Array`` by type with the buffer's shape and
            dtype; reading one is an error; ``cond_fun`` sees the real arrays); each
            location may be written at most once, in the loop or before it (unchecked, as
            in Equinox: a second write gives wrong gradients). They are not checkpointed:
            the carries kept in ``memory`` exclude them, and the backward pass hands each
            written value its cotangent from the buffer's. Indices are integer arrays;
            out of bounds, a write is dropped, as by ``.at[i].set``, and its value
            gets no cotangent, as in the unrolled loop. A write may be conditional,
            ``buf.at[i].set(x, pred=p)`` with a bool scalar
            ``p`` (as Equinox's): nothing is written, and no cotangent taken, where ``p``
            is False, so a location may be written under false predicates any number of
            times, and once under a true one. ``buf.at[i].get()`` reads the value the
            location held before the loop, which is its value until its one write (what
            Equinox's ``buffer_at_set`` reads; a read after the write is not detected).
            A `memento.while_loop` nested in ``body_fun`` may write them too, as
            Equinox's nested loops may, by naming them among its own ``buffers``: a
            number of writes per step known only at run time (Diffrax's save loop). Its
            ``cond_fun`` may not read them (a ``TypeError``). The steps take the
            buffer and return it whole, so no copy is kept per step or per slot.
        return_truncated: if True, return ``(final, truncated)``, where ``truncated`` is
            a bool scalar (one per member under ``vmap``): True when the loop stopped
            because it took ``max_steps`` steps while ``cond_fun`` still held, so the
            result is not the loop's fixed point or end. Always False without
            ``max_steps``.
        host_memory: a second level of carry-sized slots in host memory (an ``int >=
            0``, bytes as ``memory``, or ``math.inf``: every carry, which needs
            ``max_steps``; ``H >= max_steps`` is the same). The forward pass then keeps
            its checkpoints in the host slots only, by the same online policy for ``H + 1``
            slots (``h_0`` stays the caller's, on the device; above 128 slots that do not
            keep every carry, 128, with a warning), copying each kept carry to the host;
            the backward pass copies each host interval's first carry back and reverses
            the interval on the device in ``memory`` slots. This is an online policy on
            two levels, not the optimal two-level plan `memento.scan` runs. It is used
            only where it keeps at least as many carries as the device alone would,
            ``H >= memory - 1`` (else, and for ``0``/``None``, the one-level loop runs,
            the same program), and not when ``memory`` keeps every carry already. Host
            slots are placed as `memento.scan`'s (``pinned_host`` memory where the backend
            has one; on the device under an outer ``jvp``). Needs a ``memory`` budget.
        transfer_cost: not used by this loop (`memento.scan`'s): its online policy places
            checkpoints on the host whatever a copy costs. Anything but ``None`` is a
            ``TypeError``.
        jvp_body_fun: for a ``body_fun`` that JAX cannot differentiate in forward mode
            (one holding a ``jax.custom_vjp``, such as Equinox's checkpointed loop): the
            same function written so that it can, e.g. with a ``lax.scan`` in place of
            the custom loop. ``body_fun`` then runs the loop and its gradient, and
            ``jvp_body_fun`` every other derivative (``jvp``, ``jacfwd``, ``linearize``,
            Hessians, ``grad`` of ``grad``). The two are traced together, once; their
            carries and buffer writes must match (a ``TypeError``), and their values are
            taken to be equal (not checked).

    Returns:
        The final carry, as ``lax.while_loop``; ``(final, truncated)`` with
        ``return_truncated=True``.

    Raises:
        ValueError: ``max_steps < 0``; ``memory=None`` or a percentage without
            ``max_steps``; a budget
            below one carry (the message names the minimum); ``host_memory`` negative,
            ``math.inf`` without ``max_steps``, in bytes that hold no carry, or with
            ``memory=None``.
        TypeError: a body that changes the carry's structure, shapes or dtypes; a
            predicate that is not a scalar bool; a bad ``memory`` or ``max_steps``;
            ``buffers`` that are not arrays of the carry, a body that reads a buffer or
            returns something else in its place; a ``jvp_body_fun`` whose carry or
            writes differ from ``body_fun``'s; a bad ``host_memory``
            (e.g. a float other than ``math.inf``); ``transfer_cost`` given.
        NotImplementedError: inside ``shard_map(check_vma=True)``, a predicate that
            varies over mesh axes (each device may stop at its own step) with a body
            that casts a differentiated, unvaried value to varying (a carried float the
            body mixes with varying values): the cast's transpose, a ``psum``, would run
            a different number of times per device in the backward loop, a deadlock.
            Cast it before the loop (``lax.pcast(x, axes, to="varying")``). Arrays the
            body closes over (weights) are cast before the loop for you, so their
            ``psum`` runs once, after the backward loop.

    Transformations: ``jit``, ``grad``/``vjp``, ``jvp``/``jacfwd``/``linearize``,
    ``vmap`` (a batched predicate runs the batch until its last member stops, a stopped
    member's steps changing nothing; the batch shares one checkpoint schedule, that of its
    longest member, and each member's gradient is its own), nesting; derivatives of any
    order in any mode (``jax.hessian``, ``grad(grad(f))``), buffers included. Each
    derivative beyond the first runs the loop of the step's JVP (the carry and its
    tangent, the buffers and theirs) as a `memento.while_loop` with the same
    ``max_steps``, ``memory`` and ``host_memory``. Forward mode needs a ``body_fun`` that
    JAX can differentiate in forward mode (no ``jax.custom_vjp`` inside), or a
    ``jvp_body_fun``.

    Notes:
        The step counter is int32: at most 2**31 - 2 steps. A budget above 128 slots that
        does not keep every carry (``max_steps`` is None or at least the budget) is used
        as 128 slots, with a warning: the online policy's planning time grows as the cube
        of the slots. A push costs O(1) whatever the budget: the backward
        (`memento.loops._recursion`) keeps slot d - 1 for stack depth d and computes
        splits in closed form. More slots can be slower where a tiny carry's slots then
        pass 512 bytes a leaf: XLA:CPU then runs the loops as dataflow graphs over its
        thread pool.

    Example:
        >>> def solve(x):  # doctest: +SKIP
        ...     return memento.while_loop(lambda s: s[1] > 1e-6, step, (x, 1.0),
        ...                               max_steps=10_000, memory=16)
    """
    steps = _check_max_steps(max_steps)
    request = read_request(
        _NAME,
        "while_loop",
        memory=memory,
        host_memory=host_memory,
        transfer_cost=transfer_cost,
        bounded=steps is not None,
    )

    init_leaves, init_tree = jax.tree_util.tree_flatten(init_val)
    is_buffer = _buffer_mask(buffers, init_val, init_leaves)
    # A loop nested in the body of another: buffers of the outer loop (its stand-ins) are
    # written here as this loop's own buffers, on the outer step's array (`_Buffer.thread`).
    given = [x for x, b in zip(init_leaves, is_buffer) if b]
    outer = [x if isinstance(x, _Buffer) else None for x in given]
    if any(isinstance(x, _Buffer) and not b for x, b in zip(init_leaves, is_buffer)):
        raise TypeError(
            f"{_NAME}: init_val holds a buffer of an enclosing memento.while_loop that this "
            "nested loop does not name in buffers=; pass it as a buffer (e.g. "
            "buffers=lambda c: c[1]) to write it from the nested loop."
        )
    init_leaves = [c.thread() if isinstance(c, _Buffer) else jnp.asarray(c) for c in init_leaves]
    carry0 = [c for c, b in zip(init_leaves, is_buffer) if not b]
    buffers0 = [c for c, b in zip(init_leaves, is_buffer) if b]
    buffer_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in buffers0]
    # What ``buf.at[i].get()`` reads: the value before the outermost loop that owns it.
    initials = [a if o is None else o.initial for o, a in zip(outer, buffers0)]

    as_step = _Step(init_tree, tuple(is_buffer), tuple(buffer_avals), tuple(initials))

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(init_val)]
    paths = [p for p, b in zip(paths, is_buffer) if not b]
    # Per write of one step: (buffer number, number of index leaves, conditional?).
    writes: list = []
    x0 = [jnp.bool_(True), *buffers0]
    if jvp_body_fun is None:
        step = functools.partial(as_step, body_fun, writes)
        body = jvp_body = make_body(step, carry0, x0, name=_NAME, carry_paths=paths)
    else:
        body, jvp_body = _twins(as_step, body_fun, jvp_body_fun, writes, carry0, x0, paths)
    carry0 = body.cast_carry(carry0)  # a weakly typed init takes the body's dtype
    write_spec = tuple(writes)
    full0 = _merge_buffers(carry0, buffers0, is_buffer)
    cond_jaxpr, cond_consts = _trace_cond(cond_fun, full0, init_tree)
    if any(o is not None for o in outer):
        _refuse_reading_outer_buffers(cond_jaxpr, is_buffer, outer)
    # Carry leaves the body returns unchanged are read-only: as lax.while_loop does, they
    # become constants of the loop (of the body and of the predicate), out of the slots.
    readonly = body.readonly_carry()
    fixed, carry0 = split(carry0, readonly)
    twin = jvp_body is not body
    body = body.carry_to_consts(readonly, fixed)
    jvp_body = jvp_body.carry_to_consts(readonly, fixed) if twin else body
    fixed_in_full = _merge_buffers(readonly, [False] * len(buffers0), is_buffer)
    loop_cond = inputs_to_consts(cond_jaxpr, fixed_in_full)
    is_loop_buffer = [b for b, r in zip(is_buffer, fixed_in_full) if not r]

    slots, host, events = _online_slots(request, steps, nbytes(body.carry_avals))

    loop_cond_consts = [*cond_consts, *fixed]
    loop = _WhileLoop(
        body,
        jvp_body,
        loop_cond,
        len(loop_cond_consts),
        slots,
        steps,
        events,
        tuple(is_loop_buffer),
        write_spec,
        host=bool(host),
        carry_slots=_recursion.CarrySlots(
            tuple(body.carry_avals),
            per_leaf=_in_order(
                max(slots, int(host)),
                body.carry_avals,
                [*body.consts, *loop_cond_consts, *buffers0],
            ),
        ),
        again=functools.partial(
            while_loop, max_steps=max_steps, memory=memory, host_memory=host_memory
        ),
        backend=platform(carry0, buffers0),
    )
    out = differentiable(loop)(*body.consts, *loop_cond_consts, *carry0, *buffers0)
    out = no_tangent_if_int(out)
    carry, bufs = out[: len(carry0)], out[len(carry0) :]
    carry = merge(fixed, carry, readonly)
    final = _merge_buffers(carry, bufs, is_buffer)
    # An enclosing loop's buffers go back to its body as stand-ins that hold the writes.
    returned = [b if o is None else o.threaded_as(b) for o, b in zip(outer, bufs)]
    out = jax.tree_util.tree_unflatten(init_tree, _merge_buffers(carry, returned, is_buffer))
    if not return_truncated:
        return out
    if steps is None:
        return out, jnp.bool_(False)
    # Stopped after max_steps with the predicate still true (a loop that stops on its
    # predicate ends with it false).
    still = jax_core.eval_jaxpr(cond_jaxpr, list(cond_consts), *final)[0]
    return out, jnp.asarray(still, jnp.bool_)


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """A ``body_fun`` as a step of the carry without its buffers (`make_body`), called
    as ``step(body_fun, writes, c, x)``: ``writes`` gets what the step writes to each
    buffer; ``init_tree`` and ``is_buffer`` are the carry's structure and which of its
    leaves are buffers, ``buffer_avals`` and ``initials`` those buffers' shapes and
    values before the outermost loop that owns them (what ``buf.at[i].get()`` reads)."""

    init_tree: Any
    is_buffer: tuple[bool, ...]
    buffer_avals: tuple
    initials: tuple

    def __call__(self, body_fun: Callable, writes: list, c, x):
        # The carry without its buffers; the buffers are write-only stand-ins that
        # record what the body writes, returned as the step's outputs. ``active`` (a bool
        # input) says whether the step is taken: under vmap the batch steps until its
        # last member stops, and a member already stopped keeps its carry and writes
        # nothing (see `_differentiable_run`); otherwise it is always True. The buffers'
        # arrays are inputs too, read only by loops nested in the body that write them
        # (a whole-buffer output, `_WHOLE`); the other steps leave them unused.
        active, *arrays = x
        stand_ins = [
            _Buffer(j, a, initial=b, array=arr)
            for j, (a, b, arr) in enumerate(zip(self.buffer_avals, self.initials, arrays))
        ]
        full = _merge_buffers(c, stand_ins, self.is_buffer)
        out = body_fun(jax.tree_util.tree_unflatten(self.init_tree, full))
        is_stand_in = lambda x: isinstance(x, _Buffer)  # noqa: E731
        out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=is_stand_in)
        if out_tree != self.init_tree:
            raise structure_error(_NAME, self.init_tree, out, is_leaf=is_stand_in)
        new_c, ys = [], []
        writes.clear()
        j = 0
        for leaf, b, old in zip(out_leaves, self.is_buffer, full):
            if not b:
                if isinstance(leaf, _Buffer):
                    raise TypeError(f"{_NAME}: body_fun moved a buffer to a non-buffer leaf.")
                # A leaf returned as it came is left so (read-only: `Body.readonly_carry`).
                new_c.append(leaf if leaf is old else _select(active, leaf, old))
                continue
            if not (isinstance(leaf, _Buffer) and leaf.number == j):
                raise TypeError(
                    f"{_NAME}: body_fun must return buffer {j} as written with "
                    f"buf.at[i].set(x) (got {type(leaf).__name__}); buffers are write-only "
                    "inside the loop."
                )
            if leaf.threaded:
                # Written by a nested loop: the step outputs the whole array (a stopped
                # member's unchanged).
                writes.append((j, _WHOLE, False))
                ys.append(_select(active, leaf.thread(), arrays[j]))
            for idx, value, pred in () if leaf.threaded else leaf.writes:
                pred = active if pred is None else pred & active
                writes.append((j, len(idx), True))
                ys.extend([*idx, value, pred])
            j += 1
        return new_c, ys


def _online_slots(request: Request, steps: int | None, carry_bytes: int):
    """``(slots, host, events)`` of a while loop of at most ``steps`` steps (None: no
    bound) as ``request`` asks: its device slots, its host slots (0: one level), and the
    online policy's event table for the level that keeps the forward pass's carries."""
    budget, host_budget = request.memory, request.host
    if budget is None:
        assert steps is not None  # memory=None without max_steps was refused above
        slots = steps + 1
    else:
        need = None if steps is None else steps + 1  # what memory=None keeps
        slots = to_slots(budget, carry_bytes, name=_NAME, need=need)
    if steps is not None:
        slots = min(slots, steps + 1)  # more than one slot per carry is never used
    host = 0 if host_budget is None else host_slots(host_budget, carry_bytes, name=_NAME)
    if steps is not None and slots == steps + 1:
        host = 0  # the device alone keeps every carry
    elif steps is not None and host >= steps:
        # The host keeps every carry: the backward recomputes nothing, and needs no slot
        # on the device besides the carry it loads.
        host, slots = steps, 1
    elif min(host + 1, _MAX_POLICY_SLOTS) < min(slots, _MAX_POLICY_SLOTS):
        # The forward keeps its carries on the host only: fewer host slots than device
        # ones would keep fewer carries than the device alone, and evaluate more (up to
        # 1.4x, `online_evaluations`). The one-level loop runs instead.
        host = 0
    if host:
        # The forward keeps its carries in host slots by the online policy (h_0, the
        # caller's, is its first slot); the backward reverses each host interval on the
        # device by the recursion, from an empty stack, in ``slots`` slots. Finite here:
        # math.inf without max_steps was refused above, and with it became max_steps.
        host = int(host)
        what = f"host_memory={host} slots (with h_0, {host + 1})"
        events = online_events(_policy_slots(host + 1, steps, what), steps)
    else:
        slots = _policy_slots(slots, steps, f"a budget of {slots} slots")
        events = online_events(slots, None if steps is None else max(steps, 1))
    return slots, host, events


def _twins(as_step, body_fun, jvp_body_fun, writes, carry0, x0, paths) -> tuple[Body, Body]:
    """The bodies of ``body_fun`` and of ``jvp_body_fun`` (each stepped by ``as_step``),
    traced together so that they share their consts; ``writes`` gets ``body_fun``'s."""
    other: list = []
    f = functools.partial(as_step, body_fun, writes)
    g = functools.partial(as_step, jvp_body_fun, other)
    num_y: list = []

    def both(c, x):
        c_1, y_1 = f(c, x)
        c_2, y_2 = g(c, x)
        num_y[:] = [len(y_1)]
        return c_1, (y_1, c_2, y_2)

    joint = make_body(both, carry0, x0, name=_NAME, carry_paths=paths)
    body, jvp_body = joint.twins(num_y[0])
    n = len(body.carry_avals)
    second = joint.y_avals[num_y[0] : num_y[0] + n]
    if other != writes or [(a.shape, a.dtype) for a in second] != [
        (a.shape, a.dtype) for a in body.carry_avals
    ]:
        raise TypeError(
            f"{_NAME}: jvp_body_fun must be the same function as body_fun: it returns a "
            "carry of other shapes or dtypes, or writes the buffers differently."
        )
    return body, jvp_body


def _in_order(num_slots: int, carry_avals, arrays) -> bool:
    """Whether the loop's slots get a pool per carry leaf: where each leaf's slots, and
    every array the loop reads or carries (``arrays``: consts, buffers), hold at most
    `_interpreter.SMALL_ARRAY_BYTES`. XLA:CPU can then run its loops op after op in the
    calling thread (a pool per dtype can pass that size, e.g. for Diffrax's five int64
    counters, and make the loop a dataflow graph over the thread pool). Where a larger
    array makes it such a graph anyway, a pool per dtype keeps the writes of a slot in
    one chain, which that executor runs faster than as many independent writes. Sizes
    are a batch member's under vmap, as the budget's."""
    leaf = max((nbytes([a]) for a in carry_avals), default=0)
    biggest = max((nbytes([jax.typeof(x)]) for x in arrays), default=0)
    return max(num_slots, 1) * leaf <= SMALL_ARRAY_BYTES and biggest <= SMALL_ARRAY_BYTES


def _policy_slots(slots: int, steps: int | None, what: str) -> int:
    """The slots the online policy plans for, ``h_0`` included: ``slots``, or
    `_MAX_POLICY_SLOTS` (with a warning naming the budget, ``what``) when more would not
    keep every carry."""
    store_all = steps is not None and slots == steps + 1
    if store_all or slots <= _MAX_POLICY_SLOTS:
        return slots
    warnings.warn(
        f"{_NAME}: {what} is above the {_MAX_POLICY_SLOTS} slots the online checkpointing "
        f"policy plans for (its planning time grows as slots^3: 1.8 s at 128, 9 s at "
        f"256); using {_MAX_POLICY_SLOTS} slots. To keep every carry instead, pass "
        f"max_steps <= {slots - 1}.",
        stacklevel=3,
    )
    return _MAX_POLICY_SLOTS


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


def _trace_cond(cond_fun, leaves, tree):
    def flat(c):
        return cond_fun(jax.tree_util.tree_unflatten(tree, c))

    closed = jax.make_jaxpr(flat)([jax.typeof(a) for a in leaves])  # exact: weak, vma
    (out,) = closed.out_avals if len(closed.out_avals) == 1 else (None,)
    if out is None or out.shape != () or out.dtype != jnp.bool_:
        raise TypeError(
            f"{_NAME}: cond_fun must return a scalar bool, got "
            f"{[f'{a.dtype}{list(a.shape)}' for a in closed.out_avals]}."
        )
    return closed.jaxpr, list(closed.consts)


# ----------------------------------------------------------------------------------------
# Buffers (Equinox's ``buffers=``): write-only arrays of the carry, kept out of the slots


def _buffer_mask(buffers, init_val, leaves) -> list[bool]:
    """Which leaves of ``init_val`` are buffers: the leaves of ``buffers(init_val)``."""
    if buffers is None:
        return [False] * len(leaves)
    if not callable(buffers):
        raise TypeError(
            f"{_NAME}: buffers must be a function of the carry returning its buffer arrays "
            f"(e.g. buffers=lambda c: c[1]), got {buffers!r}."
        )
    chosen = jax.tree_util.tree_leaves(buffers(init_val))
    mask = [any(leaf is b for b in chosen) for leaf in leaves]
    if not chosen or sum(mask) != len(chosen) or not all(hasattr(b, "shape") for b in chosen):
        raise TypeError(
            f"{_NAME}: buffers(init_val) must return arrays that are leaves of init_val "
            f"(got {len(chosen)} leaves, {sum(mask)} of them found in init_val); pass "
            "e.g. buffers=lambda c: c[1] where c[1] is an array of the carry."
        )
    return mask


def _merge_buffers(carry, bufs, is_buffer) -> list:
    it_c, it_b = iter(carry), iter(bufs)
    return [next(it_b) if b else next(it_c) for b in is_buffer]


class _Buffer(jax.Array):
    """A buffer inside ``body_fun``: supports ``buf.at[i].set(x)`` only, recording writes.

    It is a ``jax.Array`` by type, with the buffer's ``shape``, ``dtype`` and ``ndim``, so
    that annotations of arrays accept it: Diffrax's ``SaveState`` checks its ``ts`` and
    ``ys`` against ``Real[Array, "times"]`` under jaxtyping's runtime checks (Equinox's
    ``MaybeBuffer`` unwraps Equinox's own buffer, then checks the array). Its values
    cannot be read: every read is a ``TypeError`` that says so.
    """

    def __init__(
        self, number: int, aval, writes: tuple = (), *, initial=None, array=None, threaded=False
    ):
        self.number, self._aval, self.writes = number, aval, writes
        self._initial = initial
        # The buffer's array as the step receives it (``threaded``: with the step's writes
        # applied, a nested loop having written it).
        self._array, self.threaded = array, threaded

    @property
    def initial(self):
        return self._initial

    def thread(self) -> jax.Array:
        """The array with this step's writes so far, for a loop nested in the body that
        writes the buffer (`memento.while_loop` with it among its ``buffers``)."""
        if self._array is None:
            raise TypeError(f"{_NAME}: this buffer cannot be written by a nested loop.")
        if self.threaded:
            return self._array
        array = self._array
        for index, value, pred in self.writes:
            array = _write(array, index, value, pred)
        return array

    def threaded_as(self, array) -> _Buffer:
        """This stand-in once a nested loop has written it: ``array`` holds the writes."""
        return _Buffer(self.number, self._aval, initial=self._initial, array=array, threaded=True)

    shape = property(lambda self: tuple(self._aval.shape))
    dtype = property(lambda self: self._aval.dtype)
    ndim = property(lambda self: len(self._aval.shape))
    size = property(lambda self: int(np.prod(self._aval.shape)))

    @property
    def aval(self):
        # JAX reads ``aval`` to treat a jax.Array as a value: that is a read.
        self[()]

    @property
    def at(self):
        return _BufferAt(self)

    def __getitem__(self, index):
        raise TypeError(
            f"{_NAME}: buffers are write-only inside body_fun (as in Equinox's "
            "checkpointed while loop): write with buf.at[i].set(x); read them after the loop."
        )

    def __jax_array__(self):
        self[()]

    def __array__(self, *args, **kwargs):
        self[()]

    def __repr__(self) -> str:
        return f"memento.loops.Buffer({self.dtype}{list(self.shape)}, {len(self.writes)} writes)"


# Older JAX declares jax.Array's methods abstract; a buffer implements the few it needs.
_Buffer.__abstractmethods__ = frozenset()


class _BufferAt:
    def __init__(self, buffer: _Buffer):
        self.buffer = buffer

    def __getitem__(self, index):
        return _BufferWrite(self.buffer, index)


def _as_index(index) -> tuple:
    index = tuple(jnp.asarray(i) for i in (index if isinstance(index, tuple) else (index,)))
    if not all(jnp.issubdtype(i.dtype, jnp.integer) for i in index):
        raise TypeError(f"{_NAME}: a buffer is written at integer (array) indices, got {index!r}.")
    return index


class _BufferWrite:
    def __init__(self, buffer: _Buffer, index):
        self.buffer, self.index = buffer, index

    def set(self, value, *, pred=True) -> _Buffer:
        """The buffer with ``value`` written at the index; with ``pred`` (a bool scalar,
        as Equinox's ``buf.at[i].set(x, pred=...)``), written only where it is True."""
        b = self.buffer
        index = _as_index(self.index)
        shape = jax.eval_shape(lambda *i: jnp.zeros(b.shape, b.dtype)[i], *index).shape
        value = jnp.broadcast_to(jnp.asarray(value, b.dtype), shape)
        if pred is True:
            pred = None
        else:
            pred = jnp.asarray(pred)
            if pred.shape != () or pred.dtype != jnp.bool_:
                raise TypeError(
                    f"{_NAME}: buf.at[i].set(x, pred=...) takes a bool scalar pred, got "
                    f"{pred.dtype}{list(pred.shape)}."
                )
        if b.threaded:  # written by a nested loop already: write on its array
            return b.threaded_as(_write(b.thread(), index, value, pred))
        return _Buffer(
            b.number,
            b._aval,
            (*b.writes, (index, value, pred)),
            initial=b._initial,
            array=b._array,
        )

    def get(self, **kwargs):
        """The value the location held before the loop, which is its value until its one
        write (buffers are written once per location): what Equinox's ``buffer_at_set``
        reads to write under a predicate. Reading a location after it was written gives
        that old value too, unchecked, as a second write is."""
        b = self.buffer
        if kwargs or b._initial is None:
            raise TypeError(
                f"{_NAME}: buffers are write-only inside body_fun: buf.at[i].get() (with no "
                "arguments) reads only the value a location held before the loop."
            )
        return b._initial[_as_index(self.index)]


def _refuse_reading_outer_buffers(cond_jaxpr, is_buffer, outer) -> None:
    """A nested loop's predicate may not read an enclosing loop's buffer: the enclosing
    loop's backward pass recomputes its steps with that buffer's final value, not the one
    the step saw."""
    used = {v for e in cond_jaxpr.eqns for v in e.invars if isinstance(v, jex_core.Var)}
    used |= {v for v in cond_jaxpr.outvars if isinstance(v, jex_core.Var)}
    buffer_vars = [v for v, b in zip(cond_jaxpr.invars, is_buffer) if b]
    if any(o is not None and v in used for v, o in zip(buffer_vars, outer)):
        raise TypeError(
            f"{_NAME}: the cond_fun of a loop nested in a memento.while_loop body reads a "
            "buffer of the enclosing loop; buffers are write-only there. Decide on the "
            "carry instead (e.g. an index carried next to the buffer)."
        )


# A write of a whole buffer: a nested loop wrote it, the step outputs the array.
_WHOLE = -1


def _write(array, index, value, pred=None) -> jax.Array:
    """``array.at[index].set(value)``, or, with a predicate, only where it holds."""
    if pred is not None:
        value = jnp.where(pred, value, array[index])
    return array.at[index].set(value)


def _places(write_spec) -> list[int]:
    """Each write's first output among a step's ``ys``: a whole buffer takes one; an
    indexed write its index leaves, its value and, if conditional, its predicate."""
    places, k = [], 0
    for _, n_idx, conditional in write_spec:
        places.append(k)
        k += 1 if n_idx == _WHOLE else n_idx + 1 + conditional
    return places


def _apply_writes(bufs, ys, write_spec) -> list:
    """The buffers after one step's writes (``ys``: per write, its index leaves, its value
    and, for a conditional write, its predicate)."""
    bufs = list(bufs)
    for (j, n_idx, conditional), k in zip(write_spec, _places(write_spec)):
        if n_idx == _WHOLE:
            bufs[j] = ys[k]
            continue
        index, value = tuple(ys[k : k + n_idx]), ys[k + n_idx]
        bufs[j] = _write(bufs[j], index, value, ys[k + n_idx + 1] if conditional else None)
    return bufs


# ----------------------------------------------------------------------------------------
# The loop as `_linear` differentiates it


@dataclasses.dataclass(frozen=True, eq=False)
class _WhileLoop(Loop):
    """The budgeted while loop as `_linear` differentiates it: flat arguments ``(consts,
    cond_consts, init, buffers)``, outputs ``(carry, buffers)``.

    The executor's forward keeps carries where ``events`` say: in device slots, or with
    ``host`` in host slots. Its backward back-propagates by the recursion in ``slots``
    device slots (``h_0`` included): over the kept stack, or with ``host`` over each host
    interval. ``carry_slots``: the slots' layout (`_in_order` picks ``per_leaf``).
    ``again`` is `while_loop` with this loop's ``max_steps``, ``memory`` and
    ``host_memory``: the loop of the step's JVP (`tangent_loop`) runs through it.
    """

    body: Body
    jvp_body: Body
    cond_jaxpr: Any
    num_cond_consts: int
    slots: int
    steps: int | None
    events: Any
    is_buffer: tuple[bool, ...]
    write_spec: tuple
    host: bool
    carry_slots: _recursion.CarrySlots
    again: Callable
    backend: str

    def _parts(self, leaves) -> tuple[list, list, list, list]:
        n_k, n_q = len(self.body.consts), self.num_cond_consts
        n_c = len(self.body.carry_avals)
        leaves = list(leaves)
        a, b, c = n_k, n_k + n_q, n_k + n_q + n_c
        return leaves[:a], leaves[a:b], leaves[b:c], leaves[c:]

    @property
    def _threaded(self) -> set[int]:
        """The buffers a nested loop writes whole (a step's input and output)."""
        return {j for j, n_idx, _ in self.write_spec if n_idx == _WHOLE}

    def _cond(self, cond_consts, c, bufs):
        full = _merge_buffers(c, bufs, self.is_buffer)
        return jax_core.eval_jaxpr(self.cond_jaxpr, list(cond_consts), *full)[0]

    def _running(self, cond_consts, p, c, bufs):
        ok = self._cond(cond_consts, c, bufs)
        return ok if self.steps is None else jnp.logical_and(p < self.steps, ok)

    def _step(self, consts, c, bufs, active=True, body=None):
        c, ys = (body or self.body)(consts, c, [jnp.asarray(active), *bufs])
        return c, _apply_writes(bufs, ys, self.write_spec)

    def primal(self, args, body=None):
        consts, cond_consts, init, bufs = self._parts(args)

        def body_fn(state):
            p, c, bufs = state
            return p + 1, *self._step(consts, c, bufs, body=body)

        state = (jnp.int32(0), init, bufs)
        _, c, bufs = lax.while_loop(lambda s: self._running(cond_consts, *s), body_fn, state)
        return [*c, *bufs]

    def jvp_primal(self, args):
        return self.primal(args, self.jvp_body)

    def prepare(self, perturbed):
        # Only what is perturbed, or depends on it, is differentiated. A buffer written
        # whole (by a nested loop) is differentiated as a step's input.
        mk, _, mc, mb = self._parts(perturbed)
        whole = [p and j in self._threaded for j, p in enumerate(mb)]
        b = self.body.restrict(mk, mc, [False, *whole])
        _refuse_per_step_psums(b, self.cond_jaxpr)
        return b, tuple(perturbed)

    def forward(self, plan, args):
        consts, cond_consts, init, bufs = self._parts(args)
        num_slots = self.events.memory - 1  # physical slots; h_0 is the caller's
        store_pos, store_slot, store_until = _tables(self.events)
        # In pieces only where the loop can run in order (`_in_order`, which then also
        # gives its slots a pool per leaf): where it runs as a dataflow graph anyway, one
        # read of the whole table is faster.
        pieces = _TABLE_PIECES if self.carry_slots.per_leaf else 1
        # Host slots stay on the device under an outer jvp (`_pool.under_forward_mode`).
        place = not under_forward_mode(jax.tree_util.tree_leaves((consts, init, bufs)))
        hidden = self.carry_slots.allocate(num_slots, host=self.host, place=place)

        # One schedule for the whole batch under vmap, as Equinox's loop does: the loop
        # runs while any member runs (`_any_member` is unbatched), its step counter p and
        # the checkpoint events stay unbatched, and a member that has stopped takes
        # steps that change nothing (``active`` False: its carry is kept, its writes are
        # not made). Each member's trajectory is then that of a loop of the batch's
        # length whose last steps are the identity, and the backward pass replays them
        # in lockstep, with no control flow that depends on the member. (Letting vmap
        # batch the loop instead gave each member its own recursion: the batch paid, at
        # every backward step, the longest of the members' recomputations.)
        def body_fn(state):
            p, ptr, c, (hidden, held), bufs, n, active = state
            keep = read_table(store_pos, ptr, pieces) == p
            if num_slots:
                slot = read_table(store_slot, ptr, pieces)
                until = read_table(store_until, ptr, pieces)
                hidden, held = _keep(
                    hidden, held, slot, c, self.carry_slots, keep, p, until, self.backend
                )
            taken = _member_active(active)  # True outside vmap, with no varying axes
            c, bufs = self._step(consts, c, bufs, taken)
            p, n = p + 1, n + taken.astype(jnp.int32)
            running = self._running(cond_consts, p, c, bufs)
            return p, ptr + keep.astype(jnp.int32), c, (hidden, held), bufs, n, running

        zero = jnp.int32(0)
        go = self._running(cond_consts, zero, init, bufs)
        # Per physical slot, the position of the carry it holds and where the policy
        # gives that carry up (-1: never written).
        held = (jnp.full(num_slots, -1, jnp.int32), jnp.full(num_slots, -1, jnp.int32))
        state = (zero, zero, init, (hidden, held), bufs, zero, go)
        total, _, c, (hidden, held), bufs, n, _ = lax.while_loop(
            lambda s: _any_member(s[6]), body_fn, state
        )
        stack_pos, stack_slot, depth = _stack(total, *held)
        # The buffers' values are a step's inputs only where a nested loop writes them
        # (any value will do: they are write-only); else their types are enough.
        kept = [x if j in self._threaded else None for j, x in enumerate(bufs)]
        return [*c, *bufs], (hidden, total, n, stack_pos, stack_slot, depth, kept)

    def backward(self, plan, args, cache, cts):
        b, perturbed = plan
        consts, cond_consts, init, bufs = self._parts(args)
        hidden, total, n, stack_pos, stack_slot, depth, kept = cache
        # The cotangents of the differentiated carry leaves and of the float buffers,
        # from those of every float output (carry, then buffers).
        n_c = sum(map(is_float, b.carry_avals))
        ct_c = of_floats(b.carry_avals, b.carry_mask, cts[:n_c])
        cts = iter(cts[n_c:])
        # A written location passes its cotangent to the value written there and none to
        # what it held before.
        buf_types = [jax.typeof(x) for x in bufs]
        buf_float = [is_float(x) for x in buf_types]
        ct_b = [next(cts) for f in buf_float if f]
        bufs = [jnp.zeros(t.shape, t.dtype) if x is None else x for x, t in zip(kept, buf_types)]
        kf, _ = split(consts, b.const_mask)
        threaded = self._threaded

        def give_cts(e, d_x, aux):
            # A buffer written whole by the step: its cotangent before the step.
            (ct_b, pending), d_x = aux, iter(d_x)
            ct_b = list(ct_b)
            for j in sorted(threaded):
                if buf_float[j] and b.x_mask[1 + j]:
                    ct_b[int(np.sum(buf_float[:j]))] = next(d_x)
            return ct_b, pending

        xs = lambda e: [_member_active(e < n), *bufs]  # noqa: E731
        take_cts = functools.partial(_buffer_cts, b, buf_float, self.write_spec)
        ct_k = [jnp.zeros_like(k) for k in kf]
        aux = (ct_b, _no_clears(b, buf_float, self.write_spec))
        num_slots = self.events.memory - 1
        recursion = _recursion.Recursion(b, self.slots, self.carry_slots)
        io = _recursion.CotangentIO(take_cts, give_cts)
        if self.host:
            ct_k, ct_init, aux = _host_intervals_backward(
                recursion, consts, init, xs, hidden, num_slots, total, stack_pos,
                stack_slot, depth, ct_c, ct_k, aux, io,
            )  # fmt: skip
        else:
            # Slot d - 1 holds the carry at depth d, as the recursion keeps them.
            stack = _recursion.Stack(
                self.carry_slots.reorder(hidden, stack_slot[1:]), stack_pos, depth
            )
            ct_k, ct_init, aux = recursion.backward(
                consts, init, xs, stack, total - 1, ct_c, ct_k, aux, io
            )
        ct_b, pending = aux
        ct_b = _clear(ct_b, pending, buf_float, self.write_spec)  # the first step's clears
        # The cotangents of the perturbed leaves only: a carry leaf differentiated because
        # a step makes it depend on a perturbed input has an unperturbed initial value;
        # the predicate's consts get zero.
        _, mq, mc, mb = self._parts(perturbed)
        returned = [p for p, m in zip(mc, b.carry_mask) if m]
        return [
            *ct_k,
            *[jnp.zeros_like(q) for q, m in zip(cond_consts, mq) if m],
            *[ct for ct, m in zip(ct_init, returned) if m],
            *[ct for ct, m in zip(ct_b, [m for m, f in zip(mb, buf_float) if f]) if m],
        ]

    def tangent_loop(self, args, tangents, mask):
        consts, cond_consts, init, bufs = self._parts(args)
        mk, mq, mc, mb = self._parts(mask)
        b, has_t = self._tangent_body(mk, mc, mb)
        tangents = iter(tangents)
        tk = [next(tangents) for m in mk if m]
        _ = [next(tangents) for m in mq if m]  # the predicate's: they change no step
        tc = [next(tangents) if m else None for m in mc]
        tb = [next(tangents) if m else None for m in mb]
        tc = [jnp.zeros_like(c) if t is None else t for c, t, m in zip(init, tc, b.carry_mask) if m]
        tb = [jnp.zeros_like(x) if t is None else t for x, t, h in zip(bufs, tb, has_t) if h]
        # Buffer j's tangent is tangent buffer where[j] (where has_t[j]).
        where = np.cumsum([0, *has_t]).tolist()
        places = _places(self.write_spec)

        def cond_fun(state):
            c, _, bs, _ = state
            return self._cond(cond_consts, c, bs)

        def body_fun(state):
            # One step and its JVP. A write carries over to the tangent buffer with the
            # same index and predicate and the value's tangent (zero for a value that
            # depends on nothing perturbed); a buffer written whole by a nested loop
            # takes the nested loop's tangent of it.
            c, dc, bs, dbs = state
            x = [jnp.bool_(True), *(s.thread() for s in bs)]  # this loop masks its own
            dx = [dbs[where[j]].thread() for j, m in enumerate(b.x_mask[1:]) if m]
            c, dc, ys, dy = b.jvp(consts, c, x, tk, dc, dx)
            dys = merge(dy, [None] * (len(ys) - len(dy)), b.y_mask)
            bs, dbs = list(bs), list(dbs)
            for (j, n_idx, _), k in zip(self.write_spec, places):
                t = where[j] if has_t[j] else None
                if n_idx == _WHOLE:
                    bs[j] = bs[j].threaded_as(ys[k])
                    if t is not None:  # differentiated: `_tangent_body`'s fixed point
                        dbs[t] = dbs[t].threaded_as(dys[k])
                    continue
                index, value, pred = tuple(ys[k : k + n_idx]), ys[k + n_idx], ys[k + n_idx + 1]
                bs[j] = bs[j].at[index].set(value, pred=pred)
                if t is not None:
                    dv = jnp.zeros_like(value) if dys[k + n_idx] is None else dys[k + n_idx]
                    dbs[t] = dbs[t].at[index].set(dv, pred=pred)
            return c, dc, bs, dbs

        with_buffers = {"buffers": lambda s: (s[2], s[3])} if bufs else {}
        c, dc, bs, dbs = self.again(cond_fun, body_fun, (init, tc, bufs, tb), **with_buffers)
        touts = to_floats(c, b.carry_avals, b.carry_mask, dc)
        for j, x in enumerate(bs):
            if is_float(x):
                touts.append(dbs[where[j]] if has_t[j] else jnp.zeros_like(x))
        return [*c, *bs], touts

    def _tangent_body(self, mk, mc, mb) -> tuple[Body, list[bool]]:
        """The body differentiated for the loop of the step's JVP, and which buffers take
        a tangent buffer there: a float buffer perturbed, or written with a
        differentiated value. One written whole (by a nested loop) is then a
        differentiated input of the step, its tangent carried from step to step: a
        fixed point, as `Body.restrict` finds the carry's."""
        floats = [is_float(a) for a in self.jvp_body.x_avals[1:]]
        places = _places(self.write_spec)
        whole = [False] * len(mb)
        while True:
            b = self.jvp_body.restrict(mk, mc, [False, *whole])
            written = [False] * len(mb)
            for (j, n_idx, _), k in zip(self.write_spec, places):
                written[j] = written[j] or b.y_mask[k if n_idx == _WHOLE else k + n_idx]
            has_t = [f and (m or w) for f, m, w in zip(floats, mb, written)]
            new = [h and j in self._threaded for j, h in enumerate(has_t)]
            if new == whole:
                return b, has_t
            whole = new


def _tables(events) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forward's event table: per store row, the position stored, the slot, and
    where the policy gives that carry up (`_given_up`)."""
    store_pos, store_slot = events.store_rows
    # A sentinel row past every position keeps the pointer in bounds without a test.
    big = np.iinfo(np.int32).max
    store_pos = np.append(store_pos, big).astype(np.int32)
    store_slot = np.append(store_slot, 0).astype(np.int32)
    store_until = np.append(_given_up(events), big).astype(np.int32)
    return store_pos, store_slot, store_until


def _host_intervals_backward(
    recursion: _recursion.Recursion,
    consts,
    init,
    xs,
    host,
    num_host: int,
    total,
    stack_pos,
    stack_slot,
    depth,
    ct_c,
    ct_k,
    aux,
    io: _recursion.CotangentIO,
):
    """Back-propagates steps ``total - 1`` .. 0 over the host checkpoints (`_stack`'s
    ``stack_pos``, ``stack_slot``, ``depth``), last interval first: each from its first
    carry, copied from its host slot to the device (``h_0`` is ``init``), by the
    ``recursion`` in its device slots from an empty stack; the cotangents run from one
    interval into the one before. Returns ``(ct_k, ct_init, aux)``."""
    slots, carry_slots = recursion.slots, recursion.carry_slots
    never = jnp.int32(np.iinfo(np.int32).max)
    ends = jnp.concatenate([stack_pos[1:], never[None]])  # past the last kept carry

    def interval(state):
        d, ct_c, ct_k, aux = state
        start = read_index(stack_pos, d)
        end = jnp.minimum(read_index(ends, d), total)
        slot = read_index(stack_slot, d)
        c = carry_slots.load(host, init, slot, num_host, pos=start)
        stacks = carry_slots.allocate(slots - 1)
        positions = jnp.zeros(slots, jnp.int32).at[0].set(start)
        stack = _recursion.Stack(stacks, positions, jnp.int32(0))
        ct_k, ct_c, aux = recursion.backward(
            consts, c, xs, stack, end - 1, ct_c, ct_k, aux, io, first=start
        )
        return d - 1, ct_c, ct_k, aux

    state = (depth, list(ct_c), list(ct_k), aux)
    _, ct_c, ct_k, aux = lax.while_loop(lambda s: s[0] >= 0, interval, state)
    return ct_k, ct_c, aux


# Whether any member of a batch runs: the identity outside vmap; under vmap, the any over
# the batch, unbatched (a primitive with a batching rule, lowered to nothing).
_any_member_p = jex_core.Primitive("memento_any_member")
_any_member_p.def_impl(lambda x: x)
_any_member_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(_any_member_p, lambda ctx, x: [x])


def _any_member_batched(args, dims):
    (x,), (d,) = args, dims
    return (x if d is None else jnp.any(x, axis=d)), None


batching.primitive_batchers[_any_member_p] = _any_member_batched


def _any_member(x):
    """``x``, a bool scalar; under ``vmap``, whether any member's is True, unbatched."""
    return _any_member_p.bind(x)


# Whether a member takes the step: True outside vmap, where the loop runs only while its
# predicate holds (lowered as the constant, so the selects and conditional writes it
# guards fold away); under vmap, the member's own ``x``.
try:  # the aval of values that vary over no manual mesh axis (private in JAX 0.10)
    from jax._src.core import empty_mat as _NO_MANUAL_AXES
except ImportError:
    _NO_MANUAL_AXES = None
_member_active_p = jex_core.Primitive("memento_member_active")
_member_active_p.def_impl(lambda x: np.bool_(True))


# Outside vmap the value is the constant True, so it varies over no mesh axis, whatever
# the predicate it stands for does (a per-device predicate under shard_map): typed as
# the body's ``active`` input was traced.
def _member_active_aval(x):
    if _NO_MANUAL_AXES is not None and hasattr(x, "mat"):  # JAX 0.10's type of varying axes
        return x.update(manual_axis_type=_NO_MANUAL_AXES)
    return x.update(vma=frozenset()) if hasattr(x, "vma") else x


_member_active_p.def_abstract_eval(_member_active_aval)
mlir.register_lowering(_member_active_p, lambda ctx, x: [mlir.ir_constant(np.array(True))])


def _member_active_batched(args, dims):
    (x,), (d,) = args, dims
    return (_member_active_p.bind(x), None) if d is None else (x, d)


batching.primitive_batchers[_member_active_p] = _member_active_batched


def _member_active(x):
    return _member_active_p.bind(x)


def _select(active, new, old):
    """``new`` where ``active``, else ``old`` (the carry of a step not taken), typed as
    ``new`` (its weak type kept)."""
    new = jnp.asarray(new) if not isinstance(new, jax.Array) else new
    t_new, t_old = jax.typeof(new), jax.typeof(old)
    if (t_new.shape, t_new.dtype) != (t_old.shape, t_old.dtype):
        return new  # the body changed the carry's type: make_body re-traces or refuses
    out = lax.select(active, new, old)
    if t_new.weak_type and not jax.typeof(out).weak_type and _convert_element_type is not None:
        out = _convert_element_type(out, weak_type=True)
    return out


def _refuse_per_step_psums(body: Body, cond_jaxpr) -> None:
    """Refuses a gradient whose backward loop would deadlock under ``shard_map``.

    With a predicate that varies over mesh axes, each device stops at its own step, and
    the backward loop runs as many steps as its forward did. A collective in a step's
    VJP then runs a different number of times per device: the devices wait for each
    other forever (across processes silently). Such a collective is the transpose of a
    ``pvary`` of a differentiated value inside the body. Closed-over arrays are cast
    before the loop (`memento.loops._body.hoist_pvary`); what remains is refused here,
    when the gradient is traced.
    """
    (out,) = cond_jaxpr.outvars
    axes = varying(out.aval)
    found = varying_in_step(body) if axes else []
    if found:
        raise NotImplementedError(
            f"{_NAME}: inside shard_map the predicate varies over the mesh axes "
            f"{tuple(sorted(axes))} (each device may stop at its own step), and the body "
            f"casts differentiated values to varying: {'; '.join(found)}. The cast's "
            "transpose, a psum, would run in every backward step, a number of times that "
            "differs per device, and the devices would deadlock. Cast such values before "
            "the loop, lax.pcast(x, axes, to='varying'), and carry the varying value "
            "(arrays the body closes over are cast for you)."
        )


def _keep(hidden, held, slot, c, carry_slots, keep, pos, until, backend) -> tuple[list, tuple]:
    """The kept slots after the forward step at ``pos`` stores ``c`` in ``slot`` where
    ``keep`` holds, and ``held`` (per slot: the position kept there, and ``until``,
    where the policy gives it up) updated, on ``backend`` (the inputs' platform).

    On CPU a conditional skips the masked write of every carry leaf (a read, a select and
    an in-place update each) on the steps that store nothing, most of them. Off the CPU
    the write stays masked: XLA:GPU reads a conditional's predicate back to the host at
    every step.
    """
    held_pos, held_until = held
    if backend == "cpu":

        def write(hidden, held_pos, held_until):
            hidden = carry_slots.write(hidden, slot, c, pos=pos)
            return hidden, (held_pos.at[slot].set(pos), held_until.at[slot].set(until))

        return lax.cond(keep, write, lambda *a: (a[0], a[1:]), list(hidden), *held)
    hidden = carry_slots.write(hidden, slot, c, keep, pos=pos)
    held_pos = held_pos.at[slot].set(jnp.where(keep, pos, held_pos[slot]))
    held_until = held_until.at[slot].set(jnp.where(keep, until, held_until[slot]))
    return hidden, (held_pos, held_until)


def _given_up(events) -> np.ndarray:
    """Per store row of ``events``: the position at which the policy gives up the carry
    it keeps (the row that frees its slot; int32's maximum for one kept to the end).

    A slot is only stored into once freed, so the next row on a stored slot frees it.
    """
    until = np.full(len(events.pos), np.iinfo(np.int32).max, np.int64)
    last: dict[int, int] = {}  # slot -> its last store row
    for r, (p, s, store) in enumerate(
        zip(events.pos.tolist(), events.slot.tolist(), events.store.tolist())
    ):
        if store:
            last[s] = r
        else:
            until[last.pop(s)] = p
    return until[events.store]


def _stack(n, held_pos, held_until):
    """The kept carries when the loop stopped after n steps, as a stack in position order.

    Returns ``(pos, slot, depth)``: ``pos[d]``, ``slot[d]`` for ``d <= depth`` (int32
    arrays of length ``num_slots + 1``), ``pos[0] = 0`` and ``slot[0] = -1`` (``h_0``).
    A physical slot holds a carry if the policy has not given it up before position n
    (``held_until``, -1 for a slot never written). Only arrays of the slots' length:
    the event table, read here, made the whole program a dataflow graph on XLA:CPU
    (`memento.loops._interpreter.SMALL_ARRAY_BYTES`).
    """
    held = held_until >= n
    big = jnp.iinfo(jnp.int32).max
    where = jnp.where(held, held_pos, big)
    order = jnp.argsort(where).astype(jnp.int32)
    stack_pos = jnp.concatenate([jnp.zeros(1, jnp.int32), where[order]])
    stack_slot = jnp.concatenate([jnp.full(1, -1, jnp.int32), order])
    return stack_pos, stack_slot, jnp.sum(held).astype(jnp.int32)


def _deferred(write_spec, buf_float) -> list[bool]:
    """Per write, whether `_buffer_cts` defers zeroing its location to the step before:
    a float buffer written at one index, once a step."""
    written = collections.Counter(j for j, _, _ in write_spec)
    return [n != _WHOLE and buf_float[j] and written[j] == 1 for j, n, _ in write_spec]


def _no_clears(body: Body, buf_float, write_spec) -> list:
    """The pending clears before the last step back: none (every predicate False)."""
    out = []
    places, deferred = _places(write_spec), _deferred(write_spec, buf_float)
    for (_, n_idx, _), k, defer in zip(write_spec, places, deferred):
        if defer:
            index = [jnp.zeros(a.shape, a.dtype) for a in body.y_avals[k : k + n_idx]]
            out.append((index, jnp.bool_(False)))
    return out


def _clear(ct_b, pending, buf_float, write_spec) -> list:
    """The buffers' cotangents with the pending locations zeroed (where their predicate
    holds)."""
    ct_b, todo = list(ct_b), iter(pending)
    where = np.cumsum([0, *buf_float])
    for (j, _, _), defer in zip(write_spec, _deferred(write_spec, buf_float)):
        if defer:
            index, pred = next(todo)
            f, index = int(where[j]), tuple(index)
            ct_b[f] = ct_b[f].at[index].set(jnp.where(pred, 0, ct_b[f][index]))
    return ct_b


def _buffer_cts(body: Body, buf_float, write_spec, e, ys, aux):
    """Each float write's cotangent, read from its buffer's (then zeroed there); a
    conditional write not taken gets zero and leaves the buffer's cotangent as it is.
    A step's writes are read last first, so that of two writes to one location the later
    takes the cotangent (reading them first to last gave it to the earlier one: a wrong
    gradient, `test_buffer_written_twice_a_step_and_over_the_step_before`).

    ``aux`` is ``(buffer cotangents, pending clears)``. A location written once a step is
    zeroed at the start of the step back before it (`_clear`; the caller clears the last
    step's after the loop), not in the step that reads it: zeroed there, the read (fused
    into the step's VJP) and the in-place update are unordered, and XLA copied the whole
    cotangent buffer to keep the value read (Diffrax's save loop, with a 32-float state:
    one output-sized array more than `RecursiveCheckpointAdjoint`).
    """
    ct_b, pending = aux
    ct_b = _clear(ct_b, pending, buf_float, write_spec)
    where = np.cumsum([0, *buf_float])  # buffer number -> index among float buffers
    # Each write's cotangent (None: not a float write, or its value not differentiated).
    places = _places(write_spec)
    cts: list = [None] * len(write_spec)
    pending = []
    # Last write first: where a step writes one location twice, the later write takes
    # its cotangent and the earlier none, as in the forward pass the later one wins.
    deferred = _deferred(write_spec, buf_float)
    for w in reversed(range(len(write_spec))):
        (j, n_idx, conditional), k = write_spec[w], places[w]
        if not buf_float[j]:
            continue
        f = int(where[j])
        if n_idx == _WHOLE:
            # The step's VJP takes the whole cotangent and gives the one before the step
            # (`give_cts` of `_differentiable_run`).
            cts[w] = ct_b[f] if body.y_mask[k] else None
            continue
        index = tuple(ys[k : k + n_idx])
        # As the forward's ``.at[index].set`` drops a write out of bounds (past the end,
        # or before the start after negative indices wrap once), its value takes no
        # cotangent: read zero there, not the nearest location's.
        ct = ct_b[f].at[index].get(mode="fill", fill_value=0)
        pred = ys[k + n_idx + 1] if conditional else jnp.bool_(True)
        if body.y_mask[k + n_idx]:  # the value written is differentiated
            cts[w] = jnp.where(pred, ct, jnp.zeros_like(ct)) if conditional else ct
        if deferred[w]:
            pending.append((list(index), pred))
        else:
            ct_b[f] = ct_b[f].at[index].set(jnp.where(pred, jnp.zeros_like(ct), ct))
    pending.reverse()  # in the order of `_deferred`
    return [c for c in cts if c is not None], (ct_b, pending)
