"""memento.scan with a host level (host_memory=): gradients, placement, device memory.

The conformance suite runs the two-level variants (tests/conformance/_variants.py, HOST)
through every scan test; here: budgets from one host slot to unbounded on a pytree carry
with zero-size and scalar leaves, the errors, the placement of host slots checked by
lowering for a GPU platform on the CPU, and the device memory of the compiled gradient.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento
from memento.loops import _interpreter, _pool

T = 13


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def cell(c, x):
    h, (z, s, n) = c
    h = jnp.tanh(h * 1.3 + x["v"] * s + jnp.sum(z))
    return (h, (z * 1.01, s * 0.9 + jnp.sum(h) * 0.01, n + 1)), {"y": jnp.sin(h), "s": s}


def args():
    rng = np.random.default_rng(0)
    init = (rng.normal(size=3), (np.zeros((2, 0)), 0.7))  # the float leaves
    xs = {"v": rng.normal(size=(T, 3))}
    return init, xs


def full(init):
    h, (z, s) = init
    return (h, (z, s, jnp.int32(0)))


def loss(scan, init, xs, **kw):
    (h, (_, s, _)), ys = scan(cell, full(init), xs, **kw)
    return jnp.sum(h**2) + s + jnp.sum(ys["y"] * jnp.arange(T)[:, None]) + jnp.sum(ys["s"])


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=1e-12)


@functools.cache
def _lax_grad():
    """lax.scan's gradient, once for the 24 cases below (float64: the x64 fixture)."""
    return jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)(lax.scan, *args())


# One host slot, a few, unbounded; one device slot and a few (2 of each, between them,
# planned as their neighbours).
@pytest.mark.parametrize("host", [1, 7, math.inf])
@pytest.mark.parametrize("memory", [1, 4])
@pytest.mark.parametrize("cost", [0.1, (3.0, 0.5)])
@pytest.mark.parametrize("policy", ["hsm", "auto"])
def test_gradients_equal_lax_scan_from_one_host_slot_to_unbounded(host, memory, cost, policy):
    init, xs = args()
    grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
    expected = _lax_grad()
    scan = lambda f, c, x: memento.scan(
        f, c, x, memory=memory, policy=policy, host_memory=host, transfer_cost=cost
    )
    close(grad(scan, init, xs), expected)
    s = memento.loops.scan_schedule(
        cell, full(init), xs, memory=memory, policy=policy, host_memory=host, transfer_cost=cost
    )
    r = s.simulate()
    assert r.peak_host_memory <= host and r.peak_memory <= memory


def test_vmap_jit_and_host_bytes_budget():
    init, xs = args()
    batch = jax.tree.map(lambda x: jnp.stack([x, x * 0.5]), xs)

    def g(scan, xs):
        return jax.grad(loss, argnums=2)(scan, init, xs)

    scan = lambda f, c, x: memento.scan(
        f, c, x, memory="80B", host_memory="1KiB", transfer_cost=0.5
    )
    close(jax.jit(jax.vmap(lambda x: g(scan, x)))(batch), jax.vmap(lambda x: g(lax.scan, x))(batch))


def test_without_memory_kinds_the_same_schedule_runs_on_the_device(monkeypatch):
    # Backends without a pinned_host memory: host slots stay on the device, same numbers.
    init, xs = args()
    kw = dict(memory=2, host_memory=math.inf, transfer_cost=0.2)
    grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
    scan = lambda f, c, x: memento.scan(f, c, x, **kw)
    with_host = grad(scan, init, xs)
    monkeypatch.setattr(_pool, "host_space", lambda: None)
    jax.clear_caches()
    text = jax.jit(jax.grad(lambda x: loss(scan, init, x))).lower(xs).as_text()
    assert "pinned_host" not in text
    close(jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)(scan, init, xs), with_host)


