"""One byte pool for every slot, allocated as a stack.

The paper's memory model has one budget of m slots shared by hidden states (1 slot each)
and internal states (alpha slots each). Typed buffers, one for hidden states and one for
internal states, would need room for the peak of each kind, up to twice the budget for
MSM schedules. Instead, every stored state is packed into bytes (``bitcast``, free in
XLA) and written into one ``uint8[units, unit_bytes]`` pool, where a unit holds one carry.

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

_SAVES = {Op.SAVE_HIDDEN: "h", Op.SAVE_INTERNAL: "i"}
_FREES = {Op.FREE_HIDDEN: "h", Op.FREE_INTERNAL: "i"}
_USES = {Op.LOAD_HIDDEN: "h", Op.LOAD_INTERNAL: "i", Op.BACKWARD_INTERNAL: "i"}


def stack_offsets(schedule: Schedule, internal_units: int) -> tuple[np.ndarray, int]:
    """Rewrites a schedule's slot numbers as unit offsets into one stack-allocated pool.

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
    rows = schedule.actions.copy()
    keep = np.ones(len(rows), dtype=bool)
    stack: list[tuple[str, int, int]] = []  # (kind, slot, offset)
    live: dict[tuple[str, int], int] = {}
    top = units = 0
    for i, (op, arg, _) in enumerate(rows.tolist()):
        if op in _SAVES:
            kind = _SAVES[op]
            size = 1 if kind == "h" else internal_units
            stack.append((kind, arg, top))
            live[kind, arg] = top
            rows[i, 1] = top
            top += size
            units = max(units, top)
        elif op in _FREES:
            keep[i] = False
            kind = _FREES[op]
            if not stack or stack[-1][:2] != (kind, arg):
                raise ValueError(
                    f"memento: row {i} releases {kind}-slot {arg} out of stack order; a "
                    "single pool needs stack-ordered slots (the planner's schedules are)."
                )
            top = stack.pop()[2]
            del live[kind, arg]
        elif op in _USES and arg >= 0:
            rows[i, 1] = live[_USES[op], arg]
    return rows[keep], units


def units_for(num_bytes: int, unit_bytes: int) -> int:
    return max(1, math.ceil(num_bytes / unit_bytes))


def _as_bytes(x) -> jnp.ndarray:
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    # bitcast to uint8 adds a trailing axis of the item size (none for 1-byte types)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def pack(leaves: Sequence, units: int, unit_bytes: int) -> jnp.ndarray:
    """Leaves as one ``uint8[units, unit_bytes]`` block (zero-padded)."""
    flat = [_as_bytes(l) for l in leaves]
    size = sum(int(f.shape[0]) for f in flat)
    pad = units * unit_bytes - size
    if pad < 0:
        raise ValueError(f"memento: {size} bytes do not fit in {units} units of {unit_bytes}")
    if pad:
        flat.append(jnp.zeros((pad,), jnp.uint8))
    return jnp.concatenate(flat).reshape(units, unit_bytes)


def unpack(block: jnp.ndarray, avals: Sequence) -> list:
    """The leaves (shapes and dtypes of ``avals``) packed in ``block`` by `pack`."""
    flat = block.reshape(-1)
    out, start = [], 0
    for a in avals:
        dtype = jnp.dtype(a.dtype)
        n = math.prod(a.shape)
        stored = jnp.uint8 if dtype == jnp.bool_ else dtype
        width = jnp.dtype(stored).itemsize
        chunk = lax.slice_in_dim(flat, start, start + n * width)
        start += n * width
        shape = tuple(a.shape) + ((width,) if width > 1 else ())
        x = lax.bitcast_convert_type(chunk.reshape(shape), stored)
        out.append(x != 0 if dtype == jnp.bool_ else x)
    return out


def write(pool: jnp.ndarray, offset, leaves: Sequence, units: int, when=None) -> jnp.ndarray:
    """``pool[offset : offset + units] = pack(leaves)`` (only where ``when`` holds)."""
    block = pack(leaves, units, pool.shape[1])
    offset = jnp.maximum(offset, 0)
    if when is not None:
        block = jnp.where(when, block, lax.dynamic_slice_in_dim(pool, offset, units, 0))
    return lax.dynamic_update_slice_in_dim(pool, block, offset, 0)


def read(pool: jnp.ndarray, offset, avals: Sequence, units: int) -> list:
    """The leaves stored at ``offset`` by `write`."""
    block = lax.dynamic_slice_in_dim(pool, jnp.maximum(offset, 0), units, 0)
    return unpack(block, avals)
