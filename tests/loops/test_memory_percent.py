"""``memory="5%"`` in the JAX executors: the gradient is lax.scan's, and the budget is
the documented share of storing every step (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento

T, H = 200, 8
# NumPy float64 at import: jax.numpy arrays made here would follow the process-wide
# x64 flag, and a module must not change that flag for the other tests.
XS = np.linspace(0.1, 1.0, T)[:, None] * np.ones((T, H))
C0 = np.linspace(-1.0, 1.0, H)


@pytest.fixture(autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


def cell(c, x):
    return jnp.tanh(c * x + 0.5), jnp.sum(c**2)


def loss(c0, scan, **kw):
    carry, ys = scan(cell, c0, XS, **kw)
    return jnp.sum(carry) + jnp.sum(ys)


def reference():
    return jax.grad(loss)(C0, lax.scan)


@pytest.mark.parametrize("percent", ["1%", "5%", "37.5%", "100%"])
def test_scan_gradient_and_budget_under_a_percentage(percent):
    assert jnp.asarray(C0).dtype == jnp.float64
    got = jax.grad(loss)(C0, memento.scan, memory=percent)
    np.testing.assert_allclose(got, reference(), rtol=1e-12, atol=1e-12)
    s = memento.loops.scan_schedule(cell, C0, XS, memory=percent, wrt=("init",))
    # alpha as measured (an HSM schedule reports 1): from the store-everything plan
    full = memento.loops.scan_schedule(cell, C0, XS, memory="100%", wrt=("init",), policy="ism")
    share = int(float(percent[:-1]) * T * full.alpha // 100)
    if s.policy == "static":  # planned in bytes: its rows replay its evaluations
        assert s.simulate().forward_evaluations == s.cost
    else:
        assert 1 <= s.memory <= share  # the pools may refit it lower, never higher
    if percent == "100%":
        assert s.cost == T  # every step stored: the forward sweep only


def test_scan_hundred_percent_equals_the_store_everything_budget():
    full = memento.loops.scan_schedule(cell, C0, XS, memory="100%")
    assert full.cost == T  # every step stored
    if full.policy != "static":  # a static plan's alpha is rounded from bytes
        slots = memento.loops.scan_schedule(cell, C0, XS, memory=T * full.alpha)
        assert (full.memory, full.cost, full.policy) == (slots.memory, slots.cost, slots.policy)


def test_scan_percentage_too_small_names_the_least():
    with pytest.raises(
        ValueError,
        match=r"memento.scan: memory='0.01%' of \d+ slots \(storing every step\) is less than one; pass at least",
    ):
        jax.grad(loss)(C0, memento.scan, memory="0.01%")


def test_scan_host_memory_refuses_a_percentage():
    with pytest.raises(ValueError, match=r"host_memory='5%' is a percentage; host_memory takes"):
        memento.scan(cell, C0, XS, memory=4, host_memory="5%", transfer_cost=1.0)


def test_while_loop_percentage_of_max_steps():
    def body(s):
        return jnp.sin(s[0]) * 1.01, s[1] + 1

    def f(c0, **kw):
        return memento.while_loop(lambda s: s[1] < 50, body, (c0, 0), **kw)[0].sum()

    ref = jax.grad(f)(C0, max_steps=99, memory=None)
    got = jax.grad(f)(C0, max_steps=99, memory="10%")
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(
        ValueError,
        match=r"memento.while_loop: memory='10%' is a share of storing every carry, max_steps \+ 1 slots, so it needs max_steps",
    ):
        f(C0, memory="10%")


def test_chain_percentage():
    fns = [jnp.sin, lambda x: jnp.cos(x) * 2.0, jnp.tanh]
    ref = jax.grad(lambda x: memento.chain(fns, x, memory=None).sum())(C0)
    for percent in ("30%", "100%"):
        got = jax.grad(lambda x, p=percent: memento.chain(fns, x, memory=p).sum())(C0)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    p = memento.loops.chain_plan(fns, C0, memory="100%")
    assert p.budget_bytes == sum(p.internal_bytes)
    assert p.evaluations().tolist() == [1, 1, 1]
