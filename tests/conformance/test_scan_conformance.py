"""memento.scan is lax.scan: the behaviours of JAX's own scan tests, for every variant.

The catalogue follows jax-ml/jax ``tests/lax_control_flow_test.py`` (impl, grad, RNN,
vmap, reverse, unroll, xs=None, forwarding, weak types, remat of scan, higher order),
rewritten for memento: every memento variant must give lax.scan's values, types and
derivatives, first and second order, in float64. The gradient tests run every variant;
the tests of dtypes and tree shapes run one variant per way a state is stored (`PATHS`),
the costlier transformations `FEW`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento

from ._variants import FEW, HOST, LAX, MEMENTO, PATHS, RECURSION, ROWS, STATIC, T, assert_close

# Tests of values only take the rows variants: the executor acts in the backward pass.
VALUES = [LAX, *ROWS]

rng = np.random.default_rng(0)
D = rng.normal(size=2)
XS = rng.normal(size=(T, 3))  # NumPy: float64 under the x64 fixture
C0 = rng.normal(size=4)


def body(c, a):
    # JAX's testScanImpl body: y depends on the carry, the input and a closed-over array.
    b = jnp.cos(jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(c)) + jnp.sum(D))
    c = jnp.sin(c * b)
    return c, b


def pytree_body(c, x):
    h, (count, acc) = c
    h = jnp.tanh(h * x["scale"] + jnp.sum(x["v"]))
    return (h, (count + 1, acc + jnp.sum(h))), {"h2": h**2, "n": count}


def pytree_args():
    init = (C0, (jnp.int32(0), jnp.float64(0.0)))
    xs = {"scale": XS[:, 0], "v": XS}
    return init, xs


@pytest.mark.parametrize("scan", VALUES, ids=repr)
@pytest.mark.parametrize("jit", [False, True])
def test_impl(scan, jit):
    run = jax.jit(scan, static_argnums=0) if jit else scan
    assert_close(run(body, C0, XS), lax.scan(body, C0, XS), weak=True)
    init, xs = pytree_args()
    assert_close(run(pytree_body, init, xs), lax.scan(pytree_body, init, xs), weak=True)


def grad_reverse_xs_none_and_length(scan, reverse):
    def loss(c, xs):
        c, ys = scan(body, c, xs, reverse=reverse)
        (h, (_, acc)), out = scan(pytree_body, (c, (0, 0.0)), {"scale": xs[:, 1], "v": xs})
        g, zs = scan(lambda c, _: (jnp.sin(c) * 1.1, c[0]), h, None, length=5)
        weights = jnp.arange(T, dtype=ys.dtype)
        return jnp.sum(ys * weights) + acc + jnp.sum(out["h2"]) + jnp.sum(g) + zs.sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(C0, XS)


# lax.scan's results, computed once for every variant that compares with them (the
# references of the costlier tests below are cached the same way).
lax_grad_reverse_xs_none_and_length = functools.cache(
    functools.partial(grad_reverse_xs_none_and_length, LAX)
)

_LAX_RESULTS = {}


def _lax_once(key, compute):
    """lax.scan's side of a comparison, computed by the first variant that needs it and
    reused by the others (``key`` names the test and the data the result depends on)."""
    if key not in _LAX_RESULTS:
        _LAX_RESULTS[key] = compute()
    return _LAX_RESULTS[key]


# Every variant forwards; backwards (reverse=True) one per storage path: a reversed scan is
# the same plan over the flipped steps.
REVERSE_CASES = [(s, False) for s in MEMENTO] + [(s, True) for s in PATHS]


@pytest.mark.parametrize("scan,reverse", REVERSE_CASES, ids=repr)
def test_grad_reverse_xs_none_and_length(scan, reverse):
    got = grad_reverse_xs_none_and_length(scan, reverse)
    assert_close(got, lax_grad_reverse_xs_none_and_length(reverse))


def rnn(scan, params, h0, xs):
    # JAX's testScanRnn: a tanh RNN with a loss on every output.
    def step(h, x):
        h = jnp.tanh(params["W"] @ h + params["U"] @ x + params["b"])
        return h, jnp.dot(params["v"], h)

    _, ys = scan(step, h0, xs)
    return jnp.sum((ys - 0.3) ** 2)


RNN_PARAMS = {
    "W": rng.normal(size=(4, 4)) * 0.5,
    "U": rng.normal(size=(4, 3)),
    "b": rng.normal(size=4),
    "v": rng.normal(size=4),
}


def rnn_args():
    return {k: jnp.asarray(v) for k, v in RNN_PARAMS.items()}, C0, XS


def rnn_derivatives(scan, second_order: bool) -> list:
    """The RNN loss's gradient and, if ``second_order``, forward over reverse: jvp of the
    gradient, the Hessian and jacfwd of jacrev."""
    f = functools.partial(rnn, scan)

    @jax.jit  # the four derivatives in one program
    def derivatives(*args):
        out = [jax.grad(f, argnums=(0, 1, 2))(*args)]
        if second_order:
            tangent = jax.tree_util.tree_map(jnp.ones_like, args[0])
            out.append(jax.jvp(lambda p: jax.grad(f)(p, *args[1:]), (args[0],), (tangent,)))
            out.append(jax.hessian(lambda h0: f(args[0], h0, args[2]))(args[1]))
            out.append(jax.jacfwd(jax.jacrev(lambda xs: f(args[0], args[1], xs)))(args[2]))
        return out

    return derivatives(*rnn_args())


lax_rnn_derivatives = functools.cache(functools.partial(rnn_derivatives, LAX, True))

# Forward over reverse through every storage path: the FEW variants (each executor, HSM,
# MSM and the host level) and the ISM and 2-slot MSM rows. The first-order gradient of
# every other variant is test_grad_reverse_xs_none_and_length's.
SECOND_ORDER = [*FEW, *(v for v in ROWS if v.name in ("ism-over", "msm-2"))]


@pytest.mark.parametrize("scan", SECOND_ORDER, ids=repr)
def test_rnn_value_grad_and_second_order(scan):
    assert_close(rnn_derivatives(scan, True), lax_rnn_derivatives())


def vmapped(scan, in_axes) -> list:
    """Values, the gradient of a batched loss, and batched gradients, under ``vmap``."""
    c_bdim, x_bdim = in_axes
    cs = C0 if c_bdim is None else jnp.stack([C0 * (i + 1) for i in range(3)], c_bdim)
    xs = XS if x_bdim is None else jnp.stack([XS - i for i in range(3)], x_bdim)
    loss = lambda c, x: jnp.sum(jnp.sin(scan(body, c, x)[1]))

    @jax.jit  # the three in one program (eager vmap of memento.scan: tests/loops/test_scan.py)
    def run(cs, xs):
        return [
            jax.vmap(lambda c, x: scan(body, c, x), in_axes)(cs, xs),
            jax.grad(lambda c, x: jnp.sum(jax.vmap(loss, in_axes)(c, x)), (0, 1))(cs, xs),
            jax.vmap(jax.grad(loss, (0, 1)), in_axes)(cs, xs),
        ]

    return run(cs, xs)


lax_vmapped = functools.cache(functools.partial(vmapped, LAX))

# Every batching of carry and xs for one variant per executor and level; the others are
# batched in both.
_AXES = [(0, None), (None, 0), (0, 0), (1, 2)]
_EVERY_AXIS = ("hsm-1", "hsm-rec-1", "host-msm-2-3")
VMAP_CASES = [(s, a) for s in FEW for a in _AXES if a == (0, 0) or s.name in _EVERY_AXIS]


@pytest.mark.parametrize("scan,in_axes", VMAP_CASES, ids=repr)
def test_vmap(scan, in_axes):
    assert_close(vmapped(scan, in_axes), lax_vmapped(in_axes))


@pytest.mark.parametrize("scan", FEW, ids=repr)
def test_hessian_under_vmap_and_jit(scan):
    params, h0, xs = rnn_args()
    xss = jnp.stack([xs, 0.5 * xs])

    def hess(s):
        h = jax.hessian(lambda b, xs: rnn(s, {**params, "b": b}, h0, xs))
        return jax.jit(jax.vmap(h, (None, 0)))(params["b"], xss)

    assert_close(hess(scan), _lax_once("hessian-vmap-jit", lambda: hess(LAX)))


@pytest.mark.parametrize("scan", FEW, ids=repr)
def test_remat_of_scan_and_scan_in_scan(scan):
    assert_close(remat_and_nested(scan), lax_remat_and_nested())


def remat_and_nested(s):
    params, h0, xs = rnn_args()
    remat = jax.checkpoint(lambda p: rnn(s, p, h0, xs))

    def nested(w):
        def outer(c, x):
            c2, ys = s(lambda h, xi: (jnp.sin(h * w + xi), h.sum()), c, jnp.tile(x, (3, 1)))
            return c2, ys.sum()

        return jnp.sum(s(outer, h0, xs[:, :1] * jnp.ones((1, 4)))[1])

    return jax.grad(remat)(params), jax.grad(nested)(0.7)


lax_remat_and_nested = functools.cache(functools.partial(remat_and_nested, LAX))


# -- weak types and literals ---------------------------------------------------------


@pytest.mark.parametrize("scan", VALUES, ids=repr)
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32, jnp.float32, jnp.bfloat16])
def test_weakly_typed_init_takes_the_body_dtype(scan, dtype):
    # lax.scan(f, 0, int8 xs) carries int8: a Python scalar init is weakly typed.
    xs = jnp.ones(5, dtype)
    got, ref = scan(lambda c, x: (c + x, x), 0, xs), lax.scan(lambda c, x: (c + x, x), 0, xs)
    assert_close(got, ref, weak=True)
    assert got[0].dtype == dtype


@pytest.mark.parametrize("scan", [LAX, *PATHS], ids=repr)
def test_weak_types_are_kept_and_grad_of_python_floats(scan):
    # A weakly typed carry stays weak (so later arithmetic promotes as with lax.scan).
    out = scan(lambda c, _: (c * 0.5 + 1.0, c), 0.0, None, length=4)
    want = _lax_once("weak", lambda: lax.scan(lambda c, _: (c * 0.5 + 1.0, c), 0.0, None, length=4))
    assert_close(out, want, weak=True)
    assert (out[0] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16

    # The most common call of all: grad of a function of a Python float.
    def f(s, a):
        return s(lambda c, x: (c * a + x, c), 0.0, jnp.arange(5.0))[0]

    want = _lax_once("weak-grad", lambda: jax.grad(functools.partial(f, LAX))(0.7))
    assert_close(jax.grad(functools.partial(f, scan))(0.7), want)
    eta = jnp.asarray(0.7)  # weakly typed, closed over

    def g(s, w):
        return jnp.sum(s(lambda c, x: (jnp.tanh(c * w * eta + x[0]), c * eta), C0, XS)[1])

    want = _lax_once("weak-closed-over", lambda: jax.grad(functools.partial(g, LAX))(1.3))
    assert_close(jax.grad(functools.partial(g, scan))(1.3), want)


@pytest.mark.parametrize("scan", PATHS, ids=repr)
def test_literal_and_none_outputs(scan):
    def f(c, x):
        return c * x, (0, 1.5, None, x)

    assert_close(
        scan(f, 1.0, XS[:, 0]), _lax_once("literal", lambda: lax.scan(f, 1.0, XS[:, 0])), weak=True
    )
    loss = lambda s, c: s(f, c, XS[:, 0])[0] + jnp.sum(s(f, c, XS[:, 0])[1][3])
    want = _lax_once("literal-grad", lambda: jax.grad(functools.partial(loss, LAX))(1.0))
    assert_close(jax.grad(functools.partial(loss, scan))(1.0), want)
    # a literal carry output and input-to-output forwarding
    forward = lambda s: s(lambda c, x: (2.0, x), 0.0, XS)
    assert_close(forward(scan), _lax_once("forwarding", lambda: forward(lax.scan)))


# -- dtypes --------------------------------------------------------------------------


@pytest.mark.parametrize("scan", FEW, ids=repr)
def test_complex_carry_and_residuals(scan):
    r = np.random.default_rng(1)  # the same w for every variant: lax.scan's side once
    w = jnp.asarray(r.normal(size=(3, 3)) + 1j * r.normal(size=(3, 3))) * 0.4

    def loss(s, w, c0):
        def step(c, x):
            c = jnp.tanh(w @ c + x)
            return c, jnp.abs(c) ** 2

        c, ys = s(step, c0, XS.astype(jnp.complex128))
        return jnp.sum(ys) + jnp.real(jnp.sum(c * jnp.conj(c)))

    c0 = jnp.ones(3, jnp.complex128)
    args = (w, c0)
    value = lambda s: loss(s, *args)
    g = lambda s: jax.grad(functools.partial(loss, s), argnums=(0, 1))(*args)
    hvp = lambda s: jax.jvp(
        lambda c: jax.grad(functools.partial(loss, s), 1)(w, c), (c0,), (1j * c0,)
    )
    results = lambda s: (value(s), g(s), hvp(s))
    assert_close(results(scan), _lax_once("complex", lambda: results(LAX)))


# bfloat16 through every FEW variant; float16 and float32, which round the same way,
# through one variant per executor and the host level.
LOW = [(s, d) for s in FEW for d in (jnp.float16, jnp.bfloat16, jnp.float32)
       if d == jnp.bfloat16 or s.name in ("hsm-1", "hsm-rec-1", "host-msm-2-3")]  # fmt: skip


@pytest.mark.parametrize("scan,dtype", LOW, ids=lambda v: getattr(v, "__name__", repr(v)))
def test_low_precision(scan, dtype):
    params, h0, xs = rnn_args()
    low = jax.tree_util.tree_map(lambda a: a.astype(dtype), (params, h0, xs))
    exact = _lax_once("low-exact", lambda: jax.grad(rnn, argnums=2)(LAX, params, h0, xs))
    got = jax.grad(rnn, argnums=2)(scan, *low)
    ref = _lax_once(("low", dtype), lambda: jax.grad(rnn, argnums=2)(LAX, *low))
    assert got.dtype == ref.dtype == dtype
    # Rounding follows the order of operations: no worse than twice lax.scan's own error.
    err = lambda g: float(jnp.max(jnp.abs(g.astype(jnp.float64) - exact)))
    assert err(got) <= 2 * err(ref) + 1e-3


@pytest.mark.parametrize("scan", PATHS, ids=repr)
def test_keys_ints_and_bools_in_the_carry(scan):
    def step(c, x):
        key, count, flag, h = c
        key, sub = jax.random.split(key)
        h = jnp.tanh(h + x[0] * jax.random.normal(sub, h.shape))
        return (key, count + 1, jnp.logical_not(flag), h), (count, flag, jax.random.key_data(sub))

    init = (jax.random.key(0), jnp.uint8(3), jnp.bool_(True), C0)
    loss = lambda s, h: jnp.sum(s(step, (*init[:3], h), XS)[0][3])
    # the value eager, the gradient and the hessian in one jitted program
    derivatives = jax.jit(
        lambda s, h: (
            jax.grad(functools.partial(loss, s))(h),
            jax.hessian(functools.partial(loss, s))(h),
        ),
        static_argnums=0,
    )
    results = lambda s: (s(step, init, XS), *derivatives(s, C0))
    (value, *derivatives), (want, *want_derivatives) = (
        results(scan),
        _lax_once("keys", lambda: results(LAX)),
    )
    assert_close(value, want, weak=True)
    assert_close(derivatives, want_derivatives)


# -- what is differentiated ----------------------------------------------------------


@pytest.mark.parametrize("scan", PATHS, ids=repr)
def test_leaves_without_a_gradient_may_use_ops_without_a_reverse_rule(scan):
    # The counter goes through a lax.while_loop (no reverse rule); only h is perturbed.
    def step(c, x):
        h, z = c
        z = lax.while_loop(lambda z: z < 10.0, lambda z: z * 2.0 + 1.0, z * 0.0 + 1.0)
        return (jnp.tanh(h * x[0] + 0.1), z), h.sum() + lax.stop_gradient(z)

    loss = lambda s, h: jnp.sum(s(step, (h, 3.0), XS)[1])
    results = jax.jit(  # the gradient and the hessian in one program
        lambda s: (
            jax.grad(functools.partial(loss, s))(C0),
            jax.hessian(functools.partial(loss, s))(C0),
        ),
        static_argnums=0,
    )
    assert_close(results(scan), _lax_once("no-reverse-rule", lambda: results(LAX)))


@pytest.mark.parametrize("scan", FEW, ids=repr)
def test_integer_xs_and_unused_inputs(scan):
    idx = jnp.arange(T) % 3
    table = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4)))  # the same for all

    def loss(s, table, unused):
        def step(c, i):
            return jnp.sin(c + table[i]), c[0]

        return jnp.sum(s(step, C0, idx)[1]) + 0 * jnp.sum(unused[:0])

    g = lambda s: jax.grad(functools.partial(loss, s), (0, 1))(table, XS)
    assert_close(g(scan), _lax_once("integer-xs", lambda: g(LAX)))


# -- forward mode and reverse over reverse ---------------------------------------------


def forward_modes(scan) -> list:
    """Forward mode of the RNN loss and of its loop's outputs (jvp, jacfwd, linearize),
    reverse over forward, reverse over reverse (grad of grad, jacrev of jacrev, linearize of
    the gradient), forward over forward, and jvp under vmap."""
    params, h0, xs = rnn_args()
    f = functools.partial(rnn, scan)
    outs = lambda h0, xs: scan(body, h0, xs)
    v = jax.tree_util.tree_map(lambda a: jnp.cos(jnp.arange(a.size).reshape(a.shape)), params)
    dh = jnp.sin(jnp.arange(h0.size) + 1.0)

    @jax.jit
    def run(params, h0, xs):
        _, f_lin = jax.linearize(f, params, h0, xs)
        _, g_lin = jax.linearize(jax.grad(f, 1), params, h0, xs)
        return [
            jax.jvp(f, (params, h0, xs), (v, dh, jnp.cos(xs))),
            jax.jvp(outs, (h0, xs), (dh, jnp.sin(xs))),
            jax.jacfwd(outs)(h0, xs),
            f_lin(v, dh, jnp.cos(xs)),
            jax.grad(lambda p: jax.jvp(lambda p: f(p, h0, xs), (p,), (v,))[1])(params),
            jax.grad(lambda h: jnp.sum(jax.grad(f, (0, 1))(params, h, xs)[1] ** 2))(h0),
            jax.jacrev(jax.jacrev(lambda h: f(params, h, xs)))(h0),
            g_lin(v, dh, jnp.cos(xs)),
            jax.jacfwd(jax.jacfwd(lambda h: f(params, h, xs)))(h0),
            jax.vmap(lambda t: jax.jvp(lambda h: f(params, h, xs), (h0,), (t,))[1])(
                jnp.stack([dh, 2 * dh])
            ),
        ]

    return run(params, h0, xs)


@pytest.mark.parametrize("scan", SECOND_ORDER, ids=repr)
def test_forward_modes_and_reverse_over_reverse(scan):
    assert_close(forward_modes(scan), _lax_once("forward-modes", lambda: forward_modes(LAX)))


@pytest.mark.parametrize("scan", [ROWS[0], RECURSION[0], STATIC[0]], ids=repr)
def test_forward_modes_of_a_scalar_loop_eagerly(scan):
    # Outside jit: the tangent map and the backward pass run as their own programs.
    def f(a):
        return scan(lambda c, x: (jnp.sin(c * a + x), c), 0.5, XS[:, 0])[0]

    def ref(a):
        return LAX(lambda c, x: (jnp.sin(c * a + x), c), 0.5, XS[:, 0])[0]

    for d in (
        lambda g: jax.jvp(g, (0.7,), (1.3,)),
        lambda g: jax.grad(lambda a: jax.jvp(g, (a,), (1.0,))[1])(0.7),
        lambda g: jax.grad(jax.grad(g))(0.7),
        lambda g: jax.grad(jax.grad(jax.grad(g)))(0.7),
        lambda g: jax.linearize(jax.grad(g), 0.7)[1](1.0),
        lambda g: jax.hessian(g)(0.7),
    ):
        assert_close(d(f), d(ref))


def test_variants_really_are_budgeted(expanded_jaxpr):
    # The suite means something only if the memento variants run their own executor.
    loss = lambda s, c: s(body, c, XS)[1].sum()
    for s in MEMENTO:
        assert "custom_jvp_call" in str(jax.make_jaxpr(functools.partial(loss, s))(C0))
        # the backward pass is memento's interpreter loop, where lax.scan's is a scan
        # (the static executor's is nested scans: its plans are checked in test_scan_static)
        if s.executor != "static":
            assert "while[" in expanded_jaxpr(jax.grad(functools.partial(loss, s)), C0)
    assert "while[" not in expanded_jaxpr(jax.grad(functools.partial(loss, LAX)), C0)
    # and the recursion twins run another backward pass than their rows variant
    jaxpr = lambda s: expanded_jaxpr(jax.grad(functools.partial(loss, s)), C0)
    for rec in RECURSION:
        (rows,) = (s for s in ROWS if s.name == rec.name.replace("-rec", ""))
        assert jaxpr(rec) != jaxpr(rows), rec
    assert memento.scan.__module__.startswith("memento")


def test_host_variants_really_use_the_host():
    # Each two-level variant's plan stores to the host and loads back, within its budgets.
    for s in HOST:
        schedule = memento.loops.scan_schedule(
            body, C0, XS, memory=s.memory, policy=s.policy,
            host_memory=s.host_memory, transfer_cost=s.transfer_cost,
        )  # fmt: skip
        r = schedule.simulate()
        assert r.host_stores > 0 and r.host_loads > 0, (s, r)
        assert schedule.host_memory == s.host_memory or isinstance(s.host_memory, str)
