"""A step's stored residuals (`ResidualSpec`): those that cheap exact operations make from
others, from ``x`` or from the consts are computed again where a pullback is rebuilt, not
stored. Gradients through every executor, Hessians and vmap against ``lax.scan`` in
float64; the spec's bytes for common cells."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento
from memento.loops._body import make_body, nbytes


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@jax.custom_vjp
def _twice(a):
    """``sin(a)``, whose VJP lists the same residual twice."""
    return jnp.sin(a)


def _twice_fwd(a):
    c = jnp.cos(a)
    return jnp.sin(a), (c, c)


def _twice_bwd(res, g):
    c, d = res
    return (0.5 * (c + d) * g,)


_twice.defvjp(_twice_fwd, _twice_bwd)


def _cell(w, smooth: bool = False):
    """A tanh step (``1 - tanh`` derived), a mask of ``x`` (derived from ``x``), an
    integer ``x`` leaf cast (derived) and a residual listed twice (derived; ``sin``
    instead with ``smooth``)."""

    def cell(h, x):
        xf, xi = x
        a = jnp.tanh(w @ h + xf) * xi.astype(h.dtype)
        a = jnp.where(xf > 0, a, 0.5 * h)
        return (jnp.sin(a) if smooth else _twice(a)), jnp.sum(a * a)

    return cell


def _inputs(steps: int, width: int = 4, seed: int = 0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(k[0], (width, width)) * 0.6
    xs = (jax.random.normal(k[1], (steps, width)), jnp.arange(steps, dtype=jnp.int32) % 3 + 1)
    return w, jax.random.normal(k[2], (width,)), xs


def _spec(cell, h0, xs):
    x0 = jax.tree_util.tree_map(lambda a: a[0], xs)
    return make_body(cell, h0, x0, name="t").residual_spec()


def test_a_tanh_cell_stores_its_input_and_output_alone():
    # tanh's VJP holds tanh(a) and 1 - tanh(a): the second is computed again.
    w, h0, _ = _inputs(4, width=8)
    xs = jnp.zeros((4, 8))
    spec = _spec(lambda h, x: (jnp.tanh(w @ h + x), jnp.sum(h)), h0, xs)
    assert nbytes(spec.stored) == 2 * 8 * 8  # h and tanh(w @ h + x), float64
    assert spec.derived is not None and len(spec.derived.jaxpr.outvars) == 1


def test_masks_casts_and_repeats_are_not_stored():
    w, h0, xs = _inputs(4)
    spec = _spec(_cell(w), h0, xs)
    names = {e.primitive.name for e in spec.derived.jaxpr.eqns}
    assert {"gt", "convert_element_type", "sub"} <= names
    assert spec.x_read == {0, 1}  # the mask reads xf, the cast xi
    # Stored: the carry, tanh(.), the select's input (0.5 * h is made from the
    # carry, stored), cos(a) once.
    assert all(s.shape == (4,) for s in spec.stored)
    assert len(spec.stored) <= 4


def _loss(scan, w, h0, xs, smooth=False):
    h, ys = scan(_cell(w, smooth), h0, xs)
    return jnp.sum(jnp.sin(ys)) + jnp.sum(h**2)


RUNS = [
    ("static", "25%"),
    ("static", 20),
    ("static", "4000B"),
    ("rows", 5),
    ("recursion", 4),
    ("auto", 3),
]


@pytest.mark.parametrize("executor, memory", RUNS)
def test_gradients_hessians_and_vmap_equal_lax_scan(executor, memory):
    w, h0, xs = _inputs(120)
    run = functools.partial(memento.scan, memory=memory, executor=executor)
    ours = functools.partial(_loss, run)
    ref = functools.partial(_loss, lax.scan)
    got = jax.grad(ours, (0, 1))(w, h0, xs)
    want = jax.grad(ref, (0, 1))(w, h0, xs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    # Forward over reverse: the same cell but for its custom VJP (JAX has no JVP of one).
    ours2 = functools.partial(_loss, run, smooth=True)
    ref2 = functools.partial(_loss, lax.scan, smooth=True)
    hess = jax.jacfwd(jax.grad(ours2))(w, h0, xs)
    np.testing.assert_allclose(hess, jax.jacfwd(jax.grad(ref2))(w, h0, xs), rtol=1e-9, atol=1e-11)
    batch = (jnp.stack([xs[0], -xs[0]]), jnp.stack([xs[1], xs[1]]))
    vg = jax.vmap(jax.grad(ours), (None, None, 0))(w, h0, batch)
    np.testing.assert_allclose(
        vg, jax.vmap(jax.grad(ref), (None, None, 0))(w, h0, batch), rtol=1e-11, atol=1e-12
    )


def test_a_chain_rebuilds_masks_from_its_layers_inputs():
    # A layer's relu mask is made from its input, which the chain keeps for it.
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    ws = [jax.random.normal(kk, (6, 6)) * 0.7 for kk in k[:3]]
    x = jax.random.normal(k[3], (6,))

    def layers(ws):
        return [functools.partial(lambda w, h: jnp.maximum(w @ h, 0.0) + 0.1 * h, w) for w in ws]

    def ours(ws):
        return jnp.sum(memento.chain(layers(ws), x, memory=2) ** 2)

    def ref(ws):
        h = x
        for f in layers(ws):
            h = f(h)
        return jnp.sum(h**2)

    for a, b in zip(jax.grad(ours)(ws), jax.grad(ref)(ws)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
