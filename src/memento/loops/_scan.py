"""`memento.scan`: ``lax.scan`` whose gradient follows an optimal checkpointing schedule."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from ..planning import Plan, Policy, Schedule, hsm_cost, plan
from ..planning.internals import (
    Executor,
    Request,
    StaticPlan,
    auto_charges,
    host_slots,
    loop_costs,
    loop_seconds,
    nest_schedule,
    plan_static,
    read_request,
    recursion_min_steps,
    step_seconds,
)
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
    step_profile,
    to_floats,
)
from ._budget import (
    Bytes,
    Percent,
    choose_policy,
    choose_schedule,
    internal_slots,
    to_slots,
)
from ._interpreter import (
    Program,
    compile_schedule,
    pool_bytes,
    run_backward,
    run_sweep,
    unroll_factor,
)
from ._linear import Loop, differentiable
from ._pool import checks_enabled, varying

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
        _plan,
        request=request,
        num_steps=num_steps,
        slots=_slots(request.memory, nbytes(body.carry_avals), name=_NAME),
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
    abstractly; compiles and runs nothing. ``print(plan)`` says it in one paragraph.

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
    num_steps, x_leaves = _steps(xs, length, reverse, name=name)
    if num_steps == 0:
        raise ValueError(f"{name}: a scan of 0 steps runs lax.scan and has no schedule.")
    body, _, readonly, _ = _trace(f, init, xs, x_leaves, name=name)
    slots = _slots(request.memory, nbytes(body.carry_avals), name=name)
    num_closure = len(body.consts) - sum(readonly)  # read-only carry leaves come last
    body = body.restrict(
        ["closure" in wrt] * num_closure + ["init" in wrt] * sum(readonly),
        ["init" in wrt] * len(body.carry_avals),
        ["xs" in wrt] * len(body.x_avals),
    )
    backend = platform(init, xs)
    spec, schedule, prog, slots = _plan(
        body, request=request, num_steps=num_steps, slots=slots, backend=backend, rows=True
    )
    return _describe(body, spec, schedule, prog, slots, request, num_steps, backend)


def _describe(body, spec, schedule, prog, slots, request, num_steps, backend) -> Plan:
    """The `Plan` of what `_plan` chose (``rows=True``), with its predicted bytes and
    seconds as the planner counts them."""
    sizes = _static_sizes(body, spec)
    profile = step_profile(body)
    step = step_seconds(profile.flops, profile.bytes, profile.ops, backend)
    forced = request.executor != "auto"
    chose = not forced and request.policy == "auto"  # static nests were candidates
    if isinstance(prog, StaticPlan):
        full = StaticPlan(
            prog.pieces, sizes.carry, sizes.residual, sizes.stream, sizes.level,
            sizes.whole, sizes.piece,
        )  # fmt: skip
        whole = prog.pieces == ((num_steps,),)
        why = (
            "the budget holds every step's internal state: one lax.scan, as lax.scan's own gradient"
            if whole
            else f"nested lax.scans of static lengths {list(map(list, prog.pieces))}"
            + ("" if forced else ", predicted fastest of the plans that fit")
        )
        return Plan(
            request, backend, num_steps, "static", "store all" if whole else "nest",
            slots, prog.evaluations, prog.loop_iterations,
            full.peak_bytes + sizes.fixed - sizes.accumulators,
            _static_seconds(prog, step=step, backend=backend), nest_schedule(prog),
            why[0].upper() + why[1:] + ".",
        )  # fmt: skip
    assert schedule is not None  # rows=True plans one
    if prog is None:
        evaluations = iterations = hsm_cost(num_steps, slots)
        program = slots * _recursion_slot_bytes(sizes) + sizes.fixed
        why = (
            "asked for"
            if forced
            else f"HSM runs as the recursion from {recursion_min_steps(backend):,} steps "
            f"on {backend}"
            if num_steps >= recursion_min_steps(backend)
            else "the schedule's rows would not fit the byte budget; the recursion keeps none"
        )
        why = f"HSM's binomial recursion on the device, O(slots) state ({why})."
        executor: Literal["rows", "recursion"] = "recursion"
    else:
        evaluations = schedule.cost
        iterations = evaluations + len(prog.primal_rows)
        program = pool_bytes(prog, body, spec) + prog.runtime_bytes + sizes.fixed
        why = (
            f"The optimal {schedule.policy.upper()} schedule of Gruslys et al. as rows of "
            f"data ({prog.runtime_bytes:,} bytes) read by one loop"
            + (", predicted faster than the static nests that fit." if chose else ".")
        )
        executor = "rows"
    return Plan(
        request, backend, num_steps, executor, schedule.policy, slots, evaluations,
        iterations, program,
        loop_seconds(evaluations, iterations, executor, step=step, backend=backend),
        schedule, why,
    )  # fmt: skip


def _slots(budget: int | Bytes | Percent, carry_bytes: int, *, name: str) -> int | Percent:
    """Slots of a budget; a percentage stays one until `_plan` measures alpha, its need."""
    return budget if isinstance(budget, Percent) else to_slots(budget, carry_bytes, name=name)


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


@functools.lru_cache(maxsize=64)
def _compile(schedule: Schedule) -> Program:
    return compile_schedule(schedule)


def _host_slots(request: Request, carry_bytes: int):
    """``(slots or math.inf, (write, read))`` of a request's host level, or None."""
    if request.host is None:
        return None
    slots = host_slots(request.host, carry_bytes, name=request.name)
    return (slots, request.transfer) if slots else None


