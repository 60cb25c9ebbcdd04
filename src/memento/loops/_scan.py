"""`memento.scan`: ``lax.scan`` whose gradient follows an optimal checkpointing schedule."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from ..planning import Plan, Policy, Schedule
from ..planning.internals import Executor, StaticPlan, read_request
from . import _recursion, _static
from ._body import (
    Body,
    is_float,
    make_body,
    merge,
    nbytes,
    no_tangent_if_int,
    of_floats,
    platform,
    split,
    to_floats,
)
from ._budget import Bytes
from ._choice import budget_slots, choose
from ._interpreter import run_backward, run_sweep, unroll_factor
from ._linear import Loop, differentiable

_NAME = "memento.scan"
_MAX_STEPS = 2**31 - 2  # positions and the sweep's step counter are int32


def scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    memory: int | str | Bytes | None = None,
    policy: Policy = "auto",
    executor: Executor = "auto",
    host_memory: int | float | str | Bytes | None = None,
    transfer_cost: float | tuple[float, float] | None = None,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` whose reverse-mode gradient fits a memory budget, at the best speed
    that memory allows.

    The values are those of ``lax.scan(f, init, xs, length, reverse, unroll)``, and so is
    the gradient; the backward pass keeps only what ``memory`` allows and recomputes the
    rest. The compiled program does not grow with the number of steps.

    Args:
        f, init, xs, length, reverse, unroll: as ``jax.lax.scan``.
        memory: what the gradient may keep. ``None``: everything (this is ``lax.scan``).
            A string such as ``"256MiB"`` (or `memento.bytes_budget`): the compiled
            gradient's memory, its working set included. A percentage such as ``"5%"``:
            that share of what storing every step takes. An ``int``: carry-sized slots
            for stored states (the paper's m; one holds the initial carry). Under
            ``vmap`` sizes are per batch member. A budget above need is capped at it.
        policy: ``"auto"`` (the fastest predicted plan that fits), or an optimal
            schedule of Gruslys et al.: ``"hsm"`` (store carries), ``"ism"`` (store
            steps' residuals), ``"msm"`` (mix).
        executor: how the backward pass runs. ``"static"``: nested ``lax.scan``s of
            static lengths, compiled as tight loops (``policy="auto"`` only).
            ``"rows"``: the schedule as rows of data read by one loop (any policy).
            ``"recursion"``: HSM's binomial recursion on the device (O(slots) state at
            any length). ``"auto"``: the plan and executor predicted fastest
            (`memento.loops.scan_schedule` shows the pick).
        host_memory: a second level of slots in host memory (slots, bytes or
            ``math.inf``), placed by `memento.plan`'s two-level plan on the rows.
        transfer_cost: with ``host_memory``: the time to copy one slot to the host and
            back, in forward steps (a number, or ``(write, read)``).

    Returns:
        ``(carry, ys)``, as ``lax.scan``: dtypes, weak types and shapes included.

    Raises:
        ValueError: a budget below the smallest workable plan (the message names it),
            an unknown policy or executor, inconsistent lengths, bad ``host_memory``.
        TypeError: a body that changes the carry's structure, shapes or dtypes; a bad
            ``memory``.

    Transformations: ``jit``, ``grad``/``vjp``, ``jvp``/``jacfwd``/``linearize``,
    ``vmap``, nesting, ``jax.checkpoint``, every dtype; derivatives of any order in any
    mode (``jax.hessian``, ``grad(grad(f))``). Each derivative beyond the first runs the
    loop of the step's JVP within the same ``memory``.

    Example:
        >>> carry, ys = memento.scan(cell, h0, inputs, memory="64MiB")  # doctest: +SKIP
    """
    request = read_request(
        _NAME,
        "scan",
        memory=memory,
        policy=policy,
        executor=executor,
        host_memory=host_memory,
        transfer_cost=transfer_cost,
    )
    if request.memory is None:
        return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
    num_steps, x_leaves = _steps(xs, length, reverse, name=_NAME)
    if num_steps == 0:
        return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
    if num_steps > _MAX_STEPS:
        raise ValueError(
            f"{_NAME}: {num_steps} steps is past the {_MAX_STEPS} a budgeted scan indexes "
            "with int32 positions; split the loop into an outer memento.scan over chunks, "
            "or use memory=None (lax.scan)."
        )
    body, init_leaves, readonly, fixed = _trace(f, init, xs, x_leaves, name=_NAME)
    plan = functools.partial(
        choose,
        request=request,
        num_steps=num_steps,
        slots=budget_slots(request.memory, nbytes(body.carry_avals), name=_NAME),
        backend=platform(init, xs),
    )

    again = functools.partial(
        scan,
        length=num_steps,
        unroll=unroll,
        memory=memory,
        host_memory=host_memory,
        transfer_cost=transfer_cost,
    )
    loop = _ScanLoop(body, plan, num_steps, unroll, again)
    out = no_tangent_if_int(differentiable(loop)(*body.consts, *init_leaves, *x_leaves))
    carry, ys = out[: len(init_leaves)], out[len(init_leaves) :]
    if reverse:
        ys = [jnp.flip(y, 0) for y in ys]
    carry = merge(fixed, carry, readonly)  # a read-only leaf ends as it began
    return (
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(init), carry),
        jax.tree_util.tree_unflatten(body.y_tree, ys),
    )


