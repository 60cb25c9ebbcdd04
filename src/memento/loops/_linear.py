"""Forward and reverse mode of a budgeted loop, to any order, through one linear primitive.

A budgeted loop ``F`` is a ``jax.custom_jvp`` function. Its JVP rule runs the executor's
forward pass, which keeps what the backward pass will read (the *cache*: stored carries,
residuals, schedule state), and returns the tangent ``J(a) t`` as `linear_p`, a primitive
linear in ``t`` with ``a`` and the cache as residuals. JAX then finds every derivative
from that primitive's rules, each of which is again a budgeted loop:

- evaluated (``jax.jvp``, ``jax.jacfwd``): the JVP of the plain loop, once;
- transposed (``jax.grad``, ``jax.vjp``): the executor's backward pass from the cache,
  `Adjoint`; its own transpose is the tangent map again;
- differentiated with respect to ``a`` (Hessians, reverse over forward, reverse over
  reverse): the second derivative ``D²F(a)[t, da]``, taken through the loop whose step is
  the JVP of the step (the carry and its tangent), budgeted like the first. The
  backward pass's derivative is that loop's second-order adjoint, ``H_ct(a) da``
  (`SecondAdjoint`), symmetric, so its own transpose.

The cache takes no tangent: it is a function of ``a`` that only these rules read, and they
differentiate with respect to ``a`` by a loop of their own. Under ``vmap`` the primitive's
operation is `Batched`: each rule of the operation, vmapped.

A loop plugs in through `Loop`: its plain run, its executor's forward and backward, and
its tangent loop.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from ._body import is_float, merge

Leaves = list[Any]


class Loop(abc.ABC):
    """A loop over flat argument leaves ``a``, as `differentiable` needs it."""

    @abc.abstractmethod
    def primal(self, args: Sequence) -> Leaves:
        """The outputs of the plain (unbudgeted) loop."""

    def jvp_primal(self, args: Sequence) -> Leaves:
        """`primal` as JAX differentiates it in forward mode (the tangent map's value)."""
        return self.primal(args)

    @abc.abstractmethod
    def prepare(self, perturbed: tuple[bool, ...]) -> Any:
        """The plan for differentiating with respect to the ``perturbed`` float leaves;
        passed back to `forward` and `backward`."""

    @abc.abstractmethod
    def forward(self, plan: Any, args: Sequence) -> tuple[Leaves, Any]:
        """``(outputs, cache)``: the executor's forward pass."""

    @abc.abstractmethod
    def backward(self, plan: Any, args: Sequence, cache: Any, cts: Sequence) -> Leaves:
        """The cotangents of the perturbed leaves, given those of the float outputs."""

    @abc.abstractmethod
    def tangent_loop(self, args: Sequence, tangents: Sequence, mask: Sequence[bool]) -> Leaves:
        """``(outputs, tangents of the float outputs)``: ``jax.jvp`` of this loop with
        ``tangents`` for the leaves in ``mask``, computed by the budgeted loop of the step's
        JVP (so that it is differentiable again within the budget)."""


def differentiable(loop: Loop) -> Callable:
    """``loop`` as a function of its flat argument leaves, differentiable in every mode."""

    @jax.custom_jvp
    def run(*args):
        return loop.primal(args)

    def rule(primals, tangents):
        outs, touts, _ = _jvp(loop, primals, tangents)
        return outs, touts

    run.defjvp(rule, symbolic_zeros=True)
    return run


def _perturbed(tangents) -> tuple[bool, ...]:
    return tuple(not isinstance(t, (SymbolicZero, ad.Zero)) for t in tangents)


def _jvp(loop: Loop, primals, tangents, plan=None):
    """``(outputs, output tangents, cache)`` of the loop at ``primals``, the tangents as
    `linear_p` (``plan``: the one for these tangents, when the caller has it)."""
    mask = _perturbed(tangents)
    plan = loop.prepare(mask) if plan is None else plan
    outs, cache = _cached(loop, plan, mask)(*primals)
    cache_leaves, cache_tree = jax.tree_util.tree_flatten(cache)
    floats = [o for o in outs if is_float(o)]
    op = Tangent(loop, plan, mask, len(primals), cache_tree, _avals(primals, mask), _avals(floats))
    t = [x for x, m in zip(tangents, mask) if m]
    touts = iter(op.bind([*primals, *cache_leaves], t))
    return outs, [next(touts) if is_float(o) else _zero_tangent(o) for o in outs], cache


def _cached(loop: Loop, plan, mask: tuple[bool, ...]) -> Callable:
    """The executor's forward pass as a ``custom_jvp`` function returning ``(outputs,
    cache)``: an outer derivative sees the loop's tangent map, and no tangent of the
    cache (the rules that read it differentiate with respect to the arguments)."""

    @jax.custom_jvp
    def forward(*args):
        return loop.forward(plan, args)

    def rule(primals, tangents):
        outer = _perturbed(tangents)
        if outer == mask:  # one forward pass gives both
            outs, touts, cache = _jvp(loop, primals, tangents, plan)
        else:
            outs, cache = forward(*primals)
            _, touts, _ = _jvp(loop, primals, tangents)
        zero_cache = jax.tree_util.tree_map(_zero_tangent, cache)
        return (outs, cache), (touts, zero_cache)

    forward.defjvp(rule, symbolic_zeros=True)
    return forward


def _zero_tangent(x):
    return SymbolicZero(jax.typeof(x).to_tangent_aval())


def _zero_dense(x):
    """The zero tangent of ``x`` as an array: float0 for an integer or bool leaf (a while
    loop's step counter), as ``jax.jvp`` requires."""
    if is_float(x):
        return jax.numpy.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


# -- the primitive -----------------------------------------------------------------------


class LinearOp(abc.ABC):
    """A map ``(res, lin) -> out``, linear in ``lin``: what `linear_p` computes."""

    num_res: int
    out_avals: tuple

    @abc.abstractmethod
    def apply(self, res: Sequence, lin: Sequence) -> Leaves:
        """The outputs (what the primitive lowers to)."""

    @abc.abstractmethod
    def transposed(self) -> LinearOp:
        """The operation that maps the outputs' cotangents to ``lin``'s, same residuals."""

    @abc.abstractmethod
    def jvp_res(self, res: Sequence, dres: Sequence, lin: Sequence) -> Leaves:
        """The derivative of the outputs with respect to ``res`` in the direction ``dres``
        (``None`` for a zero tangent)."""

    def __repr__(self) -> str:  # a jaxpr prints its equations' parameters
        return f"{type(self).__name__}({self.num_res} residuals)"

    def bind(self, res: Sequence, lin: Sequence) -> Leaves:
        assert len(res) == self.num_res
        return linear_p.bind(*res, *lin, op=self)


linear_p = jex_core.Primitive("memento_loop_linear")
linear_p.multiple_results = True


def _split(args, op: LinearOp):
    return list(args[: op.num_res]), list(args[op.num_res :])


def _impl(*args, op: LinearOp):
    # Op by op, as JAX runs a custom rule outside jit: XLA would fold ``0.0 + x`` to ``x``
    # in an accumulator that starts at zero, and give ``-0.0`` where lax.scan gives 0.0.
    return _apply(*args, op=op)


def _apply(*args, op: LinearOp):
    res, lin = _split(args, op)
    return list(op.apply(res, lin))


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(lambda *args, op: list(op.out_avals))
mlir.register_lowering(linear_p, mlir.lower_fun(_apply, multiple_results=True))


def _linear_jvp(primals, tangents, *, op: LinearOp):
    res, lin = _split(primals, op)
    dres, dlin = _split(tangents, op)
    out = op.bind(res, lin)
    parts = []
    if any(type(t) is not ad.Zero for t in dlin):
        dlin = [ad.instantiate_zeros(t) for t in dlin]
        parts.append(op.bind(res, dlin))
    if any(type(t) is not ad.Zero for t in dres):
        dres = [None if type(t) is ad.Zero else t for t in dres]
        parts.append(list(op.jvp_res(res, dres, lin)))
    if not parts:
        return out, [ad.Zero(a) for a in op.out_avals]
    return out, [sum(ts[1:], ts[0]) for ts in zip(*parts)]


def _linear_transpose(cts, *args, op: LinearOp):
    res, lin = _split(args, op)
    if any(ad.is_undefined_primal(r) for r in res):
        raise NotImplementedError(  # pragma: no cover - the rules never make one
            "memento: internal error: a loop's tangent map was transposed with respect to "
            "its residuals; please report it."
        )
    cts = [ad.instantiate_zeros(c) for c in cts]
    lin_cts = op.transposed().bind(res, cts)
    return [None] * len(res) + [
        c if ad.is_undefined_primal(x) else None for c, x in zip(lin_cts, lin)
    ]


def _linear_batch(args, dims, *, op: LinearOp):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    res, lin = _split(args, op)
    rdims, ldims = _split(dims, op)
    res = [_to_front(x, d) for x, d in zip(res, rdims)]
    axes = tuple(None if d is None else 0 for d in rdims)
    lin = [_to_front(x, d, size) for x, d in zip(lin, ldims)]
    out = Batched(op, axes, size).bind(res, lin)
    return out, [0] * len(out)


def _to_front(x, d, size: int | None = None):
    if d is None:
        if size is None:
            return x
        return jax.numpy.broadcast_to(x, (size, *np.shape(x)))
    return jax.numpy.moveaxis(x, d, 0)


ad.primitive_jvps[linear_p] = _linear_jvp
ad.primitive_transposes[linear_p] = _linear_transpose
batching.primitive_batchers[linear_p] = _linear_batch


# -- the operations --------------------------------------------------------------------


def _avals(leaves, mask=None) -> tuple:
    mask = [True] * len(leaves) if mask is None else mask
    return tuple(jax.typeof(x).to_tangent_aval() for x, m in zip(leaves, mask) if m)


def _over(mask: Sequence[bool], args: Sequence, f: Callable) -> tuple[Callable, Leaves]:
    """``f(args)`` as a function of the leaves ``mask`` picks (the others fixed), and
    those leaves."""
    fixed = [a for a, m in zip(args, mask) if not m]

    def of_moving(*moving):
        return f(merge(list(moving), fixed, mask))

    return of_moving, [a for a, m in zip(args, mask) if m]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Tangent(LinearOp):
    """``t -> J(a) t``: res ``(a, cache)``, lin the tangents of the perturbed leaves, out
    the float outputs' tangents."""

    loop: Loop
    plan: Any
    mask: tuple[bool, ...]
    num_args: int
    cache_tree: Any
    lin_avals: tuple
    out_avals: tuple

    @property
    def num_res(self) -> int:
        return self.num_args + self.cache_tree.num_leaves

    def apply(self, res, lin):
        def floats(args):
            return [o for o in self.loop.jvp_primal(args) if is_float(o)]

        f, moving = _over(self.mask, res[: self.num_args], floats)
        return jax.jvp(f, moving, list(lin))[1]

    def transposed(self):
        return Adjoint(self)

    def jvp_res(self, res, dres, lin):
        dargs = dres[: self.num_args]

        def touts(args):  # D²F(a)[t, da]: t fixed, the derivative in da
            return self.loop.tangent_loop(args, list(lin), self.mask)[1]

        f, moved = _over([d is not None for d in dargs], res[: self.num_args], touts)
        return jax.jvp(f, moved, [d for d in dargs if d is not None])[1]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Adjoint(LinearOp):
    """``ct -> J(a)^T ct`` by the executor's backward pass: res ``(a, cache)``, lin the
    float outputs' cotangents, out the perturbed leaves' cotangents."""

    tangent: Tangent

    @property
    def num_res(self) -> int:
        return self.tangent.num_res

    @property
    def out_avals(self) -> tuple:
        return self.tangent.lin_avals

    def apply(self, res, lin):
        t = self.tangent
        args = list(res[: t.num_args])
        cache = jax.tree_util.tree_unflatten(t.cache_tree, list(res[t.num_args :]))
        return t.loop.backward(t.plan, args, cache, list(lin))

    def transposed(self):
        return self.tangent

    def jvp_res(self, res, dres, lin):
        t = self.tangent
        args, dargs = list(res[: t.num_args]), dres[: t.num_args]
        moving = tuple(d is not None for d in dargs)
        if not any(moving):  # only the cache moved: it takes no tangent
            return [ad.instantiate_zeros(ad.Zero(a)) for a in self.out_avals]
        op = SecondAdjoint(
            t.loop, t.num_args, len(lin), t.mask, moving, _avals(args, moving), self.out_avals
        )
        return op.bind([*args, *lin], [d for d in dargs if d is not None])


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SecondAdjoint(LinearOp):
    """``da -> H_ct(a) da`` with ``H_ct`` the Hessian of ``ct . F``, rows ``out_mask`` and
    columns ``in_mask``: res ``(a, ct)``, lin the ``in_mask`` leaves of ``da``. The
    Hessian is symmetric: the transpose swaps the masks."""

    loop: Loop
    num_args: int
    num_cts: int
    out_mask: tuple[bool, ...]
    in_mask: tuple[bool, ...]
    lin_avals: tuple
    out_avals: tuple

    @property
    def num_res(self) -> int:
        return self.num_args + self.num_cts

    def apply(self, res, lin):
        def touts(args):  # d/da [ct . J(a) t] = H_ct(a) t, t = lin
            return self.loop.tangent_loop(args, list(lin), self.in_mask)[1]

        f, moving = _over(self.out_mask, res[: self.num_args], touts)
        return list(jax.vjp(f, *moving)[1](list(res[self.num_args :])))

    def transposed(self):
        return dataclasses.replace(
            self,
            out_mask=self.in_mask,
            in_mask=self.out_mask,
            lin_avals=self.out_avals,
            out_avals=self.lin_avals,
        )

    def jvp_res(self, res, dres, lin):  # third order: forward mode through the loops
        dense = [_zero_dense(r) if d is None or not is_float(r) else d for r, d in zip(res, dres)]
        return jax.jvp(lambda *r: self.apply(list(r), lin), list(res), dense)[1]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Batched(LinearOp):
    """``op`` under ``vmap``: residuals batched on axis 0 where ``axes`` says so, ``lin``
    and the outputs on axis 0, ``size`` members."""

    op: LinearOp
    axes: tuple
    size: int

    @property
    def num_res(self) -> int:
        return self.op.num_res

    @property
    def out_avals(self) -> tuple:
        return tuple(a.update(shape=(self.size, *a.shape)) for a in self.op.out_avals)

    def apply(self, res, lin):
        f = lambda r, l: self.op.apply(r, l)  # noqa: E731
        return jax.vmap(f, in_axes=(list(self.axes), 0))(list(res), list(lin))

    def transposed(self):
        return Batched(self.op.transposed(), self.axes, self.size)

    def jvp_res(self, res, dres, lin):
        moving = [d is not None for d in dres]
        present = [d for d in dres if d is not None]
        d_axes = [a for a, m in zip(self.axes, moving) if m]

        def f(r, d, l):
            return self.op.jvp_res(r, merge(d, [None] * moving.count(False), moving), l)

        return jax.vmap(f, in_axes=(list(self.axes), d_axes, 0))(list(res), present, list(lin))
