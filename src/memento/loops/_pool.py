"""Slot storage: typed stacks, one per dtype and shape, allocated as a stack.

The paper's memory model has one budget of m slots shared by hidden states (1 slot each)
and internal states (alpha slots each). Typed buffers, one for hidden states and one for
internal states, would need room for the peak of each kind: up to twice the budget for
MSM schedules, whose peaks of the two kinds fall at different times. So every stored leaf
goes into a pool shared by hidden and internal states: one pool per ``(dtype, shape)``,
of shape ``(entries, *shape)``, each stored leaf one entry.

Why typed pools. The first executor bitcast every state to ``uint32`` words. A bitcast
carries no tangent, so an outer ``jvp`` of the backward pass (``jax.hessian``,
``jvp(grad)``) silently lost every stored state's tangent, and it refuses complex
numbers and keys. A typed pool is written with ``dynamic_update_index_in_dim`` and read
with ``dynamic_index_in_dim``, both linear in the stored values: tangents flow through
the pool exactly, and every dtype is stored as itself (keys as their key data, with the
key type restored on read, weak types restored too).

Why one entry per leaf, not a flat pool of elements. A leaf keeps its shape, and so its
sharding: a batch-sharded leaf is stored where its rows live, with no collective. An
index counts entries (states times leaves), not elements, so it stays far inside int32
at any pool size: a flat pool's element offsets wrapped past 2^31 elements (a 2 MiB
leaf over 1,300 slots), and the layout must not change with the number of devices. The
recursion (`_recursion`) keeps its slots in the same pools.

Offsets. The planner's schedules use slots as a stack (Algorithm 2 of Gruslys et al.: a
state is released before any state stored before it), so the place of a stored state is
fixed by how many hidden and internal states lie below it, ``(nh, ni)``
(`memento.planning.internals.stack_depths`). Executable rows keep the two counts in two columns
(`stack_rows`; packing them into one int32 wrapped at large budgets), and a state's
first entry in pool g is ``nh * h_g + ni * i_g``, where ``h_g`` and ``i_g`` are the
entries of pool g in one hidden and one internal state. Each pool holds exactly the
peak of that sum over the schedule. Leaves of the same dtype and shape in hidden and
internal states share a pool; peaks of different pools may fall at different times, so
the total can exceed the schedule's peak, and `memento.scan` then plans for fewer slots
until it fits. That can cost MSM some evaluations: the demo's LSTM at 5% memory plans for
185 of its 205 slots.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching, lax

from ..planning import Op, Schedule
from ..planning.internals import stack_depths, two_level_depths

try:  # restores a weak type on read; no public equivalent
    from jax._src.lax.lax import _convert_element_type
except ImportError:  # pragma: no cover - older or newer JAX
    _convert_element_type = None

_SLOTTED = np.zeros(max(Op) + 1, bool)  # ops whose arg names a slot
_SLOTTED[[Op.SAVE_HIDDEN, Op.SAVE_INTERNAL, Op.LOAD_INTERNAL, Op.BACKWARD_INTERNAL]] = True
_SLOTTED[Op.HOST_SAVE_HIDDEN : Op.HOST_BACKWARD_INTERNAL + 1] = True  # host slots
_FREE = np.zeros(max(Op) + 1, bool)
_FREE[[Op.FREE_HIDDEN, Op.FREE_INTERNAL, Op.HOST_FREE_HIDDEN, Op.HOST_FREE_INTERNAL]] = True
INT32_MAX = int(np.iinfo(np.int32).max)


def checked_int32(values, what: str, *, name: str = "memento") -> np.ndarray:
    """``values`` as int32, or a clear error if any would not fit (instead of wrapping)."""
    values = np.asarray(values)
    if values.size and (values.max() > INT32_MAX or values.min() < -INT32_MAX):
        raise ValueError(
            f"{name}: {what} reaches {int(np.abs(values).max())}, past the int32 range the "
            "compiled loop indexes with; use fewer steps or a smaller budget."
        )
    return values.astype(np.int32)


def stack_rows(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A schedule's executable rows with each state's place on its stack, for the pools.

    Args:
        schedule: a schedule whose slots are released in the reverse order of their saves
            (on each level, for a two-level plan: each level is a stack of its own).

    Returns:
        ``(rows, tops, host_tops)``. ``rows``: int32 ``(n, 4)`` rows ``(op, a, b, pos)``
        without the FREE rows. For a row that saves, loads or back-propagates from a slot,
        ``(a, b)`` is ``(nh, ni)``, the hidden and internal states below its state on its
        level (a host row's op says it is on the host); for a load of ``h_0``,
        ``(-1, 0)``; otherwise ``(arg, 0)`` (an ADVANCE's count). ``tops``,
        ``host_tops``: the distinct ``(nh, ni)`` on the device / host stack after each
        save there (int64), whose maximum per pool sizes it.

    Raises:
        ValueError: if the schedule does not release its slots in stack order, or a
            count does not fit int32.
    """
    actions = schedule.actions
    try:
        if len(actions) and int(actions[:, 0].max()) >= Op.HOST_SAVE_HIDDEN:
            _, nh, ni = two_level_depths(actions)
        else:
            nh, ni = stack_depths(actions)
    except ValueError as e:
        raise ValueError(
            f"memento: {e}; a pool needs stack-ordered slots (the planner's are)."
        ) from None
    keep = ~_FREE[actions[:, 0]]
    op, arg, pos = (np.ascontiguousarray(actions[keep, k]) for k in range(3))
    slotted = _SLOTTED[op] | ((op == Op.LOAD_HIDDEN) & (arg >= 0))
    rows = np.empty((len(op), 4), np.int64)
    rows[:, 0] = op
    rows[:, 1] = np.where(slotted, nh, arg)
    rows[:, 2] = np.where(slotted, ni, 0)
    rows[:, 3] = pos

    def tops(save_h, save_i):
        is_h, is_i = op == save_h, op == save_i
        out = np.concatenate(
            [
                np.stack([nh[is_h] + 1, ni[is_h]], axis=1),
                np.stack([nh[is_i], ni[is_i] + 1], axis=1),
            ]
        )
        return np.unique(out, axis=0) if len(out) else np.zeros((0, 2), np.int64)

    return (
        checked_int32(rows, "a schedule row"),
        tops(Op.SAVE_HIDDEN, Op.SAVE_INTERNAL),
        tops(Op.HOST_SAVE_HIDDEN, Op.HOST_SAVE_INTERNAL),
    )


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
# Debug mode: device-side invariant checks


