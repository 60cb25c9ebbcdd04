"""`memento.diffrax`: Diffrax's step loop through `memento.while_loop`.

``diffrax.diffeqsolve(..., adjoint=memento.diffrax.CheckpointAdjoint(memory=32))``
differentiates the numerical solution (discretise-then-optimise), as Diffrax's default
``RecursiveCheckpointAdjoint`` does, with the step loop run by `memento.while_loop`.

How it plugs in: a ``diffrax.AbstractAdjoint`` runs the solve through the loop of
``diffeqsolve``, handing it two while loops. The outer one takes the solver steps; the
inner one, inside each step, saves the solution at the ``SaveAt(ts=...)`` times that step
passed. Both have Equinox's signature (``cond_fun, body_fun, init_val, max_steps,
buffers``), and ``buffers`` names the output arrays (``SaveAt``'s ``ts`` and ``ys``) that
the loop only writes to.

Both are `memento.while_loop`s. The outer one has those buffers, so the saved outputs
take no checkpoint slots. The inner one names the same buffers as its own: a loop nested
in a `memento.while_loop` body writes the enclosing loop's buffers (each save time once,
as Diffrax does), with no copy of them per step, and it keeps its small carry (a few
indices) in a few slots of its own.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

from . import _needs_jax  # noqa: F401  (first: without jax, an ImportError naming the extra)

try:
    import diffrax
except ImportError as e:  # pragma: no cover - exercised only without diffrax
    raise ImportError('memento.diffrax needs Diffrax: pip install "memento-jax[diffrax]"') from e

import equinox as eqx
import jax.tree_util as jtu

from .loops import Bytes, parse_memory, while_loop

__all__ = ["CheckpointAdjoint"]

_NAME = "memento.diffrax.CheckpointAdjoint"


class CheckpointAdjoint(diffrax.AbstractAdjoint):
    """Backpropagates through ``diffrax.diffeqsolve`` with `memento.while_loop`.

    A drop-in for ``diffrax.RecursiveCheckpointAdjoint``: the gradient is that of the
    numerical solution (the same, to rounding), the solver's steps are checkpointed
    online within ``memory`` slots, and the backward pass re-plans optimally from what
    was kept (binomial checkpointing; see `memento.while_loop` for the counts). Pick it
    for a budget in bytes, for fewer recomputations at equal memory, or to
    backpropagate with ``max_steps=None`` and a bounded budget.

    A slot holds one solver state: ``y`` with the solver's and the step size
    controller's state (e.g. an FSAL stage, the previous step size). The outputs of
    ``SaveAt(t0=..., t1=..., ts=..., steps=..., dense=..., fn=...)`` take no slots: they
    are written, not checkpointed, as in Diffrax (``steps`` and ``dense`` on accepted
    steps only, as conditional writes to `memento.while_loop`'s buffers).

    Args:
        memory: the budget for the step loop, as `memento.while_loop`'s ``memory``: an
            ``int`` of solver-state slots (the initial state included), bytes
            (``"64MiB"``, ``memento.bytes_budget(n)``), or ``None`` to keep every step's
            state (needs ``diffeqsolve(..., max_steps=...)``). Under ``vmap`` sizes are
            those of one batch member.
        saves_per_step: deprecated, and has no effect (a ``DeprecationWarning``): the
            save loop writes the outputs in place, as many rows as each step passes.
            It will be removed.

    Raises:
        TypeError, ValueError: a ``memory`` that is not a budget (at construction).
        ValueError: from ``diffeqsolve``: ``memory=None`` with ``max_steps=None``; an
            ``UnsafeBrownianPath``.

    Transformations: ``jit``, ``grad``/``vjp``, ``vmap`` (over initial conditions or
    parameters; the batch steps until its last member is done), ``jvp``/``jacfwd`` and
    derivatives of any order (``jax.hessian``, ``grad(grad(f))``), as
    `memento.while_loop`. A Runge-Kutta solver's default stage loop is Equinox's
    checkpointed loop, a ``jax.custom_vjp`` that JAX cannot differentiate in forward
    mode. The steps and their gradient run with it; every other derivative is taken
    through the same solver with ``scan_kind="bounded"`` (the stage loop
    ``diffrax.DirectAdjoint`` uses), the step loop's ``jvp_body_fun``. The gradient's
    program and memory are those of the solver as given; the first call traces the
    step twice.

    Notes:
        ``max_steps=None`` is supported with a budget: the loop is then unbounded and
        checkpointed online. ``RecursiveCheckpointAdjoint`` needs ``checkpoints=`` for
        that; with its default it refuses to backpropagate.

        ``SaveAt(ts=...)``: each step runs Diffrax's save loop, a `memento.while_loop`
        nested in the step loop's body, which writes the times the step passed into
        the outputs (buffers of both loops); the backward pass recomputes its few
        interpolations from 4 slots of its integer carry.

        Supported Diffrax versions: those of the ``memento-jax[diffrax]`` extra (0.7.x;
        tested with 0.7.2, also under Diffrax's own runtime type checks, jaxtyping with
        beartype). The adjoint hands its loops to ``AbstractAdjoint``'s solve loop
        (``self._loop``), the extension point Diffrax's own adjoints use. Progress meters
        (``TextProgressMeter``) work under ``jax.grad``.

    Example:
        >>> sol = diffrax.diffeqsolve(  # doctest: +SKIP
        ...     diffrax.ODETerm(f), diffrax.Tsit5(), 0.0, 10.0, 0.01, y0,
        ...     saveat=diffrax.SaveAt(ts=ts),
        ...     stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
        ...     adjoint=memento.diffrax.CheckpointAdjoint(memory=32))
    """

    memory: int | str | Bytes | None = eqx.field(static=True)
    saves_per_step: int | None = eqx.field(default=None, static=True, kw_only=True)

    def __check_init__(self):
        if self.memory is not None:
            parse_memory(self.memory, name=_NAME)
        n = self.saves_per_step
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"{_NAME}: saves_per_step must be None or an int >= 1, got {n!r}; it is "
                "deprecated and has no effect: leave it out."
            )
        if n is not None:
            warnings.warn(
                f"{_NAME}: saves_per_step is deprecated and has no effect (the save loop "
                "writes the outputs in place, as many rows as a step passes); leave it out.",
                DeprecationWarning,
                stacklevel=3,
            )

    def loop(
        self,
        *,
        terms,
        saveat,
        init_state,
        max_steps,
        throw,
        passed_solver_state,
        passed_controller_state,
        **kwargs,
    ):
        # As RecursiveCheckpointAdjoint: a solver or controller state passed in is
        # differentiated through like the rest of the initial state.
        del throw, passed_solver_state, passed_controller_state
        _check(terms, saveat, max_steps, self.memory)
        loop = functools.partial(
            self._loop,
            terms=terms,
            saveat=saveat,
            init_state=init_state,
            max_steps=max_steps,
            inner_while_loop=_inner_loop,
        )
        solver = kwargs.pop("solver")
        jvp_step = None
        twin = _forward_differentiable(solver)
        if twin is not None:
            # The same steps with a stage loop JAX can differentiate in forward mode, for
            # the derivatives beyond the gradient: the step loop's body from a solve
            # with that solver, stopped as it enters the loop. A solve that cannot be
            # traced so keeps its gradient, and forward mode gives JAX's own error.
            try:
                loop(solver=twin, outer_while_loop=_capture_body, **kwargs)
            except _Found as found:
                jvp_step = found.body_fun
            except Exception:
                pass
        return loop(solver=solver, outer_while_loop=_outer_loop(self.memory, jvp_step), **kwargs)


def _check(terms, saveat, max_steps, memory) -> None:
    if memory is None and max_steps is None:
        raise ValueError(
            f"{_NAME}: memory=None keeps every step's state, which needs "
            "diffeqsolve(..., max_steps=...); pass a budget (e.g. "
            "CheckpointAdjoint(memory=32) or memory='64MiB') or max_steps."
        )
    unsafe = jtu.tree_leaves(terms, is_leaf=lambda x: isinstance(x, diffrax.UnsafeBrownianPath))
    if any(isinstance(x, diffrax.UnsafeBrownianPath) for x in unsafe):
        raise ValueError(
            f"{_NAME}: an UnsafeBrownianPath cannot be replayed, so the backward pass "
            "cannot recompute steps; use diffrax.VirtualBrownianTree, or "
            "adjoint=diffrax.ForwardMode()."
        )


# ----------------------------------------------------------------------------------------
# The two loops: the solver's steps, and inside each the SaveAt(ts=...) times it passed


def _outer_loop(memory, jvp_body_fun) -> Callable:
    def outer_while_loop(cond_fun, body_fun, init_val, *, max_steps, buffers):
        return while_loop(
            cond_fun,
            body_fun,
            init_val,
            max_steps=max_steps,
            memory=memory,
            buffers=buffers,
            jvp_body_fun=jvp_body_fun,
        )

    return outer_while_loop


def _forward_differentiable(solver):
    """``solver`` with the stage loop ``diffrax.DirectAdjoint`` gives it (one JAX can
    differentiate in every mode), where its default one is Equinox's checkpointed loop,
    a ``jax.custom_vjp``; ``None`` where the solver has no such loop."""
    kinds = (diffrax.AbstractRungeKutta, diffrax.AbstractSRK)
    if not (isinstance(solver, kinds) and solver.scan_kind is None):
        return None
    return eqx.tree_at(lambda s: s.scan_kind, solver, "bounded", is_leaf=lambda x: x is None)


class _Found(Exception):  # the body_fun a solve hands its step loop
    def __init__(self, body_fun):
        self.body_fun = body_fun


def _capture_body(cond_fun, body_fun, init_val, *, max_steps, buffers):
    raise _Found(body_fun)


# Slots of the inner loop, whose carry is a few integers: every carry is kept up to 3
# saves in one step; beyond, the online policy recomputes interpolations, which are cheap
# next to a solver step.
_INNER_SLOTS = 4


def _inner_loop(cond_fun, body_fun, init_val, *, max_steps, buffers, checkpoints=None):
    """Diffrax's save loop: it writes the outer loop's buffers (nested writes of
    `memento.while_loop`), or, outside the outer loop, arrays."""
    del checkpoints
    return while_loop(
        cond_fun, body_fun, init_val, max_steps=max_steps, memory=_INNER_SLOTS, buffers=buffers
    )
