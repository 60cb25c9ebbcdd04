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

The outer loop is `memento.while_loop` with those buffers, so the saved outputs take no
checkpoint slots. Inside its body the buffers are write-only stand-ins that record a
fixed list of writes per step, while the inner loop writes a number of rows known only
at run time. So the inner loop (also a `memento.while_loop`, on a few
slots of its small carry) writes into a per-step log of ``saves_per_step`` rows
(``len(ts)`` by default), ``(index, value)`` pairs with unused rows pointing at one extra
row appended to each buffer, and the step then writes the whole log to the stand-in at
once: ``buf.at[index].set(values)``. The extra
row is cut off after the loop; it takes many writes, but as it never reaches the result
its cotangent is zero, so each of those writes gets a zero cotangent, as it should.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    import diffrax
except ImportError as e:  # pragma: no cover - exercised only without diffrax
    raise ImportError('memento.diffrax needs Diffrax: pip install "memento-jax[diffrax]"') from e

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .loops import Buffer as _StandIn, Bytes, parse_memory, while_loop

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
        saves_per_step: the most ``SaveAt(ts=...)`` times one solver step may pass, or
            ``None`` (the default) for ``len(ts)``, always enough. Each step writes its
            saved outputs as one block of this many rows, so a small value (e.g. 1 or 2
            when steps are no longer than the spacing of ``ts``) saves time and memory
            when ``ts`` is long; a step that passes more raises an error at run time
            (``equinox.error_if``) rather than save wrong values.

    Raises:
        TypeError, ValueError: a ``memory`` that is not a budget (at construction).
        ValueError: from ``diffeqsolve``: ``memory=None`` with ``max_steps=None``; an
            ``UnsafeBrownianPath``.

    Transformations: ``jit``, ``grad``/``vjp``, ``vmap`` (over initial conditions or
    parameters; the batch steps until its last member is done). Forward mode
    (``jax.jvp``) is not supported, as with ``RecursiveCheckpointAdjoint``: use
    ``diffrax.ForwardMode``.

    Notes:
        ``max_steps=None`` is supported with a budget: the loop is then unbounded and
        checkpointed online. ``RecursiveCheckpointAdjoint`` needs ``checkpoints=`` for
        that; with its default it refuses to backpropagate.

        With ``SaveAt(ts=...)`` each step writes a block of ``saves_per_step`` rows of
        outputs (those it did not pass go to a discarded row). With the default
        (``len(ts)`` rows), time per step grows with the size of the whole output, and
        the gradient's temporary memory holds about two more output-sized arrays than
        ``RecursiveCheckpointAdjoint`` with as many checkpoints (measured with 200 save
        times, ``tests/test_diffrax.py``); a small ``saves_per_step`` removes both.

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
                f"{_NAME}: saves_per_step must be None or an int >= 1, got {n!r}; pass the "
                "most SaveAt(ts=...) times one solver step can pass, or None."
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
        return self._loop(
            terms=terms,
            saveat=saveat,
            init_state=init_state,
            max_steps=max_steps,
            inner_while_loop=_inner_loop(self.saves_per_step),
            outer_while_loop=_outer_loop(self.memory),
            **kwargs,
        )


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
# The outer loop: the solver's steps


def _outer_loop(memory) -> Callable:
    def outer_while_loop(cond_fun, body_fun, init_val, *, max_steps, buffers):
        # One extra row per buffer, the target of the log rows a step does not use.
        padded = _map_buffers(init_val, buffers, lambda b: jnp.concatenate([b, b[:1]]))
        final = while_loop(
            cond_fun, body_fun, padded, max_steps=max_steps, memory=memory, buffers=buffers
        )
        return _map_buffers(final, buffers, lambda b: b[:-1])

    return outer_while_loop


def _map_buffers(tree, buffers, fn):
    """``tree`` with ``fn`` applied to the leaves that ``buffers(tree)`` returns."""
    leaves, treedef = jtu.tree_flatten(tree)
    chosen = jtu.tree_leaves(buffers(tree))
    return jtu.tree_unflatten(
        treedef, [fn(x) if any(x is c for c in chosen) else x for x in leaves]
    )


# ----------------------------------------------------------------------------------------
# The inner loop: the SaveAt(ts=...) times one step passed


