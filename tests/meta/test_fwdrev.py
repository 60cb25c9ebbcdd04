"""fwdrev_grad: the gradient equals jax.grad, its VJP equals JAX's in every mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memento
from memento.meta import fwdrev_grad

MODES = ["fwdrev", "revfwd", "revrev"]


def inner_loss(params, eta, batch, scale, key):
    """Depends on parameters and meta-parameters; has int and key arguments."""
    noise = jax.random.normal(key, batch["x"].shape[-1:])
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"]) * eta["gain"]
    err = h @ params["v"] - batch["y"]
    reg = jnp.sum(jnp.exp(eta["log_decay"]) * params["w"] ** 2)
    return jnp.mean(err**2) * scale + reg + 1e-2 * jnp.sum(noise)


def make_problem(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    params = {
        "w": jax.random.normal(ks[0], (3, 4)),
        "b": jax.random.normal(ks[1], (4,)),
        "v": jax.random.normal(ks[2], (4,)),
    }
    eta = {"gain": 1.0 + 0.1 * jax.random.normal(ks[3], (4,)), "log_decay": jnp.full((3, 4), -2.0)}
    batch = {"x": jax.random.normal(ks[4], (5, 3)), "y": jax.random.normal(ks[5], (5,))}
    return params, eta, batch


def assert_trees_close(a, b, rtol=1e-9, atol=1e-10):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("mode", MODES)
def test_value_equals_jax_grad(x64, mode):
    params, eta, batch = make_problem()
    key = jax.random.key(1)
    got = fwdrev_grad(inner_loss, mode=mode)(params, eta, batch, 2, key)
    want = jax.grad(inner_loss)(params, eta, batch, 2, key)
    assert_trees_close(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("argnums", [0, (0, 1), (1,)])
def test_vjp_equals_jax_for_every_input(x64, mode, argnums):
    """Hessian and mixed-derivative products: cotangents of params, eta and the batch."""
    params, eta, batch = make_problem()
    key = jax.random.key(1)
    ours = fwdrev_grad(inner_loss, argnums, mode=mode)
    ref = jax.grad(inner_loss, argnums)
    out, pull = jax.vjp(lambda p, e, b: ours(p, e, b, 3, key), params, eta, batch)
    out_ref, pull_ref = jax.vjp(lambda p, e, b: ref(p, e, b, 3, key), params, eta, batch)
    assert_trees_close(out, out_ref)
    ct = jax.tree.map(lambda x: jnp.cos(3.0 * x) + 0.5, out)
    assert_trees_close(pull(ct), pull_ref(ct))


@pytest.mark.parametrize("mode", MODES)
def test_closed_over_meta_parameters_get_their_cotangent(x64, mode):
    params, eta, batch = make_problem()
    key = jax.random.key(1)

    def outer(eta, grad):
        g = grad(lambda p, b: inner_loss(p, eta, b, 1, key))(params, batch)
        new = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
        return inner_loss(new, eta, batch, 1, key)

    got = jax.grad(outer)(eta, lambda f: fwdrev_grad(f, mode=mode))
    want = jax.grad(outer)(eta, jax.grad)
    assert_trees_close(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_has_aux_and_aux_cotangent(x64, mode):
    params, eta, batch = make_problem()
    key = jax.random.key(1)

    def loss(p, e, b):
        value = inner_loss(p, e, b, 1, key)
        return value, {"value": value, "count": jnp.int32(5)}

    def outer(p, e, grad):
        g, aux = grad(loss, has_aux=True)(p, e, b=batch)
        return jnp.sum(g["w"] ** 2) + aux["value"] ** 2

    (g, aux) = fwdrev_grad(loss, has_aux=True, mode=mode)(params, eta, batch)
    g_ref, aux_ref = jax.grad(loss, has_aux=True)(params, eta, batch)
    assert_trees_close((g, aux), (g_ref, aux_ref))
    got = jax.grad(outer, argnums=(0, 1))(
        params, eta, lambda f, has_aux: _kw(fwdrev_grad(f, has_aux=has_aux, mode=mode))
    )
    want = jax.grad(outer, argnums=(0, 1))(
        params, eta, lambda f, has_aux: _kw(jax.grad(f, has_aux=has_aux))
    )
    assert_trees_close(got, want)


def _kw(fn):
    """Adapts a positional-only gradient function to take the batch by keyword."""
    return lambda p, e, b: fn(p, e, b)


@pytest.mark.parametrize("mode", ["fwdrev", "revfwd"])
def test_vmap_jit_over_tasks(x64, mode):
    params, eta, _ = make_problem()
    key = jax.random.key(1)
    batches = make_problem(1)[2], make_problem(2)[2]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *batches)

    def meta(eta, batch, grad):
        g = grad(inner_loss)(params, eta, batch, 1, key)
        return jnp.sum(jax.tree.leaves(jax.tree.map(lambda x: jnp.sum(x**2), g))[0])

    got = jax.jit(jax.vmap(jax.grad(meta), (None, 0, None), 0), static_argnums=2)(
        eta, stacked, lambda f: fwdrev_grad(f, mode=mode)
    )
    want = jax.vmap(jax.grad(meta), (None, 0, None), 0)(eta, stacked, jax.grad)
    assert_trees_close(got, want)


def test_float32_default_works_and_jvp_is_refused():
    params, eta, batch = make_problem()
    key = jax.random.key(1)
    g = fwdrev_grad(inner_loss)
    assert g(params, eta, batch, 1, key)["w"].dtype == jnp.float32
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda p: g(p, eta, batch, 1, key), (params,), (params,))


def test_exported_at_top_level():
    assert memento.fwdrev_grad is fwdrev_grad


def test_bad_mode_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"memento\.fwdrev_grad: mode must be one of .* got 'fwd'"):
        fwdrev_grad(inner_loss, mode="fwd")


def test_bad_argnums_and_loss():
    with pytest.raises(TypeError, match=r"memento\.fwdrev_grad: argnums must be an int"):
        fwdrev_grad(inner_loss, argnums="0")
    with pytest.raises(TypeError, match=r"memento\.fwdrev_grad: loss_fn must be callable"):
        fwdrev_grad(3.0)
    with pytest.raises(ValueError, match=r"memento\.fwdrev_grad: argnums=7 is out of range"):
        fwdrev_grad(lambda x: jnp.sum(x), argnums=7)(jnp.ones(2))


def test_integer_argument_cannot_be_differentiated():
    with pytest.raises(TypeError, match=r"memento\.fwdrev_grad: argument 1 is differentiated"):
        fwdrev_grad(lambda x, n: jnp.sum(x) * n, argnums=1)(jnp.ones(2), 3)
