"""The scans every conformance test runs: ``lax.scan`` and memento's variants.

Each variant is a drop-in ``scan(f, init, xs=None, length=None, reverse=False, unroll=1)``.
The memento variants cover every policy, budgets of 1 and 2 slots, a third of the length
and more than the length, ``unroll``, a byte budget, and HSM both as schedule rows and as
the device recursion that long scans use. Tests compare each with
``lax.scan`` (or an unrolled loop) in float64.
"""

import dataclasses
import functools

import jax
import numpy as np
from jax import lax

import memento

T = 9  # the length most tests use; budgets below are chosen against it


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    memory: object = None
    policy: str = "auto"
    unroll: int = 1
    recursion: bool = False  # HSM as the device recursion (`memento.loops._recursion`)

    def __call__(self, f, init, xs=None, length=None, reverse=False, unroll=1):
        if self.memory is None:
            return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
        return memento.scan(
            f, init, xs, length, reverse, max(unroll, self.unroll),
            memory=self.memory, policy=self.policy,
            executor="recursion" if self.recursion else "rows",
        )  # fmt: skip

    def __repr__(self):
        return self.name


LAX = Variant("lax.scan")
MEMENTO = [
    Variant("hsm-1", 1, "hsm"),
    Variant("hsm-2", 2, "hsm"),
    Variant("hsm-third", T // 3, "hsm"),
    Variant("hsm-over", T + 5, "hsm"),
    Variant("ism-over", 4 * T, "ism"),
    Variant("msm-2", 2, "msm"),
    Variant("msm-third", T // 3, "msm"),
    Variant("msm-over", 4 * T, "msm"),
    Variant("auto-third", T // 3, "auto"),
    Variant("auto-bytes", "4KiB", "auto"),
    Variant("hsm-unroll", T // 3, "hsm", unroll=2),
    Variant("hsm-rec-2", 2, "hsm", recursion=True),
    Variant("hsm-rec-third", T // 3, "hsm", unroll=2, recursion=True),
]
ALL = [LAX, *MEMENTO]
# A smaller set for the costlier tests (dtypes, second order under vmap, ...).
FEW = [MEMENTO[0], MEMENTO[2], MEMENTO[6], MEMENTO[8], MEMENTO[10], MEMENTO[-1]]


def assert_close(a, b, rtol=1e-10, atol=1e-10, weak=False):
    """Trees with the same structure, shapes, dtypes (weak types too, if ``weak``) and
    close values. Values compare weak types; gradients need not (JAX's own differ with
    the path a cotangent takes)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb):
        tx, ty = jax.typeof(x), jax.typeof(y)
        assert (tx.shape, tx.dtype) == (ty.shape, ty.dtype), (tx, ty)
        assert not weak or tx.weak_type == ty.weak_type, (tx, ty)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def jit_scan(scan):
    """``scan`` under ``jax.jit`` with the body static."""
    return functools.partial(jax.jit(scan, static_argnums=(0, 3, 4, 5)))
