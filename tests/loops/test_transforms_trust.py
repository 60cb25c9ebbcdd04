"""Transformations the trust issue found wanting, each against ``lax.scan`` (or the
unrolled loop) in float64.

- Reverse over reverse reached through ``jax.checkpoint`` (and ``check_grads(order=2)``)
  is exact for ``memento.scan`` and ``memento.while_loop``; forward over reverse too,
  through ``jax.checkpoint``.
- Read-only carry leaves (returned unchanged by the body) are loop constants, as in
  ``lax.scan`` and ``lax.while_loop``: ``vmap`` keeps an unbatched one unbatched, so a
  ``cond`` with a batched predicate around the loop forwards it (JAX's
  ``test_scan_readonly_carry_optimization`` and ``test_while_readonly_carry_optimization``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import memento

T = 7
XS = np.linspace(-0.9, 1.1, T)  # NumPy: float64 whatever the x64 flag at import


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def assert_close(a, b, tol=1e-12):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


SCANS = {
    "rows-hsm": functools.partial(memento.scan, memory=2, policy="hsm", executor="rows"),
    "rows-ism": functools.partial(memento.scan, memory=4, policy="ism", executor="rows"),
    "recursion": functools.partial(memento.scan, memory=2, executor="recursion"),
}


def scan_loss(a, scan=lax.scan):
    def step(c, x):
        c = jnp.sin(c * a + x)
        return c, c * x

    c, ys = scan(step, 0.5, XS)
    return c + jnp.sum(ys**2)


def while_loss(a, unrolled=False):
    step = lambda s: (s[0] + 1, jnp.sin(s[1] * a + 0.1 * s[0]))
    if unrolled:
        s = (0, 0.5)
        for _ in range(T):
            s = step(s)
    else:
        s = memento.while_loop(lambda s: s[0] < T, step, (0, 0.5), memory=2)
    return s[1] ** 2


LOSSES = {
    **{
        f"scan-{k}": (functools.partial(scan_loss, scan=s), "memento.scan")
        for k, s in SCANS.items()
    },
    "while_loop": (while_loss, "memento.while_loop"),
}
REFERENCES = {"scan": scan_loss, "while_loop": functools.partial(while_loss, unrolled=True)}


def _reference(case):
    return REFERENCES["while_loop" if case == "while_loop" else "scan"]


# -- 7. reverse over reverse through jax.checkpoint --------------------------------------


def _reverse_over_reverse(f) -> list:
    return [
        lambda: jax.grad(jax.grad(jax.checkpoint(f)))(0.7),
        lambda: jax.jit(jax.grad(jax.grad(jax.checkpoint(f))))(0.7),
        lambda: jax.grad(jax.grad(jax.remat(f, policy=jax.checkpoint_policies.nothing_saveable)))(
            0.7
        ),
        lambda: jax.jit(
            jax.grad(
                jax.grad(jax.checkpoint(f, policy=jax.checkpoint_policies.everything_saveable))
            )
        )(0.7),
        lambda: jax.grad(lambda a: jax.grad(jax.checkpoint(f))(a) * a)(0.7),
        lambda: jax.jit(jax.jacrev(jax.jacrev(jax.checkpoint(f))))(0.7),
        lambda: jax.grad(jax.grad(f))(0.7),
        lambda: jax.grad(jax.jit(jax.grad(f)))(0.7),
        lambda: jax.jvp(jax.jit(jax.grad(f)), (0.7,), (1.0,)),
    ]


@pytest.mark.parametrize("case", LOSSES)
def test_reverse_over_reverse_through_checkpoint_is_exact(case):
    f, _ = LOSSES[case]
    for got, want in zip(_reverse_over_reverse(f), _reverse_over_reverse(_reference(case))):
        assert_close(got(), want())
    check_grads(jax.checkpoint(f), (0.7,), order=2, modes=["rev", "fwd"])


@pytest.mark.parametrize("case", LOSSES)
def test_forward_over_reverse_stays_exact(case):
    f, _ = LOSSES[case]
    ref = _reference(case)
    # (jax.hessian is jacfwd of jacrev: one of the two.)
    want = jax.hessian(ref)(0.7), jax.jvp(jax.grad(ref), (0.7,), (1.3,))
    for wrap in (lambda g: g, jax.checkpoint, jax.jit):
        g = wrap(f)
        assert_close(jax.hessian(g)(0.7), want[0])
        assert_close(jax.jvp(jax.grad(g), (0.7,), (1.3,)), want[1])
    # under vmap, and third order by forward mode over it (jitted: one program each; the
    # eager transformations are the ones above)
    a = jnp.array([0.3, 0.7, -1.2])
    vmapped = lambda f: jax.jit(jax.vmap(jax.hessian(f)))(a)
    third = lambda f: jax.jit(jax.jacfwd(jax.hessian(f)))(0.7)
    assert_close(vmapped(f), vmapped(ref))
    assert_close(third(f), third(ref))


def test_hessian_of_an_rnn_through_checkpoint_is_exact():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 3)) * 0.5)
    xs = jnp.asarray(rng.normal(size=(9, 3)))

    def loss(w, scan):
        c, ys = scan(lambda h, x: (jnp.tanh(w @ h + x), h), jnp.ones(3) * 0.1, xs)
        return jnp.sum(c**2) + jnp.sum(jnp.cos(ys))

    want = jax.jit(jax.hessian(functools.partial(loss, scan=lax.scan)))(w)  # once
    for s in SCANS.values():
        assert_close(jax.jit(jax.hessian(jax.checkpoint(functools.partial(loss, scan=s))))(w), want)


# -- 8. read-only carry leaves are loop constants -----------------------------------------


def test_jax_scan_readonly_carry_optimization():
    # JAX's test_scan_readonly_carry_optimization, with memento.scan for lax.scan.
    def f(x, y, scan):
        def g(_, y):
            y, _ = scan(lambda y, _: (y, None), y, None, length=1)
            return y

        return lax.cond(x < 0, g, g, x, y)

    for s in [lax.scan, *SCANS.values()]:
        out = jax.vmap(functools.partial(f, scan=s), (0, None), None)(jnp.arange(3.0), 3.0)
        assert float(out) == 3.0


def test_jax_while_readonly_carry_optimization():
    # JAX's test_while_readonly_carry_optimization, and the same inside a cond.
    def foo(w, x, c_max, loop):
        _, x, w = loop(lambda v: v[0] < c_max, lambda v: (v[0] + 1, v[1] @ v[2], v[2]), (0, x, w))
        return w, x

    w, xs, c_maxs = jnp.ones((2, 2)), jnp.ones((4, 2)), jnp.arange(4)
    loops = [lax.while_loop, functools.partial(memento.while_loop, memory=2, max_steps=5)]
    outs = [
        jax.vmap(functools.partial(foo, loop=loop), (None, 0, 0), (None, 0))(w, xs, c_maxs)
        for loop in loops
    ]
    assert_close(outs[0], outs[1])
    assert_close(outs[1][0], w)

    def h(x, y, loop):
        def g(_, y):
            return loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1]), (0, y))[1]

        return lax.cond(x < 0, g, g, x, y)

    for loop in loops:
        assert float(jax.vmap(functools.partial(h, loop=loop), (0, None), None)(XS, 3.0)) == 3.0


def _ro_loss(w, v, h0, xs, scan, reverse=False):
    # carry (h, w, n, v): w and v read-only (w used by the step, v only returned and
    # emitted), n an int counter.
    def step(c, x):
        h, w, n, v = c
        h = jnp.tanh(w @ h + x)
        return (h, w, n + 1, v), (h * v[0], v)

    (h, w2, n, v2), (ys, vs) = scan(step, (h0, w, 0, v), xs, reverse=reverse)
    return jnp.sum(h**2) + jnp.sum(jnp.sin(w2)) + jnp.sum(ys) + jnp.sum(v2 * vs[-1]) + 0.0 * n


RO_SCANS = {
    "hsm-1": functools.partial(memento.scan, memory=1, policy="hsm"),
    "hsm-3": functools.partial(memento.scan, memory=3, policy="hsm"),
    "recursion-2": functools.partial(memento.scan, memory=2, executor="recursion"),
    "ism-9": functools.partial(memento.scan, memory=9, policy="ism"),
    "msm-5": functools.partial(memento.scan, memory=5, policy="msm"),
    "auto-bytes": functools.partial(memento.scan, memory="2KiB"),
    "huge": functools.partial(memento.scan, memory=10**6),
}


def _ro_args(seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(3, 3)) * 0.5)
    v = jnp.asarray(rng.normal(size=(2,)))
    h0 = jnp.asarray(rng.normal(size=(3,)))
    xs = jnp.asarray(rng.normal(size=(T, 3)))
    return w, v, h0, xs


@pytest.mark.parametrize("scan", RO_SCANS, ids=str)
@pytest.mark.parametrize("reverse", [False, True])
def test_readonly_carry_gradients_equal_lax_scan(scan, reverse):
    s = RO_SCANS[scan]
    args = _ro_args()
    grad = lambda sc: jax.jit(
        jax.grad(functools.partial(_ro_loss, scan=sc, reverse=reverse), argnums=(0, 1, 2, 3))
    )(*args)
    assert_close(grad(s), grad(lax.scan))
    # values too, the read-only leaves returned as they came in (same types; lax.scan
    # hands a Python int back as it came, memento as an array of its type)
    run = lambda sc: sc(lambda c, x: (c, x), (args[0], 0, jnp.float32(1)), args[3])
    assert_close(run(s), run(lax.scan))
    types = lambda out: [jax.typeof(jnp.asarray(a)) for a in jax.tree_util.tree_leaves(out)]
    assert types(run(s)) == types(run(lax.scan))


@pytest.mark.parametrize("scan", ["hsm-1", "recursion-2", "ism-9"], ids=str)
def test_readonly_carry_under_vmap(scan):
    s = RO_SCANS[scan]
    w, v, h0, xs = _ro_args()
    ws = jnp.stack([w, 2 * w, -w])
    h0s = jnp.stack([h0, -h0, 0 * h0])
    g = lambda sc, axes: jax.jit(
        jax.vmap(jax.grad(functools.partial(_ro_loss, scan=sc), argnums=(0, 1, 2, 3)), axes)
    )
    for axes, a in [
        ((None, None, 0, None), (w, v, h0s, xs)),  # read-only leaves unbatched
        ((0, None, 0, None), (ws, v, h0s, xs)),  # a batched read-only leaf
        ((0, None, None, None), (ws, v, h0, xs)),  # only the read-only leaf batched
    ]:
        assert_close(g(s, axes)(*a), g(lax.scan, axes)(*a))

    # an unbatched read-only leaf stays unbatched, as lax.scan keeps it
    def final(h0, sc):
        (h, w2, _, _), _ = sc(
            lambda c, x: ((jnp.tanh(c[1] @ c[0] + x), *c[1:]), None), (h0, w, 0, v), xs
        )
        return h, w2

    outs = [jax.vmap(functools.partial(final, sc=sc), (0,), (0, None))(h0s) for sc in (s, lax.scan)]
    assert_close(outs[0], outs[1])


def test_readonly_carry_plans_as_a_closed_over_value():
    # A read-only carry leaf is a loop constant: the schedule (alpha included) is the one
    # of the same body closing over it, in slots and in bytes.
    w, _, h0, xs = _ro_args()
    as_carry = lambda c, x: ((jnp.tanh(c[1] @ c[0] + x), c[1]), c[0])
    closed = lambda h, x: (jnp.tanh(w @ h + x), h)
    for memory, policy in [(2, "auto"), (3, "hsm"), (9, "ism"), (5, "msm"), ("4KiB", "auto")]:
        kw = dict(memory=memory, policy=policy, executor="rows")
        assert memento.loops.scan_schedule(
            as_carry, (h0, w), xs, **kw
        ) == memento.loops.scan_schedule(closed, h0, xs, **kw)
    # wrt="init" differentiates a read-only leaf of init, as the closure's would be
    kw = dict(memory=3, executor="rows")
    assert memento.loops.scan_schedule(
        as_carry, (h0, w), xs, wrt=("init",), **kw
    ) == memento.loops.scan_schedule(closed, h0, xs, wrt=("init", "closure"), **kw)
    # a body without read-only leaves traces as before
    body = memento.loops._scan._trace(closed, h0, xs, [xs], name="t")
    assert body[2] == (False,) and body[3] == []


def test_every_carry_leaf_read_only():
    w, v, _, xs = _ro_args()

    def loss(w, v, scan):
        (w2, v2), ys = scan(lambda c, x: (c, jnp.sin(c[0] @ x) * c[1][0]), (w, v), xs)
        return jnp.sum(ys**2) + jnp.sum(w2 * v2[1])

    g = lambda sc: jax.grad(functools.partial(loss, scan=sc), (0, 1))(w, v)
    # (no "ism-9": with no carry left, a slot is nominal and one internal state takes
    # more than 9 of them, as for any scan with an empty carry)
    for k, s in RO_SCANS.items():
        if k != "ism-9":
            assert_close(g(s), g(lax.scan))


def test_readonly_carry_of_while_loop_gradients():
    w, v, h0, _ = _ro_args()

    def step(c):
        i, h, w, v = c
        return i + 1, jnp.tanh(w @ h + v[0]), w, v

    def loss(w, v, h0, n, loop):
        # v is read by the predicate as well as the body
        _, h, w2, v2 = loop(lambda c: (c[0] < n) & (c[3][1] < 10.0), step, (0, h0, w, v))
        return jnp.sum(h**2) + jnp.sum(jnp.cos(w2)) + jnp.sum(v2**3)

    def unrolled(cond, body, c):
        for _ in range(T):
            c = lax.cond(cond(c), body, lambda c: c, c)
        return c

    # One program per loop: the trip count n an argument, run for 0, 1, 4 and T steps,
    # and its vmap over w and n (2 and 5 steps) in the same program.
    ws, ns = jnp.stack([w, -w]), jnp.array([2, 5])

    def programs(loop):
        grad = jax.grad(functools.partial(loss, loop=loop), (0, 1, 2))
        batched = jax.vmap(grad, (0, None, None, 0))
        return jax.jit(lambda n: (grad(w, v, h0, n), batched(ws, v, h0, ns)))

    counts = (0, 1, 4, T)
    ref = programs(unrolled)
    want = {n: ref(n) for n in counts}  # the references, once
    for memory in (1, 2, 3, 8):
        ours = programs(functools.partial(memento.while_loop, memory=memory, max_steps=T))
        for n in counts:
            assert_close(ours(n), want[n])