_WRT: tuple[Literal["closure", "init", "xs"], ...] = ("closure", "init", "xs")


def explain(
    f: Callable,
    init: Any,
    xs: Any = None,
    *,
    memory: int | str | Bytes,
    policy: Policy = "auto",
    length: int | None = None,
    reverse: bool = False,
    wrt: Sequence[Literal["closure", "init", "xs"]] = _WRT,
    executor: Executor = "auto",
    host_memory: int | float | str | Bytes | None = None,
    transfer_cost: float | tuple[float, float] | None = None,
) -> Plan:
    """What `memento.scan`'s gradient of ``scan(f, init, xs, ...)`` will run, and why.

    The plan is chosen exactly as `memento.scan` chooses it when the gradient is traced
    (the same alpha measured from the step's residuals, the same executor, the same refit
    of the budget), for the platform of ``init`` and ``xs``. Traces ``f`` once,
    abstractly; compiles and runs nothing. ``init`` and ``xs`` may be arrays or
    ``jax.ShapeDtypeStruct``s (the plan for a loop too large to hold, before holding it).
    ``print(plan)`` says it in one paragraph.

    Args:
        f, init, xs: as `memento.scan` (and ``jax.lax.scan``).
        memory, policy, length, reverse, executor, host_memory, transfer_cost: as
            `memento.scan` (keyword-only here);
            ``memory`` is required (``None`` is ``lax.scan``, which follows no schedule).
        wrt: what the gradient is taken with respect to, since alpha is measured from
            the residuals of what is differentiated: any of ``"closure"`` (every float
            array ``f`` closes over), ``"init"`` and ``"xs"`` (their float leaves).

    Returns:
        The `memento.planning.Plan`: the executor and policy, the slots, the forward
        evaluations, the predicted bytes and seconds, and the schedule (for
        `memento.planning.simulate`). Under ``vmap`` `memento.scan` sizes one batch
        member: pass unbatched ``init`` and ``xs``.

    Raises:
        ValueError, TypeError: as `memento.scan`; ``memory=None``, an empty loop, or a
            ``wrt`` outside ``("closure", "init", "xs")``.

    Example:
        >>> plan = memento.explain(cell, h0, inputs, memory="64MiB")  # doctest: +SKIP
        >>> plan.executor, plan.program_bytes  # doctest: +SKIP
    """
    return _explain(
        "memento.explain", f, init, xs, memory=memory, policy=policy, length=length,
        reverse=reverse, wrt=wrt, executor=executor, host_memory=host_memory,
        transfer_cost=transfer_cost,
    )  # fmt: skip


def scan_schedule(
    f: Callable,
    init: Any,
    xs: Any = None,
    *,
    memory: int | str | Bytes,
    policy: Policy = "auto",
    length: int | None = None,
    reverse: bool = False,
    wrt: Sequence[Literal["closure", "init", "xs"]] = _WRT,
    executor: Executor = "auto",
    host_memory: int | float | str | Bytes | None = None,
    transfer_cost: float | tuple[float, float] | None = None,
) -> Schedule:
    """The schedule `memento.scan` follows for a gradient of ``scan(f, init, xs, ...)``:
    `explain`'s ``plan.schedule`` (same arguments).

    Returns:
        The `Schedule`; ``schedule.policy`` is the policy ``"auto"`` picked and
        ``schedule.cost`` the forward evaluations of ``f`` per gradient.

    Example:
        >>> s = memento.loops.scan_schedule(cell, h0, inputs, memory="64MiB")  # doctest: +SKIP
        >>> s.policy, s.cost  # doctest: +SKIP
    """
    return _explain(
        "memento.loops.scan_schedule", f, init, xs, memory=memory, policy=policy,
        length=length, reverse=reverse, wrt=wrt, executor=executor,
        host_memory=host_memory, transfer_cost=transfer_cost,
    ).schedule  # fmt: skip


