"""What a budgeted loop is asked for, validated once: `read_request` and `Request`; what
it will run, and why: `Plan`. NumPy only.

Every entry point reads its arguments here: `memento.scan` (and `memento.explain`),
`memento.while_loop`, `memento.chain` and `memento.torch`'s `scan` and `chain`. Each
passes what it was given and which loop it is (``loop``); an argument a loop has no use
for, or a combination it cannot run, is refused here with one message for all of them.
What depends on the traced step (slots of a byte budget, the executor ``"auto"`` picks)
is planned later, once the step is measured, into a `Plan`.

The backend a plan is timed for is an argument everywhere (`recursion_min_steps`,
`auto_charges`): the JAX side takes it from the inputs' devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal, cast

from ._auto import Charges, Policy, check_policy
from ._budget import Bytes, Percent, as_int, parse_memory
from ._host import check_host
from ._schedule import Schedule

__all__ = [
    "CHAIN_POLICIES",
    "EXECUTORS",
    "ChainPolicy",
    "Executor",
    "Plan",
    "Request",
    "auto_charges",
    "host_slots",
    "read_request",
    "recursion_min_steps",
]

Executor = Literal["auto", "static", "rows", "recursion"]
EXECUTORS: tuple[Executor, ...] = ("auto", "static", "rows", "recursion")
LoopKind = Literal["scan", "while_loop", "chain", "torch"]
ChainPolicy = Literal["auto", "hsm", "msm"]
CHAIN_POLICIES: tuple[ChainPolicy, ...] = ("auto", "hsm", "msm")


@dataclasses.dataclass(frozen=True)
class Request:
    """A budgeted loop's arguments, validated (`read_request`).

    Attributes:
        name: the entry point, for messages.
        memory: ``None`` (keep everything), carry-sized slots, `Bytes` or `Percent`.
        policy: one of `POLICIES` (``CHAIN_POLICIES`` for a chain).
        executor: one of `EXECUTORS` (``"auto"`` where the loop has no choice).
        host: the host level's budget: ``None`` (one level), slots, `Bytes` or
            ``math.inf``.
        transfer: ``(write, read)``, a slot's copy to the host and back in forward steps,
            for a host level; ``None`` without one.
    """

    name: str
    memory: int | Bytes | Percent | None
    policy: Policy
    executor: Executor = "auto"
    host: int | float | Bytes | None = None
    transfer: tuple[float, float] | None = None


def read_request(
    name: str,
    loop: LoopKind,
    *,
    memory,
    policy="auto",
    executor="auto",
    host_memory=None,
    transfer_cost=None,
    bounded: bool = True,
) -> Request:
    """The `Request` of a ``loop``'s arguments, as the entry point ``name`` was given them.

    ``bounded``: whether the loop's length is known before it runs (a ``while_loop``
    without ``max_steps`` is not), which keeping everything, a percentage and an
    unbounded host level need.

    Raises:
        ValueError: an unknown policy or executor, or a combination the loop cannot run
            (the message says what to pass instead); a bad size string.
        TypeError: a ``memory`` or ``host_memory`` of the wrong type; ``transfer_cost``
            for a ``while_loop``.
    """
    if loop == "while_loop":
        return _while_request(name, memory, host_memory, transfer_cost, bounded)
    if loop == "chain":
        if policy not in CHAIN_POLICIES:
            raise ValueError(f"{name}: policy must be one of {CHAIN_POLICIES}, got {policy!r}.")
        return Request(name, _memory(name, memory), cast(Policy, policy))
    policy = check_policy(name, policy)
    if loop == "torch":
        return Request(name, _memory(name, memory), policy)
    executor = check_executor(name, executor, policy)
    host, transfer = _scan_host(name, host_memory, transfer_cost, memory, policy, executor)
    return Request(name, _memory(name, memory), policy, executor, host, transfer)


def _memory(name: str, memory) -> int | Bytes | Percent | None:
    return None if memory is None else parse_memory(memory, name=name)


def check_executor(name: str, executor, policy: Policy) -> Executor:
    """``executor`` if it is one of `EXECUTORS` and can run ``policy``; else a ValueError."""
    if executor not in EXECUTORS:
        raise ValueError(f"{name}: executor must be one of {EXECUTORS}, got {executor!r}.")
    if executor == "static" and policy != "auto":
        raise ValueError(
            f"{name}: executor='static' runs its own family of plans (nested segments), "
            f"chosen for the budget by policy='auto'; got policy={policy!r}. Use "
            "executor='rows' (any policy) or 'recursion' (HSM) for the paper's schedules."
        )
    if executor == "recursion" and policy not in ("hsm", "auto"):
        raise ValueError(
            f"{name}: executor='recursion' runs HSM's binomial recursion, so policy must "
            f"be 'hsm' or 'auto' (which then plans HSM); got policy={policy!r}. Use "
            "executor='rows' or 'auto' for ISM and MSM."
        )
    return cast(Executor, executor)


def parse_host_memory(name: str, host_memory) -> int | float | Bytes | None:
    """``host_memory=`` as given, validated: ``None``, an int number of host slots
    (``>= 0``), `Bytes` (a size string or `memento.bytes_budget`) or ``math.inf``.

    Raises:
        TypeError: anything else (a float other than ``math.inf``, a bool).
        ValueError: a negative number of slots, an unreadable size string.
    """
    if isinstance(host_memory, str | Bytes):
        budget = parse_memory(host_memory, name=name, arg="host_memory")
        if isinstance(budget, Percent):
            raise ValueError(
                f"{name}: host_memory={host_memory!r} is a percentage; host_memory takes "
                "carry-sized slots, a size such as '16GiB', or math.inf."
            )
        return budget
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


def _scan_host(name, host_memory, transfer_cost, memory, policy, executor):
    """A scan's ``(host budget or None, (write, read) or None)``."""
    host = parse_host_memory(name, host_memory)
    probe = 1 if isinstance(host, Bytes) else host  # validates transfer_cost below
    _, pair, _ = check_host(name, "hsm", probe, transfer_cost, "step")
    if not host:
        return None, None
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


