"""The static executor: a `StaticPlan` run as nested ``lax.scan``s of static lengths.

Every loop has a trip count known when the program is traced, so XLA compiles each as
it compiles ``lax.scan``. The plan's pieces run in order in the forward pass, each keeping
what `memento.planning.StaticPlan` says (the internal states of a piece stored whole, the
carries at the starts of a nest's outer segments), and in reverse in the backward pass.
An innermost segment is back-propagated as ``lax.scan``'s VJP does it, a loop that keeps
each step's residuals (`Body.save`) and a reverse loop over their pullbacks, except that
the reverse loop adds the consts' cotangents into the running ones: no segment's sum is
a buffer of its own.

Leaves are flat and split as the `Body` differentiates them: ``*_f`` leaves are
differentiated (cotangents flow), the others are closed over. A segment's start keeps
the carry's leaves that later steps' residuals depend on (`ResidualSpec.kept`); a run
again from it fills the others with their values at the nest's first step, kept once
(a counter or a log that no derivative reads is not stored per start). The residuals it
gives are those of the forward pass: they depend on the kept leaves alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax import lax

from ..planning.internals import StaticPlan
from ._body import Body, ResidualSpec, merge, split
from ._interpreter import read_index

Leaves = list


def _run(b: Body, consts, c, xs, start, n: int, unroll: int):
    """``n`` primal steps from ``c`` at step ``start``: ``(carry, ys)``, as ``lax.scan``.

    Each step reads its slice of the full ``xs``: no segment of ``xs`` is copied."""

    def step(state, _):
        c, i = state
        c, y = b(consts, c, _at(xs, i))
        return (c, i + 1), y

    (c, _), ys = lax.scan(step, (list(c), start), None, length=n, unroll=unroll)
    return c, ys


def _counted(f: Callable, state, n: int, *, reverse: bool = False):
    """``lax.scan`` of ``f(state, i)`` for ``i`` in ``range(n)`` (last first with
    ``reverse``), the index counted in the carry rather than read from an array."""

    def body(carry, _):
        state, i = carry
        i = i - 1 if reverse else i
        state, out = f(state, i)
        return (state, i if reverse else i + 1), out

    (state, _), out = lax.scan(body, (state, jnp.int32(n if reverse else 0)), None, length=n)
    return state, out


def kept_mask(b: Body, spec: ResidualSpec) -> list[bool]:
    """The carry leaves a nest's stored starts keep (`ResidualSpec.kept`)."""
    return list(spec.kept or [True] * len(b.carry_avals))


def forward(b: Body, spec: ResidualSpec, plan: StaticPlan, consts, init, xs, *, unroll: int = 1):
    """The forward pass: ``(carry, ys, saved)``, ``saved`` one entry per piece (the
    stacked residuals of its steps, or the stacked starts of its outer segments, of
    their kept leaves, and the others at the nest's first step)."""
    c, ys, saved, start = list(init), [], [], 0
    mask = kept_mask(b, spec)
    for levels in plan.pieces:
        n = math.prod(levels)
        if len(levels) == 1:
            c, y, stored = _stored_run(b, spec, consts, c, xs, start, n, unroll)
            saved.append(stored)
        else:
            fill = split(c, mask)[1]
            c, y, starts = _forward_starts(b, consts, c, xs, start, levels, unroll, mask)
            saved.append((starts, fill))
        ys.append(y)
        start += n
    ys = [jnp.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*ys)]
    return c, ys, saved


def _forward_starts(b: Body, consts, c, xs, start, levels, unroll: int, mask):
    """A nest piece forward from step ``start``: its carry, ys, and the starts of its
    ``K`` outer segments (their leaves in ``mask``)."""
    k, unit = levels[0], math.prod(levels[1:])

    def segment(c, i):
        c_end, y = _run(b, consts, c, xs, start + i * unit, unit, unroll)
        return c_end, (split(c, mask)[0], y)

    c, (starts, y) = _counted(segment, list(c), k)
    return c, [a.reshape(k * unit, *a.shape[2:]) for a in y], starts


