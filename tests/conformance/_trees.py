"""Random carries for the randomised tests: leaves of mixed dtypes and shapes (scalars,
vectors, zero-size), special values (NaN, inf, -0.0), budgets from one slot to 2^40
bytes, and an exact comparison of the results.

A carry is a list of `Leaf`: ``smooth`` floats (float64, float32, complex128) that a
tanh recurrence couples together; ``special`` floats (float64, float32) that hold NaN,
inf and signed zeros and are updated element by element (so a NaN stays where it is and
its position can be compared exactly); ``count`` leaves (ints, uint8, bool) that are not
differentiated. The special leaves reach the coupling through ``where(isfinite)``, which
keeps their NaNs out of the other leaves in both passes.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import memento

SHAPES = [(), (3,), (0,), (2, 0), (2, 2)]
SMOOTH = [np.float64, np.float32, np.complex128]
SPECIAL = [np.float64, np.float32]
COUNT = [np.int32, np.uint8, np.int8, np.bool_]
# What an update of a special leaf meets: a multiplier of 0 turns inf into NaN.
SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0])
TOP = 2**40  # the largest budget drawn, in bytes


@dataclasses.dataclass(frozen=True)
class Leaf:
    kind: str  # "smooth", "special" or "count"
    dtype: type
    shape: tuple
    y: str = "none"  # what the step outputs for it: "none", "self" or "sum"

    def __repr__(self):
        return f"{self.kind}:{np.dtype(self.dtype).name}{list(self.shape)}:{self.y}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def differentiable(self) -> bool:
        return self.kind != "count"


@st.composite
def leaf(draw, kinds=("smooth", "special", "count")):
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from({"smooth": SMOOTH, "special": SPECIAL, "count": COUNT}[kind]))
    y = draw(st.sampled_from(["none", "self", "sum"] if kind != "count" else ["none", "self"]))
    return Leaf(kind, dtype, draw(st.sampled_from(SHAPES)), y)


def values(leaf: Leaf, rng, lead=(), specials=True):
    """An array for ``leaf`` with leading axes ``lead``; NaN, inf and signed zeros in
    about a third of a special leaf's elements (if ``specials``)."""
    shape = (*lead, *leaf.shape)
    if leaf.kind == "count":
        if leaf.dtype is np.bool_:
            return rng.integers(0, 2, shape).astype(bool)
        return rng.integers(0, 100, shape).astype(leaf.dtype)
    v = 0.3 * rng.normal(size=shape)
    if np.dtype(leaf.dtype).kind == "c":
        v = v + 0.3j * rng.normal(size=shape)
    if leaf.kind == "special" and specials:
        where = rng.random(shape) < 0.35
        v = np.where(where, rng.choice(SPECIALS, shape), v)
    return np.asarray(v).astype(leaf.dtype)


def cotangent(leaf: Leaf, rng, shape):
    """A cotangent for an output of ``leaf``: NaN, inf and -0.0 on special leaves; on
    smooth ones (which the coupling mixes) only signed zeros, so that a NaN stays local."""
    v = rng.normal(size=shape)
    if np.dtype(leaf.dtype).kind == "c":
        v = v + 1j * rng.normal(size=shape)
    pool = SPECIALS if leaf.kind == "special" else np.array([-0.0, 0.0])
    v = np.where(rng.random(shape) < 0.3, rng.choice(pool, shape), v)
    return np.asarray(v).astype(leaf.dtype)


def step(carry_leaves, x_leaves, zero_y):
    """A body ``f(carry, xs) -> (carry, ys)`` over lists of leaves. ``x_leaves`` holds,
    in this order, the multipliers of the special carry leaves (same shape and dtype), then
    smooth or count inputs of any shape; ``zero_y``: also output a zero-size array."""
    specials = [i for i, c in enumerate(carry_leaves) if c.kind == "special"]

    def f(consts, carry, xs):
        xs = xs or []
        mult = dict(zip(specials, xs[: len(specials)]))
        drive = xs[len(specials) :]
        total = jnp.zeros((), jnp.float64)
        for c, v in zip(carry_leaves, carry):
            if c.kind == "smooth":
                total += jnp.sum(jnp.real(v)).astype(jnp.float64)
            elif c.kind == "special":
                total += jnp.sum(jnp.where(jnp.isfinite(v), v, 0)).astype(jnp.float64)
        for d, x in zip(x_leaves[len(specials) :], drive):
            if d.kind == "smooth":
                total += jnp.sum(jnp.real(x)).astype(jnp.float64)
        k = 0.1 * jnp.tanh(total)
        out, ys = [], []
        for i, (c, v) in enumerate(zip(carry_leaves, carry)):
            if c.kind == "smooth":
                v = jnp.tanh(v * jnp.asarray(consts[i]).astype(v.dtype) + k.astype(v.dtype))
            elif c.kind == "special":
                v = v * mult[i]
            elif c.dtype is np.bool_:
                v = ~v
            else:
                v = v + jnp.asarray(1, v.dtype)
            out.append(v)
            if c.y == "self":
                ys.append(v)
            elif c.y == "sum" and c.kind == "smooth":
                ys.append(jnp.sum(jnp.abs(v) ** 2))
            elif c.y == "sum":  # element by element, as the special leaf itself
                ys.append(jnp.where(jnp.isfinite(v), v, 0) * jnp.where(jnp.signbit(v), 2, 3))
        if zero_y:
            ys.append(jnp.zeros((0, 2)) + k)
        return out, ys

    return f