def checks_enabled() -> bool:
    """Whether the executors check their invariants on the device: set the environment
    variable ``MEMENTO_CHECKS=1`` (read when a gradient is traced; the test suite sets it).

    Each stored state then carries a tag, ``2p`` for ``h_p`` and ``2p + 1`` for step
    ``p``'s internal state, checked on every load against the position the schedule
    expects; pool entries are checked to lie within the pools, and the working state's
    position is checked before each fused backward. A broken invariant raises (as a
    ``JaxRuntimeError`` naming it) when the computation runs. Off by default.
    """
    return os.environ.get("MEMENTO_CHECKS", "") not in ("", "0")


TAG = jax.ShapeDtypeStruct((), jnp.int32)


def check(ok, what: str) -> None:
    """Raises at run time, on the device's host callback, where ``ok`` is false."""

    def fail_unless(ok):
        if not np.all(ok):
            raise AssertionError(
                f"memento (MEMENTO_CHECKS): executor invariant broken: {what}. This is a "
                "bug in memento; please report it with the loop's shapes and budget."
            )

    # The callback runs only when a check fails: a host callback on every row would make
    # the loop many times slower (a callback per iteration, no fused loop kernel on XLA:CPU).
    ok = jnp.all(ok)
    lax.cond(ok, lambda: None, lambda: jax.debug.callback(fail_unless, ok))


# ----------------------------------------------------------------------------------------
# Host memory: where a two-level plan's host slots live