def _explain(name, f, init, xs, *, memory, policy, length, reverse, wrt, executor,
             host_memory, transfer_cost) -> Plan:  # fmt: skip
    request = read_request(
        name,
        "scan",
        memory=memory,
        policy=policy,
        executor=executor,
        host_memory=host_memory,
        transfer_cost=transfer_cost,
    )
    if isinstance(wrt, str) or not set(wrt) <= set(_WRT):
        raise ValueError(
            f"{name}: wrt must be a collection of 'closure', 'init' and 'xs', got {wrt!r}."
        )
    if request.memory is None:
        raise ValueError(
            f"{name}: memory=None is lax.scan, which keeps every step and follows no "
            "schedule; pass a budget (slots, '256MiB' or memento.bytes_budget(n))."
        )
    backend = platform(init, xs)
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves((init, xs))):
        # Shapes alone: plan for them as for arrays of them (f is traced abstractly).
        found = []
        jax.eval_shape(
            lambda init, xs: found.append(
                _plan_for(name, f, init, xs, request, length, reverse, wrt, backend)
            ),
            init,
            xs,
        )
        return found[0]
    return _plan_for(name, f, init, xs, request, length, reverse, wrt, backend)


def _plan_for(name, f, init, xs, request, length, reverse, wrt, backend) -> Plan:
    num_steps, x_leaves = _steps(xs, length, reverse, name=name)
    if num_steps == 0:
        raise ValueError(f"{name}: a scan of 0 steps runs lax.scan and has no schedule.")
    body, _, readonly, _ = _trace(f, init, xs, x_leaves, name=name)
    slots = budget_slots(request.memory, nbytes(body.carry_avals), name=name)
    num_closure = len(body.consts) - sum(readonly)  # read-only carry leaves come last
    body = body.restrict(
        ["closure" in wrt] * num_closure + ["init" in wrt] * sum(readonly),
        ["init" in wrt] * len(body.carry_avals),
        ["xs" in wrt] * len(body.x_avals),
    )
    _, choice = choose(body, request=request, num_steps=num_steps, slots=slots, backend=backend)
    return choice.plan(request, backend, num_steps)


def _steps(xs, length, reverse: bool, *, name: str) -> tuple[int, list]:
    """The number of steps, and the leaves of xs as arrays in the order they are scanned."""
    x_leaves = jax.tree_util.tree_leaves(xs)
    num_steps = _length(x_leaves, length, name=name)
    x_leaves = [jnp.asarray(x) for x in x_leaves]
    if reverse:
        x_leaves = [jnp.flip(x, 0) for x in x_leaves]
    return num_steps, x_leaves


def _trace(f: Callable, init, xs, x_leaves, *, name: str):
    """The `Body` of ``f`` for one step of xs, and init's leaves typed as its carry.

    Carry leaves that ``f`` returns unchanged are read-only: as ``lax.scan`` does, they
    become constants of the loop (`Body.carry_to_consts`), out of the checkpointed carry.

    Returns:
        ``(body, init, readonly, fixed)``: ``body`` and ``init`` without the read-only
        leaves, ``readonly`` the mask of those among init's leaves and ``fixed`` their
        values (the last consts of ``body``).
    """
    init_leaves, init_tree = jax.tree_util.tree_flatten(init)
    init_leaves = [jnp.asarray(c) for c in init_leaves]
    x_tree = jax.tree_util.tree_structure(xs)
    x_example = jax.tree_util.tree_unflatten(x_tree, [_slice_aval(x) for x in x_leaves])
    body = make_body(f, jax.tree_util.tree_unflatten(init_tree, init_leaves), x_example, name=name)
    init_leaves = body.cast_carry(init_leaves)
    readonly = body.readonly_carry()
    fixed, init_leaves = split(init_leaves, readonly)
    return body.carry_to_consts(readonly, fixed), init_leaves, readonly, fixed


def _slice_aval(x):
    """The exact abstract value of one step's slice of ``x`` (see `_body._aval`)."""
    return jax.typeof(lax.index_in_dim(x, 0, keepdims=False))


def _length(x_leaves, length, *, name: str) -> int:
    if any(getattr(x, "ndim", 0) == 0 for x in x_leaves):
        raise ValueError(f"{name}: every leaf of xs needs a leading axis to scan over.")
    lengths = {int(x.shape[0]) for x in x_leaves}
    if len(lengths) > 1:
        raise ValueError(
            f"{name}: the leaves of xs have different leading lengths {sorted(lengths)}; "
            "they must all have the same."
        )
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise TypeError(f"{name}: length must be a non-negative int, got {length!r}.")
        if lengths and lengths != {length}:
            raise ValueError(
                f"{name}: length={length} does not match the leading length {lengths.pop()} of xs."
            )
        return length
    if not lengths:
        raise ValueError(f"{name}: with xs=None, pass length= (the number of steps).")
    return lengths.pop()


