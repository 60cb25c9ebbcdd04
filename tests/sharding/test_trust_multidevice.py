"""memento on several devices: the multi-device items of the trust issue (19).

Runs where 2 or more devices exist; ``tests/test_trust_sharding.py`` runs this file in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (2 CPU devices).
Every gradient is compared with ``lax.scan``'s (or the unrolled loop's) in float64.

- item 0: a carry with a scalar leaf beside a vector on 2+ devices (the pools' layout);
  one slot layout on any device count (they failed with the shaped layout of several devices).
- item 6: ``shard_map(check_vma=True)`` and an LSTM whose final cell state gets no
  cotangent: the zero cotangent memento makes must vary as the value does.
- item 10: a ``while_loop`` whose predicate varies per device, its body reading a weight
  unvaried: the weight's ``pvary`` is done before the loop, so its transpose (a
  ``psum``) runs once, after the backward loop, not in every step (a deadlock when the
  steps differ per device); a value the body casts that memento cannot move is refused.
- item 11: explicit mesh axes under ``jax.set_mesh``: the recursion (scan and
  ``while_loop``) with a batch-sharded carry, and a scalar accumulator beside it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import memento
from memento_bench.hlo import loop_collectives

pytestmark = pytest.mark.skipif(
    jax.device_count() < 2,
    reason="needs 2 devices (tests/test_trust_sharding.py provides them)",
)

B, H = 4, 8  # batch split over 2 devices
POLICIES = [("hsm", 3), ("ism", 40), ("msm", 4), ("auto", 3), ("hsm-rec", 3)]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def budgeted(policy, memory, monkeypatch):
    """``memento.scan`` with a budget; ``"hsm-rec"``: HSM run as the device recursion."""
    executor = "rows"
    if policy == "hsm-rec":
        policy, executor = "hsm", "recursion"
    return lambda f, init, xs: memento.scan(
        f, init, xs, memory=memory, policy=policy, executor=executor
    )


def mesh(types=AxisType.Auto):
    return jax.make_mesh((2,), ("b",), axis_types=(types,), devices=jax.devices()[:2])


def assert_close(a, b, tol=1e-10):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# lax.scan's (or the unrolled loop's) results, computed by the first case that needs them
# and reused by the others (other budgets and policies) that compare with the same thing.
_REFERENCES = {}


def unrolled(cond, body, s, steps):
    """The while loop unrolled ``steps`` times, each step taken only where ``cond``."""
    for _ in range(steps):
        s = jax.tree_util.tree_map(lambda a, b, s=s: jnp.where(cond(s), a, b), body(s), s)
    return s


# ----------------------------------------------------------------------------------------
# item 0: a scalar carry leaf beside a vector (the pools' layout on several devices)


def _tanh_scan(scan, carry_dtypes, t0, w, xs):
    s_dtype, v_dtype = carry_dtypes

    def step(c, x):
        t, y = c
        if jnp.issubdtype(v_dtype, jnp.floating):
            y_new = jnp.tanh(w * y + t * x).astype(v_dtype)
            t_new = jnp.tanh(t + jnp.sum(y_new) * 0.1).astype(s_dtype)
        else:  # an integer vector: counted, not differentiated
            y_new = (y + 1).astype(v_dtype)
            t_new = jnp.tanh(t * x[0] + jnp.sum(y_new.astype(s_dtype)) * 1e-3 + w[0])
        return (t_new, y_new), t_new

    y0 = jnp.arange(4).astype(v_dtype)
    (t, y), ts = scan(step, (jnp.asarray(t0, s_dtype), y0), xs)
    loss = jnp.sum(ts * ts) + jnp.sum(jnp.sin(t))
    if jnp.issubdtype(v_dtype, jnp.floating):
        loss = loss + jnp.sum(y.astype(s_dtype) ** 2)
    return loss


@pytest.mark.parametrize("policy", ["hsm", "msm", "ism", "auto"])
@pytest.mark.parametrize(
    "dtypes", [(jnp.float32, jnp.float64), (jnp.float32, jnp.uint8), (jnp.float32, jnp.float32)]
)
def test_scalar_leaf_beside_vector(policy, dtypes):
    # 50 steps, carry (t, y): a float32 scalar and a 4-vector, on 2+ devices (the shaped
    # layout): the gradient must equal lax.scan's whatever the pool of the scalar.
    xs = jax.random.normal(jax.random.PRNGKey(1), (50, 4), jnp.float64).astype(dtypes[0])
    w = jnp.linspace(0.5, 1.5, 4).astype(dtypes[0])
    memory = 40 if policy == "ism" else 6
    ours = lambda f, i, x: memento.scan(f, i, x, memory=memory, policy=policy)
    got = _TANH_GRAD(ours, dtypes, 0.3, w, xs)
    want = _TANH_GRAD(lax.scan, dtypes, 0.3, w, xs)  # compiled once per dtypes
    assert_close(got, want, tol=2e-5)  # float32 leaves


_TANH_GRAD = jax.jit(jax.grad(_tanh_scan, (2, 3, 4)), static_argnums=(0, 1))


# ----------------------------------------------------------------------------------------
# item 6: an LSTM in shard_map(check_vma=True); the final cell state gets no cotangent


def lstm_data(steps=6):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    w = jax.random.normal(k[0], (2 * H, 4 * H), jnp.float64) * 0.3
    xs = jax.random.normal(k[1], (steps, B, H), jnp.float64)
    h0 = jax.random.normal(k[2], (B, H), jnp.float64) * 0.1
    c0 = jax.random.normal(k[3], (B, H), jnp.float64) * 0.1
    return w, h0, c0, xs


def lstm_cell(w, hc, x):
    h, c = hc
    i, f, o, u = jnp.split(jnp.concatenate([h, x], -1) @ w, 4, -1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h


def lstm_loss(w, h0, c0, xs, scan):
    (h, _), ys = scan(functools.partial(lstm_cell, w), (h0, c0), xs)  # c: no cotangent
    return jnp.sum(h**2) + jnp.sum(ys * jnp.arange(1, len(xs) + 1)[:, None, None])


@pytest.mark.parametrize(
    "policy,memory,grad_inside",
    [*[(*p, False) for p in POLICIES], (*POLICIES[1], True), (*POLICIES[-1], True)],
)
def test_lstm_shard_map_check_vma(policy, memory, grad_inside, monkeypatch):
    w, h0, c0, xs = lstm_data()
    specs = (P(), P("b"), P("b"), P(None, "b"))

    def run(scan):
        if grad_inside:
            body = lambda *a: jax.grad(lstm_loss, (0, 1, 2, 3))(*a, scan)
            outs = (P(), P("b"), P("b"), P(None, "b"))
        else:
            body = lambda *a: lstm_loss(*a, scan)[None]
            outs = P("b")
        f = jax.shard_map(body, mesh=mesh(), in_specs=specs, out_specs=outs, check_vma=True)
        if grad_inside:
            return jax.jit(f)(w, h0, c0, xs)
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2, 3)))(w, h0, c0, xs)

    got = run(budgeted(policy, memory, monkeypatch))
    if ("lstm", grad_inside) not in _REFERENCES:  # lax.scan's: once per grad_inside
        _REFERENCES["lstm", grad_inside] = run(lax.scan)
    want = _REFERENCES["lstm", grad_inside]
    if grad_inside:  # each device's gradient of its own loss: w's is a varying sum
        got, want = got[1:], want[1:]
    assert_close(got, want)


def test_lstm_while_loop_shard_map_check_vma():
    w, h0, c0, _ = lstm_data()
    steps = 5

    def loss(w, h0, c0, loop):
        def body(s):
            i, h, c = s
            (h, c), _ = lstm_cell(w, (h, c), jnp.sin(h))
            return i + 1, h, c

        _, h, _ = loop(lambda s: s[0] < steps, body, (0, h0, c0))  # c: no cotangent
        return jnp.sum(h**2)[None]

    ours = functools.partial(memento.while_loop, memory=3, max_steps=8)
    ref = functools.partial(unrolled, steps=steps)
    grads = []
    for loop in (ours, ref):
        f = jax.shard_map(
            lambda w, h, c, loop=loop: loss(w, h, c, loop), mesh=mesh(),
            in_specs=(P(), P("b"), P("b")), out_specs=P("b"), check_vma=True,
        )  # fmt: skip
        grads.append(jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a)), (0, 1, 2)))(w, h0, c0))
    assert_close(*grads)


# ----------------------------------------------------------------------------------------
# item 10: per-device predicates and weights read unvaried


def rnn_data():
    k = jax.random.split(jax.random.PRNGKey(2), 2)
    w = jax.random.normal(k[0], (H, H), jnp.float64) * 0.4
    h0 = jax.random.normal(k[1], (B, H), jnp.float64)
    return w, h0


def per_device_loss(w, h0, n, loop):
    def body(s):
        i, h = s
        return i + 1, jnp.tanh(h @ w)  # w unvaried, h varying: a pvary of w in the step

    _, h = loop(lambda s: s[0] < n[0], body, (jnp.int32(0), h0))  # n[0]: this device's
    return jnp.sum(h**2)[None]


def per_device_grad(loop):
    f = jax.shard_map(
        lambda w, h, n: per_device_loss(w, h, n, loop), mesh=mesh(),
        in_specs=(P(), P("b"), P("b")), out_specs=P("b"), check_vma=True,
    )  # fmt: skip
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1)))


@pytest.mark.parametrize("memory,max_steps", [(3, 12), (2, None), (13, 12)])
def test_while_loop_per_device_predicate(memory, max_steps):
    # Device 0 stops after 3 steps, device 1 after 9. Before the fix the weight's psum ran
    # in each backward step and the devices waited for each other forever (XLA: "waiting
    # for 'all reduce' ... may be stuck"); the runner's timeout bounds this test.
    w, h0 = rnn_data()
    n = jnp.array([3, 9])
    ours = (
        per_device_grad(functools.partial(memento.while_loop, memory=memory, max_steps=max_steps))
        .lower(w, h0, n)
        .compile()
    )  # once: its collectives read, and run
    coll = loop_collectives(ours.as_text())
    assert not any(coll.values()), coll  # no collective in any loop: the psum is after
    if "per-device" not in _REFERENCES:  # the unrolled loop's: once for the three budgets
        _REFERENCES["per-device"] = per_device_grad(functools.partial(unrolled, steps=9))(w, h0, n)
    assert_close(ours(w, h0, n), _REFERENCES["per-device"])


def test_while_loop_per_device_predicate_refuses_cast_in_body():
    # A carried scale t, unvaried, multiplies the varying state: its pvary is in the step
    # and memento cannot move it (it changes every step): refused at trace time.
    w, h0 = rnn_data()

    def loss(w, h0, n, t0):
        def body(s):
            i, t, h = s
            return i + 1, t * 1.01, jnp.tanh((h @ w) * t)

        s = memento.while_loop(lambda s: s[0] < n[0], body, (jnp.int32(0), t0, h0), memory=3)
        return jnp.sum(s[2] ** 2)[None]

    f = jax.shard_map(
        loss, mesh=mesh(), in_specs=(P(), P("b"), P("b"), P()), out_specs=P("b"),
        check_vma=True,
    )  # fmt: skip
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 3)))
    with pytest.raises(NotImplementedError, match=r"predicate varies over the mesh axes \('b',\)"):
        grad.lower(w, h0, jnp.array([3, 9]), 1.0)
    # cast before the loop, as the message says: runs, and equals the unrolled loop
    grads = []
    for loop in (functools.partial(memento.while_loop, memory=3), _unrolled9):
        g = jax.shard_map(
            functools.partial(_cast_scale_loss, loop=loop), mesh=mesh(),
            in_specs=(P(), P("b"), P("b"), P()), out_specs=P("b"), check_vma=True,
        )  # fmt: skip
        grads.append(jax.jit(jax.grad(lambda *a, g=g: jnp.sum(g(*a)), (0, 1, 3)))(
            w, h0, jnp.array([3, 9]), 1.0
        ))  # fmt: skip
    assert_close(*grads)


def _unrolled9(cond, body, s):
    return unrolled(cond, body, s, 9)


def _cast_scale_loss(w, h0, n, t0, loop):
    def body(s):
        i, t, h = s
        return i + 1, t * 1.01, jnp.tanh((h @ w) * t)

    t0 = lax.pcast(t0, ("b",), to="varying")
    s = loop(lambda s: s[0] < n[0], body, (jnp.int32(0), t0, h0))
    return jnp.sum(s[2] ** 2)[None]


@pytest.mark.parametrize("policy,memory", [POLICIES[0], POLICIES[1], POLICIES[-1]])
def test_scan_weight_psum_once(policy, memory, monkeypatch):
    # memento.scan's trip count is uniform, but a psum per backward step is wasted work:
    # lax.scan's own backward loop holds one all-reduce, memento's none.
    w, h0 = rnn_data()
    xs = jax.random.normal(jax.random.PRNGKey(5), (8, B, H), jnp.float64)

    def loss(w, h0, xs, scan):
        h, ys = scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h)), h0, xs)
        return (jnp.sum(h**2) + jnp.sum(ys))[None]

    def grad(scan):
        f = jax.shard_map(
            lambda *a: loss(*a, scan), mesh=mesh(), in_specs=(P(), P("b"), P(None, "b")),
            out_specs=P("b"), check_vma=True,
        )  # fmt: skip
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2)))

    # each compiled once: run, and its loops' all-reduces read; lax.scan's once for all
    ours = grad(budgeted(policy, memory, monkeypatch)).lower(w, h0, xs).compile()
    if "psum" not in _REFERENCES:
        ref = grad(lax.scan).lower(w, h0, xs).compile()
        _REFERENCES["psum"] = ref(w, h0, xs), loop_collectives(ref.as_text())["all-reduce"]
    want, theirs = _REFERENCES["psum"]
    assert_close(ours(w, h0, xs), want)
    mine = loop_collectives(ours.as_text())["all-reduce"]
    assert not mine and theirs, (mine, theirs)


# ----------------------------------------------------------------------------------------
# item 11: explicit mesh axes under jax.set_mesh


@pytest.mark.parametrize("policy,memory", POLICIES)
def test_set_mesh_explicit_scan(policy, memory, monkeypatch):
    w, h0 = rnn_data()
    xs = jax.random.normal(jax.random.PRNGKey(5), (10, B, H), jnp.float64)
    m = mesh(AxisType.Explicit)

    def loss(w, h0, xs, scan):
        h, ys = scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h**2, axis=1)), h0, xs)
        return jnp.sum(ys) + jnp.sum(jnp.sin(h))

    grad = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
    with jax.set_mesh(m):
        h0s = jax.device_put(h0, NamedSharding(m, P("b")))
        xss = jax.device_put(xs, NamedSharding(m, P(None, "b")))
        got = grad(w, h0s, xss, budgeted(policy, memory, monkeypatch))
        if "set_mesh" not in _REFERENCES:  # lax.scan's: once for the five policies
            _REFERENCES["set_mesh"] = grad(w, h0s, xss, lax.scan)
        want = _REFERENCES["set_mesh"]
    assert_close(got, want)
    for a, b in zip(got, want):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


@pytest.mark.parametrize(
    "memory,max_steps,acc0",
    [(3, 20, 0.0), (3, None, "array"), (13, 12, 0.0), (1, None, "array")],
)
def test_set_mesh_explicit_while_scalar_accumulator(memory, max_steps, acc0):
    # A scalar accumulator (replicated) beside the batch-sharded state.
    w, h0 = rnn_data()
    m = mesh(AxisType.Explicit)

    def loss(w, h0, loop):
        def body(s):
            i, acc, h = s
            h = jnp.tanh(h @ w)
            return i + 1, acc + jnp.sum(h), h

        a0 = jnp.zeros(()) if acc0 == "array" else acc0
        _, acc, h = loop(lambda s: s[0] < 12, body, (0, a0, h0))
        return acc + jnp.sum(h**2)

    ours = functools.partial(memento.while_loop, memory=memory, max_steps=max_steps)
    grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    with jax.set_mesh(m):
        h0s = jax.device_put(h0, NamedSharding(m, P("b")))
        got = grad(w, h0s, ours)
        want = grad(w, h0s, functools.partial(unrolled, steps=12))
    assert_close(got, want)
    assert got[1].sharding.is_equivalent_to(h0s.sharding, 2)