def host_space():
    """``jax.memory.Space.Host`` when JAX and the default backend have a ``pinned_host``
    memory kind (GPUs, TPUs, and the CPU, where it is the same RAM), else None:
    then host slots stay in device memory, running the same schedule with the same
    numbers."""
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is None:  # pragma: no cover - older JAX
        return None
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # pragma: no cover - a backend without memories
        return None
    return space.Host if "pinned_host" in kinds else None


def _to(x, space):
    return x if space is None else jax.device_put(x, space)


def on_host(x) -> bool:
    """Whether the array ``x`` (or its abstract value) lies in host memory."""
    space = getattr(jax.typeof(x), "memory_space", None)
    host = host_space()
    return host is not None and space == host


try:  # the tracers of forward-mode differentiation
    from jax._src.interpreters.ad import JVPTracer as _JVP, LinearizeTracer as _LIN

    _FORWARD_TRACERS: tuple = (_JVP, _LIN)
except ImportError:  # pragma: no cover - older or newer JAX
    _FORWARD_TRACERS = ()


def under_forward_mode(leaves) -> bool:
    """Whether any of ``leaves`` carries a tangent (an outer ``jvp``: ``jax.hessian``).

    Host slots then stay on the device: JAX 0.10.2 builds the zero tangent of a host
    array on the device, so a loop that carries a host pool under ``jvp`` fails to type
    (its tangent enters in device memory and leaves in host memory)."""
    return any(isinstance(x, _FORWARD_TRACERS) for x in leaves)


# ----------------------------------------------------------------------------------------
# The pools


def pick(when, yes, no):
    """``yes`` where the scalar ``when`` holds, else ``no``. A scalar predicate is valid
    under explicit mesh axes, where a broadcast one would need ``no``'s sharding."""
    return lax.select_n(when, no, yes)


def put(pool, index, value):
    """``pool[index] = value`` (one entry, in place)."""
    return lax.dynamic_update_index_in_dim(pool, value.astype(pool.dtype), index, 0)


def get(pool, index):
    """``pool[index]`` (one entry; ``index`` is in bounds by construction)."""
    return lax.dynamic_index_in_dim(pool, index, 0, keepdims=False)


# Host pools are read and written with the entry's index as a scalar operand of a dynamic
# slice. Under vmap JAX turns a dynamic slice of a batched operand into a gather whose
# index array it builds in device memory, which JAX refuses to mix with a host operand;
# these rules keep a slice along the slot axis, past the batch axes.


@functools.cache
def _host_get(axis: int):
    @custom_batching.custom_vmap
    def host_get(pool, index):
        entry = lax.dynamic_index_in_dim(pool, index, axis, keepdims=False)
        return jax.device_put(entry, jax.memory.Space.Device)  # the copy back

    @host_get.def_vmap
    def _(axis_size, in_batched, pool, index):
        if in_batched[1]:  # pragma: no cover - schedules are shared by the batch
            raise NotImplementedError("memento: a batched slot index")
        pool = pool if in_batched[0] else _broadcast(pool, axis_size)
        return _host_get(axis + 1)(pool, index), True

    return host_get


@functools.cache
def _host_put(axis: int):
    @custom_batching.custom_vmap
    def host_put(pool, index, value):
        value = jax.device_put(value.astype(pool.dtype), jax.memory.Space.Host)  # copy out
        return lax.dynamic_update_index_in_dim(pool, value, index, axis)

    @host_put.def_vmap
    def _(axis_size, in_batched, pool, index, value):
        if in_batched[1]:  # pragma: no cover - schedules are shared by the batch
            raise NotImplementedError("memento: a batched slot index")
        pool = pool if in_batched[0] else _broadcast(pool, axis_size)
        value = value if in_batched[2] else jnp.broadcast_to(value, (axis_size, *value.shape))
        return _host_put(axis + 1)(pool, index, value), True

    return host_put


def _broadcast(pool, n: int):
    """``pool`` with a leading batch axis of ``n``, built on the device (one copy each
    way; only where an unbatched pool meets a batched state, before the loop)."""
    pool = jax.device_put(pool, jax.memory.Space.Device)
    return jax.device_put(jnp.broadcast_to(pool, (n, *pool.shape)), jax.memory.Space.Host)