def _while_request(name, memory, host_memory, transfer_cost, bounded: bool) -> Request:
    if transfer_cost is not None:
        raise TypeError(
            f"{name}: transfer_cost= (got {transfer_cost!r}) is memento.scan's: the while "
            "loop's online policy places its checkpoints on the host whatever a copy costs "
            "(it weighs no transfers), so it has no use for one; drop transfer_cost."
        )
    if memory is None and not bounded:
        raise ValueError(
            f"{name}: memory=None keeps every carry, which needs max_steps; pass a budget "
            "(e.g. memory=16 slots or memory='64MiB') or max_steps."
        )
    budget = _memory(name, memory)
    if isinstance(budget, Percent) and not bounded:
        raise ValueError(
            f"{name}: memory={memory!r} is a share of storing every carry, max_steps + 1 "
            "slots, so it needs max_steps; pass max_steps, or a budget in slots or bytes "
            "(e.g. memory=16 or memory='64MiB')."
        )
    host = parse_host_memory(name, host_memory)
    if host is not None and memory is None:
        raise ValueError(
            f"{name}: host_memory={host_memory!r} needs a device budget too: memory=None "
            "keeps every carry on the device; pass memory= (slots or bytes) for the "
            "backward's recomputation on the device."
        )
    if host == math.inf and not bounded:
        raise ValueError(
            f"{name}: host_memory=math.inf keeps every carry on the host, which needs "
            "max_steps (the host slots are allocated before the loop runs); pass max_steps "
            "or a finite host_memory (slots or bytes)."
        )
    return Request(name, budget, "auto", "auto", host)