@pytest.mark.parametrize(
    "kw, match, error",
    [
        (dict(memory=2, host_memory=-1, transfer_cost=1.0), "host_memory=-1 slots is negative", ValueError),
        (dict(memory=2, host_memory=4), "needs transfer_cost", ValueError),
        (dict(memory=2, transfer_cost=1.0), "pass host_memory= too", ValueError),
        (dict(memory=2, host_memory=4, transfer_cost=-1.0), "finite and >= 0", ValueError),
        (dict(memory=2, host_memory=4, transfer_cost=1.0, executor="recursion"), "rows executor", ValueError),
        (dict(memory=8, host_memory=4, transfer_cost=1.0, policy="ism"), "policy='ism' has no two-level", ValueError),
        (dict(memory=None, host_memory=4, transfer_cost=1.0), "needs a device budget", ValueError),
        (dict(memory=2, host_memory=2.5, transfer_cost=1.0), "host_memory must be None, an int", TypeError),
        (dict(memory=2, host_memory="lots", transfer_cost=1.0), "cannot read host_memory='lots'", ValueError),
        (dict(memory=2, host_memory="abc"), "cannot read host_memory='abc'", ValueError),
        (dict(memory=2, host_memory="0B", transfer_cost=1.0), "host_memory='0B' is 0 bytes", ValueError),
        (dict(memory="lots", host_memory=2, transfer_cost=1.0), "cannot read memory='lots'", ValueError),
        (dict(memory=2, host_memory="1B", transfer_cost=1.0), "host_memory=1 bytes holds no carry", ValueError),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(kw, match, error):
    init, xs = args()
    with pytest.raises(error, match=r"memento\.scan: .*" + re.escape(match).replace(r"\ ", " ")):
        jax.grad(loss, argnums=2)(lambda f, c, x: memento.scan(f, c, x, **kw), init, xs)


# -- placement: the lowered module for a GPU, on the CPU -----------------------------------


def _placements(text: str, where: str) -> int:
    pattern = r'annotate_device_placement.*_xla_buffer_placement = "' + where + '"'
    return len(re.findall(pattern, text))


def _cuda_text(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _rows_as_constants(monkeypatch):
    """The schedule's rows as constants of the program rather than a host callback's
    results (`_interpreter.runtime_arrays`): a callback lowers only for the platform of
    the backend it runs on, so a program with one cannot be lowered for cuda on a CPU
    machine. Placement does not depend on how the rows arrive."""
    monkeypatch.setattr(
        _interpreter, "runtime_arrays", lambda arrays: [jnp.asarray(a) for a in arrays]
    )


def _expected_sites(schedule):
    """Host placements a gradient's module holds for a one-leaf carry under HSM (one
    host pool): one for the pool, one per place that stores to the host (the sweep, its
    fused last step, the backward rows), one copy back per place that loads."""
    prog = _interpreter.compile_schedule(schedule)
    branches = set(prog.primal_rows[:, 0].tolist())
    t = schedule.num_steps
    stores = (
        int((prog.host_save_hidden[: t - 1 if prog.fused_last else t, 0] >= 0).any())
        + int(prog.fused_last and prog.host_save_hidden[t - 1, 0] >= 0)
        + int(int(_interpreter._BRANCH[memento.planning.Op.HOST_SAVE_HIDDEN]) in branches)
    )
    loads = int(int(_interpreter._BRANCH[memento.planning.Op.HOST_LOAD_HIDDEN]) in branches)
    return 1 + stores, loads


@pytest.mark.parametrize("host", [None, 1, 3, math.inf])
@pytest.mark.parametrize("cost", [0.2, 2.5])
def test_host_stores_and_loads_are_placed_on_the_host(monkeypatch, host, cost):
    monkeypatch.delenv("MEMENTO_CHECKS", raising=False)  # no tags: one leaf per state
    _rows_as_constants(monkeypatch)
    W = jnp.eye(8) * 0.5
    f = lambda c, x: (jnp.tanh(W @ c + x), jnp.sum(c))
    h0, xs = jnp.ones(8), jnp.ones((40, 8)) * 0.01
    kw = dict(memory=3, policy="hsm")
    if host is not None:
        kw |= dict(host_memory=host, transfer_cost=cost)
    g = jax.grad(lambda h, x: jnp.sum(memento.scan(f, h, x, **kw)[1]) + 0.0)
    text = _cuda_text(g, h0, xs)
    if host is None:
        assert _placements(text, "pinned_host") == 0 and _placements(text, "device") == 0
        return
    s = memento.loops.scan_schedule(f, h0, xs, **kw)
    r = s.simulate()
    assert r.host_stores > 0 and r.host_loads > 0
    stores, loads = _expected_sites(s)
    assert _placements(text, "pinned_host") == stores
    assert _placements(text, "device") == loads


# -- device memory ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cell",
    [
        lambda W: lambda c, x: (jnp.tanh(W * c + x) * jnp.cos(c), jnp.sum(c)),
        lambda W: lambda c, x: (jnp.tanh(W * c + x), jnp.sum(c)),
    ],
    ids=["two residual arrays", "one carry-shaped residual"],
)
def test_device_memory_is_the_one_level_plans_plus_the_host_pools(cell):
    # On the CPU, host memory is the same RAM, and XLA:CPU counts the host pools in its
    # temporary bytes: the gradient's temporary bytes less the host pools' are at most
    # those of the one-level plan at the same device budget on the same executor (the
    # rows: two-level plans run there), within a few carries of control state. On a GPU
    # the host pools are host allocations, and the same bound should hold for the
    # device's bytes alone. The one-level plan is pinned to the rows: as the recursion
    # (what "auto" runs for HSM off the CPU) it takes far less working memory, 4.2 KB
    # against 17 KB here (`python benchmarks/device_budget.py`), and a budget compares
    # slots, not executors. The carry is 16 KiB: the executors' control state (the
    # schedule's int32 rows, counters) is a few KiB whatever the carry, and with a
    # 512-byte carry it alone came to 12 carries on an H200 (2026-11-27, jax 0.11.2);
    # at 16 KiB and 256 KiB carries the host level took 1.2 and 1.0 carries more device
    # memory than the one-level plan there (benchmarks/device_budget_by_carry.py).
    n = 2048
    W = jnp.full(n, 0.5)
    f = cell(W)
    h0, xs = jnp.ones(n), jnp.ones((200, n)) * 0.01
    carry = n * 8

    def temp(**kw):  # (device bytes, host bytes) of the gradient's temporaries
        g = jax.jit(jax.grad(lambda h, x: jnp.sum(memento.scan(f, h, x, **kw)[1])))
        m = g.lower(h0, xs).compile().memory_analysis()
        return m.temp_size_in_bytes, getattr(m, "host_temp_size_in_bytes", 0) or 0

    one, _ = temp(memory=4, executor="rows")
    for host in (5, 20, math.inf):
        kw = dict(memory=4, host_memory=host, transfer_cost=0.5)
        two, two_host = temp(**kw)
        s = memento.loops.scan_schedule(f, h0, xs, **kw)
        host_bytes = s.simulate().peak_host_memory * carry
        if two_host == 0:  # the CPU: the host pools are counted in the temporary bytes
            two, two_host = two - host_bytes, host_bytes
        assert two <= one + 4 * carry, (host, one, two, host_bytes)
        assert two_host >= host_bytes  # the host pools are really allocated