@dataclasses.dataclass(frozen=True, eq=False)
class Pools:
    """Where hidden and internal states live; see the module docstring.

    One pool per ``(dtype, shape, explicit sharding, varying axes)`` of the stored leaves, of shape
    ``(entries, *shape)``; a stored leaf takes one entry. Zero-size leaves take none (they
    are rebuilt on read).

    With ``tagged`` (`checks_enabled`), each state has one more leaf, an int32 tag
    (see `checks_enabled`): `write` takes it last among the leaves, `read` returns it
    last.

    Attributes:
        hidden_avals, internal_avals: the leaves of one hidden / internal state (tag
            included).
        groups: ``(dtype, shape, explicit sharding or None, varying axes)`` of each pool.
        hidden_pool, internal_pool: the pool of each leaf of a hidden / internal state
            (None: zero-size, not stored).
        hidden_size, internal_size: entries of each pool that one state takes.
        sizes: entries of each pool (its peak over the schedule).
    """

    hidden_avals: tuple
    internal_avals: tuple
    groups: tuple
    hidden_pool: tuple
    internal_pool: tuple
    hidden_size: tuple[int, ...]
    internal_size: tuple[int, ...]
    sizes: tuple[int, ...]
    tagged: bool = False
    host: bool = False  # the host level's pools: kept in host memory where it exists

    @staticmethod
    def of(
        hidden_avals,
        internal_avals,
        tops: np.ndarray,
        *,
        tagged: bool = False,
        host: bool = False,
        per_leaf: bool = False,
        name: str = "memento",
    ) -> Pools:
        """Pools for states of these leaves, sized by ``tops``: rows ``(nh, ni)`` of
        states on the stack after each save (the peak is among them).

        ``per_leaf``: a pool for each leaf of a hidden state (no internal states), of one
        entry per slot, rather than one per ``(dtype, shape)``. The same bytes, in smaller
        arrays: XLA:CPU runs a loop body's ops one after the other, in the calling
        thread, only while every array they touch holds at most 512 bytes; past that, it
        runs them as a dataflow graph over its thread pool, at a few microseconds more
        per iteration (`memento.while_loop` keeps small carries' slots so)."""
        if per_leaf:
            assert not internal_avals, "per_leaf pools hold hidden states only"
            hidden_avals = (*hidden_avals, TAG) if tagged else hidden_avals
            keys = [_group(a) for a in hidden_avals]
            at = np.cumsum([k is not None for k in keys]) - 1
            hidden_pool = tuple(None if k is None else int(j) for k, j in zip(keys, at))
            groups = tuple(k for k in keys if k is not None)
            internal_pool: tuple = ()
        else:
            if tagged:
                hidden_avals, internal_avals = (*hidden_avals, TAG), (*internal_avals, TAG)
            stored = [a for a in (*hidden_avals, *internal_avals) if _group(a) is not None]
            groups = tuple(dict.fromkeys(_group(a) for a in stored))
            hidden_pool, internal_pool = (
                tuple(None if _group(a) is None else groups.index(_group(a)) for a in avals)
                for avals in (hidden_avals, internal_avals)
            )

        def size(pool_of):
            out = [0] * len(groups)
            for j in pool_of:
                if j is not None:
                    out[j] += 1
            return tuple(out)

        hs, is_ = size(hidden_pool), size(internal_pool)
        tops = np.asarray(tops, np.int64).reshape(-1, 2)
        sizes = tuple(
            int((tops[:, 0] * h + tops[:, 1] * i).max()) if len(tops) else 0
            for h, i in zip(hs, is_)
        )
        checked_int32(sizes, "a slot pool's number of entries", name=name)
        return Pools(
            tuple(hidden_avals),
            tuple(internal_avals),
            groups,
            hidden_pool,
            internal_pool,
            hs,
            is_,
            sizes,
            tagged,
            host,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all pools."""
        return sum(
            n * math.prod(e) * d.itemsize for (d, e, _, _), n in zip(self.groups, self.sizes)
        )

    def allocate(self, *, place: bool = True) -> list:
        """Zeroed pools: the host level's in host memory where there is one and ``place``
        (else on the device, like the device level's)."""
        space = host_space() if self.host and place else None
        return [
            _to(zeros((n, *e), d, axes, _stacked(sharding)), space)
            for (d, e, sharding, axes), n in zip(self.groups, self.sizes)
        ]

    def _starts(self, nh, ni) -> list:
        # Offsets are at most the pool's size, checked to fit int32 in `of`; a masked
        # write of a row that stores nothing may carry -1, read as 0.
        nh, ni = jnp.maximum(nh, 0), jnp.maximum(ni, 0)
        return [nh * h + ni * i for h, i in zip(self.hidden_size, self.internal_size)]

    def _avals(self, kind: str):
        if kind == "h":
            return zip(self.hidden_avals, self.hidden_pool)
        return zip(self.internal_avals, self.internal_pool)

    def in_bounds(self, nh, ni, kind: str):
        """Whether a state of ``kind`` at ``(nh, ni)`` lies within every pool."""
        n = self.hidden_size if kind == "h" else self.internal_size
        ok = jnp.bool_(True)
        for start, k, size in zip(self._starts(nh, ni), n, self.sizes):
            ok = ok & (start + k <= size)
        return ok & (nh >= 0) & (ni >= 0)

    def write(self, pools: Sequence, nh, ni, leaves: Sequence, kind: str, when=None) -> list:
        """Stores one state's ``leaves`` below which lie ``nh`` hidden and ``ni`` internal
        states (only where ``when``, a scalar, holds). Each leaf is written in place."""
        # Values go where the pools are (host pools are on the device when JAX has no
        # host memory, or under forward mode: `under_forward_mode`).
        host = any(on_host(p) for p in pools)
        if host and when is not None:
            # A masked write would read the host entry back to the device: copy only
            # where the row stores (a write-or-identity conditional keeps pools in place).
            return lax.cond(
                when,
                lambda p: self.write(p, nh, ni, leaves, kind),
                lambda p: list(p),
                list(pools),
            )
        pools, starts = list(pools), self._starts(nh, ni)
        for leaf, (aval, j) in zip(leaves, self._avals(kind)):
            if j is None:
                continue
            w = to_storage(leaf, aval).astype(self.groups[j][0])
            if when is not None:
                w = pick(when, w, get(pools[j], starts[j]))
            # The copy to the host: an annotated placement XLA turns into a transfer.
            pools[j] = _host_put(0)(pools[j], starts[j], w) if host else put(pools[j], starts[j], w)
            starts[j] = starts[j] + 1
        return pools

    def read(self, pools: Sequence, nh, ni, kind: str, *, stored: bool = False) -> list:
        """The leaves of the state stored by `write` at ``(nh, ni)`` (``stored=True``: in
        their storage form, e.g. key data, to be mixed with others before
        `from_storage`)."""
        out, starts = [], self._starts(nh, ni)
        for aval, j in self._avals(kind):
            if j is None:  # zero-size: nothing stored
                s = storage_aval(aval)
                x = zeros(s.shape, s.dtype, varying(aval), explicit_sharding(aval))
            else:
                x = (
                    _host_get(0)(pools[j], starts[j])
                    if on_host(pools[j])
                    else get(pools[j], starts[j])
                )
                starts[j] = starts[j] + 1
            out.append(x if stored else from_storage(x, aval))
        return out


def _group(aval) -> tuple | None:
    """``(dtype, shape, explicit sharding, shard_map axes it varies over)`` of the pool
    that stores ``aval`` (a leaf is read back as it was stored: varying or not); None for
    a zero-size leaf, which needs no storage."""
    s = storage_aval(aval)
    if math.prod(s.shape) == 0:
        return None
    return np.dtype(s.dtype), tuple(s.shape), explicit_sharding(aval), varying(aval)
