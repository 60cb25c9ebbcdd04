"""`memento.chain`: the gradient of a composition of different layers under a memory budget.

A chain ``x_{p+1} = fns[p](x_p)``, ``p = 0..n-1``, is the heterogeneous loop of Gruslys et
al. (2016), appendix C: its steps ("layers") differ in cost, in the size of their hidden
state ``x_p`` (the paper's ``s``) and in the size of their internal state (the residuals
of their VJP, ``i``). `memento.planning.plan_chain` finds the schedule with the least
weighted forward cost that fits a budget, choosing at each push between a hidden state,
an internal state or nothing (MSM's choices); this module measures the chain and runs
that schedule.

Measuring (once per trace of the gradient, from the inputs it differentiates):

- cost ``u_p``: the floating-point operations XLA counts for layer p
  (``jax.jit(...).lower(...).cost_analysis()["flops"]``, 1 where XLA reports none),
  quantised to integers with the most expensive layer at 1000 units;
- hidden size ``s_p``: bytes of ``x_p``;
- internal size ``i_p``: bytes of ``x_p`` and ``x_{p+1}`` plus the residuals of
  ``jax.vjp`` of layer p that are neither (the leaves of the pullback it returns,
  each buffer counted once, closed-over parameters excluded: they are held anyway);
- all three sizes are quantised into units of ``unit_bytes`` (rounded up, the budget
  rounded down, so the plan never exceeds the budget in bytes) with the budget at most
  about 1000 units (`memento.planning.internals.plan_chain_bytes`): the table has ``n^2 E / 2`` entries.

Execution. Each layer is closure-converted (`_body.make_body`: parameters it closes
over, Equinox module fields, ``functools.partial`` arguments, and tracers of enclosing
transformations become explicit inputs that receive cotangents). The chain is a
``jax.custom_vjp`` function of (parameters, x). Its forward rule runs the schedule's first
sweep (ADVANCE, SAVE_HIDDEN, SAVE_INTERNAL rows, and the forward half of the final
BACKWARD_FUSED), and returns what the sweep stored as residuals. Its backward rule replays
the remaining rows in Python, at trace time (both rules follow `memento.planning.walk`,
the row walk `memento.planning.simulate` checks schedules with), so the program is
*unrolled*: every
evaluation the plan makes is one copy of the layer in the program, and compile time grows
with the number of layers and with the plan's cost (unlike `memento.scan`, whose program
does not grow with its length; use `scan_layers` for long stacks of identical layers).
A loaded state passes through ``lax.optimization_barrier`` together with the current
cotangent, and each of its leaves through ``select(c == c | c != c, leaf, 0)`` for one
element ``c`` of that cotangent: a predicate true for every ``c`` (NaN included) that no
compiler folds, so every value (-0.0, NaN, inf, integers, booleans) and every cotangent
passes through bit for bit. XLA:CPU expands optimization barriers before its last CSE
pass, so a barrier alone does not stop it from merging the recomputations from one state
into one; the tie does, on every backend, and it also keeps a recomputation after the
backward steps that precede it. So the compiled program evaluates every layer as often
as the plan says, in the plan's order (tested by counting instructions in the compiled
program).

Transformations: ``jit``, ``grad``/``vjp``, ``vmap`` (the plan is made for one batch
member and shared), and forward mode and derivatives of any order through `_linear`: the
chain's tangent map is the composition's JVP, its transpose the replayed schedule, and a
second derivative the chain of the layers' JVPs, planned within the same budget.

Limitations:

- the program is unrolled (above); planning is a Python loop over ``n^2 / 2`` subproblems,
  about a second for a hundred layers, so chains of a few hundred layers at most;
- the plan bounds the states the program keeps alive; XLA adds the working memory of the
  layers being evaluated (the paper's "working state", not charged) and schedules buffers
  its own way, so the compiled program's memory follows the budget without equalling it;
- a uniform stack (every layer the same computation on parameters of the same shapes)
  is not turned into a `memento.scan` automatically: scanning needs the parameters
  stacked, and stacking per-layer parameters inside the gradient copies them and their
  cotangents. Hold such parameters stacked and call `scan_layers`, whose program does not grow with the
  depth.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from ..planning import Op, Schedule, walk
from ..planning.internals import INITIAL, ChainPlan, ChainPolicy, check_layers, plan_layers
from ._body import Body, ResidualSpec, make_body, nbytes, no_tangent_if_int, of_floats, to_floats
from ._budget import Bytes, Percent
from ._linear import Loop, differentiable

__all__ = ["ChainPlan", "chain", "chain_plan", "scan_layers"]

_NAME = "memento.chain"


# -- tracing and measuring --------------------------------------------------------------


def _layers(fns: Sequence[Callable], x) -> list[Body]:
    """Each layer traced once on its input's abstract value, as a `Body` with no carry.

    A layer is a loop body ``(carry, x) -> (carry, y)`` whose carry is empty: its input is
    the body's ``x`` and its output the body's ``y``, so `Body`'s closure conversion,
    residual probe and perturbation masks serve chains unchanged.
    """
    bodies = []
    example = x
    for p, f in enumerate(fns):
        try:
            b = make_body(lambda c, h, f=f: (c, f(h)), (), example, name=_NAME)
        except TypeError as e:
            raise TypeError(f"{_NAME}: fns[{p}] failed on its input: {e}") from e
        bodies.append(b)
        example = jax.tree_util.tree_unflatten(b.y_tree, list(b.y_avals))
    return bodies


def _avals(leaves) -> list:
    return [l if isinstance(l, jax.ShapeDtypeStruct) else jax.typeof(l) for l in leaves]


def _flops(b: Body) -> float:
    """XLA's flop count of one evaluation of a layer; 1 where it gives none."""

    def primal(consts, x):
        return b(consts, [], x)[1]

    try:
        analysis = jax.jit(primal).lower(_avals(b.consts), list(b.x_avals)).cost_analysis()
    except Exception:  # a backend without cost analysis: unit costs
        return 1.0
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops", 0.0)
    return max(1.0, float(flops or 0.0))