def backward(
    b: Body, spec: ResidualSpec, plan: StaticPlan, consts, xs, saved, ct_c, ct_ys, *, unroll=1
):
    """The backward pass: ``(ct_consts_f, ct_init_f, ct_xs_f)`` for the cotangents
    ``ct_c`` (differentiated carry leaves) and ``ct_ys`` (differentiated ys, stacked).

    The cotangents of the consts are accumulated in place, step by step, in the ones it
    returns: no segment's are summed apart first."""
    kf, _ = split(consts, b.const_mask)
    xf, _ = split(xs, b.x_mask)
    state = (list(ct_c), [jnp.zeros_like(k) for k in kf], [jnp.zeros_like(x) for x in xf])
    offsets = [0]
    for levels in plan.pieces:
        offsets.append(offsets[-1] + math.prod(levels))
    spare: list = []  # arrays of pieces already back-propagated, free to reuse
    for levels, start, kept in reversed(list(zip(plan.pieces, offsets, saved))):
        if len(levels) == 1:
            state = _pull_steps(b, spec, consts, xs, ct_ys, kept, start, levels[0], state, unroll)
            continue
        starts, fill = kept
        state = _backward_nest(
            b, spec, consts, xs, ct_ys, levels, start, starts, fill, state, unroll, spare
        )
        spare.extend(starts)
    ct_c, ct_k, ct_xs = state
    return ct_k, ct_c, ct_xs


def _reuse(spare: list, shape, dtype):
    """An array of ``shape`` and ``dtype`` taken from ``spare``, or zeros."""
    for i, a in enumerate(spare):
        if a.shape == shape and a.dtype == dtype:
            return spare.pop(i)
    return jnp.zeros(shape, dtype)


def _at(stacked: Sequence, i) -> Leaves:
    """Entry ``i`` of each stacked array, ``0 <= i < len`` (in range by construction)."""
    return [read_index(a, i) for a in stacked]


def _put(a, v, i):
    """``a.at[i].set(v)`` along the first axis, in place, ``0 <= i < len(a)``."""
    return lax.dynamic_update_index_in_dim(a, v, i, 0, allow_negative_indices=False)


def _digit(j, count: int, k: int):
    """``(j // count) % k`` for ``j >= 0``, without the ops of a division by 1."""
    q = j if count == 1 else lax.div(j, jnp.int32(count))
    # Kept where the quotient is below k already (the outermost digit): XLA:CPU runs the
    # nest's backward faster with it.
    return lax.rem(q, jnp.int32(k))


