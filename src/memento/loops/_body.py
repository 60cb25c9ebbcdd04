"""The loop body as a pure function of flat leaves, with its residuals made explicit.

A user's body ``f(carry, x) -> (carry, y)`` may close over arrays (weights, tracers of an
enclosing ``jit`` or ``grad``). We trace it once with ``jax.make_jaxpr``: its closed-over
values become explicit ``consts``, which the executors pass around and differentiate like
``lax.scan`` does. Every later evaluation re-binds the same jaxpr, so the body is traced a
constant number of times whatever the number of steps.

Internal states (the paper's Definition 3) are the residuals of ``jax.vjp`` of one step:
the leaves of the pullback it returns. Residual leaves that *are* a const or the step's
``x`` are not stored (they are at hand in the backward pass), nor those computed from
the consts alone (computed again where the pullback is rebuilt, as ``lax.scan`` hoists
them out of its loop), nor those that cheap exact operations make from the others, the
consts and ``x`` (``1 - tanh(a)`` beside ``tanh(a)``, a mask of ``x``: computed again
too); the rest are, and their total size measures the paper's alpha.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core as jax_core, lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core

from ._pool import from_storage, nbytes as nbytes, varying

Leaves = list[Any]


def is_float(x) -> bool:
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    return jax.dtypes.issubdtype(dtype, np.inexact)


def platform(*trees) -> str:
    """The platform a loop over ``trees`` runs on, for the planner's time model: that of
    the first committed concrete array (or ``jax.ShapeDtypeStruct`` with a sharding)
    among them, else the default device's (``jax.default_device``), else JAX's default
    backend. Under ``jit`` the inputs are tracers, and the default device decides."""
    for leaf in jax.tree_util.tree_leaves(trees):
        concrete = isinstance(leaf, jax.Array) and not isinstance(leaf, jax_core.Tracer)
        if concrete and getattr(leaf, "committed", False):
            return next(iter(leaf.devices())).platform
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            return next(iter(leaf.sharding.device_set)).platform
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


def split(leaves: Sequence, mask: Sequence[bool]) -> tuple[Leaves, Leaves]:
    return [l for l, m in zip(leaves, mask) if m], [l for l, m in zip(leaves, mask) if not m]


def merge(yes: Sequence, no: Sequence, mask: Sequence[bool]) -> Leaves:
    yes_it, no_it = iter(yes), iter(no)
    return [next(yes_it) if m else next(no_it) for m in mask]


def of_floats(avals: Sequence, mask: Sequence[bool], values: Sequence) -> Leaves:
    """Of ``values``, one per float leaf of ``avals``, those of the leaves in ``mask``: the
    cotangents a differentiated loop takes, from those of every float output."""
    floats = [m for a, m in zip(avals, mask) if is_float(a)]
    return [v for v, m in zip(values, floats, strict=True) if m]


def to_floats(outs: Sequence, avals: Sequence, mask: Sequence[bool], values) -> Leaves:
    """One value per float leaf of ``outs``: the next of ``values`` for the leaves in
    ``mask``, zeros for the others (the tangents of every float output, from those a
    differentiated loop returns)."""
    values = iter(values)
    return [
        next(values) if m else jnp.zeros_like(o)
        for o, a, m in zip(outs, avals, mask)
        if is_float(a)
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualSpec:
    """Where each leaf of a step's pullback comes from.

    ``source[i]`` is ``("const", j)`` or ``("x", j)`` for leaves that are the j-th const or
    x leaf of the step, ``("captured", j)`` for ``captured[j]``, a concrete array the step
    holds itself (a value a nested ``custom_vjp`` or ``jax.checkpoint`` closed over when
    the body was traced: the same object in every step), ``("invariant", j)`` for the
    j-th output of ``invariant``, else ``("stored", j)``: the j-th stored residual.
    ``reads[i]``: whether the stored residuals depend on the i-th carry leaf (None: not
    known, as if all do). ``kept[i]``: whether the residuals of later steps do, through
    the carry (the least set of leaves that holds ``reads`` and every leaf the next
    values of its own leaves depend on): a run of steps again from a start needs those
    leaves only (None: not known, as if all do).

    ``forward`` is the probe's own trace, of ``(consts, carry, x)`` to ``(carry_out, y,
    stored)``: `Body.save` evaluates it rather than linearizing the step again, so every
    step stores exactly the residuals probed.

    ``invariant`` computes, from the consts ``invariant_consts`` picks, the residuals that
    depend on the consts alone (a weight transposed, cast or indexed): the same in every
    step, so they are computed again where a pullback is rebuilt instead of stored per
    step, as ``lax.scan`` hoists them out of its loop.

    ``derived`` computes, from ``(consts, x, stored)``, the residuals that cheap exact
    operations make from those (``1 - tanh(a)`` beside ``tanh(a)``, a mask of ``x``, a
    residual listed twice): ``("derived", j)`` is its j-th output. They are computed
    again where a pullback is rebuilt, not stored (None if there are none).
    """

    treedef: Any
    source: tuple[tuple[str, int], ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]
    forward: Any
    captured: tuple[Any, ...] = ()
    reads: tuple[bool, ...] | None = None
    kept: tuple[bool, ...] | None = None
    invariant: Any = None
    invariant_consts: tuple[bool, ...] = ()
    derived: Any = None
    derived_x: tuple[int, ...] = ()

    @property
    def x_read(self) -> frozenset[int]:
        """The leaves of ``x`` a pullback rebuilt by `Body.restore` reads: those it
        holds, and those ``derived`` computes from (``derived_x``)."""
        return frozenset(j for kind, j in self.source if kind == "x") | set(self.derived_x)

    @property
    def outputs(self) -> tuple[bool, ...]:
        """Whether each stored residual is one of the step's outputs (a carry or ``y``
        leaf) as it is: ``tanh``'s value, say, held once where the outputs are held."""
        outvars = self.forward.jaxpr.outvars
        head = len(outvars) - len(self.stored)
        made = {v for v in outvars[:head] if isinstance(v, jex_core.Var)}
        return tuple(v in made for v in outvars[head:])


