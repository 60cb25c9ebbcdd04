"""Typed slot pools, allocated as a stack.

The paper's memory model has one budget of m slots shared by hidden states (1 slot each)
and internal states (alpha slots each). Typed buffers, one for hidden states and one for
internal states, would need room for the peak of each kind: up to twice the budget for
MSM schedules, whose peaks of the two kinds fall at different times. So every stored leaf
of a given dtype goes into one flat pool of that dtype, and hidden and internal states
share it.

Why typed pools, not one pool of words. The first executor bitcast every state to
``uint32`` words. A bitcast carries no tangent, so an outer ``jvp`` of the backward pass
(``jax.hessian``, ``jvp(grad)``) silently lost every stored state's tangent, and it
refuses complex numbers and keys. A typed pool is written with ``dynamic_update_slice``
and read with ``dynamic_slice``, both linear in the stored values: tangents flow through
the pool exactly, and every dtype is stored as itself (keys as their key data, with the
key type restored on read, weak types restored too).

Offsets. The planner's schedules use slots as a stack (Algorithm 2 of Gruslys et al.: a
state is released before any state stored before it), so the place of a stored state is
fixed by how many hidden and internal states lie below it, ``(nh, ni)``. Executable rows
encode that pair in their ``arg`` as ``nh + base * ni`` (`stack_offsets` with
``internal_units = base``), and a state's offset in the pool of dtype d is
``nh * h_d + ni * i_d``, where ``h_d`` and ``i_d`` are the elements of dtype d in one
hidden and one internal state. Each pool holds exactly the peak of that sum over the
schedule. When every stored leaf has one dtype (the common case) the pool is the
schedule's peak memory, the paper's m; with several dtypes each pool takes its own peak,
which is more only when the dtype mix of hidden and internal states differs.

On one device the pools are flat (1-D), which is what lets states of different shapes
share them. On several devices they keep each leaf's shape, and so its sharding (see
`Pools`): a flat pool cannot be sharded the way a batch-sharded leaf is, and writing
into it would gather the leaf on every device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..planning import Op, Schedule
from ..planning._schedule import _IS_SAVE, _depths, _lut

try:  # restores a weak type on read; no public equivalent
    from jax._src.lax.lax import _convert_element_type
except ImportError:  # pragma: no cover - older or newer JAX
    _convert_element_type = None

_SLOTTED = _lut(Op.SAVE_HIDDEN, Op.SAVE_INTERNAL, Op.LOAD_INTERNAL, Op.BACKWARD_INTERNAL)


def stack_offsets(schedule: Schedule, internal_units: int) -> tuple[np.ndarray, int]:
    """Rewrites a schedule's slot numbers as offsets into one stack-allocated pool.

    Vectorised (`memento.planning.stack_depths`): a state's offset is the units of the
    states below it in the stack, ``n_hidden_below + internal_units * n_internal_below``.
    A hidden state takes 1 unit and an internal state ``internal_units``; with
    ``internal_units = base > memory`` an offset encodes ``(nh, ni)`` as ``nh + base * ni``.

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


# ----------------------------------------------------------------------------------------
# Storage form of a leaf: keys as their key data, everything else as itself.


def is_key(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def storage_aval(aval) -> jax.ShapeDtypeStruct:
    """Shape and dtype of ``aval`` as stored (a key's key data; no weak type)."""
    if is_key(aval):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)


def nbytes(avals) -> int:
    """Bytes of the stored form of ``avals``."""
    total = 0
    for a in avals:
        s = storage_aval(a)
        total += math.prod(s.shape) * np.dtype(s.dtype).itemsize
    return total


def varying(aval) -> frozenset:
    """The ``shard_map`` mesh axes that values of ``aval`` vary over (none outside one)."""
    return getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())


def zeros(shape, dtype, axes: frozenset, spec=None):
    """Zeros that vary over the ``shard_map`` axes ``axes`` (storage for such values),
    sharded as ``spec`` (a `jax.sharding.NamedSharding` or None)."""
    z = jnp.zeros(shape, dtype, out_sharding=spec) if spec is not None else jnp.zeros(shape, dtype)
    return lax.pcast(z, tuple(sorted(axes)), to="varying") if axes else z


def explicit_sharding(aval):
    """``aval``'s sharding when it is explicit (a mesh with explicit axes), else None:
    then JAX types every op by its sharding, and storage must be created sharded."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or mesh.empty or not any(sharding.spec):
        return None
    return sharding


def _stacked(sharding):
    """The sharding of a stack of values sharded as ``sharding`` (a new leading axis)."""
    if sharding is None:
        return None
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
    )


def stack_of(aval, n: int):
    """``n`` stored forms of ``aval`` along a new leading axis, zeros, sharded as ``aval``
    along the others when its sharding is explicit."""
    s = storage_aval(aval)
    return zeros((n, *s.shape), s.dtype, varying(aval), _stacked(explicit_sharding(aval)))


def to_storage(x, aval):
    return jax.random.key_data(x) if is_key(aval) else x


def from_storage(x, aval):
    """The value of ``aval``'s type stored as ``x``: key type and weak type restored."""
    if is_key(aval):
        return jax.random.wrap_key_data(x, impl=aval.dtype._impl)
    if getattr(aval, "weak_type", False) and _convert_element_type is not None:
        return _convert_element_type(x, weak_type=True)
    return x


# ----------------------------------------------------------------------------------------
# The pools


def keep_shapes() -> bool:
    """Whether pools keep each leaf's shape (see `Pools`): when the program may be
    partitioned over several devices, so that a stored leaf keeps its sharding."""
    return jax.device_count() > 1


