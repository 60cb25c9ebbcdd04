"""How a budgeted scan's gradient runs: each executor's fit and price for one body, and
the choice among them (`choose`).

The static nests (`_static_fit`), the schedule's rows (`_rows_fit`, `_two_level_fit`) and
HSM's recursion (`_recursion_fit`) each say whether they fit the request's memory and what
they cost, as a `Choice`; `choose` takes the one the time model predicts fastest, or the
executor the request forces. `memento.explain` shows the `Choice` as a `Plan`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import jax

from ..planning import Plan, Policy, Schedule, hsm_cost, plan
from ..planning.internals import (
    Request,
    StaticPlan,
    auto_charges,
    dataflow_loops,
    host_slots,
    loop_costs,
    loop_seconds,
    nest_schedule,
    plan_static,
    recursion_min_steps,
    step_seconds,
)
from ._body import (
    Body,
    ResidualSpec,
    StepProfile,
    nbytes,
    recomputed_bytes,
    rerun_profile,
    split,
    step_profile,
)
from ._budget import Bytes, Percent, choose_policy, choose_schedule, internal_slots, to_slots
from ._interpreter import Program, compile_schedule, pool_bytes, rows_floor
from ._pool import checks_enabled, varying


@dataclasses.dataclass(frozen=True, eq=False)
class Choice:
    """One executor's plan for a body: what it runs, and what it costs as the planner
    counts it.

    ``program`` is what the executor runs: a `StaticPlan`, the rows' `Program`, or None
    for the recursion (which runs in ``slots``). ``schedule`` builds the plan's schedule
    on demand (`memento.explain` replays it; a gradient of a static nest or the
    recursion never needs it).
    """

    executor: Literal["static", "rows", "recursion"]
    policy: str
    slots: int
    evaluations: float
    iterations: float
    program_bytes: int
    seconds: float
    program: StaticPlan | Program | None
    schedule: Callable[[], Schedule]
    why: str

    def plan(self, request: Request, backend: str, num_steps: int) -> Plan:
        """This choice as `memento.explain` shows it."""
        return Plan(
            request, backend, num_steps, self.executor, self.policy, self.slots,
            self.evaluations, self.iterations, self.program_bytes, self.seconds, self.why,
            make_schedule=self.schedule,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Bytes the static planner counts for a body: a carry, a step's internal state, what
    a step being back-propagated streams (its slice of the ys' cotangents), and the fixed
    working set of the backward pass (a step's VJP in flight, the cotangent accumulators
    of the closed-over arrays, the loops' control state), and what each level beyond the
    second and each nest beyond the first adds. Of the fixed working set,
    ``accumulators`` are the closed-over arrays' cotangents, which the static executor
    accumulates in the gradient it returns (no temporary buffer), and ``loop`` the
    control state that a static plan holds only with inner loops
    (`StaticPlan.loop_bytes`); ``start`` what a one-step segment's stored start keeps
    (`StaticPlan.start_bytes`); ``carry_rewrite`` and ``residual_rewrite`` their bytes
    in bfloat16 leaves (`StaticPlan.carry_rewrite_bytes`); ``widened`` a stored start's
    leaves as the step casts them wider (`StaticPlan.widened_bytes`); ``in_flight`` what
    the working set counts for one step's gradient (its residuals or its largest
    intermediate, the weights' cotangents made as products, the residuals computed again
    from the closed-over arrays, XLA's small buffers), to which `_Fit.gradient_over`
    compares one step compiled alone; ``one_step`` what a nest of one-step segments
    holds beyond its count (`_Fit.one_step`, `StaticPlan.one_step_bytes`); ``kept`` what
    a nest's stored start keeps (`ResidualSpec.kept`; the rest, ``carry - kept``, each
    nest keeps once, `StaticPlan.fill_bytes`)."""

    carry: int
    residual: int
    stream: int
    fixed: int
    level: int
    piece: int
    accumulators: int
    loop: int
    start: int
    kept: int
    carry_rewrite: int = 0
    residual_rewrite: int = 0
    widened: int = 0
    in_flight: int = 0
    one_step: int = 0

    @property
    def summed_in_place(self) -> int:
        """The fixed working set of an executor that sums the closed-over arrays'
        cotangents in the gradient it returns (the static nests, the recursion)."""
        return self.fixed - self.accumulators


