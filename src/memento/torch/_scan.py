"""`memento.torch.scan`: a recurrent loop whose PyTorch gradient follows an optimal
checkpointing schedule (Gruslys et al. 2016) under a memory budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..planning import Bytes, Charges, Policy, Schedule
from ..planning.internals import (
    Percent,
    choose_schedule,
    internal_slots,
    read_request,
    to_slots,
)
from . import _tree
from ._machine import Machine, Record, Steps, check_x, make_function
from ._probe import Closure, Outside, Storages, is_float, nbytes, refuse_functorch
from ._replay import Context, Snapshots, rng_moved, rng_state, set_rng_state

_NAME = "memento.torch.scan"


class _Loop(Steps):
    """The loop ``h, y = step(h, x)`` as the machine sees it (see `Steps`).

    While ``watching`` (the first sweep), every step runs under a `Closure` that finds
    the tensors it uses from outside: parameters first used after step 0 are added to
    ``params``; ``read`` and ``mutated`` gather every outside tensor read and modified.
    """

    def __init__(self, step, h_tree, x_leaves, x_tree, num_steps):
        self.step, self.h_tree, self.x_tree = step, h_tree, x_tree
        self.x_leaves, self.num_steps = x_leaves, num_steps
        self._xs = [x.detach() for x in x_leaves]  # xs[p] is then a view with no graph
        self._x_needs = [x.requires_grad and is_float(x) for x in x_leaves]
        self.params: list[torch.Tensor] = []
        self.read: dict[int, torch.Tensor] = {}
        self.mutated: dict[int, torch.Tensor] = {}
        self.copy = False  # the step modifies its carry in place
        self.needs_grad = False  # the step calls torch.autograd.grad itself
        self.watching = False
        self.outside = Outside()
        self.ys: list[torch.Tensor] = []
        self.y_tree: _tree.TreeDef = ("none",)
        self.ct_ys: list = []

    def found(self, closure: Closure, inputs: list[torch.Tensor]) -> None:
        """Adds what ``closure`` saw a step (on ``inputs``) use from outside."""
        known = {id(t) for t in self.params}
        new = [t for t in closure.tensors if is_float(t) and id(t) not in known]
        self.params += self.outside.filter(new, inputs)
        self.read.update((id(t), t) for t in closure.read)
        self.mutated.update((id(t), t) for t in closure.mutated)

    def call(self, p, h, x):
        h_tree, x_tree = _tree.unflatten(self.h_tree, h), _tree.unflatten(self.x_tree, x)
        if self.watching:
            closure = Closure([*h, *x])
            with closure:
                carry, y = _call(self.step, h_tree, x_tree)
            self.found(closure, [*h, *x])
        else:
            carry, y = _call(self.step, h_tree, x_tree)
        # The structure was checked on step 0 (`_probe`); leaves are all that is read.
        return _tree.leaves(carry, name=_NAME, what="the carry"), (
            [] if y is None else _tree.leaves(y, name=_NAME, what="y")
        )

    def copies(self, p):
        return self.copy

    def grad_mode(self, p):
        return self.needs_grad

    def x(self, p):
        return [x[p] for x in self._xs]

    def x_needs(self):
        return self._x_needs

    def emit(self, p, y):
        for buf, leaf in zip(self.ys, y):
            buf[p].copy_(leaf)

    def y_cotangent(self, p):
        return [None if c is None else c[p] for c in self.ct_ys]


def _call(step: Callable, h: Any, x: Any) -> tuple[Any, Any]:
    out = step(h, x)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"{_NAME}: step must return a pair (carry, y), got {type(out).__name__}; return "
            "(h, None) when there is no per-step output"
        )
    return out


def _steps(x_leaves: list[torch.Tensor], length: int | None) -> int:
    lengths = set()
    for x in x_leaves:
        if x.dim() == 0:
            raise ValueError(
                f"{_NAME}: every leaf of xs needs a leading axis to loop over; got a scalar"
            )
        lengths.add(int(x.shape[0]))
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"{_NAME}: length must be an int >= 0, got {length!r}")
        lengths.add(length)
    if len(lengths) > 1:
        raise ValueError(
            f"{_NAME}: the leaves of xs (and length) disagree on the number of steps: "
            f"{sorted(lengths)}"
        )
    if not lengths:
        raise ValueError(f"{_NAME}: pass xs with a leading axis, or length= when xs is None")
    return lengths.pop()


def _check_carry(h0: list[torch.Tensor], h0_tree, carry, carry_tree) -> None:
    if carry_tree != h0_tree:
        raise TypeError(
            f"{_NAME}: step returned a carry of another structure than h0: {carry_tree} "
            f"instead of {h0_tree}; the carry must keep its structure, shapes and dtypes"
        )
    for i, (a, b) in enumerate(zip(_tree.describe(h0), _tree.describe(carry))):
        if a != b:
            raise TypeError(
                f"{_NAME}: step changed carry leaf {i} from shape {a[0]} {a[1]} to "
                f"{b[0]} {b[1]}; the carry must keep its shapes and dtypes"
            )


def _plain(step, h0, xs, x_leaves, x_tree, num_steps, *, start=None):
    """The loop as written (after ``start``: step 0's carry and y, when given)."""
    h = h0
    ys: list = []
    first = 0
    if start is not None:
        h, y0 = start
        ys.append(y0)
        first = 1
    for p in range(first, num_steps):
        h, y = _call(step, h, _tree.unflatten(x_tree, [x[p] for x in x_leaves]))
        ys.append(y)
    y_leaves = [_tree.flatten(y, name=_NAME, what="y") for y in ys]
    stacked = [torch.stack(leaves) for leaves in zip(*(l for l, _ in y_leaves))]
    return h, _tree.unflatten(y_leaves[0][1], stacked) if y_leaves else None


def _prepare(step, h0, xs, memory, policy, length, *, name: str = _NAME):
    """Reads the arguments, runs step 0 as the probe, measures and plans."""
    request = read_request(name, "torch", memory=memory, policy=policy)
    budget, policy = request.memory, request.policy
    if not callable(step):
        raise TypeError(f"{name}: step must be callable, got {type(step).__name__}")
    h_leaves, h_tree = _tree.flatten(h0, name=name, what="h0")
    x_leaves, x_tree = _tree.flatten(xs, name=name, what="xs")
    refuse_functorch(name, [*h_leaves, *x_leaves])
    num_steps = _steps(x_leaves, length)
    loop = _Loop(step, h_tree, x_leaves, x_tree, num_steps)
    return loop, h_leaves, h_tree, budget, policy, num_steps


class _Probe(NamedTuple):
    rec0: Record
    schedule: Schedule | None
    context: Context
    rng_before: Any


def _probe(
    loop: _Loop, h_leaves, h_tree, budget: int | Bytes | Percent, policy: Policy, *, name: str
):
    """Step 0 with grad: the tensors it uses from outside, whether it modifies its carry,
    draws random numbers or modifies buffers, alpha, and the schedule.

    The probe is step 0's evaluation in the first sweep (`Machine.pre`): the schedule's
    evaluations are all the loop makes. It runs on copies of the carry, so that a step
    modifying its carry in place is seen doing so (and then always given copies).
    """
    x0 = loop.x(0)
    x_in = [x.requires_grad_() if n else x for x, n in zip(x0, loop.x_needs())]
    h_in = [h.detach().requires_grad_() if is_float(h) else h.detach() for h in h_leaves]
    with torch.enable_grad():
        h_call = [h.clone() for h in h_in]
    h_versions = [h._version for h in h_call]
    x_versions = [x._version for x in x_in]
    closure, snapshots = Closure([*h_in, *h_call, *x_in]), Snapshots()
    rng_before = rng_state()
    with torch.enable_grad(), snapshots, closure:
        carry, y = _call(
            loop.step, _tree.unflatten(h_tree, h_call), _tree.unflatten(loop.x_tree, x_in)
        )
    check_x(name, 0, x_in, x_versions)
    loop.copy = any(h._version != v for h, v in zip(h_call, h_versions))
    loop.needs_grad = closure.calls_grad
    carry_leaves, carry_tree = _tree.flatten(carry, name=name, what="the carry")
    y_leaves, loop.y_tree = _tree.flatten(y, name=name, what="y")
    _check_carry(h_leaves, h_tree, carry_leaves, carry_tree)
    rec0 = Record(0, h_in, x_in, carry_leaves, y_leaves)
    loop.found(closure, [*h_in, *h_call, *x_in])
    rng = rng_moved(rng_before, rng_state())
    # What step 0 modified in place besides its inputs, by the operations' schemas
    # (BatchNorm's kernel writes its running statistics without a version bump).
    ours = {id(t) for t in (*h_in, *h_call, *x_in)}
    state = [t for t, _ in snapshots.saved.values() if id(t) not in ours]
    old = [v for t, v in snapshots.saved.values() if id(t) not in ours]
    context = Context(rng=rng, state=state, start=(rng_before if rng else None, old))
    carry_bytes = nbytes(h_leaves)
    # The internal state: what a `Record` holds, i.e. what autograd saved, the input carry
    # and y (the parameters and xs excluded: they are held anyway), plus the output carry.
    # The copies of the carry stand for it unless the step modifies them.
    saved = Storages()
    saved.add([*h_in, *y_leaves])
    saved.add_graph([*carry_leaves, *y_leaves], loop.params)
    copies = [] if loop.copy else h_call
    residual = saved.bytes_except(loop.params, loop.x_leaves, carry_leaves, copies)
    alpha = internal_slots(residual, carry_bytes)
    schedule = None
    if budget is not None and loop.num_steps > 0:
        slots = to_slots(budget, carry_bytes, name=name, need=loop.num_steps * alpha)
        # Above storing every internal state (and h_0) nothing is gained: cap the budget.
        slots = min(slots, loop.num_steps * alpha + 1)
        # A stored internal state is the step's own autograd graph, kept, not copied:
        # "auto" charges it nothing beyond its slots (JAX's pools charge a fraction).
        schedule = choose_schedule(
            loop.num_steps, slots, alpha, policy, name=name, charges=Charges(internal=0.0)
        )
    return _Probe(rec0, schedule, context, rng_before), snapshots


def _check_sweep(loop: _Loop, probe: _Probe, *, name: str) -> None:
    """Raises if a step after step 0 drew random numbers or modified a tensor from
    outside when step 0 did not: their values at the stored states were not kept."""
    context = probe.context
    if not context.rng and rng_moved(probe.rng_before, rng_state()):
        raise NotImplementedError(
            f"{name}: a step after step 0 drew random numbers, and step 0 did not; the "
            "random number generator's state is kept for recomputation only when step 0 "
            "draws. Draw at every step (e.g. dropout at every step), or pass the random "
            "numbers in xs."
        )
    state = {id(t) for t in context.state}
    late = [t for i, t in loop.mutated.items() if i not in state]
    if late:
        t = late[0]
        raise NotImplementedError(
            f"{name}: a step after step 0 modified a tensor from outside in place (a "
            f"{t.dtype} tensor of shape {tuple(t.shape)}) that step 0 did not modify; its "
            "values are kept for recomputation only when step 0 modifies it. Modify it at "
            "every step, or carry it in the loop's state."
        )


_Run = make_function(_NAME)


@torch.compiler.disable  # dynamo cannot trace the walker: a graph break, run eagerly
def scan(
    step: Callable[[Any, Any], tuple[Any, Any]],
    h0: Any,
    xs: Any = None,
    *,
    memory: int | str | Bytes | None = None,
    policy: Policy = "auto",
    length: int | None = None,
) -> tuple[Any, Any]:
    """The loop ``h, y = step(h, x)`` over the first axis of ``xs``; its gradient fits
    ``memory``, with the fewest recomputations.

    The value is that of the plain loop::

        ys = []
        for x in xs:            # xs[p] for each leaf of xs
            h, y = step(h, x)
            ys.append(y)
        return h, torch.stack(ys)   # leaf by leaf

    and so is the gradient, to ``h0``, to ``xs`` and to every tensor ``step`` uses that
    requires grad (``nn.Module`` parameters, closed-over tensors, leaf or not), as
    ``torch.utils.checkpoint(..., use_reentrant=False)`` delivers them. The backward pass
    keeps only what ``memory`` allows and recomputes the rest, following the schedule of
    `memento.plan` (Gruslys et al. 2016): HSM stores carries, ISM keeps whole steps'
    autograd graphs (their saved tensors, the "internal state"), MSM mixes both, and
    ``"auto"`` picks the one of least predicted work. The step is evaluated
    ``schedule.cost`` times in all (`scan_schedule`), the forward pass included.

    Args:
        step: ``(h, x) -> (h, y)``: ``h`` keeps its structure, shapes and dtypes; ``y`` a
            tensor, a nested tuple/list/dict of tensors, or ``None``.
        h0: the initial carry: a tensor or nested tuples, lists, dicts of tensors.
        xs: the per-step inputs, leaves with a leading axis of the number of steps, or
            ``None`` with ``length``.
        memory: what the backward pass may keep, ``h0`` included. ``None`` (the
            default, as `memento.scan`): the plain loop, autograd storing everything. An
            ``int``: slots of one carry (the paper's m; 1 recomputes from ``h0`` for
            every step). A string such as ``"16MiB"`` or ``memento.bytes_budget(n)``:
            bytes, turned into slots from the carry's size. A budget above what storing
            every step takes is capped there.
        policy: ``"auto"``, ``"hsm"``, ``"ism"`` or ``"msm"``, as `memento.plan`. The
            size of a step's internal state in carries (the paper's alpha) is measured
            on step 0: the bytes of the tensors its autograd graph saves (read from
            the graph's nodes; parameters and ``xs`` excluded), its input carry and
            ``y``, plus the output carry.
        length: the number of steps when ``xs`` is ``None``.

    Returns:
        ``(h_T, ys)``: the last carry and the ``y``'s stacked along a new first axis
        (``None`` when ``step`` returns ``y = None``).

    Raises:
        ValueError: a budget below one carry, ``policy="ism"`` below one internal state,
            an unknown policy, leaves of ``xs`` of different lengths.
        TypeError: a carry whose structure, shape or dtype changes; a leaf that is not a
            tensor; a bad ``memory``; a step that does not return a pair.
        NotImplementedError: under ``torch.func`` transforms (``grad``, ``vmap``, ...); a
            step that draws random numbers or modifies a tensor from outside only after
            step 0.
        RuntimeError: a step that modifies its ``x`` in place; (in backward) a parameter
            or input modified in place after the forward pass, as plain autograd raises.

    Where gradients go: the tensors ``step`` uses from outside are found at every step
    of the forward pass (a ``TorchFunctionMode`` sees every torch operation's
    arguments). Under ``torch.no_grad()``, ``torch.inference_mode()``, or when nothing
    requires grad, nothing is stored: the plain loop runs.

    Recomputation replays what the forward pass saw, as ``torch.utils.checkpoint`` does
    and more: the random number generators' states (dropout draws the same masks, and
    the caller's stream ends where the plain loop leaves it), the autocast settings, and
    the buffers a step modifies in place (BatchNorm's running statistics end as the
    plain loop leaves them). A step that modifies its carry in place (``h.mul_(0.5)``,
    ``t += 1``) is given copies of the stored states.

    Transformations: ``torch.autograd`` (``backward``, ``autograd.grad``,
    ``gradcheck``), first order: a second derivative through the loop
    (``create_graph=True`` then ``backward`` again) raises, as does a second
    ``backward`` of the same call. ``torch.compile`` of a function that calls it works:
    the call runs eagerly (a graph break; compile ``step`` for speed). ``torch.func``
    transforms raise a ``NotImplementedError``. Forward-mode AD is not supported.

    Example:
        >>> cell = torch.nn.LSTMCell(8, 16)  # doctest: +SKIP
        >>> (h, c), ys = memento.torch.scan(
        ...     lambda hc, x: (cell(x, hc), cell(x, hc)[0]), (h0, c0), xs, memory="1MiB")
    """
    loop, h_leaves, h_tree, budget, policy, num_steps = _prepare(
        step, h0, xs, memory, policy, length
    )
    if num_steps == 0:
        # The shape of ys: one evaluation on zeros, under no_grad, discarded (the RNG and
        # what it modifies in place are put back).
        x = [torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device) for x in loop.x_leaves]
        h = _tree.unflatten(h_tree, [h.detach().clone() for h in h_leaves])
        rng, snapshots = rng_state(), Snapshots()
        with torch.no_grad(), snapshots:
            _, y = _call(step, h, _tree.unflatten(loop.x_tree, x))
        snapshots.restore()
        set_rng_state(rng)
        y_leaves, y_tree = _tree.flatten(y, name=_NAME, what="y")
        empty = [torch.zeros((0, *y.shape), dtype=y.dtype, device=y.device) for y in y_leaves]
        return h0, _tree.unflatten(y_tree, empty)
    if budget is None or not torch.is_grad_enabled():  # autograd stores everything, or nothing
        return _plain(step, h0, xs, loop.x_leaves, loop.x_tree, num_steps)
    probe, _ = _probe(loop, h_leaves, h_tree, budget, policy, name=_NAME)
    rec0, schedule, context = probe.rec0, probe.schedule, probe.context
    assert schedule is not None
    wants = [t.requires_grad for t in (*h_leaves, *loop.x_leaves)] + [True] * len(loop.params)
    if not any(wants):  # nothing to differentiate: finish as a plain loop
        start = (
            _tree.unflatten(h_tree, rec0.out),
            _tree.unflatten(loop.y_tree, [y.detach() for y in rec0.y]),
        )
        return _plain(step, h0, xs, loop.x_leaves, loop.x_tree, num_steps, start=start)
    loop.ys = [torch.empty((num_steps, *y.shape), dtype=y.dtype, device=y.device) for y in rec0.y]
    machine = Machine(loop, h_leaves, schedule, context, _NAME)
    machine.pre = rec0
    loop.watching = True
    try:
        machine.sweep()
    finally:
        loop.watching = False
    _check_sweep(loop, probe, name=_NAME)
    context.watch_versions([loop.params, loop.read.values(), h_leaves, loop.x_leaves])
    n_h, n_x = len(h_leaves), len(loop.x_leaves)

    def outputs(m: Machine):
        return [*m.cur, *loop.ys]

    def grads(m: Machine, cts: list, needs: tuple):
        loop.ct_ys = cts[n_h:]
        m.backward(cts[:n_h], list(needs[n_h + n_x :]))
        ct_x: list = [None] * n_x
        for p, gs in m.ct_x:
            for j, g in gs.items():
                if g is None:
                    continue
                if ct_x[j] is None:
                    ct_x[j] = torch.zeros_like(loop.x_leaves[j])
                ct_x[j][p] = g
        ct_h = [
            None if not need else (g if g is not None else torch.zeros_like(h))
            for g, h, need in zip(m.ct, h_leaves, needs[:n_h])
        ]
        return [*ct_h, *ct_x, *m.ct_params]

    outs = _Run.apply(machine, outputs, grads, *h_leaves, *loop.x_leaves, *loop.params)
    h_t = _tree.unflatten(h_tree, list(outs[:n_h]))
    ys = _tree.unflatten(loop.y_tree, list(outs[n_h:]))
    return h_t, ys


def scan_schedule(
    step: Callable,
    h0: Any,
    xs: Any = None,
    *,
    memory: int | str | Bytes,
    policy: Policy = "auto",
    length: int | None = None,
) -> Schedule:
    """The schedule `scan` runs for these arguments (step 0 is evaluated once to measure).

    Its ``cost`` is the number of times `scan` evaluates ``step``, the forward pass
    included, when something requires grad; ``alpha`` is the measured size of a step's
    internal state in carries.

    Raises:
        ValueError: as `scan`; zero steps (there is nothing to plan).
    """
    name = "memento.torch.scan_schedule"
    if memory is None:
        raise ValueError(f"{name}: memory=None stores everything; pass a budget to plan for")
    loop, h_leaves, h_tree, budget, policy, num_steps = _prepare(
        step, h0, xs, memory, policy, length, name=name
    )
    if num_steps == 0:
        raise ValueError(f"{name}: xs has 0 steps; there is nothing to plan")
    assert budget is not None
    probe, snapshots = _probe(loop, h_leaves, h_tree, budget, policy, name=name)
    snapshots.restore()  # only measured: the buffers and the RNG are as they were
    set_rng_state(probe.rng_before)
    assert probe.schedule is not None
    return probe.schedule
