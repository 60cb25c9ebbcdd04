"""The conformance suite on several devices: 8 simulated CPU devices, in a subprocess (the
device count is fixed when JAX starts), on a subset of it: the randomised tests with
fewer examples, a few variants of the catalogue, and a carry of scalar leaves beside a
vector sharded over every device (the slot layout once depended on the device count and
broke on scalars).
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import memento

INSIDE = "MEMENTO_DEVICES" in os.environ  # set by test_on_several_devices for its run

# The subset run on several devices: the tests below and the randomised ones, and from
# the catalogue the gradients and integer and key leaves through one variant per executor
# (the layout on several devices is the executor's; every policy, ISM and MSM included,
# runs in the randomised tests).
_VARIANTS = "hsm-1 or hsm-rec-1"
SUBSET = (
    "sharded or memento_scan_equals_lax_scan or random_carries or "
    "((grad_reverse or keys_ints or forward_modes_and_reverse_over_reverse) "
    f"and ({_VARIANTS}))"
)


@pytest.mark.skipif(INSIDE, reason="the run this test starts")
# 8 devices only: a run at 2 devices repeated this one at the same cost (about 100 CPU-s);
# tests/sharding/test_trust_multidevice.py runs the executors on 2 devices.
@pytest.mark.parametrize("devices", [8])
def test_on_several_devices(devices):
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "MEMENTO_DEVICES": str(devices),
        "MEMENTO_EXAMPLES": "2",
    }
    here = Path(__file__).parent
    files = [
        "test_devices.py",
        "test_random.py",
        "test_while_conformance.py",
        "test_scan_conformance.py",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-x",
         "-k", SUBSET, *(str(here / f) for f in files)],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    tail = run.stdout.strip().splitlines()[-1]
    assert " passed" in tail and "skipped" not in tail and "deselected" in tail, tail


# (auto through the recursion plans HSM: the program of ("hsm", "recursion").)
RUNS = [
    ("hsm", "rows"),
    ("hsm", "recursion"),
    ("msm", "rows"),
    ("ism", "rows"),
]


@pytest.mark.parametrize("memory", [1, "1TiB"])
@pytest.mark.parametrize("policy,executor", RUNS)
def test_sharded_vector_beside_scalar_leaves(policy, executor, memory):
    # On every device there is (8 in the run above, 1 in the plain suite).
    if INSIDE:
        assert jax.device_count() == int(os.environ["MEMENTO_DEVICES"])
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("b",), axis_types=(AxisType.Auto,))
    h = jax.device_put(jnp.linspace(-1.0, 1.0, 4 * n), NamedSharding(mesh, P("b")))
    xs = jnp.linspace(-0.5, 0.5, 12)

    def f(c, x):
        s, h, u, e, s32 = c
        h = jnp.tanh(h * s + x)
        s = jnp.sin(s + 0.1 * jnp.mean(h))
        s32 = jnp.cos(s32 * x.astype(jnp.float32) + 0.5)
        return (s, h, u + jnp.uint8(1), e * 2.0, s32), (s * jnp.sum(h), s32, u)

    def loss(scan, s, h, s32, xs):
        init = (s, h, jnp.uint8(3), jnp.zeros((0,)), s32)
        (s, h, u, e, s32), (y, y32, us) = scan(f, init, xs)
        low = s32 + jnp.sum(y32)  # float32, cast: the test runs under strict promotion too
        value = s + jnp.sum(h**2) + low.astype(s.dtype) + jnp.sum(y) + jnp.sum(e)
        return value, (u, us)

    def grads(scan):
        go = jax.jit(jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True), static_argnums=0)
        return go(scan, jnp.float64(0.5), h, jnp.float32(0.25), xs)

    def ours(f, init, xs):
        return memento.scan(f, init, xs, memory=memory, policy=policy, executor=executor)

    try:
        got = grads(ours)
    except ValueError as e:  # ISM below one internal state: a clear refusal
        assert policy == "ism" and "needs room for one internal state" in str(e), e
        return
    want = grads(lax.scan)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = 1e-5 if a.dtype == jnp.float32 else 1e-10
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)
    # the gradient of the sharded leaf is sharded as lax.scan's
    assert got[1][1].sharding.is_equivalent_to(want[1][1].sharding, 1)