class _Stored(NamedTuple):
    """A step's pullback leaves' ``source`` and its ``stored`` residuals, with the probe's
    trace (``traced``: to the carry, y, and then the stored residuals, from ``head`` on)
    and the trace of the stored residuals alone (``closed``)."""

    source: tuple
    stored: tuple
    traced: Any
    closed: Any
    head: int

    def without(self, dropped: Sequence[bool], kind: str) -> _Stored:
        """These with the stored residuals ``dropped`` picks computed elsewhere: the
        leaves read from them become ``(kind, j)``, ``j`` the how-manieth dropped one."""
        if not any(dropped):
            return self
        renumber = [(kind, sum(dropped[:j])) if d else ("stored", j - sum(dropped[:j]))
                    for j, d in enumerate(dropped)]  # fmt: skip
        source = tuple(renumber[j] if k == "stored" else (k, j) for k, j in self.source)
        stored = tuple(s for s, d in zip(self.stored, dropped) if not d)
        outvars = self.traced.jaxpr.outvars
        kept = [o for o, d in zip(outvars[self.head :], dropped) if not d]
        traced = self.traced.replace(
            jaxpr=self.traced.jaxpr.replace(outvars=outvars[: self.head] + kept)
        )
        closed = self.closed.replace(jaxpr=self.closed.jaxpr.replace(outvars=kept))
        return _Stored(source, stored, traced, closed, self.head)


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """``f`` closure-converted and flattened. See the module docstring.

    Attributes:
        consts: closed-over values, the differentiable "parameters" of the loop.
        carry_tree, x_tree, y_tree: pytree structures.
        carry_avals, x_avals, y_avals: flat ``ShapeDtypeStruct``s (x: one step's slice),
            weak types included.
        const_mask, carry_mask, x_mask, y_mask: the leaves a step's VJP differentiates:
            every float leaf, or after `restrict` only those that are perturbed.
    """

    jaxpr: Any
    consts: Leaves
    carry_tree: Any
    x_tree: Any
    y_tree: Any
    carry_avals: tuple[jax.ShapeDtypeStruct, ...]
    x_avals: tuple[jax.ShapeDtypeStruct, ...]
    y_avals: tuple[jax.ShapeDtypeStruct, ...]
    const_mask: tuple[bool, ...] = ()
    carry_mask: tuple[bool, ...] = ()
    x_mask: tuple[bool, ...] = ()
    y_mask: tuple[bool, ...] = ()

    def __post_init__(self):
        for name, leaves in (
            ("const_mask", self.consts),
            ("carry_mask", self.carry_avals),
            ("x_mask", self.x_avals),
            ("y_mask", self.y_avals),
        ):
            if not getattr(self, name):
                object.__setattr__(self, name, tuple(is_float(a) for a in leaves))

    def restrict(self, consts: Sequence[bool], init: Sequence[bool], xs: Sequence[bool]) -> Body:
        """The body differentiated only where it must be, given which float consts, initial
        carry leaves and xs leaves are perturbed (need a cotangent).

        A carry leaf is perturbed if its initial value is, or if a step makes it depend on
        a perturbed input: the fixed point of `_depends` over steps, as ``lax.scan``'s
        own JVP finds it. Leaves that are not perturbed are closed over, not
        differentiated, so a step may apply ops without a reverse rule to them.
        """
        k = [m and p for m, p in zip(self.const_mask, consts)]
        x = [m and p for m, p in zip(self.x_mask, xs)]
        c = [m and p for m, p in zip(self.carry_mask, init)]
        n = len(self.carry_avals)
        while True:
            out = _depends(self.jaxpr, k + c + x)
            new_c = [a or (m and b) for a, b, m in zip(c, out[:n], self.carry_mask)]
            if new_c == c:
                break
            c = new_c
        y = [m and b for m, b in zip(self.y_mask, out[n:])]
        return dataclasses.replace(
            self, const_mask=tuple(k), carry_mask=tuple(c), x_mask=tuple(x), y_mask=tuple(y)
        )

    def twins(self, num_y: int) -> tuple[Body, Body]:
        """This body, traced as two steps of the same carry and inputs that return
        ``(carry, (y, carry_2, y_2))`` (``num_y`` leaves of ``y``), as the two bodies
        ``(carry, y)`` and ``(carry_2, y_2)``: the same consts, each with only the
        equations of its own outputs."""
        if _dce_jaxpr is None:  # pragma: no cover - older or newer JAX
            raise NotImplementedError("twin bodies need JAX's dce_jaxpr, absent in this JAX.")
        n = len(self.carry_avals)
        outs = list(self.jaxpr.outvars)

        def part(outvars, y_avals):
            return dataclasses.replace(
                self,
                jaxpr=_live(self.jaxpr.replace(outvars=outvars)),
                y_tree=jax.tree_util.tree_structure([0] * len(y_avals)),
                y_avals=y_avals,
                y_mask=(),
            )

        return (
            part(outs[: n + num_y], self.y_avals[:num_y]),
            part(outs[n + num_y :], self.y_avals[num_y + n :]),
        )

    def readonly_carry(self) -> tuple[bool, ...]:
        """Which carry leaves a step returns unchanged (the body's output carry *is* its
        input, not a copy or a computed equal): ``lax.scan`` and ``lax.while_loop`` move
        them to the loop's constants, see `carry_to_consts`."""
        n = len(self.carry_avals)
        if any(hasattr(e, "input_index") for e in self.jaxpr.effects):
            return (False,) * n  # effects that point at inputs by position: leave as is
        return tuple(o is i for o, i in zip(self.jaxpr.outvars[:n], self.jaxpr.invars[:n]))

    def carry_to_consts(self, mask: Sequence[bool], values: Sequence) -> Body:
        """The body with the carry leaves ``mask`` picks (read-only ones, see
        `readonly_carry`) made consts bound to ``values``, appended after its own.

        A read-only carry leaf is then what ``lax.scan`` makes it: a loop constant, whose
        final value is the initial one (returned by the caller, not the loop: JAX then
        sees the output *is* the input, so ``vmap`` keeps an unbatched one unbatched and
        ``cond`` forwards it), whose cotangent is the final carry's plus what the steps
        give it as a const's, and which takes no room in the checkpoint slots.
        """
        if not any(mask):
            return self
        n = len(self.carry_avals)
        jaxpr = inputs_to_consts(self.jaxpr, [*mask, *[False] * len(self.x_avals)])
        keep = [*(not m for m in mask), *[True] * len(self.y_avals)]
        jaxpr = jaxpr.replace(outvars=[o for o, k in zip(self.jaxpr.outvars, keep) if k])
        avals = tuple(a for a, m in zip(self.carry_avals, mask) if not m)
        assert len(self.jaxpr.outvars) == n + len(self.y_avals)
        return Body(
            jaxpr=jaxpr,
            consts=[*self.consts, *values],
            carry_tree=jax.tree_util.tree_structure([0] * len(avals)),
            x_tree=self.x_tree,
            y_tree=self.y_tree,
            carry_avals=avals,
            x_avals=self.x_avals,
            y_avals=self.y_avals,
        )

    def cast_carry(self, leaves: Sequence) -> Leaves:
        """Initial carry leaves typed as `carry_avals` (see `make_body`)."""
        return [_as_aval(jnp.asarray(c), a) for c, a in zip(leaves, self.carry_avals)]

    # -- evaluation ---------------------------------------------------------------------
    def __call__(self, consts: Sequence, carry: Sequence, x: Sequence) -> tuple[Leaves, Leaves]:
        """One primal step on flat leaves: ``(carry, y)``, typed exactly as the avals
        (literal outputs become arrays; a weak type follows the input carry's)."""
        out = jax_core.eval_jaxpr(self.jaxpr, list(consts), *carry, *x)
        out = [_as_aval(o, a) for o, a in zip(out, self.carry_avals + self.y_avals)]
        n = len(self.carry_avals)
        return out[:n], out[n:]

    def _diff_fn(self, consts, carry, x) -> tuple[Callable, Leaves, Leaves, Leaves]:
        """The step as a function of its differentiated leaves, the others closed over."""
        kf, ki = split(consts, self.const_mask)
        cf, ci = split(carry, self.carry_mask)
        xf, xi = split(x, self.x_mask)
        cmask, ymask = self.carry_mask, self.y_mask

        def g(kf, cf, xf):
            c, y = self(
                merge(kf, ki, self.const_mask), merge(cf, ci, cmask), merge(xf, xi, self.x_mask)
            )
            c_f, c_i = split(c, cmask)
            y_f, y_i = split(y, ymask)
            return (c_f, y_f), (c_i, y_i)

        return g, kf, cf, xf

    def jvp(self, consts, carry, x, t_consts, t_carry, t_x):
        """One step and its JVP: ``(carry_out, t_carry_out, y, t_y)``, the tangents given
        and returned for the differentiated leaves only (a carry's in its own dtype)."""
        g, kf, cf, xf = self._diff_fn(consts, carry, x)
        primals, tangents = (kf, cf, xf), (t_consts, t_carry, t_x)
        (c_f, y_f), (dc, dy), (c_i, y_i) = jax.jvp(g, primals, tangents, has_aux=True)
        dc = [lax.convert_element_type(d, jax.typeof(a).dtype) for d, a in zip(dc, cf)]
        return merge(c_f, c_i, self.carry_mask), dc, merge(y_f, y_i, self.y_mask), dy

    def linearize(self, consts, carry, x):
        """Runs one step keeping its residuals.

        Returns:
            ``(carry_out, y, pullback)``, the pullback mapping ``(ct_carry_f, ct_y_f)``
            (differentiated leaves only) to ``(ct_consts_f, ct_carry_f, ct_x_f)``.
        """
        g, kf, cf, xf = self._diff_fn(consts, carry, x)
        (c_f, y_f), pullback, (c_i, y_i) = jax.vjp(g, kf, cf, xf, has_aux=True)
        c = merge(c_f, c_i, self.carry_mask)
        y = merge(y_f, y_i, self.y_mask)
        return c, y, pullback

    def residual_spec(self) -> ResidualSpec:
        """Traces `linearize` abstractly to find which pullback leaves must be stored.

        The probe sees exactly the avals (weak types included) that every later call
        sees, so the trace it makes is the one `save` makes.
        """
        found: dict = {}

        def probe(consts, carry, x):
            c, y, pullback = self.linearize(consts, carry, x)
            leaves, treedef = jax.tree_util.tree_flatten(pullback)
            found["treedef"] = treedef
            found["source"], found["captured"] = _sources(leaves, consts, x)
            return c, y, [l for l, (kind, _) in zip(leaves, found["source"]) if kind == "stored"]

        traced, (_, _, stored) = jax.make_jaxpr(probe, return_shape=True)(
            _avals(self.consts), self.carry_avals, self.x_avals
        )
        head = len(self.carry_avals) + len(self.y_avals)
        # The stored residuals alone, for the analyses below.
        closed = traced.replace(jaxpr=traced.jaxpr.replace(outvars=traced.jaxpr.outvars[head:]))
        res = _Stored(found["source"], tuple(stored), traced, closed, head)
        invariant, consts_used, fixed = _invariants(closed, len(self.consts))
        res = res.without(fixed, "invariant")
        derived, made, derived_x = _derived(res.closed, len(self.consts), len(self.carry_avals))
        res = res.without(made, "derived")
        source, stored, traced, closed = res.source, res.stored, res.traced, res.closed
        reads = _reads(closed, len(self.consts), self.carry_avals)
        return ResidualSpec(
            found["treedef"], source, stored, traced, found["captured"], reads=reads,
            kept=_kept(traced, len(self.consts), len(self.y_avals), reads),
            invariant=invariant, invariant_consts=consts_used, derived=derived,
            derived_x=derived_x,
        )  # fmt: skip

    def per_step_temp_bytes(self, backend: str, num_steps: int) -> int | None:
        """The temporary bytes XLA assigns to the gradient of ``num_steps`` steps run as
        ``lax.scan(jax.checkpoint(step))`` for ``backend``: every step's start stored,
        each step run again alone and back-propagated. None where `gradient_temp_bytes`
        is (the same restrictions)."""
        shaped = self._on_one_device(backend, num_steps)
        if shaped is None:
            return None
        consts, carry, xs, cts = shaped
        n = len([m for m in self.carry_mask if m])

        def gradient(consts, carry, xs, cts):
            kf, ki = split(consts, self.const_mask)
            cf, ci = split(carry, self.carry_mask)
            xf, xi = split(xs, self.x_mask)

            def run(kf, cf, xf):
                k = merge(kf, ki, self.const_mask)
                c = merge(cf, ci, self.carry_mask)
                step = jax.checkpoint(lambda c, x: tuple(self(k, c, x)))
                c, ys = lax.scan(step, c, merge(xf, xi, self.x_mask))
                return split(c, self.carry_mask)[0], split(ys, self.y_mask)[0]

            _, pullback = jax.vjp(run, kf, cf, xf)
            return pullback((cts[:n], cts[n:]))

        return _temp_bytes(gradient, consts, carry, xs, cts)

    def _on_one_device(self, backend: str, num_steps: int | None = None):
        """Abstract inputs on one device of ``backend`` for a program of one step (or,
        with ``num_steps``, of that many steps' xs and ys): ``(consts, carry, x, cts)``,
        the cotangents those of the differentiated carry and ys leaves; None where
        `gradient_temp_bytes` says."""
        consts, carry, x = (_avals(a) for a in (self.consts, self.carry_avals, self.x_avals))
        if any(varying(a) or _on_mesh(a) for a in (*consts, *carry, *x)):
            return None
        try:
            device = jax.devices(backend)[0]
        except RuntimeError:
            return None
        sharding = jax.sharding.SingleDeviceSharding(device)
        lead = () if num_steps is None else (num_steps,)
        ys = [a for a, m in zip(self.y_avals, self.y_mask) if m]
        cts = [a for a, m in zip(self.carry_avals, self.carry_mask) if m]
        stacked = [(*lead, *a.shape) for a in x] + [(*lead, *a.shape) for a in ys]

        def struct(a, shape=None):
            shape = a.shape if shape is None else shape
            return jax.ShapeDtypeStruct(shape, a.dtype, weak_type=a.weak_type, sharding=sharding)

        return (
            [struct(a) for a in consts],
            [struct(a) for a in carry],
            [struct(a, s) for a, s in zip(x, stacked)],
            [struct(a) for a in cts] + [struct(a, s) for a, s in zip(ys, stacked[len(x) :])],
        )

    def gradient_temp_bytes(self, backend: str) -> int | None:
        """The temporary bytes XLA assigns to one step's gradient (the step keeping its
        residuals, then its pullback) compiled alone for ``backend``: what a loop that
        back-propagates one step at a time holds beside its own state, including the
        cotangents of wide intermediates that XLA keeps as arrays. None where the step
        cannot be compiled alone on one device: its values vary over ``shard_map``'s
        mesh axes or are typed with a mesh's sharding, or the backend has no device here
        or reports no memory analysis)."""
        shaped = self._on_one_device(backend)
        if shaped is None:
            return None
        n = len([m for m in self.carry_mask if m])

        def gradient(consts, carry, x, cts):
            _, _, pullback = self.linearize(consts, carry, x)
            return pullback((cts[:n], cts[n:]))

        return _temp_bytes(gradient, *shaped)

    def save(self, spec: ResidualSpec, consts, carry, x) -> tuple[Leaves, Leaves, Leaves]:
        """Runs one step and returns ``(carry_out, y, stored_residuals)`` per ``spec``:
        the probe's own trace (``spec.forward``) evaluated, so that every step stores
        exactly the residuals probed."""
        traced = spec.forward
        out = jax_core.eval_jaxpr(traced.jaxpr, traced.consts, *consts, *carry, *x)
        n, m = len(self.carry_avals), len(self.y_avals)
        c = [_as_aval(o, a) for o, a in zip(out[:n], self.carry_avals)]
        y = [_as_aval(o, a) for o, a in zip(out[n : n + m], self.y_avals)]
        stored = out[n + m :]
        if not all(_same_type(o, a) for o, a in zip(stored, spec.stored)):
            raise RuntimeError(  # the probe and this call saw different input types
                "memento: internal error: a step's residuals differ from those probed (input "
                f"types {[jax.typeof(a) for a in (*consts, *carry, *x)]}); please report it."
            )
        return c, y, stored

    def restore(self, spec: ResidualSpec, stored, consts, x) -> Callable:
        """Rebuilds the pullback of a step from its stored residuals."""
        pools = {"const": list(consts), "x": list(x), "stored": list(stored)}
        pools["captured"] = list(spec.captured)
        pools["invariant"] = _invariant_values(spec, consts)
        if spec.derived is not None:
            d = spec.derived
            pools["derived"] = jax_core.eval_jaxpr(d.jaxpr, d.consts, *consts, *x, *stored)
        leaves = [pools[kind][j] for kind, j in spec.source]
        return jax.tree_util.tree_unflatten(spec.treedef, leaves)


