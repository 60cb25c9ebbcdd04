"""One word pool for every slot, allocated as a stack.

The paper's memory model has one budget of m slots shared by hidden states (1 slot each)
and internal states (alpha slots each). Typed buffers, one for hidden states and one for
internal states, would need room for the peak of each kind, up to twice the budget for
MSM schedules. Instead, every stored state is bitcast to unsigned words and written into
one flat pool, where a unit holds one carry.

The word is the smallest item size among the stored leaves, at most 4 bytes, so a float32
state is bitcast to ``uint32`` of the same shape. ``benchmarks/pool.py`` measures writing
and reading back an LSTM step's 14 residual leaves (60 KiB) on CPU: through a ``uint32``
pool it costs about what typed per-leaf buffers cost (32-40 us against 36-47 us a step
over four runs on a slow shared host), through a ``uint8`` pool about 1.6x more (58-64
us): bitcasts that add a byte axis are not free in XLA:CPU.

The planner's schedules use their slots as a stack (Algorithm 2 of Gruslys et al.: a state
is released before any state stored before it), so a stack allocator gives each stored
state a unit offset and the pool needs exactly the schedule's peak, the paper's m.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..planning import Op, Schedule
from ..planning._schedule import _IS_SAVE, _depths, _lut
from ._body import nbytes

_SLOTTED = _lut(Op.SAVE_HIDDEN, Op.SAVE_INTERNAL, Op.LOAD_INTERNAL, Op.BACKWARD_INTERNAL)


def stack_offsets(schedule: Schedule, internal_units: int) -> tuple[np.ndarray, int]:
    """Rewrites a schedule's slot numbers as unit offsets into one stack-allocated pool.

    Vectorised (`memento.planning.stack_depths`): a state's offset is the units of the
    states below it in the stack, ``n_hidden_below + internal_units * n_internal_below``.

    Args:
        schedule: a schedule whose slots are released in the reverse order of their saves.
        internal_units: units an internal state takes (a hidden state takes 1).

    Returns:
        ``(rows, units)``: the executable rows (no FREE rows) with the ``arg`` of every
        save, load and backward-from-slot row replaced by the unit offset of its state
        (``-1``, the initial state, stays), and the pool size in units.

    Raises:
        ValueError: if the schedule does not release its slots in stack order.
    """
    actions = schedule.actions
    if schedule.planned_peak is not None and schedule.policy in ("hsm", "ism"):
        # The planner's HSM and ISM schedules hold one kind of state and number each slot
        # by its depth in the stack (`memento.planning._dp._emit`; the planner's tests
        # replay them and tests/loops/test_pool.py checks this shortcut against the
        # general count): the offset is the slot number times the state's size.
        op = np.ascontiguousarray(actions[:, 0])
        keep = (op != Op.FREE_HIDDEN) & (op != Op.FREE_INTERNAL)
        rows, op = actions[keep], op[keep]
        size = 1 if schedule.policy == "hsm" else internal_units
        if size != 1:
            slotted = _SLOTTED[op] | ((op == Op.LOAD_HIDDEN) & (rows[:, 1] >= 0))
            rows[:, 1] = np.where(slotted, rows[:, 1] * size, rows[:, 1])
        saves = rows[_IS_SAVE[op], 1]
        return rows, int(saves.max(initial=-size)) + size
    keep = (actions[:, 0] != Op.FREE_HIDDEN) & (actions[:, 0] != Op.FREE_INTERNAL)
    nh, ni, bad = _depths(actions)
    if bad >= 0:
        op, arg, _ = (int(v) for v in actions[bad])
        kind = "h" if op in (Op.SAVE_HIDDEN, Op.LOAD_HIDDEN, Op.FREE_HIDDEN) else "i"
        raise ValueError(
            f"memento: row {bad} releases {kind}-slot {arg} out of stack order; a "
            "single pool needs stack-ordered slots (the planner's schedules are)."
        )
    rows = actions[keep]
    offset = nh[keep] + internal_units * ni[keep]
    op = rows[:, 0]
    slotted = _SLOTTED[op] | ((op == Op.LOAD_HIDDEN) & (rows[:, 1] >= 0))
    rows[slotted, 1] = offset[slotted]
    # The pool's size: the highest unit any stored state reaches.
    top = np.concatenate(
        [
            offset[op == Op.SAVE_HIDDEN] + 1,
            offset[op == Op.SAVE_INTERNAL] + internal_units,
            [0],
        ]
    )
    return rows, int(top.max())


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize  # bool is stored as one byte


def word_bytes(avals: Sequence) -> int:
    """The pool's word: the smallest item size of the leaves it stores, capped at 4."""
    return min([4, *(_itemsize(a.dtype) for a in avals)])


def unit_words(carry_bytes: int, word: int) -> int:
    """Words in one unit (one carry); at least one, so an empty carry still has slots."""
    return max(1, math.ceil(carry_bytes / word))


_WORD_DTYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _as_words(x, word_dtype) -> jnp.ndarray:
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    # Same item size: a bitcast of the same shape; larger items gain a trailing axis.
    return lax.bitcast_convert_type(x, word_dtype).reshape(-1)


def _from_words(flat, aval):
    dtype = jnp.dtype(aval.dtype)
    stored = jnp.dtype(jnp.uint8) if dtype == jnp.bool_ else dtype
    width = stored.itemsize // flat.dtype.itemsize
    shape = tuple(aval.shape) + ((width,) if width > 1 else ())
    x = lax.bitcast_convert_type(flat.reshape(shape), stored)
    return x != 0 if dtype == jnp.bool_ else x


def allocate(units: int, unit_words: int, word: int) -> jnp.ndarray:
    """A flat pool of ``units * unit_words`` words of ``word`` bytes."""
    return jnp.zeros((units * unit_words,), _WORD_DTYPES[word])


def write(pool, offset, leaves: Sequence, unit_words: int, when=None) -> jnp.ndarray:
    """Stores ``leaves`` from unit ``offset`` on (only where ``when``, a scalar, holds).

    Each leaf is written in place at its own word offset: no concatenation, so the pool
    costs the same memory traffic as one typed buffer per leaf.
    """
    start = jnp.maximum(offset, 0) * unit_words
    for leaf in leaves:
        w = _as_words(leaf, pool.dtype)
        if when is not None:
            w = jnp.where(when, w, lax.dynamic_slice_in_dim(pool, start, w.shape[0]))
        pool = lax.dynamic_update_slice_in_dim(pool, w, start, 0)
        start = start + w.shape[0]
    return pool


def read(pool, offset, avals: Sequence, unit_words: int) -> list:
    """The leaves (shapes and dtypes of ``avals``) stored at unit ``offset`` by `write`."""
    start = jnp.maximum(offset, 0) * unit_words
    out = []
    for aval in avals:
        n = nbytes([aval]) // pool.dtype.itemsize
        out.append(_from_words(lax.dynamic_slice_in_dim(pool, start, n), aval))
        start = start + n
    return out
