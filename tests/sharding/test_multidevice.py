"""memento on 8 devices: values, gradients, shardings, collectives and memory.

Runs only where 8 devices exist; ``tests/test_sharding.py`` runs this file in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 CPU devices).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import memento
from memento_bench.hlo import loop_collectives

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/test_sharding.py provides them)"
)

T, B, H = 32, 512, 16  # the batch dominates memory, as in data parallelism
# "hsm-rec": HSM as the device recursion long scans use (`memento.loops._recursion`).
POLICIES = [("hsm", 4), ("ism", 40), ("msm", 8), ("auto", 6), ("hsm-rec", 4)]
# Byte budgets, where the rows and the recursion compile one step's gradient alone to
# count it (on one device; skipped where the values' types name a mesh).
BYTES = [("hsm-rec", "1MiB"), ("auto", "1MiB")]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def data():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w = jax.random.normal(k[0], (H, H), jnp.float64) * 0.3
    xs = jax.random.normal(k[1], (T, B, H), jnp.float64)
    h0 = jax.random.normal(k[2], (B, H), jnp.float64) * 0.1
    return w, h0, xs


def loss(w, h0, xs, scan):
    def cell(h, x):
        h = jnp.tanh(h @ w + x)
        return h, jnp.sum(h**2, axis=1)

    h, ys = scan(cell, h0, xs)
    return jnp.sum(ys * jnp.arange(T)[:, None]) + jnp.sum(jnp.sin(h))


def budgeted(policy, memory):
    if policy != "hsm-rec":
        return lambda f, init, xs: memento.scan(f, init, xs, memory=memory, policy=policy)

    return lambda f, init, xs: memento.scan(
        f, init, xs, memory=memory, policy="hsm", executor="recursion"
    )


def mesh(types=AxisType.Auto, shape=(8,), names=("b",)):
    return jax.make_mesh(shape, names, axis_types=(types,) * len(shape))


def assert_close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-9, atol=1e-9)


def data_parallel():
    w, h0, xs = data()
    m = mesh()
    return (
        w,
        jax.device_put(h0, NamedSharding(m, P("b"))),
        jax.device_put(xs, NamedSharding(m, P(None, "b"))),
    )


GRAD = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)


@functools.cache
def _data_parallel_reference():
    """lax.scan's gradient and loop collectives, compiled once for the policies below."""
    with jax.enable_x64(True):
        args = data_parallel()
        compiled = GRAD.lower(*args, lax.scan).compile()
        return compiled(*args), loop_collectives(compiled.as_text())


@pytest.mark.parametrize("policy,memory", POLICIES + BYTES)
def test_jit_data_parallel(policy, memory):
    w, h0, xs = data()
    args = data_parallel()
    ours = budgeted(policy, memory)
    # compiled once: run, and its text and memory inspected
    c_ours = GRAD.lower(*args, ours).compile()
    got = c_ours(*args)
    want, theirs = _data_parallel_reference()
    assert_close(got, want)
    for a, b in zip(got, want):  # the gradients are sharded as lax.scan's
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    # no collective in the loops that lax.scan's loops lack
    mine = loop_collectives(c_ours.as_text())
    for kind in ("all-gather", "all-to-all", "collective-permute"):
        assert len(mine[kind]) <= len(theirs[kind]), (kind, mine, theirs)
    # storage is split over the devices: per-device temp memory about 1/8 of one device's
    one = jax.devices()[0]
    single = GRAD.lower(
        jax.device_put(w, one), jax.device_put(h0, one), jax.device_put(xs, one), ours
    ).compile()
    per_device = c_ours.memory_analysis().temp_size_in_bytes
    alone = single.memory_analysis().temp_size_in_bytes
    assert per_device <= 1.25 * alone / 8, (per_device, alone)


@pytest.mark.parametrize("policy,memory", [*POLICIES[:2], POLICIES[-1], *BYTES])
def test_jit_explicit_sharding(policy, memory):
    # Explicit mesh axes: every value's type carries its sharding, storage included.
    w, h0, xs = data()
    m = mesh(AxisType.Explicit)
    h0s = jax.device_put(h0, NamedSharding(m, P("b")))
    xss = jax.device_put(xs, NamedSharding(m, P(None, "b")))
    grad = jax.jit(jax.grad(loss, (1, 2)), static_argnums=3)
    got, want = grad(w, h0s, xss, budgeted(policy, memory)), grad(w, h0s, xss, lax.scan)
    assert_close(got, want)
    for a, b in zip(got, want):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.parametrize("policy,memory", POLICIES)