def y_leaves(carry_leaves, zero_y):
    """The `Leaf` of each output of `step`, in order (a "sum" of a smooth leaf is a
    float64 scalar... of the leaf's real dtype)."""
    out = []
    for c in carry_leaves:
        if c.y == "self" or (c.y == "sum" and c.kind == "special"):
            out.append(c)
        elif c.y == "sum":
            real = np.float32 if c.dtype is np.float32 else np.float64
            out.append(Leaf(c.kind, real, ()))
    if zero_y:
        out.append(Leaf("smooth", np.float64, (0, 2)))
    return out


@st.composite
def budgets(draw, carry_bytes: int):
    """A budget drawn log-uniformly from one slot (``carry_bytes``) to 2^40 bytes: as
    slots (an int), as a string with a unit, or as `memento.bytes_budget`."""
    lo = max(carry_bytes, 1)
    n = int(lo * (TOP / lo) ** draw(st.floats(0, 1)))
    n = min(max(n, lo), TOP)
    form = draw(st.sampled_from(["slots", "string", "bytes_budget"]))
    if form == "slots":
        return max(1, n // lo)
    if form == "bytes_budget":
        return memento.bytes_budget(n)
    unit, size = draw(
        st.sampled_from(
            [
                ("B", 1),
                ("KiB", 2**10),
                ("MiB", 2**20),
                ("GiB", 2**30),
                ("TiB", 2**40),
                ("KB", 10**3),
                ("GB", 10**9),
            ]
        )
    )
    # Plain decimals ("1099511627776B"): memory= strings take no exponent ("1.1e+12B").
    text = f"{math.ceil(n / size * 1000) / 1000:.3f}".rstrip("0").rstrip(".") + unit
    if int(float(text[: -len(unit)]) * size) < lo:  # rounded below one slot
        text = f"{lo}B"
    return text


def assert_same(got, want, context="", exact=True):
    """Same structure, shapes and dtypes; NaN and inf where ``want`` has them, zeros of the
    same sign where it has zeros, and other values close (float32 to 1e-4).

    ``exact=False`` (for forward derivatives of a backward pass): non-finite values where
    ``want`` has them, NaN and inf alike, and zeros of either sign. There JAX leaves the
    tangent of a cotangent a symbolic zero or makes it a real one depending on how the
    backward pass is written (an unrolled loop, a scan, a while loop), so 0 * inf is
    NaN in one and absent in the other: lax.scan and the unrolled loop disagree too."""
    lg, tg = jax.tree_util.tree_flatten(got)
    lw, tw = jax.tree_util.tree_flatten(want)
    assert tg == tw, (tg, tw, context)
    for i, (a, b) in enumerate(zip(lg, lw)):
        a, b = np.asarray(a), np.asarray(b)
        msg = f"{context} leaf {i}"
        assert (a.shape, a.dtype) == (b.shape, b.dtype), (a.shape, a.dtype, b.shape, b.dtype, msg)
        if a.dtype.kind not in "fc":
            np.testing.assert_array_equal(a, b, err_msg=msg)
            continue
        tol = 1e-4 if a.dtype in (np.float32, np.complex64) else 1e-9
        for x, y in ((a.real, b.real), (a.imag, b.imag)) if a.dtype.kind == "c" else ((a, b),):
            if not exact:
                finite = np.isfinite(y)
                np.testing.assert_array_equal(np.isfinite(x), finite, err_msg="inf at " + msg)
                np.testing.assert_allclose(x[finite], y[finite], rtol=tol, atol=tol, err_msg=msg)
                continue
            np.testing.assert_array_equal(np.isnan(x), np.isnan(y), err_msg="NaN at " + msg)
            special = np.isinf(y) | (y == 0)
            np.testing.assert_array_equal(x[special], y[special], err_msg="inf/0 at " + msg)
            np.testing.assert_array_equal(
                np.signbit(x[special]), np.signbit(y[special]), err_msg="signs at " + msg
            )
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol, err_msg=msg)
