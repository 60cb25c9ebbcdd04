"""The scans every conformance test runs: ``lax.scan`` and memento's variants.

Each variant is a drop-in ``scan(f, init, xs=None, length=None, reverse=False, unroll=1)``.
The memento variants cover every policy, budgets of 1 and 2 slots, a third of the length
and more than the length, ``unroll`` and a byte budget. Every HSM and auto variant runs
through both executors of `memento.scan`: ``executor="rows"`` (the schedule as rows of
data) and ``executor="recursion"`` (HSM's binomial recursion on the device; auto then
plans HSM). ISM and MSM run as rows only, the one executor they have. The `HOST` variants
add a host level (``host_memory=``, from one host slot to unbounded, cheap and dear
transfers): two-level plans, run by the rows. Tests compare each with ``lax.scan`` (or an
unrolled loop) in float64.

The executor acts only in the backward pass: a loop that is not differentiated is
``lax.scan`` whatever it says, so the value-only tests take `ROWS` (no recursion twins).
"""

import dataclasses
import functools
import math

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
    executor: str = "rows"  # `memento.scan`'s executor=
    host_memory: object = None  # `memento.scan`'s host_memory= and transfer_cost=
    transfer_cost: object = None

    def __call__(self, f, init, xs=None, length=None, reverse=False, unroll=1):
        if self.memory is None:
            return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)
        return memento.scan(
            f, init, xs, length, reverse, max(unroll, self.unroll),
            memory=self.memory, policy=self.policy,
            executor=self.executor,
            host_memory=self.host_memory, transfer_cost=self.transfer_cost,
        )  # fmt: skip

    def __repr__(self):
        return self.name


def recursion(v: Variant) -> Variant:
    """``v`` through the device recursion: its twin with ``executor="recursion"``."""
    return dataclasses.replace(v, name=v.name.replace("-", "-rec-", 1), executor="recursion")


LAX = Variant("lax.scan")
ROWS = [
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
]
# The recursion twin of every variant whose policy it runs (HSM; auto, planned as HSM).
RECURSION = [recursion(v) for v in ROWS if v.policy in ("hsm", "auto")]
# Two-level plans: 1 host slot to unbounded, transfers cheaper and dearer than a step.
HOST = [
    Variant("host-hsm-1-1", 1, "hsm", host_memory=1, transfer_cost=0.5),
    Variant("host-hsm-2-inf", 2, "hsm", host_memory=math.inf, transfer_cost=0.1),
    Variant("host-msm-2-3", 2, "msm", host_memory=3, transfer_cost=(2.0, 0.5)),
    Variant("host-auto-third-inf", T // 3, "auto", host_memory=math.inf, transfer_cost=0.5),
    Variant("host-auto-bytes", "96B", "auto", host_memory="1MiB", transfer_cost=0.3),
]
# The static executor (nested lax.scans of static lengths), planned by auto for a slot or
# byte budget: 75% of what storing every step takes makes it nest.
STATIC = [
    Variant("static-slots", "75%", "auto", executor="static"),
    Variant("static-unroll", "75%", "auto", unroll=2, executor="static"),
    Variant("static-bytes", "64KiB", "auto", executor="static"),
]
MEMENTO = [*ROWS, *RECURSION, *HOST, *STATIC]
# A smaller set for the costlier tests (vmap, second order, complex and low precision,
# ...): each executor (rows, recursion, host level) at one slot and with unroll, MSM's
# rows and the host level's. Auto runs the program of the policy it picks (through the
# recursion, HSM's): auto-third and its twin run the gradient tests, and auto the PATHS.
_FEW = [
    "hsm-1", "hsm-rec-1", "msm-third", "hsm-unroll", "hsm-rec-unroll", "host-msm-2-3",
    "static-slots",
]  # fmt: skip
FEW = [v for v in MEMENTO if v.name in _FEW]
# One variant per way a state is stored: FEW with ISM's internal states, auto planning
# from a byte budget (sized from the dtypes) and auto over an unbounded host level. The
# tests of dtypes and tree shapes (weak types, literal and None outputs, keys, leaves
# without a reverse rule) take these; the budgets in between change the schedule, not
# how a leaf is stored, and every variant runs the gradient tests.
_PATHS = ("ism-over", "auto-bytes", "host-auto-third-inf")
PATHS = [*FEW, *(v for v in MEMENTO if v.name in _PATHS)]


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
