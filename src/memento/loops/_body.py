"""The loop body as a pure function of flat leaves, with its residuals made explicit.

A user's body ``f(carry, x) -> (carry, y)`` may close over arrays (weights, tracers of an
enclosing ``jit`` or ``grad``). We trace it once with ``jax.make_jaxpr``: its closed-over
values become explicit ``consts``, which the executors pass around and differentiate like
``lax.scan`` does. Every later evaluation re-binds the same jaxpr, so the body is traced a
constant number of times whatever the number of steps.

Internal states (the paper's Definition 3) are the residuals of ``jax.vjp`` of one step:
the leaves of the pullback it returns. Residual leaves that *are* a const or the step's
``x`` are not stored (they are at hand in the backward pass); the rest are, and their
total size measures the paper's alpha.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core as jax_core

Leaves = list[Any]


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def nbytes(leaves) -> int:
    return sum(math.prod(np.shape(l)) * jnp.dtype(l.dtype).itemsize for l in leaves)


def split(leaves: Sequence, mask: Sequence[bool]) -> tuple[Leaves, Leaves]:
    return [l for l, m in zip(leaves, mask) if m], [l for l, m in zip(leaves, mask) if not m]


def merge(yes: Sequence, no: Sequence, mask: Sequence[bool]) -> Leaves:
    yes_it, no_it = iter(yes), iter(no)
    return [next(yes_it) if m else next(no_it) for m in mask]


def float0_zeros(x):
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualSpec:
    """Where each leaf of a step's pullback comes from.

    ``source[i]`` is ``("const", j)`` or ``("x", j)`` for leaves that are a differentiable
    const or x leaf of the step, else ``("stored", j)``: the j-th stored residual.
    """

    treedef: Any
    source: tuple[tuple[str, int], ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """``f`` closure-converted and flattened. See the module docstring.

    Attributes:
        consts: closed-over values, the differentiable "parameters" of the loop.
        carry_tree, x_tree, y_tree: pytree structures.
        carry_avals, x_avals, y_avals: flat ``ShapeDtypeStruct``s (x: one step's slice).
    """

    jaxpr: Any
    consts: Leaves
    carry_tree: Any
    x_tree: Any
    y_tree: Any
    carry_avals: tuple[jax.ShapeDtypeStruct, ...]
    x_avals: tuple[jax.ShapeDtypeStruct, ...]
    y_avals: tuple[jax.ShapeDtypeStruct, ...]

    # -- masks of differentiable (inexact) leaves ---------------------------------------
    @property
    def const_mask(self) -> list[bool]:
        return [is_float(c) for c in self.consts]

    @property
    def carry_mask(self) -> list[bool]:
        return [is_float(a) for a in self.carry_avals]

    @property
    def x_mask(self) -> list[bool]:
        return [is_float(a) for a in self.x_avals]

    @property
    def y_mask(self) -> list[bool]:
        return [is_float(a) for a in self.y_avals]

    # -- evaluation ---------------------------------------------------------------------
    def __call__(self, consts: Sequence, carry: Sequence, x: Sequence) -> tuple[Leaves, Leaves]:
        """One primal step on flat leaves: ``(carry, y)``."""
        out = jax_core.eval_jaxpr(self.jaxpr, list(consts), *carry, *x)
        n = len(self.carry_avals)
        return list(out[:n]), list(out[n:])

    def _diff_fn(self, consts, carry, x) -> tuple[Callable, Leaves, Leaves, Leaves]:
        """The step as a function of its float leaves, with the int leaves closed over."""
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

    def linearize(self, consts, carry, x):
        """Runs one step keeping its residuals.

        Returns:
            ``(carry_out, y, pullback)``, the pullback mapping ``(ct_carry_f, ct_y_f)`` (float
            leaves only) to ``(ct_consts_f, ct_carry_f, ct_x_f)``.
        """
        g, kf, cf, xf = self._diff_fn(consts, carry, x)
        (c_f, y_f), pullback, (c_i, y_i) = jax.vjp(g, kf, cf, xf, has_aux=True)
        c = merge(c_f, c_i, self.carry_mask)
        y = merge(y_f, y_i, self.y_mask)
        return c, y, pullback

    def residual_spec(self) -> ResidualSpec:
        """Traces `linearize` abstractly to find which pullback leaves must be stored."""
        found = {}

        def probe(consts, carry, x):
            _, _, pullback = self.linearize(consts, carry, x)
            leaves, treedef = jax.tree_util.tree_flatten(pullback)
            kf, _ = split(consts, self.const_mask)
            xf, _ = split(x, self.x_mask)
            found["treedef"] = treedef
            found["source"] = _sources(leaves, kf, xf)
            return [l for l, (kind, _) in zip(leaves, found["source"]) if kind == "stored"]

        stored = jax.eval_shape(probe, _avals(self.consts), self.carry_avals, self.x_avals)
        return ResidualSpec(found["treedef"], found["source"], tuple(stored))

    def save(self, spec: ResidualSpec, consts, carry, x) -> tuple[Leaves, Leaves, Leaves]:
        """Runs one step and returns ``(carry_out, y, stored_residuals)`` per ``spec``."""
        c, y, pullback = self.linearize(consts, carry, x)
        leaves = jax.tree_util.tree_leaves(pullback)
        kf, _ = split(consts, self.const_mask)
        xf, _ = split(x, self.x_mask)
        if _sources(leaves, kf, xf) != spec.source:  # pragma: no cover - JAX invariant
            raise RuntimeError("memento: the step's residual structure changed between traces")
        return c, y, [l for l, (kind, _) in zip(leaves, spec.source) if kind == "stored"]

    def restore(self, spec: ResidualSpec, stored, consts, x) -> Callable:
        """Rebuilds the pullback of a step from its stored residuals."""
        kf, _ = split(consts, self.const_mask)
        xf, _ = split(x, self.x_mask)
        pools = {"const": kf, "x": xf, "stored": list(stored)}
        leaves = [pools[kind][j] for kind, j in spec.source]
        return jax.tree_util.tree_unflatten(spec.treedef, leaves)


def call_reverse_mode_only(run: Callable, args: Sequence, *, name: str, instead: str):
    """``run(*args)`` where ``run`` is a ``custom_vjp`` function; a clear error under jvp.

    JAX refuses forward-mode differentiation of a custom VJP with a message that does not
    say what to do instead; the executors say it.
    """
    try:
        return run(*args)
    except TypeError as e:
        if "forward-mode" in str(e) or "jvp" in str(e):
            raise TypeError(
                f"{name}: forward-mode differentiation (jvp, jacfwd) is not supported: its "
                f"gradient is a custom reverse-mode rule. Use jax.grad / jax.vjp, or {instead} "
                "for forward mode."
            ) from e
        raise


def _sources(leaves, kf, xf) -> tuple[tuple[str, int], ...]:
    out, n_stored = [], 0
    for leaf in leaves:
        src = next((("const", j) for j, k in enumerate(kf) if leaf is k), None)
        src = src or next((("x", j) for j, v in enumerate(xf) if leaf is v), None)
        if src is None:
            src, n_stored = ("stored", n_stored), n_stored + 1
        out.append(src)
    return tuple(out)


def _avals(leaves) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(np.shape(l), jnp.result_type(l)) for l in leaves]


def make_body(f: Callable, init, x_example, *, name: str) -> tuple[Body, Any]:
    """Traces ``f(init, x_example)`` once; returns the `Body` and the output pytree.

    Raises:
        TypeError: if ``f`` does not return a ``(carry, y)`` pair whose carry has the
            structure, shapes and dtypes of ``init`` (as ``lax.scan`` requires).
    """
    carry_leaves, carry_tree = jax.tree_util.tree_flatten(init)
    x_leaves, x_tree = jax.tree_util.tree_flatten(x_example)
    carry_avals = tuple(_avals(carry_leaves))
    x_avals = tuple(_avals(x_leaves))

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
            raise TypeError(
                f"{name}: the body's output carry has structure {new_tree}, but the input "
                f"carry has structure {carry_tree}; return a carry of the same structure."
            )
        for a, b in zip(carry_avals, _avals(new_leaves)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise TypeError(
                    f"{name}: the body changes a carry leaf from {a.dtype}{list(a.shape)} to "
                    f"{b.dtype}{list(b.shape)}; the carry must keep its shapes and dtypes "
                    "(cast inside the body)."
                )
        y_leaves, y_tree = jax.tree_util.tree_flatten(y)
        found["y_tree"] = y_tree
        return new_leaves + y_leaves

    found: dict[str, Any] = {}
    closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(list(carry_avals), list(x_avals))
    n = len(carry_avals)
    body = Body(
        jaxpr=closed.jaxpr,
        consts=list(closed.consts),
        carry_tree=carry_tree,
        x_tree=x_tree,
        y_tree=found["y_tree"],
        carry_avals=carry_avals,
        x_avals=x_avals,
        y_avals=tuple(out_shape[n:]),
    )
    return body, found["y_tree"]
