"""Meta-gradients through budgeted loops equal those of memory=None (MixFlow-MG's use case).

``fwdrev_grad``'s VJP is forward-over-reverse: a ``jvp`` of ``grad(loss)``. With a
budgeted ``memento.scan`` inside the loss, that ``jvp`` goes through the scan's backward
pass, whose stored states must carry their tangents (the word pool lost them).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import memento

from ._variants import assert_close

rng = np.random.default_rng(2)
XS = rng.normal(size=(12, 3))


def inner_loss(w, eta, xs, memory, policy="auto"):
    def cell(h, x):
        h = jnp.tanh(w @ h + eta * x)
        return h, jnp.sum(h**2)

    h, ys = memento.scan(cell, jnp.ones(3), xs, memory=memory, policy=policy)
    return jnp.sum(ys) + jnp.sum(jnp.sin(h))


@pytest.mark.parametrize("memory,policy", [(2, "hsm"), (3, "ism"), (4, "msm"), (5, "auto")])
def test_fwdrev_grad_over_a_budgeted_scan(memory, policy):
    w = rng.normal(size=(3, 3)) * 0.5
    if policy == "ism":
        memory = 40  # room for an internal state of this body

    def meta(eta, memory):
        g = memento.fwdrev_grad(functools.partial(inner_loss, memory=memory, policy=policy))
        return jnp.sum(g(w, eta, XS) ** 2)

    assert_close(jax.grad(meta)(0.8, memory), jax.grad(meta)(0.8, None))
    assert_close(jax.jit(jax.grad(meta), static_argnums=1)(0.8, memory), jax.grad(meta)(0.8, None))


@pytest.mark.parametrize("mode", ["revfwd", "revrev"])
def test_every_mode_over_a_budgeted_scan(mode):
    def meta(eta, memory):
        g = memento.fwdrev_grad(functools.partial(inner_loss, memory=memory), mode=mode)
        return jnp.sum(g(jnp.eye(3) * 0.5, eta, XS) ** 2)

    assert_close(jax.grad(meta)(0.8, 2), jax.grad(meta)(0.8, None))


def sgd_meta(steps: int, **kw):
    """``meta(eta, memory)``: the squared norm of parameters after ``steps`` of SGD at
    learning rate ``0.1 * eta`` on a weighted least-squares loss, by ``inner_loop``."""
    params = {"w": jnp.asarray(rng.normal(size=(3,)))}
    batches = jnp.asarray(rng.normal(size=(steps, 4, 3)))

    def loss(p, eta, batch):
        return eta * jnp.mean((batch @ p["w"] - 1.0) ** 2) + jnp.sum(p["w"] ** 2) * 0.01

    def meta(eta, memory):
        opt = lambda eta: optax.sgd(0.1 * eta)
        out = memento.meta.inner_loop(loss, opt, params, eta, batches, memory=memory, **kw)
        return jnp.sum(out["w"] ** 2)

    return meta


def test_forward_mode_of_a_budgeted_inner_loop_in_mode_revrev():
    meta = sgd_meta(6, mode="revrev")
    want = jax.jvp(lambda e: meta(e, None), (0.3,), (1.0,))
    assert_close(jax.jvp(lambda e: meta(e, 2), (0.3,), (1.0,)), want)


@pytest.mark.parametrize("memory", [2, "1KiB"])
def test_inner_loop_with_a_python_float_eta(memory):
    meta = sgd_meta(5)
    assert_close(jax.grad(meta)(0.2, memory), jax.grad(meta)(0.2, None))
