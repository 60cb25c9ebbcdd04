"""The reproducers of the conformance issue, as reported, one test each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento

from ._variants import assert_close


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm", "auto"])
def test_hessian_of_a_tanh_rnn_is_exact(policy):
    # Reported: max |H - H_lax| = 5.4 on entries up to 11.8; all zeros under ISM.
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    w = jax.random.normal(k1, (4, 4), jnp.float64) * 0.5
    xs = jax.random.normal(k2, (20, 4), jnp.float64)

    def loss(w, scan):
        h, ys = scan(lambda h, x: (jnp.tanh(w @ h + x), jnp.sum(h**2)), jnp.ones(4), xs)
        return ys.sum() + h.sum()

    budget = 40 if policy == "ism" else 5
    got = jax.hessian(loss)(w, lambda f, i, x: memento.scan(f, i, x, memory=budget, policy=policy))
    ref = jax.hessian(loss)(w, lax.scan)
    assert float(jnp.max(jnp.abs(ref))) > 1.0  # a Hessian worth comparing
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_grad_of_a_python_float():
    # Reported: RuntimeError "the step's residual structure changed between traces".
    def f(a, scan):
        return scan(lambda c, x: (c * a + x, c), 0.0, jnp.arange(5.0))[0]

    got = jax.grad(f)(0.7, lambda *a: memento.scan(*a, memory=2))
    assert_close(got, jax.grad(f)(0.7, lax.scan))


def test_dtypes_lax_scan_takes():
    # complex carries, typed keys, a weakly typed init, a Python literal output
    mul = lambda c, x: (c * x.astype(c.dtype), c)
    c = memento.scan(mul, 1 + 1j, jnp.arange(1.0, 4.0), memory=2)
    # (lax.scan marks these ys weakly typed, though its carry is not: weak types of
    # outputs forwarded from a promoted init are the one documented difference.)
    assert_close(c, lax.scan(mul, 1 + 1j, jnp.arange(1.0, 4.0)))
    split = lambda k, _: (jax.random.split(k)[0], jax.random.key_data(k))
    assert_close(
        memento.scan(split, jax.random.key(0), None, length=4, memory=2),
        lax.scan(split, jax.random.key(0), None, length=4),
    )
    cond, body = lambda s: s[1] < 3, lambda s: (jax.random.split(s[0])[0], s[1] + 1)
    assert_close(
        memento.while_loop(cond, body, (jax.random.key(0), 0), memory=2),
        lax.while_loop(cond, body, (jax.random.key(0), 0)),
    )
    xs8 = jnp.ones(5, jnp.int8)
    add = lambda c, x: (c + x, x)
    assert (
        memento.scan(add, 0, xs8, memory=2)[0].dtype == lax.scan(add, 0, xs8)[0].dtype == jnp.int8
    )
    lit = lambda c, x: (c * x, 0)
    assert_close(
        jax.grad(lambda c: memento.scan(lit, c, jnp.arange(3.0), memory=2)[0])(2.0),
        jax.grad(lambda c: lax.scan(lit, c, jnp.arange(3.0))[0])(2.0),
    )
