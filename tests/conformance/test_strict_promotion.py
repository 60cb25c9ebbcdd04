"""memento under JAX's strict settings, as Equinox's own suite runs:
``jax_numpy_rank_promotion="raise"`` and ``jax_numpy_dtype_promotion="strict"``.

A representative subset of the conformance cases runs inside both context managers:
`memento.scan` through every executor (rows, the device recursion, host slots) and
policy, `memento.while_loop` (one level, host slots, buffers, vmap, second order),
`memento.chain`, `memento.meta.inner_loop` and `memento.diffrax.CheckpointAdjoint`.
The bodies are written for the strict settings (the plain loops run them too), so any
error comes from memento's own code. Values and gradients are compared with ``lax.scan``
or the unrolled loop, in float64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento

from ._variants import PATHS, assert_close

rng = np.random.default_rng(11)
W = rng.normal(size=(3, 3)) * 0.6  # NumPy: float64 under the x64 fixture
H0 = rng.normal(size=3)
XS = rng.normal(size=(9, 3))
BUF0 = rng.normal(size=(5, 3))
BATCHES = rng.normal(size=(5, 4, 3))


@pytest.fixture(autouse=True)
def strict():
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        yield


def scan_loss(scan, w, h0, xs, reverse):
    # Beside the float64 state: a counter, a float32 and a complex leaf, a PRNG key, and
    # a pytree of ys.
    def body(c, x):
        h, n, low, z, key = c
        h = jnp.tanh(w @ h + x["v"] * x["s"])
        low = low * jnp.float32(0.9) + jnp.sum(h).astype(jnp.float32)
        z = z * lax.complex(jnp.cos(x["s"]), jnp.sin(h[0]))
        key = jax.random.split(key)[0]
        return (h, n + 1, low, z, key), {"h2": h**2, "n": n}

    init = (h0, jnp.int32(0), jnp.float32(1.0), jnp.complex128(0.5 + 1j), jax.random.key(0))
    (h, n, low, z, key), ys = scan(body, init, {"v": xs, "s": xs[:, 0]}, reverse=reverse)
    loss = jnp.sum(jnp.sin(h)) + jnp.sum(ys["h2"]) + low.astype(h.dtype) + jnp.abs(z) ** 2
    return loss, (n, ys["n"], jax.random.key_data(key))


# One variant per executor and way a state is stored: the rows (HSM at one slot, ISM's
# internal states), the device recursion (with unroll) and the host level (MSM's rows).
STRICT = [v for v in PATHS if v.name in ("hsm-1", "ism-over", "hsm-rec-unroll", "host-msm-2-3")]


@pytest.mark.parametrize("scan", STRICT, ids=repr)
def test_scan_every_executor(scan):
    def run(scan):
        return [
            jax.value_and_grad(scan_loss, (1, 2, 3), has_aux=True)(scan, W, H0, XS, reverse)
            for reverse in (False, True)
        ]

    run = jax.jit(run, static_argnums=0)
    assert_close(run(scan), run(lax.scan))


def test_scan_second_order_and_vmap():
    scan = functools.partial(memento.scan, memory=2)

    def run(scan):
        f = lambda h0: scan_loss(scan, W, h0, XS, False)[0]
        return jax.hessian(f)(H0), jax.vmap(jax.grad(f))(jnp.stack([H0, -H0]))

    run = jax.jit(run, static_argnums=0)
    assert_close(run(scan), run(lax.scan))


def rnn_while(loop, w, h0, n=7):
    def body(s):
        i, h, acc = s
        h = jnp.tanh(w @ h + 0.1 * i)
        return i + 1, h, acc + jnp.sum(h**2)

    i, h, acc = loop(lambda s: s[0] < n, body, (0, h0, 0.0))
    return jnp.sum(jnp.sin(h)) + acc, i


def unrolled(cond, body, init):
    while bool(cond(init)):
        init = body(init)
    return init


WHILE_BUDGETS = [
    dict(memory=1),
    dict(memory=None, max_steps=16),
    dict(memory=2, host_memory=3),
]


@pytest.mark.parametrize("kw", WHILE_BUDGETS, ids=str)
def test_while_loop_gradients_and_second_order(kw):
    loop = functools.partial(memento.while_loop, **kw)

    def derivatives(loop):
        f = lambda w, h0: rnn_while(loop, w, h0)[0]
        return jax.grad(f, (0, 1))(W, H0), jax.hessian(f, 1)(W, H0)

    got = jax.jit(derivatives, static_argnums=0)(loop)
    assert_close(got, derivatives(unrolled))


def test_while_loop_vmap_with_a_batched_predicate():
    def loss(loop, w, h0, n):
        return rnn_while(loop, w, h0, n)[0]

    loop = functools.partial(memento.while_loop, memory=2)
    h0s, ns = jnp.stack([H0, -H0, 0.5 * H0]), jnp.asarray([2, 7, 4])
    got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, loop), (0, 1))))(
        jnp.stack([W] * 3), h0s, ns
    )
    for k in range(3):
        want = jax.grad(loss, (1, 2))(unrolled, W, h0s[k], int(ns[k]))
        assert_close(jax.tree_util.tree_map(lambda g, k=k: g[k], got), want)


def test_while_loop_buffers_and_truncation():
    # Plain and conditional writes, one of them past the end, and a loop truncated at
    # max_steps.
    def loss(loop, w, h0, buf0):
        def body(s):
            i, h, buf = s
            h = jnp.tanh(w @ h + 0.1)
            buf = buf.at[i].set(h)
            return i + 1, h, buf

        _, h, buf = loop(lambda s: s[0] < 6, body, (0, h0, buf0))
        weights = jnp.arange(1.0, 1.0 + buf.size, dtype=buf.dtype).reshape(buf.shape)
        return jnp.sum(jnp.sin(buf) * weights) + jnp.sum(h**2)

    ours = functools.partial(memento.while_loop, memory=2, buffers=lambda s: s[2])
    buf0 = jnp.asarray(BUF0)
    got = jax.jit(jax.grad(functools.partial(loss, ours), (0, 1, 2)))(W, H0, buf0)
    assert_close(got, jax.grad(loss, (1, 2, 3))(unrolled, W, H0, buf0))

    truncated = memento.while_loop(
        lambda s: s[0] < 10, lambda s: (s[0] + 1, s[1] * 0.5), (0, H0),
        memory=2, max_steps=4, return_truncated=True,
    )  # fmt: skip
    assert bool(truncated[1]) and int(truncated[0][0]) == 4


@pytest.mark.parametrize("memory", [1, "1KiB"])
def test_chain(memory):
    layers = [lambda x, k=k: jnp.tanh(W @ x + 0.1 * k) for k in range(6)]

    def loss(chain, h0):
        return jnp.sum(chain(layers, h0) ** 2)

    ours = functools.partial(memento.chain, memory=memory)
    plain = lambda fns, x: functools.reduce(lambda x, f: f(x), fns, x)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, ours)))(H0)
    assert_close(got, jax.value_and_grad(functools.partial(loss, plain))(H0))


def test_inner_loop_and_fwdrev_grad():
    optax = pytest.importorskip("optax")
    batches = jnp.asarray(BATCHES)

    def inner(p, eta, batch):
        return eta * jnp.mean((batch @ p["w"] - 1.0) ** 2) + jnp.sum(p["w"] ** 2) * 0.01

    def meta(eta, inner_loop):
        opt = optax.sgd(0.1, momentum=0.9)  # optax's adam itself mixes int and float
        return jnp.sum(inner_loop(inner, opt, {"w": H0}, eta, batches)["w"] ** 2)

    def plain(loss, opt, params, eta, batches):
        state = opt.init(params)
        for batch in batches:
            updates, state = opt.update(jax.grad(loss)(params, eta, batch), state, params)
            params = optax.apply_updates(params, updates)
        return params

    eta = jnp.float64(0.7)
    want = jax.grad(meta)(eta, plain)
    for memory in (2, None):
        ours = functools.partial(memento.meta.inner_loop, memory=memory)
        assert_close(jax.jit(jax.grad(meta), static_argnums=1)(eta, ours), want)


def test_diffrax_checkpoint_adjoint():
    diffrax = pytest.importorskip("diffrax")
    from memento.diffrax import CheckpointAdjoint

    def loss(y0, a, adjoint):
        term = diffrax.ODETerm(lambda t, y, a: -a * y + jnp.sin(t))
        saveat = diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 7))  # a nested save loop
        sol = diffrax.diffeqsolve(
            term, diffrax.Euler(), 0.0, 1.0, 0.1, y0, a, saveat=saveat, adjoint=adjoint
        )
        return jnp.sum(sol.ys**2)

    y0, a = jnp.asarray([1.0, -0.5]), jnp.asarray([0.3, 1.2])
    grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    assert_close(
        grad(y0, a, CheckpointAdjoint(memory=2)),
        grad(y0, a, diffrax.RecursiveCheckpointAdjoint()),
    )