class Work(NamedTuple):
    """Work of a step or part of one: ``flops``, ``bytes`` touched, ``ops``."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0

    def plus(self, other: Work, times: int = 1) -> Work:
        """This work and ``times`` times ``other``."""
        return Work(*(a + times * b for a, b in zip(self, other)))


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """What one primal step does, counted on its jaxpr (loops inside it by their trip
    count): ``flops`` (a matrix product ``2 * out * contracted``, any other op one per
    output element), ``bytes`` (every op's inputs and outputs), ``ops``, ``largest``, the
    bytes of its largest intermediate array, ``products``, the bytes of the
    differentiated closed-over arrays' cotangents that the step's VJP computes as matrix
    products (see `step_profile`), ``matmuls``, its matrix products and
    convolutions, ``varying``, the bytes of its largest intermediate that depends on
    the carry or ``x`` (not on the closed-over arrays alone), ``widened``, the bytes
    of the carry leaves it casts to a wider dtype, as cast (see `step_profile`), and
    ``hoisted``, the `Work` of those counts spent on values of the
    closed-over arrays alone (a weight cast or transposed), which XLA hoists out of a
    loop of steps but not out of a step run again under ``jax.checkpoint``."""

    flops: float
    bytes: float
    ops: int
    largest: int
    products: int = 0
    matmuls: int = 0
    varying: int = 0
    widened: int = 0
    hoisted: Work = dataclasses.field(default_factory=Work)


# Ops that pass a closed-over array on as it is, but for its layout or dtype: a matrix
# product of their output takes the array's cotangent as one of its own.
_RELAYOUTS = frozenset(
    {"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims", "copy", "copy_p"}
)
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def rerun_profile(body: Body, kept: Sequence[bool]) -> StepProfile:
    """The `StepProfile` of a step run again from a start that keeps the carry leaves in
    ``kept`` (`ResidualSpec.kept`): only the work that its kept leaves' next values and
    its ys depend on (and effects), what XLA runs of a run whose other leaves' values
    are not used."""
    if _dce_jaxpr is None:  # pragma: no cover - older or newer JAX
        return step_profile(body)
    used = [*kept, *[True] * len(body.y_avals)]
    pruned, _ = _dce_jaxpr(_constvars_in(body.jaxpr), used, instantiate=True)
    consts = pruned.invars[: len(body.jaxpr.constvars)]
    tracked = {v for v, m in zip(consts, body.const_mask) if m}
    return _profile(pruned, tracked, fixed=set(consts))


def step_profile(body: Body) -> StepProfile:
    """The `StepProfile` of a step of ``body``.

    ``products`` counts, for each matrix product (or convolution) of a differentiated
    closed-over array and an operand of its own rows (a batch, say: dimensions neither
    contracted nor batched), the array's bytes: its cotangent is then a product that
    contracts those rows, a buffer of its own before the step adds it to the gradient. A
    product of a matrix and a vector gives its cotangent as an outer product, which XLA
    fuses into that sum, and is not counted.

    ``widened`` counts the bfloat16 carry leaves that the step casts to a wider dtype, at
    the wider size: reading such a leaf from a stack of stored carries inside a loop,
    XLA:CPU casts the whole stack first, out of the loop (it computes in float32 what is
    bfloat16). It keeps a float16 stack as it is.
    """
    tracked = {v for v, m in zip(body.jaxpr.constvars, body.const_mask) if m}
    profile = _profile(body.jaxpr, tracked, fixed=set(body.jaxpr.constvars))
    carry = set(body.jaxpr.invars[: len(body.carry_avals)])
    widened = {}
    for eqn in body.jaxpr.eqns:
        if eqn.primitive.name != "convert_element_type" or not _in(eqn.invars[0], carry):
            continue
        v, out = eqn.invars[0], eqn.outvars[0].aval
        if v.aval.dtype == jnp.bfloat16 and out.dtype.itemsize > v.aval.dtype.itemsize:
            widened[v] = max(widened.get(v, 0), nbytes([out]))
    return dataclasses.replace(profile, widened=sum(widened.values()))


def _profile(
    jaxpr, tracked: set, cast: frozenset | set = frozenset(), fixed: frozenset | set = frozenset()
) -> StepProfile:
    """``tracked``: the differentiated closed-over arrays, and what relayouts pass them
    on as; ``cast``: those of them cast to another dtype on the way (a cotangent in the
    cast dtype, converted back before it is summed: a buffer of its own, whatever the
    product's other operand); ``fixed``: the values computed from the closed-over
    arrays alone."""
    flops, nbytes_, ops, largest, products, matmuls, varying = 0.0, 0.0, 0, 0, 0, 0, 0
    hoisted = Work()
    tracked, cast, fixed = set(tracked), set(cast), set(fixed)
    reduced = _reduced_away(jaxpr)
    for eqn in jaxpr.eqns:
        shaped = [v for v in eqn.outvars if hasattr(v.aval, "shape")]
        outs = [v.aval for v in shaped]
        ins = [v.aval for v in eqn.invars if hasattr(getattr(v, "aval", None), "shape")]
        inner = [p for p in eqn.params.values() if hasattr(getattr(p, "jaxpr", p), "eqns")]
        if inner:
            times = eqn.params.get("length", 1)
            for sub in inner:
                sub = getattr(sub, "jaxpr", sub)
                # A call passes its operands on in order; a loop's carry is not followed.
                aligned = "length" not in eqn.params and len(sub.invars) == len(eqn.invars)
                pairs = list(zip(sub.invars, eqn.invars)) if aligned else []
                into = {s for s, v in pairs if _in(v, tracked)}
                held = {s for s, v in pairs if _fixed(v, fixed)}
                q = _profile(sub, into, {s for s, v in pairs if _in(v, cast)}, held)
                flops, nbytes_ = flops + times * q.flops, nbytes_ + times * q.bytes
                ops, largest = ops + times * q.ops, max(largest, q.largest)
                products, matmuls = products + times * q.products, matmuls + times * q.matmuls
                varying = max(varying, q.varying)
                hoisted = hoisted.plus(q.hoisted, times)
            if _of_fixed(eqn, fixed):
                fixed.update(eqn.outvars)
            continue
        name = eqn.primitive.name
        size = sum(math.prod(a.shape) for a in outs)
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            size *= 2 * math.prod(ins[0].shape[d] for d in lhs_contract)
        if name in _PRODUCTS:
            products += _product_cotangents(eqn, tracked, cast)
            matmuls += 1
        elif name in _RELAYOUTS and any(_in(v, tracked) for v in eqn.invars):
            tracked.update(eqn.outvars)
            recast = name == "convert_element_type" and eqn.params["new_dtype"] != ins[0].dtype
            if recast or any(_in(v, cast) for v in eqn.invars):
                cast.update(eqn.outvars)
        out_bytes = [math.prod(a.shape) * a.dtype.itemsize for a in outs]
        touched = sum(math.prod(a.shape) * a.dtype.itemsize for a in ins) + sum(out_bytes)
        flops, nbytes_, ops = flops + size, nbytes_ + touched, ops + 1
        held = [b for v, b in zip(shaped, out_bytes) if v not in reduced]
        largest = max([largest, *held])
        if _of_fixed(eqn, fixed):
            fixed.update(eqn.outvars)
            hoisted = hoisted.plus(Work(size, touched, 1))
        else:
            varying = max([varying, *held])
    return StepProfile(flops, nbytes_, ops, largest, products, matmuls, varying, hoisted=hoisted)


# Ops XLA fuses into their consumers, and the reductions that such a chain ends in: a sum
# only, whose derivative does not read its operand (a max's compares the operand with the
# result, so the step that keeps residuals holds the operand whole).
_ELEMENTWISE = frozenset(
    {
        "abs", "add", "and", "broadcast_in_dim", "convert_element_type", "cos", "div", "eq",
        "erf", "exp", "exp2", "expand_dims", "expm1", "ge", "gt", "integer_pow", "le",
        "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or",
        "pow", "rsqrt", "select_n", "sign", "sin", "sqrt", "square", "squeeze", "sub",
        "tan", "tanh",
    }
)  # fmt: skip
_REDUCTIONS = frozenset({"reduce_sum"})
# Of those, the ones that cost more than a memory read, and that a backend may compute
# differently from one fusion to another.
_TRANSCENDENTAL = frozenset(
    {
        "cos", "div", "erf", "exp", "exp2", "expm1", "log", "log1p", "logistic", "pow",
        "rsqrt", "sin", "sqrt", "tan", "tanh",
    }
)  # fmt: skip


def _reduced_away(jaxpr) -> set:
    """The values of ``jaxpr`` that only flow into reductions through elementwise ops
    (``sum(outer(h, v))``'s outer product, say): made by an elementwise op, and every
    use a reduction or an elementwise op whose outputs are such values too. XLA computes
    them inside the reduction's fusion, never as arrays; the step's outputs are arrays."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                uses.setdefault(v, []).append(eqn)
    outs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    away: set = set()
    for eqn in reversed(jaxpr.eqns):  # each value's uses before the value
        if eqn.primitive.name not in _ELEMENTWISE:
            continue
        for v in eqn.outvars:
            used = uses.get(v, [])
            if v not in outs and used and all(_reduces(u, away) for u in used):
                away.add(v)
    return away


def _reduces(eqn, away: set) -> bool:
    """Whether ``eqn`` is a reduction, or elementwise with every output in ``away``."""
    name = eqn.primitive.name
    return name in _REDUCTIONS or (name in _ELEMENTWISE and all(o in away for o in eqn.outvars))


def _product_cotangents(eqn, tracked: set, cast: set) -> int:
    """Bytes of the tracked operands of a matrix product (or convolution) whose cotangent
    contracts rows of the other operand, or is cast back (see `_profile`)."""
    lhs, rhs = eqn.invars[:2]
    if eqn.primitive.name == "conv_general_dilated":
        # The kernel's cotangent is a convolution over the batch and spatial dimensions.
        rows = [True, True]
    else:
        (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
        rows = [
            len(rhs.aval.shape) > len(contract_r) + len(batch_r),  # rhs free dims: lhs's ct
            len(lhs.aval.shape) > len(contract_l) + len(batch_l),
        ]
    return sum(
        math.prod(v.aval.shape) * v.aval.dtype.itemsize
        for v, r in zip((lhs, rhs), rows)
        if (r or _in(v, cast)) and _in(v, tracked)
    )


def _fixed(v, fixed: set) -> bool:
    """Whether ``v`` is a literal or one of ``fixed``."""
    return isinstance(v, jex_core.Literal) or _in(v, fixed)


def _of_fixed(eqn, fixed: set) -> bool:
    """Whether ``eqn`` has no effects and reads only literals and ``fixed`` values (the
    values computed from the closed-over arrays alone): its outputs are then such values."""
    return not eqn.effects and all(_fixed(v, fixed) for v in eqn.invars)


def _in(v, tracked: set) -> bool:
    try:
        return v in tracked
    except TypeError:  # a literal, unhashable: never a closed-over array
        return False


def inputs_to_consts(jaxpr, mask: Sequence[bool]):
    """``jaxpr`` with the inputs ``mask`` picks moved after its constvars, in order."""
    moved = [v for v, m in zip(jaxpr.invars, mask) if m]
    return jaxpr.replace(
        constvars=[*jaxpr.constvars, *moved],
        invars=[v for v, m in zip(jaxpr.invars, mask) if not m],
    )


try:  # JAX's own symbolic-zero analysis, as lax.scan's JVP uses; no public equivalent
    from jax._src.interpreters.ad import jvp_jaxpr as _jvp_jaxpr
    from jax._src.interpreters.partial_eval import (
        convert_constvars_jaxpr as _constvars_in,
        dce_jaxpr as _dce_jaxpr,
    )
except ImportError:  # pragma: no cover - older or newer JAX
    _jvp_jaxpr = _constvars_in = _dce_jaxpr = None


def _reads(closed, num_consts: int, carry_avals: Sequence) -> tuple[bool, ...] | None:
    """Which carry leaves the outputs of ``closed`` (a step's stored residuals, of
    ``(consts, carry, x)``) depend on; None where JAX's dead-code analysis is missing."""
    if _dce_jaxpr is None:  # pragma: no cover - older or newer JAX
        return None
    k = len(closed.jaxpr.constvars)
    _, used = _dce_jaxpr(_constvars_in(closed.jaxpr), [True] * len(closed.jaxpr.outvars))
    return tuple(used[k + num_consts : k + num_consts + len(carry_avals)])


def _kept(traced, num_consts: int, num_ys: int, reads) -> tuple[bool, ...] | None:
    """The carry leaves that a run of steps from a start needs to give every step's
    residuals (`ResidualSpec.kept`): from ``reads``, what the next values of the leaves
    needed depend on, until nothing is added. ``traced`` maps ``(consts, carry, x)`` to
    ``(carry_out, y, stored)``. Effects keep what they read (dead-code elimination keeps
    them)."""
    if _dce_jaxpr is None or reads is None:  # pragma: no cover - older or newer JAX
        return None
    jaxpr, k = _constvars_in(traced.jaxpr), len(traced.jaxpr.constvars)
    num_carry = len(reads)
    rest = len(jaxpr.outvars) - num_carry - num_ys
    kept = list(reads)
    while True:
        _, used = _dce_jaxpr(jaxpr, kept + [False] * num_ys + [True] * rest)
        more = [a or b for a, b in zip(kept, used[k + num_consts : k + num_consts + num_carry])]
        if more == kept:
            return tuple(kept)
        kept = more


def _invariants(closed, num_consts: int):
    """``(jaxpr, consts_used, fixed)``: of the outputs of ``closed`` (a step's residuals,
    of ``(consts, carry, x)``), ``fixed[i]`` whether the i-th depends on the consts alone,
    through equations without effects; ``jaxpr`` computes those from the consts that
    ``consts_used`` picks (None, and ``fixed`` all False, if there are none)."""
    jaxpr = closed.jaxpr
    held = {*jaxpr.constvars, *jaxpr.invars[:num_consts]}
    for eqn in jaxpr.eqns:
        if _of_fixed(eqn, held):
            held.update(eqn.outvars)
    fixed = tuple(not isinstance(o, jex_core.Literal) and o in held for o in jaxpr.outvars)
    if _dce_jaxpr is None or not any(fixed):
        return None, (), (False,) * len(fixed)
    k = len(jaxpr.constvars)
    outs = [o for o, f in zip(jaxpr.outvars, fixed) if f]
    # Effects feed none of them (their outputs vary); dead-code elimination keeps them.
    pure = [e for e in jaxpr.eqns if not e.effects]
    jaxpr = jaxpr.replace(eqns=pure, outvars=outs, effects=frozenset())
    pruned, used = _dce_jaxpr(_constvars_in(jaxpr), [True] * len(outs))
    # The closed jaxpr's own constants stay constants; the step's consts become inputs.
    consts_used = tuple(used[k : k + num_consts])
    held = [c for c, u in zip(closed.consts, used[:k]) if u]
    pruned = inputs_to_consts(
        pruned, [True] * len(held) + [False] * (len(pruned.invars) - len(held))
    )
    return jex_core.ClosedJaxpr(pruned, held), consts_used, fixed


# Operations whose result is the same wherever XLA computes it (each output element a
# correctly rounded function of its inputs, or a move of data) and that cost about a
# memory read: a residual made by them from others is computed again, not stored.
_CHEAP = (_ELEMENTWISE - _TRANSCENDENTAL) | {"copy", "copy_p", "reshape"}


def _derived(closed, num_consts: int, num_carry: int):
    """Of the outputs of ``closed`` (a step's stored residuals, of
    ``(consts, carry, x)``), ``derived[i]`` whether the i-th is computed by `_CHEAP`
    operations without effects from literals, the consts, ``x`` and outputs made before
    it that are not derived (``1 - tanh(a)`` from ``tanh(a)``, a mask from ``x``, an
    output listed twice); ``jaxpr`` computes those from ``(consts, x, kept)``, ``kept``
    the outputs that are not derived, in order; ``x_read`` the leaves of ``x`` it reads.
    Returns ``(jaxpr, derived, x_read)``: ``(None, all False, ())`` if none is derived."""
    jaxpr = closed.jaxpr
    x_vars = jaxpr.invars[num_consts + num_carry :]
    outs = {}  # output var -> its first position
    for i, o in enumerate(jaxpr.outvars):
        if not isinstance(o, jex_core.Literal):
            outs.setdefault(o, i)
    # What a pullback has at hand, and the values cheap operations make from it.
    known = {*jaxpr.constvars, *jaxpr.invars[:num_consts], *x_vars}
    known.update(v for v in jaxpr.invars[num_consts : num_consts + num_carry] if v in outs)
    cheap, made = set(), []
    for eqn in jaxpr.eqns:  # in order: an output is decided before anything that reads it
        ok = not eqn.effects and eqn.primitive.name in _CHEAP
        ok = ok and all(_fixed(u, known) or u in cheap for u in eqn.invars)
        for o in eqn.outvars:
            if ok:
                cheap.add(o)
            elif o in outs:
                known.add(o)
        if ok:
            made.append(eqn)
    derived = tuple(
        isinstance(o, jex_core.Literal) or o in cheap or outs[o] < i
        for i, o in enumerate(jaxpr.outvars)
    )
    if not any(derived):
        return None, derived, ()
    kept = [o for o, d in zip(jaxpr.outvars, derived) if not d]
    outvars = [o for o, d in zip(jaxpr.outvars, derived) if d]
    # The cheap equations the derived outputs read, in order.
    needed = {o for o in outvars if not isinstance(o, jex_core.Literal)}
    eqns = []
    for eqn in reversed(made):
        if any(o in needed for o in eqn.outvars):
            eqns.append(eqn)
            needed.update(u for u in eqn.invars if not isinstance(u, jex_core.Literal))
    invars = [*jaxpr.invars[:num_consts], *x_vars, *kept]
    body = jaxpr.replace(invars=invars, outvars=outvars, eqns=eqns[::-1], effects=frozenset())
    read = tuple(j for j, v in enumerate(x_vars) if v in needed)
    return jex_core.ClosedJaxpr(body, closed.consts), derived, read


def _invariant_values(spec: ResidualSpec, consts) -> Leaves:
    """The residuals ``spec.invariant`` computes from ``consts`` (none if it has none)."""
    if spec.invariant is None:
        return []
    picked = [c for c, u in zip(consts, spec.invariant_consts) if u]
    return jax_core.eval_jaxpr(spec.invariant.jaxpr, spec.invariant.consts, *picked)


def recomputed_bytes(spec: ResidualSpec) -> int:
    """Bytes of the residuals a pullback computes again: from the consts (``invariant``),
    but for a const's transpose (XLA folds a transpose into the op that reads it, a
    matrix product's dimension numbers, a fusion's indexing, never an array of its own),
    and from the others (``derived``)."""
    derived = 0 if spec.derived is None else nbytes(spec.derived.out_avals)
    if spec.invariant is None:
        return derived
    jaxpr = spec.invariant.jaxpr
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def folded(out) -> bool:  # a transpose of a const as it is
        eqn = made.get(out)
        return (
            eqn is not None and eqn.primitive.name == "transpose" and not _in(eqn.invars[0], made)
        )

    return derived + nbytes([out.aval for out in jaxpr.outvars if not folded(out)])


def _live(jaxpr):
    """``jaxpr`` (constvars and invars kept, in order) without the equations that no
    output needs."""
    k = len(jaxpr.constvars)
    opened, _ = _dce_jaxpr(_constvars_in(jaxpr), [True] * len(jaxpr.outvars), instantiate=True)
    return inputs_to_consts(opened, [True] * k + [False] * (len(opened.invars) - k))


def _depends(jaxpr, inputs: Sequence[bool]) -> list[bool]:
    """Which float outputs of ``jaxpr`` (constvars then invars in) have a nonzero tangent
    when the marked inputs have one.

    JAX's JVP of the jaxpr decides, with symbolic zeros, exactly as it decides for
    ``lax.scan``: ``stop_gradient`` cuts a dependence, and nested calls and conds are
    looked into (Diffrax's step size, computed under ``stop_gradient``, does not make
    the time perturbed; a progress meter then reads it through ``unvmap_max``, which
    has no JVP rule). Where that JVP cannot be formed (a primitive without a JVP rule
    on a marked value, which the VJP will refuse anyway), `_depends_conservative`.
    """
    if _jvp_jaxpr is not None and _constvars_in is not None and any(inputs):
        try:
            closed = jex_core.ClosedJaxpr(_constvars_in(jaxpr), ())
            _, nonzero = _jvp_jaxpr(closed, list(inputs), False)
        except NotImplementedError:
            pass
        else:
            return [bool(nz) and is_float(v.aval) for nz, v in zip(nonzero, jaxpr.outvars)]
    return _depends_conservative(jaxpr, inputs)


def _depends_conservative(jaxpr, inputs: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` (constvars then invars in) depend on the marked inputs.

    Forward propagation over equations, conservative for higher-order primitives (every
    output of an equation depends on every input). Integer outputs never count.
    """
    marked = {v for v, m in zip([*jaxpr.constvars, *jaxpr.invars], inputs) if m}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in marked for v in eqn.invars):
            marked.update(v for v in eqn.outvars if is_float(v.aval))
    return [isinstance(v, jex_core.Var) and v in marked for v in jaxpr.outvars]


def _as_aval(x, aval):
    """``x`` (an array or a literal's value) typed as ``aval``: a no-op when it already is."""
    if isinstance(x, jax.Array):
        t = jax.typeof(x)
        if (t.shape, t.dtype, t.weak_type) == (aval.shape, aval.dtype, aval.weak_type):
            return x
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return x
    return from_storage(lax.convert_element_type(jnp.asarray(x), aval.dtype), aval)


def no_tangent_if_int(out):
    """``out`` (a pytree) with its integer, bool and key leaves given no tangent at all,
    as ``lax.scan`` and ``lax.while_loop`` give them.

    Integer, bool and key outputs of a custom rule leave it with a float0 tangent that
    is not JAX's symbolic zero, so under ``jax.grad`` a later primitive without a JVP
    rule (e.g. Equinox's unvmap_max, in Diffrax's progress meters) fails on them."""
    return jax.tree_util.tree_map(lambda x: x if is_float(x) else _no_tangent(x), out)


@jax.custom_jvp
def _no_tangent(x):
    """The identity, with a symbolic zero tangent whatever the input's."""
    return x


def _no_tangent_jvp(primals, tangents):
    (x,), _ = primals, tangents
    return x, SymbolicZero(jax.typeof(x).to_tangent_aval())


_no_tangent.defjvp(_no_tangent_jvp, symbolic_zeros=True)


def _sources(leaves, kf, xf) -> tuple[tuple[tuple[str, int], ...], tuple]:
    """The probe's `ResidualSpec.source` and ``captured`` for pullback ``leaves``, whose
    step took the tracers ``kf`` (consts) and ``xf`` (x)."""
    out, captured, n_stored = [], [], 0
    for leaf in leaves:
        src = next((("const", j) for j, k in enumerate(kf) if leaf is k), None)
        src = src or next((("x", j) for j, v in enumerate(xf) if leaf is v), None)
        if src is None and not isinstance(leaf, jax_core.Tracer):
            src = ("captured", len(captured))
            captured.append(leaf)
        if src is None:
            src, n_stored = ("stored", n_stored), n_stored + 1
        out.append(src)
    return tuple(out), tuple(captured)


def _same_type(value, aval) -> bool:
    t = jax.typeof(value)
    return (t.shape, t.dtype) == (aval.shape, aval.dtype)


def _aval(x):
    """The exact abstract value of ``x``: shape, dtype, weak type, and under
    ``shard_map`` the mesh axes it varies over (so a trace inserts the same ``pvary``s as
    the values' own)."""
    return x if isinstance(x, (jax.ShapeDtypeStruct, jax_core.ShapedArray)) else jax.typeof(x)


def _temp_bytes(f: Callable, *args) -> int | None:
    """XLA's temporary bytes for ``f`` compiled for ``args`` (None where the backend
    reports no memory analysis). On CPU without LLVM's optimisations: they come after
    buffer assignment, and take about 40% of the compile."""
    lowered = jax.jit(f).lower(*args)
    leaves = jax.tree_util.tree_leaves(args)
    cpu = all(d.platform == "cpu" for a in leaves for d in a.sharding.device_set)
    options = {"xla_backend_optimization_level": 0} if cpu else None
    analysis = lowered.compile(options).memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def _on_mesh(aval) -> bool:
    """Whether ``aval``'s type names a mesh (explicit sharding, ``jax.set_mesh``)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and not getattr(mesh, "empty", True)


def _avals(leaves) -> list:
    return [_aval(l) for l in leaves]


def _type_str(a) -> str:
    return f"{a.dtype}{list(a.shape)}" + (" (weakly typed)" if a.weak_type else "")


def structure_error(name: str, carry_tree, out, is_leaf=None) -> TypeError:
    """The error for a body whose output carry ``out`` is not structured as ``carry_tree``.

    Names every leaf that is in one and not the other by its key path, as ``lax.scan``'s
    error does (``carry['b'][1]``); when the leaves agree and only containers differ (a
    tuple for a list), the two structures.
    """
    out_tree = jax.tree_util.tree_structure(out, is_leaf=is_leaf)
    marks = jax.tree_util.tree_unflatten(carry_tree, [object()] * carry_tree.num_leaves)
    paths_in = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(marks)]
    paths_out = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(out, is_leaf=is_leaf)
    ]
    wrong = [f"carry{p} (input only)" for p in paths_in if p not in set(paths_out)]
    wrong += [f"carry{p} (output only)" for p in paths_out if p not in set(paths_in)]
    where = "; ".join(wrong) if wrong else "the containers, not the leaves"
    return TypeError(
        f"{name}: the body's output carry has structure {out_tree}, but the input carry has "
        f"structure {carry_tree}; differs at {where}. Return a carry of the same structure."
    )


def make_body(
    f: Callable, init, x_example, *, name: str, carry_paths: Sequence[str] | None = None
) -> Body:
    """Traces ``f(init, x_example)``; returns the `Body`.

    As ``lax.scan``, an initial carry leaf that is weakly typed (a Python scalar, say)
    takes the dtype that the body gives it (``0`` with ``int8`` inputs carries ``int8``):
    the body is traced a second time when that happens. Pass the initial carry through
    `Body.cast_carry` before running the loop. ``carry_paths`` name the carry's leaves
    in messages (``jax.tree_util.keystr``; default: ``init``'s key paths).

    Raises:
        TypeError: if ``f`` does not return a ``(carry, y)`` pair whose carry has the
            structure, shapes and dtypes of ``init`` (as ``lax.scan`` requires); the
            message names every leaf that differs.
    """
    carry_leaves, carry_tree = jax.tree_util.tree_flatten(init)
    x_leaves, x_tree = jax.tree_util.tree_flatten(x_example)
    x_avals = tuple(_avals(x_leaves))
    found: dict[str, Any] = {}

    def flat_f(c, x):
        out = f(
            jax.tree_util.tree_unflatten(carry_tree, c), jax.tree_util.tree_unflatten(x_tree, x)
        )
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{name}: the body must return a pair (carry, y), got {type(out).__name__}."
            )
        new_c, y = out
        new_leaves, new_tree = jax.tree_util.tree_flatten(new_c)
        if new_tree != carry_tree:
            raise structure_error(name, carry_tree, new_c)
        y_leaves, found["y_tree"] = jax.tree_util.tree_flatten(y)
        return new_leaves + y_leaves

    def trace(carry_avals):
        return jax.make_jaxpr(flat_f, return_shape=True)(list(carry_avals), list(x_avals))

    carry_avals = tuple(_avals(carry_leaves))
    closed, out_shape = trace(carry_avals)
    promoted = tuple(
        a.update(dtype=jnp.result_type(np.dtype(a.dtype).type(0).item(), b.dtype), weak_type=False)
        if a.weak_type and (a.dtype != b.dtype or not b.weak_type)
        else a
        for a, b in zip(carry_avals, out_shape)
    )
    if promoted != carry_avals:
        carry_avals = promoted
        closed, out_shape = trace(carry_avals)
    n = len(carry_avals)
    if carry_paths is None:  # else the caller's, when init is a part of the user's carry
        carry_paths = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(init)
        ]
    paths = carry_paths
    wrong = [
        f"carry{p}: {_type_str(a)} in, {_type_str(b)} out"
        for p, a, b in zip(paths, carry_avals, out_shape[:n])
        if a.shape != b.shape or a.dtype != b.dtype
    ]
    if wrong:
        raise TypeError(
            f"{name}: the body must return a carry with the shapes and dtypes of the initial "
            f"carry (cast inside the body, or change init); differs at {'; '.join(wrong)}."
        )
    # Literal consts (Python scalars a nested trace hands over) become arrays, whose
    # identity the residual probe can follow.
    jaxpr, consts = hoist_pvary(closed.jaxpr, [jnp.asarray(c) for c in closed.consts])
    return Body(
        jaxpr=jaxpr,
        consts=consts,
        carry_tree=carry_tree,
        x_tree=x_tree,
        y_tree=found["y_tree"],
        carry_avals=carry_avals,
        x_avals=x_avals,
        y_avals=tuple(_avals(out_shape[n:])),
    )


def hoist_pvary(jaxpr, consts: Sequence) -> tuple[Any, Leaves]:
    """The step with the ``pvary`` of closed-over values done once, before the loop.

    Inside ``shard_map(check_vma=True)``, a body that combines an unvaried const (a
    weight, read the usual data-parallel way) with a varying carry gets a ``pvary`` of
    the const inside the step. Its transpose is a ``psum``, which a step's VJP would run
    once per step inside the backward loop: wasteful in a scan, and in a while loop
    whose predicate varies (each device stops at its own step) a deadlock, the devices
    entering different numbers of all-reduces. Here each such ``pvary`` of a const
    (``axes``) becomes a new const, ``lax.pcast(k, axes, to="varying")`` computed by
    the caller, outside the loop: its transpose, one ``psum`` of the accumulated
    cotangent, runs once after the backward loop. The equation is dropped and the
    value it produced is bound to the new const, so every other equation (nested
    jaxprs included) sees exactly the type it was traced with. Consts no longer used
    are dropped. Only top-level ``pvary``s of consts are moved; `varying_in_step` finds
    what stays (`memento.while_loop` refuses it under a varying predicate).
    """
    index = {v: j for j, v in enumerate(jaxpr.constvars)}
    hoisted: dict[tuple, Any] = {}  # (const, axes) -> the new constvar
    rename: dict = {}  # the dropped pvary's output -> the constvar for its value
    eqns = []
    for eqn in jaxpr.eqns:
        ins = eqn.invars
        if eqn.primitive.name != "pvary" or not all(
            isinstance(v, jex_core.Var) and v in index for v in ins
        ):
            eqns.append(eqn)
            continue
        axes = tuple(eqn.params["axes"])
        for v, out in zip(ins, eqn.outvars):
            rename[out] = hoisted.setdefault((index[v], axes), out)
    if not hoisted:
        return jaxpr, list(consts)
    if len(set(rename.values())) != len(rename):  # the same pvary twice: share one const
        eqns = [e.replace(invars=[rename.get(v, v) if isinstance(v, jex_core.Var) else v
                                  for v in e.invars]) for e in eqns]  # fmt: skip
    outvars = [rename.get(v, v) if isinstance(v, jex_core.Var) else v for v in jaxpr.outvars]
    used = {v for e in eqns for v in e.invars if isinstance(v, jex_core.Var)}
    used |= {v for v in outvars if isinstance(v, jex_core.Var)}
    keep = [j for j, v in enumerate(jaxpr.constvars) if v in used]
    new_vars = [jaxpr.constvars[j] for j in keep] + list(hoisted.values())
    new_consts = [consts[j] for j in keep] + [
        lax.pcast(consts[j], axes, to="varying") for j, axes in hoisted
    ]
    return jaxpr.replace(constvars=new_vars, eqns=eqns, outvars=outvars), new_consts


def varying_in_step(body: Body) -> list[str]:
    """The ``pvary``s left in a step (after `hoist_pvary`) whose float operand depends on
    a differentiated input: each one's transpose, a ``psum``, would run in every step of
    the backward loop. Described as ``"float32[2,8] over ('b',)"``; nested jaxprs that
    take such an operand count when they hold any float ``pvary`` (conservative)."""
    jaxpr = body.jaxpr
    inputs = [*body.const_mask, *body.carry_mask, *body.x_mask]
    marked = {v for v, m in zip([*jaxpr.constvars, *jaxpr.invars], inputs) if m}
    found = []
    for eqn in jaxpr.eqns:
        hit = [v for v in eqn.invars if isinstance(v, jex_core.Var) and v in marked]
        if not hit:
            continue
        if eqn.primitive.name == "pvary":
            found += [f"{_type_str(v.aval)} over {tuple(eqn.params['axes'])}" for v in hit
                      if is_float(v.aval)]  # fmt: skip
        else:
            found += [f"{_type_str(v)} over {axes} (in {eqn.primitive.name})"
                      for v, axes in _nested_pvarys(eqn.params)]  # fmt: skip
        marked.update(v for v in eqn.outvars if is_float(v.aval))
    return found


def _nested_pvarys(params) -> list:
    """``(operand aval, axes)`` of every float ``pvary`` in the jaxprs among ``params``."""
    out = []
    for p in params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
            sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
            if not isinstance(sub, jex_core.Jaxpr):
                continue
            for e in sub.eqns:
                if e.primitive.name == "pvary":
                    out += [(v.aval, tuple(e.params["axes"])) for v in e.invars
                            if is_float(v.aval)]  # fmt: skip
                else:
                    out += _nested_pvarys(e.params)
    return out