@dataclasses.dataclass(frozen=True, eq=False)
class _ScanLoop(Loop):
    """The budgeted scan as `_linear` differentiates it: flat arguments ``(consts, init,
    xs)``, outputs ``(carry, ys)``.

    ``unroll`` is ``lax.scan``'s: the first sweep is a ``lax.scan`` with it, and the
    backward pass's recomputation loops run as many steps per iteration. ``again`` is
    `scan` with this loop's memory (and the policy and executor it predicts fastest: a
    forced one may not fit that loop), for the loop of the step's JVP.
    """

    body: Body
    plan_for: Callable
    num_steps: int
    unroll: Any
    again: Callable

    def _parts(self, leaves) -> tuple[list, list, list]:
        n_k, n_c = len(self.body.consts), len(self.body.carry_avals)
        return list(leaves[:n_k]), list(leaves[n_k : n_k + n_c]), list(leaves[n_k + n_c :])

    def primal(self, args):
        consts, init, xs = self._parts(args)
        step = lambda c, x: self.body(consts, c, x)  # noqa: E731
        c, ys = lax.scan(step, init, xs, length=self.num_steps, unroll=self.unroll)
        return [*c, *ys]

    def prepare(self, perturbed):
        # Only what is perturbed, or depends on it, is differentiated.
        _, init, _ = masks = self._parts(perturbed)
        b = self.body.restrict(*masks)
        spec, choice = self.plan_for(b)
        prog, budget = choice.program, choice.slots
        # A carry leaf differentiated only because a step makes it depend on a perturbed
        # input returns no cotangent: its initial value is not perturbed.
        returned = [p for p, m in zip(init, b.carry_mask) if m]
        return b, spec, prog, budget, returned

    def forward(self, plan, args):
        b, spec, prog, budget, _ = plan
        consts, init, xs = self._parts(args)
        if isinstance(prog, StaticPlan):
            k = unroll_factor(self.unroll, self.num_steps)
            c, ys, saved = _static.forward(b, spec, prog, consts, init, xs, unroll=k)
            return [*c, *ys], saved
        if prog is None:
            c, ys, slots, working = _recursion.scan_forward(
                b, spec, budget, consts, init, xs, self.num_steps, unroll=self.unroll
            )
        else:
            c, ys, slots, working = run_sweep(prog, b, spec, consts, init, xs, unroll=self.unroll)
        return [*c, *ys], (slots, working)

    def backward(self, plan, args, cache, cts):
        b, spec, prog, budget, returned = plan
        consts, init, xs = self._parts(args)
        n = sum(map(is_float, b.carry_avals))
        ct_c = of_floats(b.carry_avals, b.carry_mask, cts[:n])
        ct_ys = of_floats(b.y_avals, b.y_mask, cts[n:])
        k = unroll_factor(self.unroll, self.num_steps)
        if isinstance(prog, StaticPlan):
            ct_k, ct_init, ct_xs = _static.backward(
                b, spec, prog, consts, xs, cache, ct_c, ct_ys, unroll=k
            )
        elif prog is None:
            ct_k, ct_init, ct_xs = _recursion.scan_backward(
                b, spec, budget, self.num_steps, consts, init, xs, *cache, ct_c, ct_ys, unroll=k
            )
        else:
            ct_k, ct_init, ct_xs = run_backward(
                prog, b, spec, consts, init, xs, *cache, ct_c, ct_ys, unroll=k
            )
        ct_init = [c for c, m in zip(ct_init, returned) if m]
        return [*ct_k, *ct_init, *ct_xs]

    def tangent_loop(self, args, tangents, mask):
        consts, init, xs = self._parts(args)
        mk, mc, mx = self._parts(mask)
        b = self.body.restrict(mk, mc, mx)
        tangents = iter(tangents)
        tk = [next(tangents) for m in mk if m]
        tc = [next(tangents) if m else None for m in mc]
        tx = [next(tangents) for m in mx if m]
        tc = [jnp.zeros_like(c) if t is None else t for c, t, m in zip(init, tc, b.carry_mask) if m]

        def step(carry, x):
            (c, dc), (x, dx) = carry, x
            c, dc, y, dy = b.jvp(consts, c, x, tk, dc, dx)
            return (c, dc), (y, dy)

        (c, dc), (ys, dys) = self.again(step, (init, tc), (xs, tx))
        touts = to_floats(c, b.carry_avals, b.carry_mask, dc)
        touts += to_floats(ys, b.y_avals, b.y_mask, dys)
        return [*c, *ys], touts