_CONTROL_BYTES = 1024  # loop counters, indices and XLA's small buffers
_LEVEL_BYTES = 640  # a nest's level beyond the second: its loops' counters (XLA:CPU: 64 B each)
_SHORT_LOOP = 8  # steps of the per-step idiom compiled to measure a one-step segment


@dataclasses.dataclass(frozen=True, eq=False)
class _Fit:
    """A body and a request, measured: what every executor's fit reads.

    ``slots`` is the budget in carry slots, capped at what the loop can use;
    ``budget`` the request's bytes, or those slots (a percentage resolved); ``step`` one
    step's predicted seconds on ``backend`` in a loop of steps, ``again`` those of its
    work on the closed-over arrays alone, which such a loop hoists out (`StepProfile`'s
    ``hoisted``), and which a step run again under remat does again; ``rerun`` a step's
    run again from a static nest's start, which keeps only the carry leaves later
    residuals depend on (`rerun_profile`; None: ``step``).
    """

    body: Body
    request: Request
    num_steps: int
    backend: str
    spec: ResidualSpec
    alpha: int
    slots: int
    budget: int | Bytes
    sizes: _Sizes
    step: float
    dataflow: tuple[bool, bool] = (False, False)
    again: float = 0.0
    rerun: float | None = None

    def seconds(self, evaluations: float, iterations: float, executor: str) -> float:
        """Predicted seconds of the rows or the recursion (which run each step whole)."""
        step = self.step + self.again
        return loop_seconds(evaluations, iterations, executor, step=step, backend=self.backend)

    @functools.cached_property
    def gradient_over(self) -> int:
        """Under a byte budget, the bytes by which one step's gradient as XLA compiles it
        alone (`Body.gradient_temp_bytes`) exceeds what the working set counts for it
        (``sizes.in_flight``): a wide intermediate whose cotangent XLA keeps as an array
        beside the residuals (a softmax's, a max's). The rows and the recursion
        back-propagate one step at a time, and hold it. 0 under a slot budget (slots
        count stored states only), and where the step cannot be compiled alone."""
        if not isinstance(self.budget, Bytes):
            return 0
        measured = self.body.gradient_temp_bytes(self.backend)
        return 0 if measured is None else max(0, measured - self.sizes.in_flight)

    @functools.cached_property
    def one_step(self) -> int | None:
        """Under a byte budget, what a nest of one-step segments holds beyond its count
        (negative: short of it): XLA's bytes for a few steps of
        ``lax.scan(jax.checkpoint(step))`` (`Body.per_step_temp_bytes`), the same
        program, less the count of that plan. XLA keeps less than the count where it
        does not hold every residual at once, more where it keeps a wide intermediate's
        cotangent beside them. None under a slot budget, and where the steps cannot be
        compiled alone (`StaticPlan.one_step_bytes`)."""
        if not isinstance(self.budget, Bytes):
            return None
        n, count = self.short_loop
        measured = self.body.per_step_temp_bytes(self.backend, n)
        return None if measured is None else measured - count

    @property
    def short_loop(self) -> tuple[int, int]:
        """The steps of the per-step idiom that `one_step` compiles, and the count of
        that plan (every step's start stored, each run again alone)."""
        n = max(2, min(_SHORT_LOOP, self.num_steps))
        plan = StaticPlan(((n, 1),), **_plan_bytes(self.sizes))
        return n, plan.peak_bytes + _static_fixed(self.sizes)

    def slots_within(self, slots: int, per_slot: int, fixed: int) -> int:
        """At most ``slots``, at least one, of ``per_slot`` bytes each beside ``fixed``
        bytes within a byte budget (``slots`` under a slot budget)."""
        if not isinstance(self.budget, Bytes):
            return slots
        return max(1, min(slots, (self.budget.num_bytes - fixed) // max(per_slot, 1)))


def choose(
    body: Body, *, request: Request, num_steps: int, slots: int | Percent, backend: str
) -> tuple[ResidualSpec, Choice]:
    """The residuals and the plan for a body differentiated as ``body`` says, as
    ``request`` asks (``slots``: its memory in slots, `budget_slots`), run on ``backend``
    (`platform`: it sets the time model's constants).

    Runs when the gradient is traced (the forward rule), once the perturbed inputs are
    known: the paper's alpha is measured from the residuals actually differentiated, and a
    `Percent` budget becomes that share of ``num_steps * alpha`` slots. The budget is
    capped at `useful_slots`: no plan, pool or stack is sized by a number larger than
    what the loop can use.

    The candidates are the static nests (``policy="auto"`` only), then the loop the
    policy picks: HSM's recursion (forced, or from `recursion_min_steps` on the
    backend), or the schedule's rows, refitted to fewer slots until their pools and rows
    fit (the recursion where they cannot fit a byte budget). A static nest predicted
    faster than any loop could be is taken without planning a schedule (at 10^6 steps
    that takes seconds). With a host level, the two-level plan on the rows.

    Returns:
        ``(spec, choice)``: the body's `residual_spec` and the `Choice`.
    """
    fit = _measure(body, request, num_steps, slots, backend)
    if request.host is not None:
        host = host_slots(request.host, fit.sizes.carry, name=request.name)
        if host:
            assert request.transfer is not None  # read_request pairs it with a host level
            return fit.spec, _two_level_fit(fit, host, request.transfer)
    static = _static_fit(fit)
    if request.executor == "static":
        assert static is not None  # _static_fit raises where it has no plan
        return fit.spec, static
    # Each loop evaluates every step at least once, in one iteration each.
    if static is not None and static.seconds <= fit.seconds(num_steps, num_steps, "recursion"):
        return fit.spec, static
    # A loop's fit before its step is measured is its fastest: measured, a step only
    # takes more of the budget. A static nest faster than that needs no measurement.
    beat = math.inf if static is None else static.seconds
    loop = _loop_fit(fit, measured=False, beat=beat)
    if static is not None and static.seconds <= loop.seconds:
        return fit.spec, static
    if fit.gradient_over:
        loop = _loop_fit(fit, beat=beat)
    return fit.spec, static if static is not None and static.seconds <= loop.seconds else loop


def budget_slots(budget: int | Bytes | Percent, carry_bytes: int, *, name: str) -> int | Percent:
    """Slots of a budget; a percentage stays one until `choose` measures alpha, its need."""
    return budget if isinstance(budget, Percent) else to_slots(budget, carry_bytes, name=name)


def useful_slots(num_steps: int, alpha: int, policy: Policy) -> int:
    """The most slots a plan of ``num_steps`` steps can use: every internal state
    (``num_steps * alpha``, ``lax.scan``'s memory), or every carry under HSM. A larger
    budget plans exactly as this one (the planner's cost is flat from there on)."""
    return num_steps if policy == "hsm" else num_steps * alpha


def _measure(body: Body, request: Request, num_steps: int, slots: int | Percent, backend: str):
    spec = body.residual_spec()
    carry = nbytes(body.carry_avals)
    alpha = internal_slots(nbytes(spec.stored), carry)
    need = useful_slots(num_steps, alpha, "auto")
    slots = min(to_slots(slots, carry, name=request.name, need=need), need)
    assert request.memory is not None  # memory=None is lax.scan, which plans nothing
    budget = request.memory if isinstance(request.memory, Bytes) else slots
    profile = step_profile(body)
    hoisted = profile.hoisted
    step = step_seconds(
        profile.flops - hoisted.flops, profile.bytes - hoisted.bytes, profile.ops - hoisted.ops,
        backend,
    )  # fmt: skip
    again = step_seconds(*hoisted, backend)
    rerun = None
    if spec.kept is not None and not all(spec.kept):
        p = rerun_profile(body, spec.kept)
        rerun = step_seconds(
            p.flops - p.hoisted.flops, p.bytes - p.hoisted.bytes, p.ops - p.hoisted.ops, backend
        )
    sizes = _static_sizes(body, spec, profile)
    dataflow = dataflow_loops(profile.matmuls, sum(body.carry_mask), profile.bytes, backend)
    return _Fit(
        body, request, num_steps, backend, spec, alpha, slots, budget, sizes, step, dataflow,
        again, rerun,
    )  # fmt: skip


# The static nests.


def _static_fit(fit: _Fit) -> Choice | None:
    """The fastest static nest that fits, or None (not a candidate, or none fits; forced,
    an error)."""
    request, sizes = fit.request, fit.sizes
    forced = request.executor == "static"
    mapped = _static_unavailable(fit.body)
    if forced and mapped:
        raise NotImplementedError(
            f"{request.name}: executor='static' does not run inside shard_map (a value "
            f"varies over mesh axes: {', '.join(map(str, mapped))}); use executor='auto', "
            "'rows' or 'recursion'."
        )
    if not (forced or request.executor == "auto") or request.policy != "auto" or mapped:
        return None
    room, kinds = _static_budget(fit.budget, fit.slots, sizes)
    everything = fit.num_steps * sizes.residual + _static_fixed(sizes)
    if isinstance(fit.budget, Bytes) and fit.budget.num_bytes >= everything:
        room = math.inf  # room for lax.scan's own memory: store every step
    seconds = functools.partial(
        _static_seconds, step=fit.step, again=fit.again, backend=fit.backend,
        dataflow=fit.dataflow, rerun=fit.rerun,
    )  # fmt: skip
    prog = plan_static(fit.num_steps, room, **kinds, seconds=seconds)

    def plan(one_step: int) -> StaticPlan | None:
        return plan_static(
            fit.num_steps, room, **(kinds | {"one_step_bytes": one_step}), seconds=seconds
        )

    if _one_step_matters(fit, prog, room, plan) and fit.one_step is not None:
        # One-step segments as XLA compiles them: plan again, counting that.
        sizes = dataclasses.replace(sizes, one_step=fit.one_step)
        prog = plan(fit.one_step)
    if prog is None:
        if forced:
            raise ValueError(_no_static_plan(fit))
        return None
    # Under a slot budget the nest was fitted by its stored states; its bytes count all.
    full = StaticPlan(prog.pieces, **_plan_bytes(sizes))
    whole = prog.pieces == ((fit.num_steps,),)
    why = (
        "the budget holds every step's internal state: one lax.scan, as lax.scan's own gradient"
        if whole
        else f"nested lax.scans of static lengths {list(map(list, prog.pieces))}"
        + ("" if forced else ", predicted fastest of the plans that fit")
    )
    return Choice(
        "static", "store all" if whole else "nest", fit.slots, prog.evaluations,
        prog.loop_iterations, full.peak_bytes + _static_fixed(sizes),
        seconds(prog), prog, lambda: nest_schedule(prog), why[0].upper() + why[1:] + ".",
    )  # fmt: skip


def _one_step_matters(fit: _Fit, prog: StaticPlan | None, room: float, plan: Callable) -> bool:
    """Whether a nest of one-step segments, measured (`_Fit.one_step`), can change the
    static plan ``prog`` under a byte budget (``plan(one_step_bytes)`` plans again):
    ``prog`` has one-step segments, or the plan differs where such a nest holds no more
    than its stored starts, the least a measurement can give."""
    if not isinstance(fit.budget, Bytes) or room == math.inf or fit.num_steps < 2:
        return False
    if prog is not None and prog.one_step_segments:
        return True
    if fit.num_steps * fit.sizes.start > fit.budget.num_bytes:
        return False  # every step's start alone exceeds the budget
    n, count = fit.short_loop
    least = plan(n * fit.sizes.start - count)
    return least is not None and (prog is None or least.pieces != prog.pieces)


def _static_unavailable(body: Body) -> tuple:
    """Why the static executor cannot run this loop: the mesh axes any of its values
    varies over (inside ``shard_map``), or JAX's experimental ``jax_scan3`` scan, whose
    VJP cannot yet run inside a custom VJP's forward rule."""
    if getattr(jax.config, "jax_scan3", False):
        return ("jax_scan3",)
    avals = [*body.carry_avals, *body.x_avals, *(jax.typeof(k) for k in body.consts)]
    return tuple(sorted({axis for a in avals for axis in varying(a)}))


def _static_sizes(body: Body, spec, profile: StepProfile) -> _Sizes:
    """``profile``: the step's `step_profile` (its largest intermediate, and the weights'
    cotangents its VJP computes as matrix products)."""
    carry = nbytes(body.carry_avals)
    residual = nbytes(spec.stored)
    xs = nbytes(body.x_avals)
    # A segment back-propagated reads its xs and writes their cotangents in place; its
    # ys' cotangents are sliced.
    stream = nbytes(split(body.y_avals, body.y_mask)[0])
    consts = nbytes([jax.typeof(k) for k in split(body.consts, body.const_mask)[0]])
    # The residuals computed again from the consts where a pullback is rebuilt.
    again = recomputed_bytes(spec)
    # One step's VJP in flight: its carry, an x, its internal state or its largest
    # intermediate, whichever is larger (the largest is most often one of the residuals),
    # the weights' cotangents it computes as matrix products before adding them up; and
    # the closed-over arrays' cotangents. An intermediate of the consts alone is one of
    # the residuals computed again, where there are any (``again`` counts those that XLA
    # holds as arrays).
    largest = profile.varying if spec.invariant is not None else profile.largest
    loop = max(0, _CONTROL_BYTES - largest)
    in_flight = max(residual, largest) + profile.products + again + loop
    working = carry + xs + in_flight
    # A level beyond the second: the counters and indices of its loops.
    level = _LEVEL_BYTES
    # A nest beyond the first: its loops' state, and its carries around them.
    piece = 4 * carry + _CONTROL_BYTES // 2
    reads = spec.reads or [True] * len(body.carry_avals)
    start = nbytes([a for a, m in zip(body.carry_avals, reads) if m])
    kept = split(body.carry_avals, spec.kept or [True] * len(body.carry_avals))[0]
    rewrite = [
        nbytes([a for a in avals if a.dtype == jax.numpy.bfloat16]) for avals in (kept, spec.stored)
    ]
    return _Sizes(
        carry, residual, stream, working + consts, level, piece, consts, loop, start,
        nbytes(kept), *rewrite, profile.widened, in_flight,
    )  # fmt: skip


def _static_budget(budget: int | Bytes, slots: int, sizes: _Sizes):
    """``(budget_bytes, sizes)`` arguments of `plan_static` for a budget: a byte budget
    is the program's memory, less the backward pass's fixed working set but for the
    cotangent accumulators and the inner loops' state (which the plan counts if it has
    any); ``slots`` count stored states only, carry-sized, as in the paper (the initial
    carry is one)."""
    if isinstance(budget, Bytes):
        return budget.num_bytes - _static_fixed(sizes), _plan_bytes(sizes)
    return (slots - 1) * sizes.carry, _plan_bytes(sizes, stored_only=True)


def _plan_bytes(sizes: _Sizes, stored_only: bool = False) -> dict[str, int]:
    """`StaticPlan`'s byte arguments for ``sizes``: all of them, or (``stored_only``)
    those of the states it stores."""
    stored = {
        "carry_bytes": sizes.carry,
        "residual_bytes": sizes.residual,
        "carry_rewrite_bytes": sizes.carry_rewrite,
        "residual_rewrite_bytes": sizes.residual_rewrite,
    }
    if stored_only:
        return stored
    return stored | {
        "carry_bytes": sizes.kept,
        "fill_bytes": sizes.carry - sizes.kept,
        "stream_bytes": sizes.stream,
        "level_bytes": sizes.level,
        "piece_bytes": sizes.piece,
        "loop_bytes": sizes.loop,
        "start_bytes": sizes.start,
        "one_step_bytes": sizes.one_step,
        "widened_bytes": sizes.widened,
    }


def _static_fixed(sizes: _Sizes) -> int:
    """What a static plan's program takes besides `StaticPlan.peak_bytes`."""
    return sizes.summed_in_place - sizes.loop


def _no_static_plan(fit: _Fit) -> str:
    budget, sizes = fit.budget, dataclasses.replace(fit.sizes, one_step=fit.one_step or 0)
    room, kinds = _static_budget(budget, fit.slots, sizes)
    smallest = plan_static(fit.num_steps, math.inf, **kinds, fewest_bytes=True)
    assert smallest is not None  # nothing bounds it
    if isinstance(budget, Bytes):
        need = smallest.peak_bytes + budget.num_bytes - room
        given, least = f"{budget.num_bytes} bytes", f"{need} bytes (memory='{need}B')"
    else:
        given = f"{fit.slots} slots"
        least = f"{-(-smallest.peak_bytes // sizes.carry) + 1} slots"
    return (
        f"{fit.request.name}: executor='static' has no plan of {fit.num_steps} steps "
        f"within {given}; its smallest takes {least}. Raise memory, or use "
        "executor='auto', which falls back to the recursion."
    )


def _static_seconds(
    plan: StaticPlan,
    *,
    step: float,
    again: float,
    backend: str,
    dataflow: tuple[bool, bool],
    rerun: float | None = None,
) -> float:
    """Predicted seconds of a static plan with steps of ``step`` seconds on ``backend``,
    whose separate and fused loops run as dataflow graphs as ``dataflow`` says
    (`dataflow_loops`); a fused iteration (a one-step segment's, run again under remat
    and back-propagated) also does ``again`` seconds of work that the loops hoist. The
    steps run again, beyond the first pass's, take ``rerun`` seconds (None: ``step``)."""
    separate, fused = plan.step_iterations
    cheaper = 0.0 if rerun is None else (plan.evaluations - plan.num_steps) * (step - rerun)
    return (
        fused * again
        - cheaper
        + loop_seconds(
            plan.evaluations,
            plan.loop_iterations,
            "static",
            step=step,
            backend=backend,
            starts=plan.loop_starts,
            spilled=plan.spilled_bytes(loop_costs(backend).cache),
            rewritten=plan.rewritten_bytes,
            dataflow=separate * dataflow[0] + fused * dataflow[1],
        )
    )


# The loops: the schedule's rows and HSM's recursion.


def _loop_fit(fit: _Fit, measured: bool = True, beat: float = math.inf) -> Choice:
    """The loop the policy picks for the budget: the recursion or the rows; with
    ``measured``, a step's working set as XLA compiles it where that is larger
    (`_Fit.gradient_over`). The rows are not planned where the least they could take
    (`rows_floor`) is ``beat`` seconds or more (a static nest's) and the pick does not
    depend on them, or (``auto``) more bytes than a byte budget: at 10^6 steps planning
    them takes seconds."""
    request, fit = fit.request, _gradient_measured(fit) if measured else fit
    if request.executor == "recursion":
        return _recursion_fit(fit, "asked for")
    if _rows_floor_seconds(fit) >= beat:
        # Under a byte budget auto weighs the recursion against the rows; under slots
        # the policy may pick either, which matters only if the recursion is faster.
        recursion = _recursion_fit(fit, _ROWS_SLOWER)
        if isinstance(fit.budget, Bytes) or recursion.seconds >= beat:
            return recursion
    if request.executor == "auto" and not _rows_fit_bytes(fit):
        return _recursion_fit(fit, _ROWS_OVER)
    slots = fit.slots_within(fit.slots, fit.sizes.carry, fit.sizes.fixed)  # and the working set
    charges = auto_charges(fit.num_steps, request.executor, fit.backend)
    chosen = choose_policy(
        fit.num_steps, slots, fit.alpha, request.policy, name=request.name, charges=charges
    )
    least = recursion_min_steps(fit.backend)
    if chosen == "hsm" and request.executor == "auto" and fit.num_steps >= least:
        return _recursion_fit(
            fit, f"HSM runs as the recursion from {least:,} steps on {fit.backend}"
        )
    if chosen == "hsm":  # (`_recursion_fit` caps its own)
        slots = min(slots, useful_slots(fit.num_steps, fit.alpha, "hsm"))
    rows = _rows_fit(fit, slots, charges)
    if rows is None:  # auto: the rows do not fit a byte budget; the recursion keeps none
        return _recursion_fit(fit, _ROWS_OVER)
    hsm = request.policy in ("auto", "hsm")
    if request.executor == "auto" and hsm and isinstance(fit.budget, Bytes):
        # The rows take bytes that the recursion keeps as slots.
        reason = "predicted faster than the schedule's rows, whose bytes it keeps as slots"
        recursion = _recursion_fit(fit, reason)
        return recursion if recursion.seconds < rows.seconds else rows
    return rows


def _gradient_measured(fit: _Fit) -> _Fit:
    """``fit`` with its working set raised by `_Fit.gradient_over`: the rows and the
    recursion back-propagate one step at a time."""
    if not fit.gradient_over:
        return fit
    sizes = dataclasses.replace(fit.sizes, fixed=fit.sizes.fixed + fit.gradient_over)
    return dataclasses.replace(fit, sizes=sizes)


def _sweep_internal(fit: _Fit) -> int:
    """The most internal states a schedule on the rows can save in its first sweep:
    those its slots (or its bytes, beside the working set) hold."""
    if isinstance(fit.budget, Bytes):
        return max(0, fit.budget.num_bytes - fit.sizes.fixed) // max(1, fit.sizes.residual)
    return fit.slots // fit.alpha


def _rows_floor_seconds(fit: _Fit) -> float:
    """The least seconds any schedule on the rows could take in this budget."""
    floor = rows_floor(fit.num_steps, _sweep_internal(fit))
    return fit.seconds(floor.evaluations, floor.evaluations + floor.primal_rows, "rows")


_ROWS_OVER = "the schedule's rows would not fit the byte budget; the recursion keeps none"
_ROWS_SLOWER = "predicted faster than the static nests, which the schedule's rows cannot be"


def _rows_floor_bytes(fit: _Fit) -> int:
    """The least bytes of rows and pools any schedule on the rows takes (the internal
    states its sweep saves, each ``residual`` bytes, save primal rows)."""
    r = fit.sizes.residual
    return min(
        rows_floor(fit.num_steps, i).runtime_bytes + i * r for i in (0, _sweep_internal(fit))
    )


def _rows_fit_bytes(fit: _Fit) -> bool:
    """Whether some schedule's rows and pools could fit a byte budget beside the working
    set (`_rows_floor_bytes`); True under a slot budget."""
    if not isinstance(fit.budget, Bytes):
        return True
    return _rows_floor_bytes(fit) <= fit.budget.num_bytes - fit.sizes.fixed


def _rows_fit(fit: _Fit, slots: int, charges) -> Choice | None:
    """The schedule on the rows in ``slots``, planned again for fewer slots until its
    pools (and, under a byte budget, its rows) fit: when the pools' layout cannot share
    memory exactly as the schedule does (leaves of several dtypes or shapes, see
    `_pool.Pools`), it takes more than the schedule's slots. None where even one slot's
    rows exceed a byte budget and ``executor`` is ``"auto"``; forced, an error."""
    request, sizes, budget = fit.request, fit.sizes, fit.budget
    m = slots
    while True:
        # Fewer slots may change what auto picks: choose again at each size.
        schedule = choose_schedule(
            fit.num_steps, m, fit.alpha, request.policy, name=request.name, charges=charges
        )
        prog = _compile(schedule)
        pools = used = pool_bytes(prog, fit.body, fit.spec)
        allowed = (slots - int(schedule.counts_initial)) * sizes.carry
        if isinstance(budget, Bytes):  # the program's bytes: the rows count too
            used += prog.runtime_bytes
            allowed = budget.num_bytes - sizes.fixed
        if used <= allowed or m == 1:
            break
        m = max(1, min(m - 1, m * allowed // used))
    if used > allowed and isinstance(budget, Bytes):
        if request.executor == "auto":
            return None
        least = used + sizes.fixed
        raise ValueError(
            f"{request.name}: executor='rows' cannot run {fit.num_steps} steps within "
            f"{budget.num_bytes} bytes: its schedule's rows alone take "
            f"{prog.runtime_bytes} bytes; its smallest takes {least} bytes "
            f"(memory='{least}B'). Raise memory, or use executor='auto', which "
            "runs static nests or the recursion (no rows)."
        )
    chose = request.executor == "auto" and request.policy == "auto"  # over static nests
    why = (
        f"The optimal {schedule.policy.upper()} schedule of Gruslys et al. as rows of data "
        f"({prog.runtime_bytes:,} bytes) read by one loop"
        + (", predicted faster than the static nests that fit." if chose else ".")
    )
    return _rows_choice(fit, m, schedule, prog, pools, why)


def _rows_choice(
    fit: _Fit, slots: int, schedule: Schedule, prog: Program, pools: int, why: str
) -> Choice:
    """``pools``: the bytes of ``prog``'s pools (`pool_bytes`)."""
    evaluations = schedule.cost
    iterations = evaluations + len(prog.primal_rows)
    program_bytes = pools + prog.runtime_bytes + fit.sizes.fixed
    return Choice(
        "rows", schedule.policy, slots, evaluations, iterations, program_bytes,
        fit.seconds(evaluations, iterations, "rows"), prog, lambda: schedule, why,
    )  # fmt: skip


def _recursion_fit(fit: _Fit, reason: str) -> Choice:
    """HSM's binomial recursion in the budget's slots (fewer where a byte budget cannot
    hold their positions beside them). It keeps no rows: the smallest plan of all, one
    slot beside a step's working set. A byte budget below that is an error naming it.
    As the static nests, it sums the closed-over arrays' cotangents in the gradient it
    returns, not in a buffer of its own: its working set is smaller than the rows'."""
    per_slot, fixed = _recursion_slot_bytes(fit.sizes), fit.sizes.summed_in_place
    slots = min(fit.slots, useful_slots(fit.num_steps, fit.alpha, "hsm"))
    slots = fit.slots_within(slots, per_slot, fixed)
    program_bytes = slots * per_slot + fixed
    if isinstance(fit.budget, Bytes) and program_bytes > _tolerated(fit.budget.num_bytes):
        raise ValueError(
            f"{fit.request.name}: no plan runs {fit.num_steps} steps within "
            f"{fit.budget.num_bytes} bytes: a step's gradient works in {fixed} bytes, and "
            f"the smallest plan (the recursion, one carry stored) takes {program_bytes} "
            f"bytes (memory='{program_bytes}B'). Raise memory."
        )
    evaluations = hsm_cost(fit.num_steps, slots)
    num_steps, alpha, name = fit.num_steps, fit.alpha, fit.request.name
    return Choice(
        "recursion", "hsm", slots, evaluations, evaluations, program_bytes,
        fit.seconds(evaluations, evaluations, "recursion"),
        None, lambda: choose_schedule(num_steps, slots, alpha, "hsm", name=name),
        f"HSM's binomial recursion on the device, O(slots) state ({reason}).",
    )  # fmt: skip


def _tolerated(budget_bytes: int) -> float:
    """The most bytes a plan may be counted at under a byte budget it is the last resort
    for: the budget give or take 5% and 4 KiB, as XLA's buffer assignment differs from
    the model's count (the Limitations page)."""
    return budget_bytes * 1.05 + 4096


def _recursion_slot_bytes(sizes: _Sizes) -> int:
    """Bytes of one of the recursion's slots: a carry, its int32 position, and with
    `checks_enabled` a tag and positions (12 bytes)."""
    return sizes.carry + 4 + 12 * checks_enabled()


@functools.lru_cache(maxsize=64)
def _compile(schedule: Schedule) -> Program:
    return compile_schedule(schedule)


# A host level: the two-level plan on the rows.


def _two_level_fit(fit: _Fit, h: int | float, pair: tuple[float, float]) -> Choice:
    """`memento.plan`'s two-level schedule whose pools fit both budgets: planned again
    for fewer device slots, or fewer host slots, until they do."""
    slots, carry = fit.slots, fit.sizes.carry
    if h != math.inf:
        h = min(int(h), useful_slots(fit.num_steps, fit.alpha, "auto"))  # what can be used
    m = slots
    while True:
        try:
            schedule = _two_level_schedule(fit.num_steps, m, h, fit.alpha, fit.request.policy, pair)
        except ValueError as e:
            raise ValueError(str(e).replace("memento.plan", fit.request.name)) from None
        prog = _compile(schedule)
        used = pool_bytes(prog, fit.body, fit.spec)
        allowed = (slots - int(schedule.counts_initial)) * carry
        host_used = pool_bytes(prog, fit.body, fit.spec, host=True)
        host_ok = h == math.inf or host_used <= h * carry
        if (used <= allowed or m == 1) and (host_ok or h == 0):
            break
        if used > allowed:
            m = max(1, min(m - 1, m * allowed // max(used, 1)))
        else:
            h = max(0, min(h - 1, h * (h * carry) // max(host_used, 1)))
    why = (
        f"The optimal {schedule.policy.upper()} schedule of Gruslys et al. with a host "
        f"level, as rows of data ({prog.runtime_bytes:,} bytes) read by one loop."
    )
    return _rows_choice(fit, m, schedule, prog, used, why)


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