def useful_slots(num_steps: int, alpha: int, policy: Policy) -> int:
    """The most slots a plan of ``num_steps`` steps can use: every internal state
    (``num_steps * alpha``, ``lax.scan``'s memory), or every carry under HSM. A larger
    budget plans exactly as this one (the planner's cost is flat from there on)."""
    return num_steps if policy == "hsm" else num_steps * alpha


def _plan(
    body: Body,
    *,
    request: Request,
    num_steps: int,
    slots: int | Percent,
    backend: str,
    rows: bool = False,
):
    """The residuals, schedule, program and budget for a body differentiated as ``body``
    says, as ``request`` asks (``slots``: its memory in slots, `_slots`), run on
    ``backend`` (`platform`: it sets the time model's constants).

    Runs when the gradient is traced (the forward rule), once the perturbed inputs are
    known: the paper's alpha is measured from the residuals actually differentiated, and a
    `Percent` budget becomes that share of ``num_steps * alpha`` slots. The budget is
    capped at `useful_slots`: no plan, pool or stack is sized by a number
    larger than what the loop can use. An HSM plan runs as the recursion when
    ``executor`` says so: no program, and no schedule unless ``rows`` (then the HSM
    schedule, whose evaluations it makes). Otherwise the pools must fit the budget: when
    their layout cannot share memory exactly as the schedule does (leaves of several
    dtypes or shapes, see `_pool.Pools`), the schedule is planned again for fewer slots
    until they fit.

    With a host level, the two-level plan on the rows; its host pools are refitted to
    the host budget the same way.

    Returns:
        ``(spec, schedule, program, slots)``: ``program`` is None for the recursion,
        ``slots`` the capped budget it runs in.
    """
    name, policy, executor, budget = (
        request.name,
        request.policy,
        request.executor,
        request.memory,
    )
    spec = body.residual_spec()
    carry_bytes = nbytes(body.carry_avals)
    host = _host_slots(request, carry_bytes)
    alpha = internal_slots(nbytes(spec.stored), carry_bytes)
    need = useful_slots(num_steps, alpha, "auto")
    slots = min(to_slots(slots, carry_bytes, name=name, need=need), need)
    if host is not None:
        return _plan_two_level(
            body, spec, num_steps, slots, alpha, policy, host, carry_bytes, name=name
        )
    assert budget is not None  # memory=None is lax.scan, which plans nothing
    if not isinstance(budget, Bytes):
        budget = slots  # a percentage, resolved
    sizes = _static_sizes(body, spec)
    static = None
    mapped = _static_unavailable(body)
    if executor == "static" and mapped:
        raise NotImplementedError(
            f"{name}: executor='static' does not run inside shard_map (a value varies "
            f"over mesh axes: {', '.join(map(str, mapped))}); use executor='auto', 'rows' or "
            "'recursion'."
        )
    # One step's predicted seconds, for the static plan's choice and every comparison below.
    profile = step_profile(body)
    step = step_seconds(profile.flops, profile.bytes, profile.ops, backend)
    if executor in ("static", "auto") and policy == "auto" and not mapped:
        room, kinds = _static_budget(budget, slots, sizes)
        if isinstance(budget, Bytes) and budget.num_bytes >= num_steps * sizes.residual:
            room = math.inf  # room for lax.scan's own memory: store every step
        seconds = functools.partial(_static_seconds, step=step, backend=backend)
        static = plan_static(num_steps, room, **kinds, seconds=seconds)
    if executor == "static":
        if static is None:
            raise ValueError(_no_static_plan(name, num_steps, budget, slots, sizes))
        return spec, None, static, slots
    if static is not None and _faster_static(static, num_steps, None, step=step, backend=backend):
        # Faster than any loop of the rows or the recursion could be (each evaluates
        # every step at least once, one iteration each): no schedule to plan or compile,
        # which at 10^6 steps takes seconds.
        return spec, None, static, slots
    if isinstance(budget, Bytes):  # the rows' and the recursion's working set too
        slots = _slots_within(slots, budget, sizes, per_slot=carry_bytes)
    charges = auto_charges(num_steps, executor, backend)
    chosen = (
        "hsm"
        if executor == "recursion"
        else choose_policy(num_steps, slots, alpha, policy, name=name, charges=charges)
    )
    if chosen == "hsm":
        slots = min(slots, useful_slots(num_steps, alpha, "hsm"))
    if chosen == "hsm" and (
        executor == "recursion"
        or (executor == "auto" and num_steps >= recursion_min_steps(backend))
    ):
        slots = _recursion_slots(slots, budget, sizes)
        schedule = choose_schedule(num_steps, slots, alpha, "hsm", name=name) if rows else None
        if static is not None and _faster_static(
            static, hsm_cost(num_steps, slots), None, step=step, backend=backend
        ):
            return spec, None, static, slots
        return spec, schedule, None, slots
    m = slots
    while True:
        # Fewer slots may change what auto picks: choose again at each size.
        schedule = choose_schedule(num_steps, m, alpha, policy, name=name, charges=charges)
        prog = _compile(schedule)
        used = pool_bytes(prog, body, spec)
        allowed = (slots - int(schedule.counts_initial)) * carry_bytes
        if isinstance(budget, Bytes):  # the program's bytes: the rows count too
            used += prog.runtime_bytes
            allowed = budget.num_bytes - sizes.fixed
        if used <= allowed or m == 1:
            if static is not None and _faster_static(
                static, schedule.cost, prog, step=step, backend=backend
            ):
                return spec, None, static, slots
            if used > allowed and executor == "auto" and isinstance(budget, Bytes):
                # The rows do not fit; the recursion keeps no rows, static nests none.
                slots = _recursion_slots(slots, budget, sizes)
                hsm_evaluations = hsm_cost(num_steps, slots)
                if static is not None and _faster_static(
                    static, hsm_evaluations, None, step=step, backend=backend
                ):
                    return spec, None, static, slots
                hsm = choose_schedule(num_steps, slots, alpha, "hsm", name=name) if rows else None
                return spec, hsm, None, slots
            if used > allowed and isinstance(budget, Bytes):
                least = used + sizes.fixed
                raise ValueError(
                    f"{name}: executor='rows' cannot run {num_steps} steps within "
                    f"{budget.num_bytes} bytes: its schedule's rows alone take "
                    f"{prog.runtime_bytes} bytes; its smallest takes {least} bytes "
                    f"(memory='{least}B'). Raise memory, or use executor='auto', which "
                    "runs static nests or the recursion (no rows)."
                )
            return spec, schedule, prog, m
        m = max(1, min(m - 1, m * allowed // used))


def _slots_within(slots: int, budget: Bytes, sizes: _Sizes, *, per_slot: int) -> int:
    """At most ``slots``, at least one, of ``per_slot`` bytes each beside the fixed
    working set within a byte budget."""
    return max(1, min(slots, (budget.num_bytes - sizes.fixed) // max(per_slot, 1)))


def _recursion_slots(slots: int, budget, sizes: _Sizes) -> int:
    """``slots`` within a byte budget on the recursion, which keeps an int32 position per
    slot beside its carry (and tags and positions, 12 bytes a slot, with `checks_enabled`)."""
    if not isinstance(budget, Bytes):
        return slots
    return _slots_within(slots, budget, sizes, per_slot=_recursion_slot_bytes(sizes))


def _recursion_slot_bytes(sizes: _Sizes) -> int:
    """Bytes of one of the recursion's slots: a carry, its int32 position, and with
    `checks_enabled` a tag and positions (12 bytes)."""
    return sizes.carry + 4 + 12 * checks_enabled()


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Bytes the static planner counts for a body: a carry, a step's internal state, what
    a step being back-propagated streams (its slice of the ys' cotangents), and the fixed working set of the backward pass (a step's VJP in flight,
    the cotangent accumulators of the closed-over arrays, the loops' control state), and
    what each level beyond the second and each nest beyond the first adds. Of the fixed
    working set, ``accumulators`` are the closed-over arrays' cotangents, which the static
    executor accumulates in the gradient it returns (no temporary buffer)."""

    carry: int
    residual: int
    stream: int
    fixed: int
    level: int
    whole: int
    piece: int
    accumulators: int


_CONTROL_BYTES = 1024  # loop counters, indices and XLA's small buffers


def _static_unavailable(body: Body) -> tuple:
    """Why the static executor cannot run this loop: the mesh axes any of its values
    varies over (inside ``shard_map``), or JAX's experimental ``jax_scan3`` scan, whose
    VJP cannot yet run inside a custom VJP's forward rule."""
    if getattr(jax.config, "jax_scan3", False):
        return ("jax_scan3",)
    avals = [*body.carry_avals, *body.x_avals, *(jax.typeof(k) for k in body.consts)]
    return tuple(sorted({axis for a in avals for axis in varying(a)}))


def _static_sizes(body: Body, spec) -> _Sizes:
    carry = nbytes(body.carry_avals)
    residual = nbytes(spec.stored)
    xs = nbytes(body.x_avals)
    # A segment back-propagated reads its xs and writes their cotangents in place; its
    # ys' cotangents are sliced.
    stream = nbytes(split(body.y_avals, body.y_mask)[0])
    consts = nbytes([jax.typeof(k) for k in split(body.consts, body.const_mask)[0]])
    # One step's VJP in flight (its internal state and carry, an x, its largest
    # intermediate) and the closed-over arrays' cotangents.
    working = residual + carry + xs + max(_CONTROL_BYTES, step_profile(body).largest)
    # A level beyond the second: its starts' selection and the loop state around it.
    level = 4 * carry + _CONTROL_BYTES
    # A nest beyond the first: its loops' state, and its carries around them.
    piece = 4 * carry + _CONTROL_BYTES // 2
    return _Sizes(carry, residual, stream, working + consts, level, xs, piece, consts)


def _static_budget(budget: int | Bytes, slots: int, sizes: _Sizes):
    """``(budget_bytes, sizes)`` arguments of `plan_static` for a budget: a byte budget
    is the program's memory, less the backward pass's fixed working set but for the
    cotangent accumulators; ``slots`` count stored states only, carry-sized, as in the
    paper (the initial carry is one)."""
    if isinstance(budget, Bytes):
        return budget.num_bytes - sizes.fixed + sizes.accumulators, {
            "carry_bytes": sizes.carry,
            "residual_bytes": sizes.residual,
            "stream_bytes": sizes.stream,
            "level_bytes": sizes.level,
            "whole_bytes": sizes.whole,
            "piece_bytes": sizes.piece,
        }
    return (slots - 1) * sizes.carry, {
        "carry_bytes": sizes.carry,
        "residual_bytes": sizes.residual,
    }


def _no_static_plan(name: str, num_steps: int, budget, slots: int, sizes: _Sizes) -> str:
    room, kinds = _static_budget(budget, slots, sizes)
    smallest = plan_static(num_steps, math.inf, **kinds, fewest_bytes=True)
    assert smallest is not None  # nothing bounds it
    if isinstance(budget, Bytes):
        need = smallest.peak_bytes + budget.num_bytes - room
        given, least = f"{budget.num_bytes} bytes", f"{need} bytes (memory='{need}B')"
    else:
        given, least = f"{slots} slots", f"{-(-smallest.peak_bytes // sizes.carry) + 1} slots"
    return (
        f"{name}: executor='static' has no plan of {num_steps} steps within {given}; its "
        f"smallest takes {least}. Raise memory, or use executor='auto', which falls back "
        "to the recursion."
    )


def _faster_static(
    static: StaticPlan, evaluations: float, prog, *, step: float, backend: str
) -> bool:
    """Whether the static plan is predicted faster on ``backend``, with steps of ``step``
    seconds, than a plan of ``evaluations`` on the rows (``prog``) or the recursion
    (``prog is None``); see `loop_seconds`."""
    executor = "recursion" if prog is None else "rows"
    other_iterations = evaluations if prog is None else evaluations + len(prog.primal_rows)
    mine = _static_seconds(static, step=step, backend=backend)
    theirs = loop_seconds(evaluations, other_iterations, executor, step=step, backend=backend)
    return mine <= theirs


def _static_seconds(plan: StaticPlan, *, step: float, backend: str) -> float:
    """Predicted seconds of a static plan with steps of ``step`` seconds on ``backend``."""
    return loop_seconds(
        plan.evaluations,
        plan.loop_iterations,
        "static",
        step=step,
        backend=backend,
        starts=plan.loop_starts,
        spilled=plan.spilled_bytes(loop_costs(backend).cache),
    )


@functools.lru_cache(maxsize=64)
def _two_level_schedule(
    num_steps: int, m: int, h: int | float, alpha: int, policy: str, pair: tuple[float, float]
) -> Schedule:
    """`memento.plan`'s two-level plan (cached): MSM when an internal state takes two
    slots or more (``"auto"``), else HSM."""
    if policy == "auto":
        policy = "msm" if alpha >= 2 else "hsm"
    return plan(
        num_steps,
        m,
        policy=policy,  # pyright: ignore[reportArgumentType]
        alpha=None if policy == "hsm" else alpha,
        host_memory=h,
        transfer_cost=pair,
    )


def _plan_two_level(body, spec, num_steps, slots, alpha, policy, host, carry_bytes, *, name):
    """`_plan` with a host level: the two-level schedule whose pools fit both budgets."""
    h, pair = host
    if h != math.inf:
        h = min(int(h), useful_slots(num_steps, alpha, "auto"))  # no more than can be used
    m = slots
    while True:
        try:
            schedule = _two_level_schedule(num_steps, m, h, alpha, policy, pair)
        except ValueError as e:
            raise ValueError(str(e).replace("memento.plan", name)) from None
        prog = _compile(schedule)
        used = pool_bytes(prog, body, spec)
        allowed = (slots - int(schedule.counts_initial)) * carry_bytes
        host_used = pool_bytes(prog, body, spec, host=True)
        host_ok = h == math.inf or host_used <= h * carry_bytes
        if (used <= allowed or m == 1) and (host_ok or h == 0):
            return spec, schedule, prog, m
        if used > allowed:
            m = max(1, min(m - 1, m * allowed // max(used, 1)))
        else:
            h = max(0, min(h - 1, h * (h * carry_bytes) // max(host_used, 1)))


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
        spec, _, prog, budget = self.plan_for(b)
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