def host_slots(budget: int | float | Bytes, carry_bytes: int, *, name: str) -> int | float:
    """Carry-sized host slots (or ``math.inf``) of a host budget; 0 for 0 bytes.

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


# Between the rows and the recursion, HSM runs as the recursion from
# `recursion_min_steps` steps on: both make the optimal schedule's evaluations, the
# recursion with O(slots) state and no rows to plan or compile (on a GPU XLA compiles the
# rows slowly, and on CPU the recursion's first call is faster from about 1e5 steps on;
# benchmarks/results/recursion.json and gpu/recursion.json).
_RECURSION_FROM = {"cpu": 2**16}  # on other platforms: 1

# What a step on the rows costs beyond one on the recursion, in forward evaluations, by
# platform (`Charges.rows_step`): a schedule row read and a branch per loop iteration,
# which the recursion does not pay. From the GPU runs of benchmarks/gpu_policy.py
# (results/gpu/lstm_policy.json); on CPU the two cost alike per step.
_ROWS_STEP_CHARGE = {"gpu": 1.25}


def recursion_min_steps(backend: str) -> int:
    """The length from which ``executor="auto"`` runs an HSM scan as the recursion on
    ``backend``: 2**16 on CPU, 1 elsewhere."""
    return _RECURSION_FROM.get(backend, 1)


def auto_charges(num_steps: int, executor: Executor, backend: str) -> Charges:
    """The `Charges` under which ``policy="auto"`` picks a plan for ``num_steps`` steps
    run by ``executor`` on ``backend``: the pool's charge per internal state stored and,
    where HSM would run as the recursion and ISM and MSM on the rows, the rows' measured
    extra per step (`_ROWS_STEP_CHARGE`)."""
    recursion = executor == "auto" and num_steps >= recursion_min_steps(backend)
    return Charges(rows_step=_ROWS_STEP_CHARGE.get(backend, 0.0) if recursion else 0.0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a budgeted scan's gradient will run, and why (`memento.explain`).

    Attributes:
        request: the validated arguments.
        backend: the platform the plan was timed for (from the inputs' devices).
        num_steps: the loop's length.
        executor: ``"static"`` (nested ``lax.scan``s of static lengths), ``"rows"``
            (the schedule as rows of data) or ``"recursion"`` (HSM's binomial recursion).
        policy: the schedule's: ``"hsm"``, ``"ism"``, ``"msm"``, or ``"nest"`` (the
            static executor's nested segments; ``"store all"`` when it stores every step).
        slots: carry-sized slots the plan may fill (the initial carry's included).
        evaluations: forward evaluations of the step per gradient, the first sweep's
            included (the paper's cost; ``num_steps`` is ``lax.scan``'s).
        loop_iterations: iterations of the executor's loops per gradient.
        program_bytes: the gradient's predicted memory beyond its inputs and outputs:
            stored states, whatever encodes the schedule, and the backward pass's working
            set, as the planner counts them to fit a byte budget.
        seconds: predicted seconds of one gradient by the time model (coarse: it orders
            plans, it does not time them).
        why: one line on why this executor was chosen.
        make_schedule: writes ``schedule``.
    """

    request: Request
    backend: str
    num_steps: int
    executor: Literal["static", "rows", "recursion"]
    policy: str
    slots: int
    evaluations: float
    loop_iterations: float
    program_bytes: int
    seconds: float
    why: str
    make_schedule: Callable[[], Schedule] = dataclasses.field(
        repr=False, compare=False, kw_only=True
    )

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The plan as schedule rows, which `simulate` replays; written when first read
        (a static plan's rows at 10^6 steps take seconds to write)."""
        return self.make_schedule()

    @property
    def recomputation(self) -> float:
        """Evaluations beyond ``lax.scan``'s, as a share of them (0.33 is 33% more)."""
        return self.evaluations / self.num_steps - 1

    def __str__(self) -> str:
        budget = self.request.memory
        given = (
            f"{budget.num_bytes:,} bytes"
            if isinstance(budget, Bytes)
            else f"{budget.percent:g}% of storing every step"
            if isinstance(budget, Percent)
            else _count(int(budget or 0), "slot")
        )
        return (
            f"{self.request.name}: {_count(self.num_steps, 'step')} in {given} on "
            f"{self.backend}: executor={self.executor!r}, policy={self.policy!r}, "
            f"{_count(self.slots, 'slot')}; "
            f"{self.evaluations:,.0f} evaluations ({self.recomputation:+.0%} of lax.scan's), "
            f"{self.loop_iterations:,.0f} loop iterations, about {self.program_bytes:,} "
            f"bytes, about {_seconds(self.seconds)} per gradient. {self.why}"
        )


def _count(n: int, unit: str) -> str:
    return f"{n:,} {unit}" + ("" if n == 1 else "s")


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