def _sizes(
    bodies: Sequence[Body], specs: Sequence[ResidualSpec]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """The planner's sizes: each layer's input, and its internal state (input, output,
    and the residuals `_Replay` stores besides them, as `ResidualSpec` counts them)."""
    hidden = [nbytes(b.x_avals) for b in bodies] + [nbytes(bodies[-1].y_avals)]
    internal = [
        hidden[p] + hidden[p + 1] + nbytes([a for a, o in zip(s.stored, s.outputs) if not o])
        for p, s in enumerate(specs)
    ]  # includes input and output, as plan_chain requires
    return tuple(hidden), tuple(internal), tuple(_flops(b) for b in bodies)


def _plan(
    bodies: Sequence[Body],
    specs: Sequence[ResidualSpec],
    budget: int | Bytes | Percent,
    policy: ChainPolicy,
) -> ChainPlan:
    hidden, internal, flops = _sizes(bodies, specs)
    return plan_layers(flops, hidden, internal, budget, policy, name=_NAME)


def chain_plan(
    fns: Sequence[Callable], x: Any, *, memory: int | str | Bytes, policy: ChainPolicy = "auto"
) -> ChainPlan:
    """The plan `memento.chain` runs for these arguments, every float input differentiated.

    For inspecting a plan (its cost, peak and evaluations per layer) without running it;
    `memento.chain` plans again when its gradient is traced, for the inputs actually
    differentiated (it stores fewer residuals when parameters are not).

    Raises:
        ValueError, TypeError: as `memento.chain`.
    """
    fns, budget = _check(fns, memory, policy)
    if budget is None:
        raise TypeError(f"{_NAME}: chain_plan needs a memory budget, got None.")
    bodies = _layers(fns, x)
    return _plan(bodies, [b.residual_spec() for b in bodies], budget, policy)


def _check(fns, memory, policy) -> tuple[list[Callable], int | Bytes | Percent | None]:
    return check_layers(fns, memory, policy, name=_NAME)


# -- execution ----------------------------------------------------------------------------


def _tie(state: list, ct: list) -> tuple[list, list]:
    """``state`` made to depend on the cotangent so far, bit for bit unchanged; and ``ct``.

    A recomputation from a loaded state must be neither merged with another from the
    same state (CSE) nor moved before the backward steps already done. An
    ``optimization_barrier`` on (state, cotangent) says so, but XLA:CPU expands barriers
    before its last CSE pass (``cse_barrier_expander``), which then merges the
    recomputations. So each leaf also passes through ``select(c == c | c != c, leaf, 0)``
    with ``c`` one element of the cotangent: the predicate is true for every value of
    ``c`` (NaN included) but no compiler folds it (a float compared with itself may be
    NaN), and a select returns its operand exactly, for every dtype and value (-0.0,
    NaN, integers, booleans), and passes the leaf's cotangent through unchanged.
    """
    floats = [l for l in ct if jnp.issubdtype(l.dtype, jnp.inexact) and l.size]
    if not state or not floats:  # nothing to tie to: values are unchanged either way
        return list(state), list(ct)
    state, ct = lax.optimization_barrier((list(state), list(ct)))
    c = jnp.ravel(floats[0])[0]
    always = lax.bitwise_or(lax.eq(c, c), lax.ne(c, c))

    def tie(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):  # PRNG keys: no zeros
            return leaf
        return lax.select(jnp.broadcast_to(always, leaf.shape), leaf, jnp.zeros_like(leaf))

    return [tie(l) for l in state], list(ct)


class _Replay:
    """Runs a schedule's rows on traced values, as `memento.planning.walk` yields them.

    The walk checks each row against the rows before it (the working state's position,
    what each slot holds, the order of backward steps) and says which steps a row
    evaluates; this machine keeps the values: ``cur``, the working state's leaves;
    ``hidden``: slot -> leaves of ``x_pos``; ``internal``: slot -> (stored residuals,
    the input leaves the pullback reads, output leaves); ``working``: the residuals of
    the step a BACKWARD_FUSED ends the first sweep with, made in the forward pass.
    """

    def __init__(self, bodies, specs, consts, x0):
        self.bodies, self.specs, self.consts, self.x0 = bodies, specs, consts, x0
        self.cur = list(x0)
        self.hidden: dict[int, list] = {}
        self.internal: dict[int, tuple] = {}
        self.working: tuple | None = None
        self.ct: list = []
        self.ct_consts: list = [None] * len(bodies)

    def _save(self, p: int) -> tuple:
        """Runs layer p from the working state keeping its residuals; returns the slot."""
        b, spec = self.bodies[p], self.specs[p]
        _, y, stored = b.save(spec, self.consts[p], [], self.cur)
        needed = spec.x_read
        x = [l if j in needed else None for j, l in enumerate(self.cur)]
        self.cur = y
        return stored, x, y

    def _backward(self, p: int, slot: tuple) -> None:
        b, spec = self.bodies[p], self.specs[p]
        stored, x, _ = slot
        pullback = b.restore(spec, stored, self.consts[p], x)
        ct_k, _, ct_x = pullback(([], self.ct))
        self.ct_consts[p] = ct_k
        self.ct = list(ct_x)

    def run(self, schedule: Schedule, *, sweep: bool) -> None:
        """Runs the first sweep (``sweep``, in the forward pass: it stops after the
        forward half of the backward row that ends it, whose residuals a BACKWARD_FUSED
        keeps in ``working``), or the rows from that backward row on (``ct`` holds the
        output's cotangent)."""
        for row in walk(schedule):
            op, arg, pos = row.op, row.arg, row.pos
            backward = op in (Op.BACKWARD_FUSED, Op.BACKWARD_INTERNAL)
            if sweep and backward:
                if op == Op.BACKWARD_FUSED:
                    self.working = self._save(pos)
                return
            if row.sweep and not sweep and not backward:
                continue  # run in the forward pass
            if op == Op.ADVANCE:
                for q in row.steps:
                    self.cur = self.bodies[q](self.consts[q], [], self.cur)[1]
            elif op == Op.SAVE_HIDDEN:
                self.hidden[arg] = list(self.cur)
            elif op == Op.SAVE_INTERNAL:
                self.internal[arg] = self._save(pos)
            elif op == Op.LOAD_HIDDEN:
                state = self.x0 if arg == INITIAL else self.hidden[arg]
                self.cur, self.ct = _tie(state, self.ct)
            elif op == Op.LOAD_INTERNAL:
                self.cur, self.ct = _tie(self.internal[arg][2], self.ct)
            elif op == Op.BACKWARD_INTERNAL:
                self._backward(pos, self.internal[arg])
            elif op == Op.BACKWARD_FUSED:
                if self.working is None:
                    self.working = self._save(pos)
                self._backward(pos, self.working)
                self.working, self.cur = None, []
            elif op == Op.FREE_HIDDEN:
                del self.hidden[arg]
            elif op == Op.FREE_INTERNAL:
                del self.internal[arg]


@dataclasses.dataclass(frozen=True, eq=False)
class _ChainLoop(Loop):
    """The chain as `_linear` differentiates it: flat arguments (every layer's parameters,
    then x's leaves), outputs the last layer's. ``again`` is `chain` with this chain's
    memory and policy, for the chain of the layers' JVPs."""

    bodies: tuple[Body, ...]
    budget: Any
    policy: ChainPolicy
    again: Callable

    def _parts(self, leaves) -> tuple[list[list], list]:
        consts, start = [], 0
        for b in self.bodies:
            consts.append(list(leaves[start : start + len(b.consts)]))
            start += len(b.consts)
        return consts, list(leaves[start:])

    def _restricted(self, perturbed) -> list[Body]:
        # Only what is perturbed, or depends on it, is differentiated, so the residuals
        # measured and stored are those of the inputs differentiated.
        consts, x = self._parts(perturbed)
        restricted = []
        for b, k in zip(self.bodies, consts):
            b = b.restrict(k, [], x)
            restricted.append(b)
            x = list(b.y_mask)
        return restricted

    def primal(self, args):
        consts, x = self._parts(args)
        for b, k in zip(self.bodies, consts):
            x = b(k, [], x)[1]
        return x

    def prepare(self, perturbed):
        restricted = self._restricted(perturbed)
        specs = [b.residual_spec() for b in restricted]
        return restricted, specs, _plan(restricted, specs, self.budget, self.policy).schedule

    def forward(self, plan, args):
        restricted, specs, schedule = plan
        m = _Replay(restricted, specs, *self._parts(args))
        m.run(schedule, sweep=True)
        return m.cur, (m.hidden, m.internal, m.working)

    def backward(self, plan, args, cache, cts):
        restricted, specs, schedule = plan
        m = _Replay(restricted, specs, *self._parts(args))
        m.hidden, m.internal, m.working = dict(cache[0]), dict(cache[1]), cache[2]
        last = restricted[-1]
        m.ct = of_floats(last.y_avals, last.y_mask, cts)
        m.run(schedule, sweep=False)
        return [c for ct in m.ct_consts for c in (ct or [])] + list(m.ct)

    def tangent_loop(self, args, tangents, mask):
        consts, x = self._parts(args)
        restricted = self._restricted(mask)
        k_mask, x_mask = self._parts(mask)
        tangents = iter(tangents)
        tk = [[next(tangents) for m in km if m] for km in k_mask]
        tx = [next(tangents) for m in x_mask if m]

        def layer(b: Body, k, t):
            def f(state):
                h, th = state
                _, _, y, ty = b.jvp(k, [], h, t, [], th)
                return y, ty

            return f

        fns = [layer(b, k, t) for b, k, t in zip(restricted, consts, tk)]
        y, ty = self.again(fns, (x, tx))
        last = restricted[-1]
        touts = to_floats(y, last.y_avals, last.y_mask, ty)
        return y, touts


def chain(
    fns: Sequence[Callable],
    x: Any,
    *,
    memory: int | str | Bytes | None,
    policy: ChainPolicy = "auto",
) -> Any:
    """Applies the layers ``fns`` in turn to ``x``; its gradient fits a memory budget.

    The value is ``functools.reduce(lambda x, f: f(x), fns, x)``, and so is the gradient
    (with respect to ``x`` and to every array the layers close over or are bound to:
    Equinox modules, ``functools.partial`` arguments, closures). The backward pass keeps
    only what ``memory`` allows and recomputes the rest, following the schedule with the
    fewest forward flops for that budget (Gruslys et al. 2016, appendix C, with MSM's
    choice per stored state: a layer's input, its whole internal state, or nothing).

    Pick it over ``jax.checkpoint`` per layer or sqrt(n) segments when layers differ in
    cost and size (strided CNNs, U-Nets, mixed-width transformers): the plan stores the
    small states and the cheap-to-store residuals, and recomputes the cheap layers.

    Args:
        fns: a non-empty sequence of callables, ``fns[p]: x_p -> x_{p+1}``. Shapes, dtypes
            and pytree structures may change from layer to layer.
        x: the input ``x_0``, a pytree of arrays.
        memory: what the backward pass may keep, the input ``x_0`` included. ``None``:
            everything (plain composition). An integer (``int`` or NumPy): slots, each
            the size of the largest state the plan may store (the largest of
            ``x_0 .. x_{n-1}``, in bytes); one slot always suffices. A budget above what
            storing everything takes runs the store-everything plan (no larger). A string such as ``"5MiB"`` or
            ``memento.bytes_budget(n)``: bytes, at least the size of ``x_0``. A
            percentage such as ``"5%"``: that share of the bytes of every layer's internal
            state (input, output and residuals), summed; ``"100%"`` stores everything. Under
            ``vmap`` sizes are those of one batch member.
        policy: ``"auto"`` or ``"msm"`` (the same: store inputs of layers or their
            internal states, whichever is cheaper), or ``"hsm"`` (inputs of layers
            only, as ``jax.checkpoint`` does).

    Returns:
        ``x_n``, as the composition gives it.

    Raises:
        ValueError: empty ``fns``; a byte budget below the size of ``x_0`` (the message
            names the minimum); an unknown policy; a chain so long that planning it would
            take minutes.
        TypeError: ``fns`` not a sequence of callables; a bad ``memory``; a layer that
            fails on its input.

    Transformations: ``jit``, ``grad``/``vjp``, ``jvp``/``jacfwd``/``linearize``,
    ``vmap``, and derivatives of any order in any mode (``jax.hessian``,
    ``jax.grad(jax.grad(f))``): each derivative beyond the first runs the chain of the
    layers' JVPs within the same ``memory``.

    Measurement and planning happen when the gradient is traced (see the module
    docstring): a layer's cost is XLA's flop count, its sizes are measured from its VJP.
    The program is unrolled over the layers, as the plan evaluates them: compile time
    grows with the number of layers and with the plan's recomputation. Chains of up to a
    few hundred layers plan in about a second; for long stacks of identical layers use
    `memento.loops.scan_layers`, whose program does not grow with the depth.

    Example:
        >>> y = memento.chain([conv1, pool, conv2, head], images, memory="64MiB")  # doctest: +SKIP
    """
    fns, budget = _check(fns, memory, policy)
    if budget is None:
        return functools.reduce(lambda h, f: f(h), fns, x)
    bodies = _layers(fns, x)
    x_leaves = [jnp.asarray(l) for l in jax.tree_util.tree_leaves(x)]
    again = functools.partial(chain, memory=memory)  # the policy predicted best for it
    loop = _ChainLoop(tuple(bodies), budget, policy, again)
    out = no_tangent_if_int(differentiable(loop)(*(k for b in bodies for k in b.consts), *x_leaves))
    return jax.tree_util.tree_unflatten(bodies[-1].y_tree, out)


def scan_layers(
    layer: Callable,
    stacked_params: Any,
    x: Any,
    *,
    memory: int | str | Bytes | None,
    policy: Literal["auto", "hsm", "ism", "msm"] = "auto",
) -> Any:
    """Applies ``layer(params_p, x)`` for each slice ``params_p`` of ``stacked_params``.

    For deep stacks of identical layers (a transformer's blocks): `memento.scan` over the
    stacked parameters, so the program does not grow with the depth and the gradient
    follows the optimal schedule for ``memory`` carry-sized slots (or bytes). As a Python
    loop ``for p in range(n): x = layer(params[p], x)``, and as Flax's ``remat_scan``
    without choosing the nesting by hand.

    Args:
        layer: ``(params, x) -> x``, keeping ``x``'s structure, shapes and dtypes.
        stacked_params: a pytree whose leaves have a leading axis of length n (layers).
        x: the input, a pytree of arrays.
        memory, policy: as `memento.scan`.

    Returns:
        The output of the last layer.

    Raises:
        ValueError, TypeError: as `memento.scan`, whose name the messages carry.
    """
    if not callable(layer):
        raise TypeError(
            f"memento.loops.scan_layers: layer must be callable, got {type(layer).__name__}."
        )
    from ._scan import scan

    def step(h, params):
        return layer(params, h), None

    out, _ = scan(step, x, stacked_params, memory=memory, policy=policy)
    return out