@jtu.register_pytree_node_class
class _Log(jax.Array):
    """The writes of one inner loop to one buffer: rows ``values[:count]`` at ``index``.

    Inside the inner `memento.while_loop`, ``values`` and ``index`` are that loop's own
    write-only buffers: row ``count`` of each is written once per write. It stands for
    the outer buffer in Diffrax's save loop, so it has that buffer's shape and dtype and
    is a ``jax.Array`` by type (Diffrax's ``SaveState`` annotations check both), as
    `memento.loops.Buffer` is; it can only be written.
    """

    def __init__(self, values, index, count, shape=None):
        self.values, self.index, self.count = values, index, count
        self._shape = shape

    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self.values.dtype)
    ndim = property(lambda self: len(self._shape))

    def __getitem__(self, index):
        raise TypeError(f"{_NAME}: the save times' outputs are write-only inside the solve.")

    @property
    def aval(self):
        self[()]

    @classmethod
    def empty(cls, buffer: _StandIn, capacity: int) -> _Log:
        trash = buffer.shape[0] - 1  # the extra row of `_outer_loop`
        values = jnp.zeros((capacity, *buffer.shape[1:]), buffer.dtype)
        return cls(values, jnp.full(capacity, trash, jnp.int32), jnp.int32(0), buffer.shape)

    @property
    def at(self):
        return _LogAt(self)

    def tree_flatten(self):
        return (self.values, self.index, self.count), self._shape

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, shape=aux)


class _LogAt:
    def __init__(self, log: _Log):
        self.log = log

    def __getitem__(self, index):
        log = self.log

        class _Set:
            @staticmethod
            def set(value):
                return _Log(
                    log.values.at[log.count].set(value),
                    log.index.at[log.count].set(jnp.asarray(index, jnp.int32)),
                    log.count + 1,
                    log.shape,
                )

        return _Set


def _is_log(x) -> bool:
    return isinstance(x, _Log)


# Slots of the inner loop, whose carry is a few integers: every carry is kept up to 3
# saves in one step; beyond, the online policy recomputes interpolations, which are cheap
# next to a solver step. (Keeping all ``len(ts) + 1`` carries cost 10 KB of the 31 KB of a
# 200-time solve's gradient, for nothing in the usual case of a save or two per step.)
_INNER_SLOTS = 4


def _inner_loop(saves_per_step: int | None) -> Callable:
    def inner_while_loop(cond_fun, body_fun, init_val, *, max_steps, buffers, checkpoints=None):
        """Diffrax's inner loop: at most ``max_steps`` writes to the outer loop's buffers."""
        del checkpoints
        leaves, treedef = jtu.tree_flatten(init_val)
        chosen = jtu.tree_leaves(buffers(init_val))
        is_buffer = [any(x is c for c in chosen) for x in leaves]
        if not any(isinstance(x, _StandIn) for x in chosen):
            # Outside the outer loop (Diffrax traces a step for its output structure):
            # the buffers are arrays, written in place.
            return while_loop(
                cond_fun, body_fun, init_val, max_steps=max_steps, memory=None, buffers=buffers
            )
        capacity = max_steps if saves_per_step is None else min(saves_per_step, max_steps)
        stand_ins = [x for x, b in zip(leaves, is_buffer) if b]
        logged = [_Log.empty(x, capacity) if b else x for x, b in zip(leaves, is_buffer)]

        def log_buffers(c):
            return [(x.values, x.index) for x in jtu.tree_leaves(c, is_leaf=_is_log) if _is_log(x)]

        final, full = while_loop(
            cond_fun,
            body_fun,
            jtu.tree_unflatten(treedef, logged),
            max_steps=capacity,
            memory=_INNER_SLOTS,
            buffers=log_buffers,
            return_truncated=True,
        )
        out = jtu.tree_leaves(final, is_leaf=_is_log)
        logs = [x for x in out if _is_log(x)]
        if capacity < max_steps:
            # A step that passed more save times than the log holds would leave the rest
            # to the next step, which would extrapolate them: refuse it instead. (On every
            # buffer's values: a check is dropped with the outputs it is threaded on.)
            values = eqx.error_if(
                [log.values for log in logs],
                full,
                f"{_NAME}: a solver step passed more than saves_per_step={saves_per_step} "
                "of the SaveAt(ts=...) times; raise saves_per_step, or leave it None "
                "(room for every time).",
            )
            logs = [_Log(v, log.index, log.count, log.shape) for v, log in zip(values, logs)]
        # Each stand-in takes its log in one write: the rows used, and the extra row.
        written = iter(s.at[log.index].set(log.values) for s, log in zip(stand_ins, logs))
        return jtu.tree_unflatten(treedef, [next(written) if _is_log(x) else x for x in out])

    return inner_while_loop
