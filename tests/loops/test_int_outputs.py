"""Integer outputs of the loops carry no tangent, as those of lax.while_loop and lax.scan.

A custom VJP hands its integer outputs a ``float0`` tangent that JAX does not treat as a
symbolic zero, so under ``jax.grad`` any later primitive without a JVP rule failed on
them (Equinox's ``unvmap_max`` in Diffrax's progress meters). ``opaque`` below is such a
primitive: the identity, with no differentiation rule at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

import memento

opaque_p = Primitive("memento_test_opaque")
opaque_p.def_impl(lambda x: x)
opaque_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(opaque_p, mlir.lower_fun(lambda x: x, multiple_results=False))
batching.primitive_batchers[opaque_p] = lambda args, dims: (opaque_p.bind(*args), dims[0])


def opaque(x):
    return opaque_p.bind(x)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def test_the_primitive_has_no_jvp_rule():
    # Without memento's fix the tests below fail with this error.
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'memento_test_"):
        jax.grad(lambda x: opaque(x))(1.0)


def step(c):
    i, flag, h = c
    return i + 1, jnp.logical_not(flag), jnp.sin(h) * 1.3 + 0.1


@pytest.mark.parametrize("memory", [1, 3, None])
def test_while_loop_int_outputs_feed_a_primitive_without_jvp(memory):
    def loss(loop, h0):
        i, flag, h = loop(h0)
        # The int and bool outputs go through the primitive with no JVP rule.
        return jnp.sum(h**2) * opaque(i) + opaque(flag).astype(h.dtype)

    def mine(h0):
        return memento.while_loop(
            lambda c: c[0] < 7, step, (jnp.int32(0), jnp.bool_(True), h0),
            max_steps=10, memory=memory,
        )  # fmt: skip

    def unrolled(h0):
        c = (jnp.int32(0), jnp.bool_(True), h0)
        for _ in range(7):
            c = step(c)
        return c

    h0 = jnp.array([0.3, -1.2, 0.0])
    got = jax.jit(jax.value_and_grad(lambda h: loss(mine, h)))(h0)
    want = jax.value_and_grad(lambda h: loss(unrolled, h))(h0)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13)
    # Under vmap with a batched predicate (members stop at their own step).
    n = jnp.array([2, 5])
    hs = jnp.stack([h0, -h0])

    def batched(n, h0):
        i, _, h = memento.while_loop(
            lambda c: c[0] < n, step, (jnp.int32(0), jnp.bool_(True), h0), memory=2
        )
        return jnp.sum(h**2) * opaque(i)

    def batched_unrolled(n, h0):
        c = (jnp.int32(0), jnp.bool_(True), h0)
        for _ in range(n):
            c = step(c)
        return jnp.sum(c[2] ** 2) * c[0]

    got = jax.vmap(jax.grad(batched, argnums=1))(n, hs)
    for k in range(2):
        want = jax.grad(batched_unrolled, argnums=1)(int(n[k]), hs[k])
        np.testing.assert_allclose(got[k], want, rtol=1e-13)


@pytest.mark.parametrize("memory", [1, 3, None])
def test_scan_int_outputs_feed_a_primitive_without_jvp(memory):
    def body(c, x):
        i, h = c
        return (i + 1, jnp.sin(h) * x), (i * 2, jnp.int8(3), h)

    def loss(scan, h0, xs):
        (i, h), (js, k, hs) = scan(body, (jnp.int32(0), h0), xs)
        return (jnp.sum(h) + jnp.sum(hs**2)) * opaque(i) + jnp.sum(opaque(js) * opaque(k))

    h0, xs = jnp.array([0.3, -1.2]), jnp.linspace(0.5, 1.5, 6)
    args = (h0, xs)
    mine = jax.jit(jax.value_and_grad(
        lambda h, x: loss(lambda *a: memento.scan(*a, memory=memory), h, x), argnums=(0, 1)
    ))(*args)  # fmt: skip
    want = jax.value_and_grad(lambda h, x: loss(lax.scan, h, x), argnums=(0, 1))(*args)
    for g, w in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-13)