@pytest.mark.parametrize("grad_inside", [False, True])
def test_shard_map_with_check_vma(policy, memory, grad_inside):
    w, h0, xs = data()
    m = mesh()
    specs = (P(), P("b"), P(None, "b"))

    def run(scan):
        if grad_inside:
            body = lambda w, h0, xs: jax.grad(loss, (0, 1))(w, h0, xs, scan)
            outs = (P(), P("b"))
        else:
            body = lambda w, h0, xs: loss(w, h0, xs, scan)[None]
            outs = P("b")
        f = jax.shard_map(body, mesh=m, in_specs=specs, out_specs=outs, check_vma=True)
        if grad_inside:
            return jax.jit(f)(w, h0, xs)
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1)))(w, h0, xs)

    want = _REFERENCES.get(("shard_map", grad_inside))  # lax.scan's: once per grad_inside
    if want is None:
        want = _REFERENCES[("shard_map", grad_inside)] = run(lax.scan)
    assert_close(run(budgeted(policy, memory)), want)


_REFERENCES = {}


def test_while_loop_and_inner_loop_in_shard_map():
    w, h0, _ = data()
    m = mesh()

    def while_loss(w, h0, loop):
        def body(s):
            i, h = s
            return i + 1, jnp.tanh(h @ w)

        return jnp.sum(loop(lambda s: s[0] < 5, body, (0, h0))[1] ** 2)[None]

    def unrolled(cond, body, s):
        for _ in range(8):
            s = jax.tree_util.tree_map(lambda a, b, s=s: jnp.where(cond(s), a, b), body(s), s)
        return s

    ours = functools.partial(memento.while_loop, memory=3, max_steps=8)
    for loop in (ours, unrolled):
        f = jax.shard_map(
            lambda w, h, loop=loop: while_loss(w, h, loop), mesh=m,
            in_specs=(P(), P("b")), out_specs=P("b"), check_vma=True,
        )  # fmt: skip
        g = jax.jit(jax.grad(lambda w, h, f=f: jnp.sum(f(w, h)), (0, 1)))(w, h0)
        if loop is ours:
            got = g
    assert_close(got, g)

    batches = jax.random.normal(jax.random.PRNGKey(3), (6, B, H), jnp.float64)

    def meta(eta, batches, memory):
        def inner(p, eta, x):
            return eta * jnp.mean((x @ p) ** 2)

        p = memento.meta.inner_loop(inner, optax.sgd(0.1), w, eta, batches, memory=memory)
        return jnp.sum(p**2)[None]

    def run(memory):
        f = jax.shard_map(
            lambda e, b: meta(e, b, memory), mesh=m, in_specs=(P(), P(None, "b")),
            out_specs=P("b"), check_vma=True,
        )  # fmt: skip
        return jax.jit(jax.grad(lambda e, b: jnp.sum(f(e, b))))(0.5, batches)

    assert_close(run(2), run(None))


def test_model_parallel_hidden_sharded():
    # The hidden dimension sharded: values and gradients right. The body itself gathers h
    # for its contraction, and recomputing steps repeats that gather; storage adds none:
    # every gather in memento's loops is of a value lax.scan's loops gather too.
    w, h0, xs = data()
    m = mesh(shape=(2, 4), names=("b", "m"))
    h0s = jax.device_put(h0, NamedSharding(m, P("b", "m")))
    xss = jax.device_put(xs, NamedSharding(m, P(None, "b", "m")))
    ws = jax.device_put(w, NamedSharding(m, P(None, "m")))
    # each program compiled once: run, and its collectives read
    c_ours, c_ref = (GRAD.lower(ws, h0s, xss, s).compile() for s in (budgeted("hsm", 4), lax.scan))
    assert_close(c_ours(ws, h0s, xss), c_ref(ws, h0s, xss))
    mine, theirs = loop_collectives(c_ours.as_text()), loop_collectives(c_ref.as_text())
    assert mine["all-gather"] and set(mine["all-gather"]) <= set(theirs["all-gather"])
    assert not mine["all-to-all"] and not mine["collective-permute"]


def test_while_loop_under_jit_data_parallel():
    w, h0, _ = data()
    m = mesh()
    h0s = jax.device_put(h0, NamedSharding(m, P("b")))

    def run(w, h0, loop):
        def body(s):
            i, h = s
            return i + 1, jnp.tanh(h @ w)

        return jnp.sum(loop(lambda s: s[0] < 6, body, (0, h0))[1] ** 2)

    def unrolled(cond, body, s):
        for _ in range(6):
            s = body(s)
        return s

    ours = functools.partial(memento.while_loop, memory=3, max_steps=10)
    grad = jax.jit(jax.grad(run, (0, 1)), static_argnums=2)
    compiled = grad.lower(w, h0s, ours).compile()  # once: run, and its collectives read
    got = compiled(w, h0s)
    assert_close(got, grad(w, h0s, unrolled))
    assert got[1].sharding.is_equivalent_to(h0s.sharding, 2)
    coll = loop_collectives(compiled.as_text())
    assert not coll["all-gather"] and not coll["all-to-all"], coll