def _backward_nest(
    b, spec, consts, xs, ct_ys, levels, start, outer_starts, fill, state, unroll, spare
):
    """Back-propagate a nest piece of ``levels`` from step ``start``: one loop over its
    innermost segments, last first. Its starts keep the carry's leaves in `kept_mask`;
    a run from one takes the others from ``fill``.

    Segment ``j``'s index at each level is a digit of ``j`` in the mixed radix of the
    levels. Each inner level keeps the starts of sub-segments 2..K of the segment above
    it, run again (a ``lax.cond``) when the walk enters that segment from its end. One
    loop rather than loops nested per level: the loop's operands (``ct_ys`` and ``xs``,
    which XLA may keep as unmaterialised broadcasts) reach the innermost VJP through
    one loop boundary, as in ``lax.scan``'s own backward.
    """
    *ks, inner = levels
    mask = kept_mask(b, spec)
    units = [math.prod(levels[d + 1 :]) for d in range(len(ks))]  # steps per segment
    counts = [math.prod(ks[d + 1 :]) for d in range(len(ks))]  # innermost per segment
    carry0 = _at(outer_starts, 0)
    # Level d's buffer is bufs[d - 1]: a later piece's stored starts where one has its
    # shape (a fused last segment's do), so that XLA reuses that memory, else zeros.
    # Every buffer is filled before it is read.
    bufs = [[_reuse(spare, (k - 1, *a.shape), a.dtype) for a in carry0] for k in ks[1:]]

    def refill(buf, c, pos, count, unit):
        """Runs ``count`` sub-segments of ``unit`` steps from ``c`` at step ``pos``,
        writing each end (the next one's start) into ``buf`` in place."""

        def one(i, state):
            c, buf = state
            c, _ = _run(b, consts, merge(c, fill, mask), xs, pos + i * unit, unit, unroll)
            c = split(c, mask)[0]
            return c, [_put(a, v, i) for a, v in zip(buf, c)]

        return lax.fori_loop(0, count, one, (list(c), buf))[1]

    def one(carry, j):
        state, bufs = carry
        digits = [_digit(j, counts[d], ks[d]) for d in range(len(ks))]
        c = _at(outer_starts, digits[0])
        pos = start + digits[0] * units[0]
        new_bufs = []
        for d in range(1, len(ks)):
            # Entering a level d-1 segment from its end: all lower digits at their last.
            entering = functools.reduce(
                lax.bitwise_and, [digits[e] == ks[e] - 1 for e in range(d, len(ks))]
            )
            # A loop of 0 or K-1 trips rather than a cond: the buffer is updated in place.
            trips = lax.select(entering, jnp.int32(ks[d] - 1), jnp.int32(0))
            buf = refill(bufs[d - 1], c, pos, trips, units[d])
            new_bufs.append(buf)
            later = _at(buf, lax.max(digits[d] - 1, jnp.int32(0)))
            first = digits[d] == 0
            c = [lax.select(first, a, s) for a, s in zip(c, later)]
            pos = pos + digits[d] * units[d]
        _, _, stored = _stored_run(b, spec, consts, merge(c, fill, mask), xs, pos, inner, unroll)
        state = _pull_steps(b, spec, consts, xs, ct_ys, stored, pos, inner, state, unroll)
        return (state, new_bufs), None

    (state, _), _ = _counted(one, (state, bufs), math.prod(ks), reverse=True)
    return state


def _stored_run(b: Body, spec: ResidualSpec, consts, c, xs, start, n: int, unroll: int):
    """``n`` steps from ``c`` at step ``start`` keeping each step's stored residuals
    (`Body.save`): ``(carry, ys, stored)``, ``ys`` and ``stored`` stacked."""

    def step(state, _):
        c, i = state
        c, y, stored = b.save(spec, consts, c, _at(xs, i))
        return (c, i + 1), (y, stored)

    (c, _), (ys, stored) = lax.scan(step, (list(c), start), None, length=n, unroll=unroll)
    return c, ys, stored


def _pull_steps(b: Body, spec, consts, xs, ct_ys, stored, start, n: int, state, unroll: int):
    """Back-propagate the ``n`` steps from ``start`` whose residuals are ``stored``, last
    first, adding each step's cotangents of the consts into ``state``'s running ones.

    Each step reads its slice of ``xs`` and writes its ``xs``' cotangent in place, in the
    full arrays; the cotangents of the ``ys`` are sliced per segment (XLA may hold the full
    ones as a broadcast, which a loop reading them would materialise)."""
    ct_c, ct_k, ct_xs = state

    def step(carry, inputs):
        ct_c, ct_k, ct_xs, i = carry
        stored_i, ct_y = inputs
        i = i - 1
        d_k, d_c, d_x = b.restore(spec, stored_i, consts, _at(xs, start + i))((ct_c, ct_y))
        ct_k = [a + d for a, d in zip(ct_k, d_k)]
        ct_xs = [_put(a, d, start + i) for a, d in zip(ct_xs, d_x)]
        return (list(d_c), ct_k, ct_xs, i), None

    ct_y = [lax.dynamic_slice_in_dim(a, start, n) for a in ct_ys]
    carry = (ct_c, ct_k, ct_xs, jnp.int32(n))
    (ct_c, ct_k, ct_xs, _), _ = lax.scan(
        step, carry, (stored, ct_y), length=n, reverse=True, unroll=unroll
    )
    return ct_c, ct_k, ct_xs