@dataclasses.dataclass(frozen=True, eq=False)
class Pools:
    """Where hidden and internal states live; see the module docstring.

    Two layouts, both stacks along axis 0 of each pool:

    - flat (one device): one pool per dtype, of elements; a leaf is stored raveled. A
      hidden and an internal state share any pool of their common dtype, so the pools
      hold exactly the schedule's peak when every stored leaf has one dtype.
    - shaped (``keep_shapes``, several devices): one pool per dtype and shape, of shape
      ``(n, *shape)``; a leaf is stored as one entry, keeping its shape and therefore
      its sharding (a batch-sharded leaf is stored where its rows live: no collective).
      Hidden and internal leaves of the same dtype and shape still share a pool, but
      peaks of different pools may fall at different times, so the total can exceed
      the schedule's peak: `memento.scan` then plans for fewer slots until it fits.

    Attributes:
        hidden_avals, internal_avals: the leaves of one hidden / internal state.
        groups: ``(dtype, entry shape, explicit sharding or None)`` of each pool (shape
            ``()`` in the flat layout).
        hidden_size, internal_size: entries of each pool that one state takes.
        sizes: entries of each pool (its peak over the schedule).
        base: a row's ``arg`` is ``nh + base * ni`` (``-1``: the caller's ``h_0``).
    """

    hidden_avals: tuple
    internal_avals: tuple
    groups: tuple
    hidden_size: tuple[int, ...]
    internal_size: tuple[int, ...]
    sizes: tuple[int, ...]
    base: int

    @staticmethod
    def of(hidden_avals, internal_avals, tops: np.ndarray, base: int, shaped=None) -> Pools:
        """Pools for states of these leaves, sized by ``tops``: rows ``(nh, ni)`` of
        states on the stack after each save (the peak is among them). ``shaped``: the
        layout (default: `keep_shapes`)."""
        shaped = keep_shapes() if shaped is None else shaped
        group = _shaped_group if shaped else _flat_group
        groups = tuple(dict.fromkeys(group(a)[0] for a in (*hidden_avals, *internal_avals)))

        def size(avals):
            out = [0] * len(groups)
            for a in avals:
                g, n = group(a)
                out[groups.index(g)] += n
            return tuple(out)

        hs, is_ = size(hidden_avals), size(internal_avals)
        tops = np.asarray(tops, np.int64).reshape(-1, 2)
        sizes = tuple(
            int((tops[:, 0] * h + tops[:, 1] * i).max()) if len(tops) else 0
            for h, i in zip(hs, is_)
        )
        return Pools(tuple(hidden_avals), tuple(internal_avals), groups, hs, is_, sizes, base)

    @property
    def dtypes(self) -> tuple:
        return tuple(g[0] for g in self.groups)

    @property
    def nbytes(self) -> int:
        """Bytes of all pools."""
        return sum(n * math.prod(e) * d.itemsize for (d, e, _), n in zip(self.groups, self.sizes))

    def _group_of(self, aval) -> tuple[int, int, tuple]:
        shaped = bool(self.groups) and self.groups[0][1] != ()
        g, n = (_shaped_group if shaped else _flat_group)(aval)
        return self.groups.index(g), n, g[1]

    def allocate(self) -> list:
        axes = frozenset().union(*(varying(a) for a in (*self.hidden_avals, *self.internal_avals)))
        return [
            zeros((n, *e), d, axes, _stacked(sharding))
            for (d, e, sharding), n in zip(self.groups, self.sizes)
        ]

    def _starts(self, arg) -> list:
        arg = jnp.maximum(arg, 0)
        nh, ni = arg % self.base, arg // self.base
        return [nh * h + ni * i for h, i in zip(self.hidden_size, self.internal_size)]

    def _avals(self, kind: str):
        return self.hidden_avals if kind == "h" else self.internal_avals

    def write(self, pools: Sequence, arg, leaves: Sequence, kind: str, when=None) -> list:
        """Stores one state's ``leaves`` at ``arg`` (only where ``when``, a scalar, holds).

        Each leaf is written in place at its own offset: no concatenation, so the pools
        cost the same memory traffic as one typed buffer per leaf.
        """
        pools, starts = list(pools), self._starts(arg)
        for leaf, aval in zip(leaves, self._avals(kind)):
            j, n, e = self._group_of(aval)
            if n == 0 or math.prod(e) == 0:
                continue
            w = jnp.reshape(to_storage(leaf, aval), (n, *e))
            if when is not None:
                w = jnp.where(when, w, lax.dynamic_slice_in_dim(pools[j], starts[j], n))
            pools[j] = lax.dynamic_update_slice_in_dim(pools[j], w, starts[j], 0)
            starts[j] = starts[j] + n
        return pools

    def read(self, pools: Sequence, arg, kind: str, *, stored: bool = False) -> list:
        """The leaves of the state stored at ``arg`` by `write` (``stored=True``: in their
        storage form, e.g. key data, to be mixed with others before `from_storage`)."""
        out, starts = [], self._starts(arg)
        for aval in self._avals(kind):
            j, n, _ = self._group_of(aval)
            s = storage_aval(aval)
            x = lax.dynamic_slice_in_dim(pools[j], starts[j], n).reshape(s.shape)
            starts[j] = starts[j] + n
            out.append(x if stored else from_storage(x, aval))
        return out


def _flat_group(aval) -> tuple[tuple, int]:
    """``((dtype, (), None), entries)`` of a leaf in the flat layout."""
    s = storage_aval(aval)
    return (np.dtype(s.dtype), (), None), math.prod(s.shape)


def _shaped_group(aval) -> tuple[tuple, int]:
    """``((dtype, shape, explicit sharding), 1)`` of a leaf in the shaped layout."""
    s = storage_aval(aval)
    return (np.dtype(s.dtype), tuple(s.shape), explicit_sharding(aval)), 1
