"""`memento.scan`: ``lax.scan`` whose gradient follows an optimal checkpointing schedule."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from ..planning import Policy, Schedule, check_policy, plan
from ..planning._budget import as_int
from ..planning._host import check_host
from . import _recursion
from ._body import (
    Body,
    Static,
    call_reverse_mode_only,
    guard_backward,
    instantiate,
    make_body,
    merge,
    nbytes,
    refuse_reverse_over_reverse,
    split,
)
from ._budget import (
    Bytes,
    Charges,
    choose_policy,
    choose_schedule,
    internal_slots,
    parse_memory,
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
    """``jax.lax.scan`` whose reverse-mode gradient fits a memory budget, optimally.

    The values are those of ``lax.scan(f, init, xs, length, reverse, unroll)``. The
    gradient is the same too, but the backward pass keeps only what ``memory`` allows and
    recomputes the rest, following the schedule with the fewest forward evaluations
    (Gruslys et al. 2016) for that budget. The compiled program does not grow with the
    number of steps: the schedule is data, read by one loop.

    Pick this over ``lax.scan`` when storing every step's residuals does not fit, and over
    ``jax.checkpoint`` on the step or nested sqrt(T) scans when you want the fastest
    gradient for a given memory.

    Args:
        f, init, xs, length, reverse, unroll: as ``jax.lax.scan``. ``unroll=k`` also
            runs k steps per iteration of the backward pass's recomputation loops (the
            schedule's forward sweeps; each step's VJP still runs in its own iteration of
            the backward loop). ``True`` unrolls every step, as in ``lax.scan``. On CPU
            ``unroll=1`` was fastest in every measurement (docs/limitations.md).
        memory: what the backward pass may keep. ``None``: everything (this is
            ``lax.scan``). An ``int``: carry-sized slots (the paper's m; one slot holds the
            initial carry). A string such as ``"256MiB"`` or ``memento.bytes_budget(n)``:
            bytes, converted to slots from the measured carry size. Under ``vmap`` sizes are
            those of one batch member. Carry leaves that ``f`` returns unchanged are, as in
            ``lax.scan``, constants of the loop: they take no room in slots and do not
            count in the carry size (and keep their batching under ``vmap``).
        policy: ``"auto"`` (cheapest of the below that fits), ``"hsm"`` (store carries),
            ``"ism"`` (store step residuals, "internal states"), ``"msm"`` (mix). The size
            of a step's residuals relative to the carry (the paper's alpha) is measured
            when the gradient is traced, from the inputs it differentiates. A budget
            above what the loop can use (every step's residuals: ``lax.scan``'s memory)
            is capped at that need.
        executor: how the backward pass runs the schedule; every choice gives the same
            gradient with the same forward evaluations. ``"rows"``: the schedule as
            rows of data read by one loop (any policy). ``"recursion"``: HSM's binomial
            recursion computed on the device, with no rows (O(slots) to plan at any
            length; ``policy`` must be ``"hsm"`` or ``"auto"``, which then plans HSM).
            ``"auto"``: the recursion for HSM plans from `recursion_min_steps` steps on,
            the rows otherwise (always the rows with ``host_memory``).
        host_memory: a second level of slots in host memory, beside ``memory`` on the
            device: carry-sized slots (an ``int``), bytes (``"16GiB"``,
            `memento.bytes_budget`) or ``math.inf`` (unbounded). The schedule is then
            `memento.plan`'s two-level plan (HSM, or MSM when a step's residuals take
            two slots or more; ``policy`` ``"hsm"``, ``"msm"`` or ``"auto"``): it keeps
            states on the device, copies them to the host, or recomputes them, whichever
            costs least under its model (forward evaluations plus the part of each
            copy that one step of compute does not hide). ``memory`` still bounds the
            device's slots. ``None`` or 0: one level. Runs on the rows executor.
        transfer_cost: required with ``host_memory``: the time to copy one carry-sized
            slot to the host and back, in units of one forward step (a number, or
            ``(write, read)``), e.g. carry bytes / link bandwidth / step time.

    Host placement: host slots are placed in host memory (``jax.memory.Space.Host``,
    memory kind ``pinned_host``) where JAX has ``jax.memory.Space`` and the default
    backend a ``pinned_host`` memory: GPUs, TPUs and the CPU (the same RAM there); tested
    with JAX 0.10.2 on CPU, and lowered for ``cuda``. Elsewhere (older JAX, backends
    without it) the same schedule runs with every slot on the device, with identical
    numbers. Under an outer ``jvp`` (``jax.hessian``) host slots stay on the device: JAX
    0.10.2 builds the zero tangent of a host array in device memory. Each copy is issued
    by the row that needs it, not prefetched a row ahead: where a copy is slower than a
    step, the model's ``max(compute, transfer)`` is a lower bound on the time (a copy
    took 127-170 us for 0.5-2 MiB on an H200, ``benchmarks/host_copy.py``). The gradient
    with host slots is checked on CPU in float64 and was checked on an H200 (jax 0.11.2:
    the host tests of ``tests/loops/test_scan_host.py`` passed there, and an LSTM's
    gradient with host slots equalled ``lax.scan``'s exactly); openxla/xla#46231 gave
    wrong gradients with offloaded scan residuals on GPU before July 2026: check yours
    against ``lax.scan`` on a small case (``benchmarks/offload.py`` does).

    Returns:
        ``(carry, ys)``, as ``lax.scan``: dtypes, weak types and shapes included (a
        weakly typed ``init`` takes the dtype the body gives it).

    Raises:
        ValueError: a budget too small for one step (the message names the minimum), an
            unknown policy, inconsistent lengths; ``policy="ism"`` with a budget below one
            internal state (when the gradient is traced); ``host_memory`` negative, in
            bytes that hold no carry, without ``transfer_cost``, with ``executor="recursion"`` or
            ``policy="ism"``, or ``transfer_cost`` without ``host_memory``.
        TypeError: a body that changes the carry's structure, shapes or dtypes (the
            message names each leaf); a bad ``memory``; forward mode (see below).
        NotImplementedError: reverse over reverse (see below).

    Transformations: ``jit``, ``grad``/``vjp``, ``vmap`` (over the call or inside ``f``),
    nesting, ``jax.checkpoint``; every dtype (complex, bfloat16, ints, bools, keys). Only
    what is perturbed is differentiated, so ops without a reverse rule may act on leaves
    that need no gradient. Second order by forward over reverse (``jax.hessian``,
    ``jax.jvp(jax.grad(f))``, ``jax.jacfwd(jax.jacrev(f))``) is exact. With a budget,
    forward mode of the loop (``jvp``, ``jacfwd``, reverse over forward) raises a
    ``TypeError`` and reverse over reverse (``grad(grad(f))``, also through
    ``jax.checkpoint``) a ``NotImplementedError``:
    the gradient is a custom VJP whose backward pass is a while loop. ``memory=None``
    (``lax.scan``) supports both.

    Example:
        >>> carry, ys = memento.scan(cell, h0, inputs, memory="64MiB")  # doctest: +SKIP
    """
    policy = check_policy(_NAME, policy)
    executor = check_executor(_NAME, executor, policy)
    host = check_host_memory(_NAME, host_memory, transfer_cost, memory, policy, executor)
    if memory is None:
        return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
    budget = parse_memory(memory, name=_NAME)
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
    slots = to_slots(budget, nbytes(body.carry_avals), name=_NAME)
    plan = functools.partial(
        _plan,
        num_steps=num_steps,
        slots=slots,
        policy=policy,
        executor=executor,
        host=_host_slots(host, nbytes(body.carry_avals), name=_NAME),
    )

    run = _differentiable_run(body, plan, num_steps, unroll)
    carry, ys = call_reverse_mode_only(
        run, (body.consts, init_leaves, x_leaves), name=_NAME, instead="memory=None (lax.scan)"
    )
    if reverse:
        ys = [jnp.flip(y, 0) for y in ys]
    carry = merge(fixed, carry, readonly)  # a read-only leaf ends as it began
    return (
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(init), carry),
        jax.tree_util.tree_unflatten(body.y_tree, ys),
    )


_WRT: tuple[Literal["closure", "init", "xs"], ...] = ("closure", "init", "xs")


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
    """The schedule `memento.scan` follows for a gradient of ``scan(f, init, xs, ...)``.

    To see, draw or price the plan before compiling anything: the schedule is chosen
    exactly as `memento.scan` chooses it when the gradient is traced (the same alpha
    measured from the step's residuals, the same refit of the budget to the pools).
    Traces ``f`` once, abstractly; runs nothing.

    Args:
        f, init, xs: as `memento.scan` (and ``jax.lax.scan``).
        memory, policy, length, reverse, executor, host_memory, transfer_cost: as
            `memento.scan` (keyword-only here);
            ``memory`` is required (``None`` is ``lax.scan``, which follows no schedule).
        wrt: what the gradient is taken with respect to, since alpha is measured from
            the residuals of what is differentiated: any of ``"closure"`` (every float
            array ``f`` closes over), ``"init"`` and ``"xs"`` (their float leaves).

    Returns:
        The `Schedule`; ``schedule.policy`` is the policy ``"auto"`` picked and
        ``schedule.cost`` the forward evaluations of ``f`` per gradient. Under ``vmap``
        `memento.scan` sizes one batch member: pass unbatched ``init`` and ``xs``.

    Raises:
        ValueError, TypeError: as `memento.scan`; ``memory=None``, an empty loop, or a
            ``wrt`` outside ``("closure", "init", "xs")``.

    Example:
        >>> s = memento.loops.scan_schedule(cell, h0, inputs, memory="64MiB")  # doctest: +SKIP
        >>> s.policy, s.cost  # doctest: +SKIP
    """
    name = "memento.loops.scan_schedule"
    policy = check_policy(name, policy)
    executor = check_executor(name, executor, policy)
    host = check_host_memory(name, host_memory, transfer_cost, memory, policy, executor)
    if isinstance(wrt, str) or not set(wrt) <= set(_WRT):
        raise ValueError(
            f"{name}: wrt must be a collection of 'closure', 'init' and 'xs', got {wrt!r}."
        )
    if memory is None:
        raise ValueError(
            f"{name}: memory=None is lax.scan, which keeps every step and follows no "
            "schedule; pass a budget (slots, '256MiB' or memento.bytes_budget(n))."
        )
    budget = parse_memory(memory, name=name)
    num_steps, x_leaves = _steps(xs, length, reverse, name=name)
    if num_steps == 0:
        raise ValueError(f"{name}: a scan of 0 steps runs lax.scan and has no schedule.")
    body, _, readonly, _ = _trace(f, init, xs, x_leaves, name=name)
    slots = to_slots(budget, nbytes(body.carry_avals), name=name)
    num_closure = len(body.consts) - sum(readonly)  # read-only carry leaves come last
    body = body.restrict(
        ["closure" in wrt] * num_closure + ["init" in wrt] * sum(readonly),
        ["init" in wrt] * len(body.carry_avals),
        ["xs" in wrt] * len(body.x_avals),
    )
    _, schedule, _, _ = _plan(
        body,
        num_steps=num_steps,
        slots=slots,
        policy=policy,
        executor=executor,
        name=name,
        rows=True,
        host=_host_slots(host, nbytes(body.carry_avals), name=name),
    )
    assert schedule is not None  # rows=True always plans one
    return schedule


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


# HSM runs as a recursion on the device (`_recursion`) from `recursion_min_steps()`
# steps on, below as a program of schedule rows (`_interpreter`); both make the optimal
# schedule's evaluations (tests/loops/test_scan_recursion.py, and the conformance suite
# runs every case through both). The recursion plans nothing on the host: O(slots) at
# trace time and in memory, whatever the length. The rows cost O(t) to plan and are a
# constant of O(t) in the program. `python benchmarks/recursion.py`, same gradient
# forced either way (results/recursion.json, recursion_small.json with
# ``--no-while --cases ...``):
# - CPU (2 cores): on small bodies below 3e4 steps the recursion's first call is up to
#   25% slower (an RNN cell of width 64: 0.25 against 0.20 s at 10^3 steps; even at
#   3e4), from 1e5 on faster (0.51 against 0.57 s; a 4-float tanh body 0.16 against
#   0.20 s; at 10^6, 0.17 against 1.19 s). Per gradient they are within -35% to +12%
#   of each other, the recursion ahead from 3e4 steps on but for one cell of width 4.
# - GPU (H100, results/gpu/recursion.json): XLA compiles the rows' constant slowly,
#   1.18 against 0.26 s at 10^4 steps and 12 s at 10^5 (the tanh body); per gradient
#   the recursion is faster too (1.74 against 2.13 s at 10^4). So off the CPU every HSM
#   scan runs as the recursion.
_RECURSION_FROM = {"cpu": 2**16}  # on other platforms: 1

Executor = Literal["auto", "rows", "recursion"]
_EXECUTORS = ("auto", "rows", "recursion")


def recursion_min_steps(backend: str | None = None) -> int:
    """The length from which ``executor="auto"`` runs an HSM scan as the recursion, on
    ``backend`` (default: JAX's default backend): 2**16 on CPU, 1 elsewhere."""
    return _RECURSION_FROM.get(backend or jax.default_backend(), 1)


# What a step on the rows costs beyond one on the recursion, in forward evaluations of
# the body, by platform: `policy="auto"`'s `Charges.rows_step`. Measured on an H200
# (jax 0.11.2, results/gpu/lstm_policy.json, one process): the same HSM plan for an LSTM
# (width 1024, batch 128, 1000 steps, 50 slots) took 0.290 s on the rows and 0.240 s on
# the recursion, 50.6 us a step; an evaluation of that step costs 41.4 us at the margin
# (HSM at 250 slots, 0.2 evaluations a step fewer, took 8.3 ms less): 1.22, rounded to
# 1.25. The 4x4 cell of results/gpu/small_loops.json lost 47 us a step on the rows too:
# the extra is the executor's (a schedule row read and a branch per loop iteration), not
# the body's, so a body cheaper than the LSTM's pays more than this in evaluations and
# one dearer less. On CPU the two executors are within -35% to +12% of each other per
# gradient (above): no charge. TPUs are not measured: no charge. Two later H200 runs
# (benchmarks/results/gpu/2026-11-27b/) give 0.30 and 0.21 by the same arithmetic (its
# marginal evaluation is within their noise), but the picks under 1.25 were the fastest
# for that LSTM in all three, and for the 4x4 cell only with CUDA graphs on.
_ROWS_STEP_CHARGE = {"gpu": 1.25}


def auto_charges(num_steps: int, executor: Executor, backend: str | None = None) -> Charges:
    """The `Charges` under which ``policy="auto"`` picks a plan for ``num_steps`` steps
    run by ``executor`` on ``backend`` (default: JAX's default backend): the pool's
    charge per internal state stored and, where HSM would run as the recursion and ISM
    and MSM on the rows, the rows' measured extra per step (`_ROWS_STEP_CHARGE`)."""
    backend = backend or jax.default_backend()
    recursion = executor == "auto" and num_steps >= recursion_min_steps(backend)
    return Charges(rows_step=_ROWS_STEP_CHARGE.get(backend, 0.0) if recursion else 0.0)


def check_executor(name: str, executor, policy: Policy) -> Executor:
    """``executor`` validated at the boundary (see `memento.scan`)."""
    if executor not in _EXECUTORS:
        raise ValueError(f"{name}: executor must be one of {_EXECUTORS}, got {executor!r}.")
    if executor == "recursion" and policy not in ("hsm", "auto"):
        raise ValueError(
            f"{name}: executor='recursion' runs HSM's binomial recursion, so policy must "
            f"be 'hsm' or 'auto' (which then plans HSM); got policy={policy!r}. Use "
            "executor='rows' or 'auto' for ISM and MSM."
        )
    return executor


HostBudget = tuple[int | float | Bytes, tuple[float, float]] | None


def parse_host_memory(name: str, host_memory) -> int | float | Bytes | None:
    """``host_memory=`` as given, validated: ``None``, an int number of host slots
    (``>= 0``), `Bytes` (a size string or `memento.bytes_budget`) or ``math.inf``.

    Raises:
        TypeError: anything else (a float other than ``math.inf``, a bool).
        ValueError: a negative number of slots, an unreadable size string.
    """
    if isinstance(host_memory, str | Bytes):
        return parse_memory(host_memory, name=name, arg="host_memory")
    if isinstance(host_memory, float) and host_memory == math.inf:
        return math.inf
    if host_memory is None:
        return None
    n = as_int(host_memory)
    if n is None:
        raise TypeError(
            f"{name}: host_memory must be None, an int number of carry-sized host "
            "slots, a size string such as '16GiB', memento.bytes_budget(n) or "
            f"math.inf; got {host_memory!r}."
        )
    if n < 0:
        raise ValueError(
            f"{name}: host_memory={n} slots is negative; pass 0 or None for no "
            "host level, or a number of host slots (math.inf: unbounded)."
        )
    return n


def check_host_memory(
    name: str, host_memory, transfer_cost, memory, policy: Policy, executor: Executor
) -> HostBudget:
    """``host_memory=`` and ``transfer_cost=`` validated at the boundary: ``None`` for one
    level, else ``(host, (write, read))`` with ``host`` slots, `Bytes` or ``math.inf``."""
    host = parse_host_memory(name, host_memory)
    probe = 1 if isinstance(host, Bytes) else host  # validates transfer_cost below
    _, pair, _ = check_host(name, "hsm", probe, transfer_cost, "step")
    if not host:
        return None
    if memory is None:
        raise ValueError(
            f"{name}: host_memory={host_memory!r} needs a device budget too: memory=None is "
            "lax.scan, which keeps everything on the device; pass memory= (slots or bytes)."
        )
    if executor == "recursion":
        raise ValueError(
            f"{name}: host_memory={host_memory!r} runs on the rows executor; the recursion "
            "(executor='recursion') keeps every slot on the device. Use executor='rows' or "
            "'auto'."
        )
    if policy == "ism":
        raise ValueError(
            f"{name}: host_memory={host_memory!r} plans HSM or MSM on two levels; "
            "policy='ism' has no two-level plan. Use policy='msm', 'hsm' or 'auto'."
        )
    return host, pair


def host_slots(budget: int | float | Bytes, carry_bytes: int, *, name: str) -> int | float:
    """Carry-sized host slots (or ``math.inf``) of a budget from `parse_host_memory`;
    0 for a byte budget of 0 bytes.

    Raises:
        ValueError: a byte budget that holds no carry (a host level that could never be
            used; ask for ``None`` or 0 to plan one level).
    """
    if not isinstance(budget, Bytes):
        return budget
    if budget.num_bytes == 0:
        return 0
    slots = budget.num_bytes // max(carry_bytes, 1)
    if slots < 1:
        raise ValueError(
            f"{name}: host_memory={budget.num_bytes} bytes holds no carry "
            f"({carry_bytes} bytes); raise it, or pass None for no host level."
        )
    return slots


def _host_slots(host: HostBudget, carry_bytes: int, *, name: str):
    """``(slots or math.inf, (write, read))`` of a validated host budget, or None."""
    if host is None:
        return None
    budget, pair = host
    slots = host_slots(budget, carry_bytes, name=name)
    return (slots, pair) if slots else None


def useful_slots(num_steps: int, alpha: int, policy: Policy) -> int:
    """The most slots a plan of ``num_steps`` steps can use: every internal state
    (``num_steps * alpha``, ``lax.scan``'s memory), or every carry under HSM. A larger
    budget plans exactly as this one (the planner's cost is flat from there on)."""
    return num_steps if policy == "hsm" else num_steps * alpha


def _plan(
    body: Body,
    *,
    num_steps: int,
    slots: int,
    policy: Policy,
    executor: Executor = "auto",
    name: str = _NAME,
    rows: bool = False,
    host: tuple[int | float, tuple[float, float]] | None = None,
):
    """The residuals, schedule, program and budget for a body differentiated as ``body``
    says.

    Runs when the gradient is traced (the forward rule), once the perturbed inputs are
    known: the paper's alpha is measured from the residuals actually differentiated.
    The budget is capped at `useful_slots`: no plan, pool or stack is sized by a number
    larger than what the loop can use. An HSM plan runs as the recursion when
    ``executor`` says so: no program, and no schedule unless ``rows`` (then the HSM
    schedule, whose evaluations it makes). Otherwise the pools must fit the budget: when
    their layout cannot share memory exactly as the schedule does (leaves of several
    dtypes or shapes, see `_pool.Pools`), the schedule is planned again for fewer slots
    until they fit.

    With ``host`` (``(host slots, (write, read))``), the two-level plan on the rows; its
    host pools are refitted to the host budget the same way.

    Returns:
        ``(spec, schedule, program, slots)``: ``program`` is None for the recursion,
        ``slots`` the capped budget it runs in.
    """
    spec = body.residual_spec()
    carry_bytes = nbytes(body.carry_avals)
    alpha = internal_slots(nbytes(spec.stored), carry_bytes)
    slots = min(slots, useful_slots(num_steps, alpha, "auto"))
    if host is not None:
        return _plan_two_level(
            body, spec, num_steps, slots, alpha, policy, host, carry_bytes, name=name
        )
    charges = auto_charges(num_steps, executor)
    chosen = (
        "hsm"
        if executor == "recursion"
        else choose_policy(num_steps, slots, alpha, policy, name=name, charges=charges)
    )
    if chosen == "hsm":
        slots = min(slots, useful_slots(num_steps, alpha, "hsm"))
    if chosen == "hsm" and (
        executor == "recursion" or (executor == "auto" and num_steps >= recursion_min_steps())
    ):
        schedule = choose_schedule(num_steps, slots, alpha, "hsm", name=name) if rows else None
        return spec, schedule, None, slots
    m = slots
    while True:
        # Fewer slots may change what auto picks: choose again at each size.
        schedule = choose_schedule(num_steps, m, alpha, policy, name=name, charges=charges)
        prog = _compile(schedule)
        used = pool_bytes(prog, body, spec)
        allowed = (slots - int(schedule.counts_initial)) * carry_bytes
        if used <= allowed or m == 1:
            return spec, schedule, prog, m
        m = max(1, min(m - 1, m * allowed // used))


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


def _differentiable_run(body: Body, plan: Callable, num_steps: int, unroll):
    """The loop as a ``custom_vjp`` function of (consts, init, xs), flat leaves.

    ``unroll`` is ``lax.scan``'s: the first sweep is a ``lax.scan`` with it, and the
    backward pass's recomputation loops run as many steps per iteration."""
    k = unroll_factor(unroll, num_steps)

    @jax.custom_vjp
    def run(consts, init, xs):
        def step(c, x):
            return body(consts, c, x)

        return lax.scan(step, init, xs, length=num_steps, unroll=unroll)

    def fwd(consts, init, xs):
        # symbolic_zeros: each argument comes with whether it is perturbed (needs a
        # cotangent); only what is perturbed, or depends on it, is differentiated.
        b = body.restrict(*([a.perturbed for a in args] for args in (consts, init, xs)))
        spec, _, prog, budget = plan(b)
        consts, init, xs = ([a.value for a in args] for args in (consts, init, xs))
        if prog is None:
            c, ys, slots, working = _recursion.scan_forward(
                b, spec, budget, consts, init, xs, num_steps, unroll=unroll
            )
        else:
            c, ys, slots, working = run_sweep(prog, b, spec, consts, init, xs, unroll=unroll)
        return (c, ys), (consts, init, xs, slots, working, Static((b, spec, prog, budget)))

    def bwd(res, cts):
        consts, init, xs, slots, working, static = res
        b, spec, prog, budget = static.value
        ct_c, ct_ys = cts
        ct_c_f = instantiate(ct_c, b.carry_avals, b.carry_mask)
        ct_ys_f = instantiate(ct_ys, b.y_avals, b.y_mask, leading=num_steps)
        refuse_reverse_over_reverse((res, cts), name=_NAME)
        if prog is None:
            ct_k, ct_init, ct_xs = _recursion.scan_backward(
                b, spec, budget, num_steps, consts, init, xs, slots, working, ct_c_f, ct_ys_f,
                unroll=k,
            )  # fmt: skip
        else:
            ct_k, ct_init, ct_xs = run_backward(
                prog, b, spec, consts, init, xs, slots, working, ct_c_f, ct_ys_f, unroll=k
            )
        ct_k, ct_init, ct_xs = guard_backward((ct_k, ct_init, ct_xs), name=_NAME)
        # None is a zero cotangent for custom_vjp: leaves not differentiated.
        return (
            merge(ct_k, [None] * (len(consts) - len(ct_k)), b.const_mask),
            merge(ct_init, [None] * (len(init) - len(ct_init)), b.carry_mask),
            merge(ct_xs, [None] * (len(xs) - len(ct_xs)), b.x_mask),
        )

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run
