"""Forward mode and derivatives of every order of a budgeted memento.while_loop, in float64.

Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) equals ``lax.while_loop``'s;
reverse over forward, forward over reverse and reverse over reverse equal those of the
loop run for the n steps it takes (``lax.fori_loop`` with the trip count). Each runs the
loop of the step's JVP, a budgeted `memento.while_loop` itself, buffers and nested loops
included.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento

H = 3
N = 9  # the steps the loops below take


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def assert_close(a, b, tol=1e-12):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def params(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(k[0], (H, H), jnp.float64) * 0.6
    b = jax.random.normal(k[1], (H,), jnp.float64)
    h0 = jax.random.normal(k[2], (H,), jnp.float64)
    return w, b, h0


def memento_loop(**kw):
    return lambda cond, body, init: memento.while_loop(cond, body, init, **kw)


def counted(n):
    """The reference for reverse mode: the loop run for the n steps it takes."""
    return lambda cond, body, init: lax.fori_loop(0, n, lambda _, s: body(s), init)


def bounded(n):
    """The reference for reverse mode of a loop of at most n steps: each a conditional."""

    def loop(cond, body, init):
        step = lambda _, s: lax.cond(cond(s), body, lambda s: s, s)
        return lax.fori_loop(0, n, step, init)

    return loop


def final(loop, w, b, h0, n=N):
    """A counted loop whose carry is a pytree with an int leaf and a weakly typed float;
    w closed over by the body, the count n (a traced int) by the predicate."""

    def body(s):
        i, (h, acc) = s
        h = jnp.tanh(w @ h + b)
        return i + 1, (h, acc + jnp.sum(h) * 0.1)

    _, (h, acc) = loop(lambda s: s[0] < n, body, (0, (h0, 0.0)))
    return h, acc


def loss(loop, w, b, h0):
    h, acc = final(loop, w, b, h0)
    return jnp.sum(jnp.sin(h)) + acc**2


def derivatives(loop):
    """Every mode, in one program: jvp, jacfwd, linearize (forward mode), reverse over
    forward, jax.hessian (forward over reverse), grad of grad and jacrev of jacrev
    (reverse over reverse)."""
    w, b, h0 = params()
    v = jnp.cos(jnp.arange(H * H, dtype=jnp.float64)).reshape(H, H)
    dh = jnp.sin(jnp.arange(H) + 1.0)
    f = functools.partial(loss, loop)

    @jax.jit
    def run(w, b, h0):
        _, lin = jax.linearize(f, w, b, h0)
        return [
            jax.jvp(functools.partial(final, loop), (w, b, h0), (v, b, dh)),
            jax.jacfwd(lambda h: final(loop, w, b, h))(h0),
            lin(v, b, dh),
            jax.grad(lambda w: jax.jvp(lambda h: f(w, b, h), (h0,), (dh,))[1])(w),
            jax.hessian(f, 2)(w, b, h0),
            jax.grad(lambda h: jnp.sum(jax.grad(f, (0, 2))(w, b, h)[0] ** 2))(h0),
            jax.jacrev(jax.jacrev(lambda h: f(w, b, h)))(h0),
        ]

    return run(w, b, h0)


@functools.cache
def _reference():
    return derivatives(counted(N))


@pytest.mark.parametrize(
    "kw",
    [
        dict(memory=1),
        dict(memory=3),
        dict(memory=3, max_steps=40),
        dict(memory=64),  # far more than the loop needs: every carry
        dict(memory="1KiB"),
        dict(memory=None, max_steps=N + 2),
    ],
    ids=repr,
)
def test_every_mode_equals_the_loop_of_n_steps(kw):
    assert_close(derivatives(memento_loop(**kw)), _reference())


def test_forward_mode_equals_lax_while_loop_bit_for_bit():
    # The tangent map evaluated is jvp of lax.while_loop itself.
    w, b, h0 = params(1)

    def forward(loop):
        f = functools.partial(final, loop)

        @jax.jit
        def run(w, b, h0):
            _, lin = jax.linearize(f, w, b, h0)
            return jax.jvp(f, (w, b, h0), (w, b, h0)), jax.jacfwd(f, 2)(w, b, h0), lin(w, b, h0)

        return run(w, b, h0)

    got, want = forward(memento_loop(memory=2)), forward(lax.while_loop)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_grad_of_grad_equals_the_loop_of_n_steps():
    def f(loop, a):
        body = lambda s: (s[0] + 1, jnp.sin(s[1] * a + 0.1 * s[0]))
        return loop(lambda s: s[0] < 7, body, (0, 0.5))[1] ** 2

    ours = jax.jit(jax.grad(jax.grad(functools.partial(f, memento_loop(memory=2)))))
    assert_close(ours(0.7), jax.grad(jax.grad(functools.partial(f, counted(7))))(0.7))


def test_data_dependent_stop_under_vmap():
    # A fixed-point iteration stopping on a tolerance, per member: each member's
    # jvp and second derivatives are its own loop's, stopped at its own step.
    w, b, h0 = params(2)
    w = w * 0.3

    def solve(loop, scale, h0):
        def body(s):
            h, _ = s
            new = jnp.tanh(scale * w @ h + b)
            return new, jnp.max(jnp.abs(new - h))

        return loop(lambda s: s[1] > 1e-6, body, (h0, jnp.float64(1.0)))[0]

    def steps(scale, h0):  # the trip count, for the reference
        def body(s):
            i, h, _ = s
            new = jnp.tanh(scale * w @ h + b)
            return i + 1, new, jnp.max(jnp.abs(new - h))

        return int(lax.while_loop(lambda s: s[2] > 1e-6, body, (0, h0, jnp.float64(1.0)))[0])

    def modes(loop, scale, h0):
        f = lambda s, h: jnp.sum(solve(loop, s, h) ** 2)
        return [
            jax.jvp(functools.partial(solve, loop), (scale, h0), (1.0, jnp.ones(H)))[1],
            jax.hessian(f, (0, 1))(scale, h0),
            jax.grad(lambda s: jnp.sum(jax.grad(f, 1)(s, h0) ** 2))(scale),
        ]

    scales, h0s = jnp.array([0.5, 1.0, 2.0]), jnp.stack([h0, -h0, 2 * h0])
    got = jax.jit(jax.vmap(functools.partial(modes, memento_loop(memory=3))))(scales, h0s)
    for m, (s, h) in enumerate(zip(scales, h0s)):
        n = steps(s, h)
        loop = lambda c, f, i, n=n: lax.fori_loop(0, n, lambda _, x: f(x), i)
        assert_close(jax.tree_util.tree_map(lambda x, m=m: x[m], got), modes(loop, s, h))


# -- buffers= ---------------------------------------------------------------------------

ROWS = 12


def saving(loop, w, h0, buf0):
    """Step i writes h at row i (under a predicate: not at i == 4) and 2h at row
    ROWS - 1 - i (unconditionally)."""

    def body(s):
        i, h, buf = s
        h = jnp.tanh(w @ h)
        if isinstance(buf, memento.loops.Buffer):
            buf = buf.at[i].set(h, pred=i != 4)
        else:
            buf = buf.at[i].set(jnp.where(i != 4, h, buf[i]))
        return i + 1, h, buf.at[ROWS - 1 - i].set(2.0 * h)

    _, h, buf = loop(lambda s: s[0] < 5, body, (0, h0, buf0))
    return h, buf


def saving_modes(loop):
    w, _, h0 = params(3)
    buf0 = jnp.full((ROWS, H), 0.5)
    weights = jnp.arange(ROWS)[:, None]

    def f(w, h, buf):
        return jnp.sum(jnp.sin(saving(loop, w, h, buf)[1]) * weights)

    v, dbuf = jnp.ones((H, H)), jnp.cos(jnp.arange(ROWS * H, dtype=jnp.float64)).reshape(ROWS, H)

    @jax.jit
    def run(w, h0, buf0):
        return [
            jax.jvp(functools.partial(saving, loop), (w, h0, buf0), (v, h0, dbuf)),
            jax.hessian(f, 1)(w, h0, buf0),
            jax.grad(lambda b: jnp.sum(jax.grad(f, (0, 2))(w, h0, b)[0] ** 2))(buf0),
            jax.grad(lambda w: jax.jvp(lambda b: f(w, h0, b), (buf0,), (dbuf,))[1])(w),
        ]

    return run(w, h0, buf0)


@pytest.mark.parametrize("memory", [1, 3])
def test_buffers_in_every_mode(memory):
    ours = memento_loop(memory=memory, max_steps=8, buffers=lambda s: s[2])
    assert_close(saving_modes(ours), saving_modes(counted(5)))


def test_buffers_forward_mode_equals_lax_while_loop():
    w, _, h0 = params(3)
    buf0 = jnp.full((ROWS, H), 0.5)
    tangents = (jnp.ones((H, H)), h0, jnp.sin(buf0 + jnp.arange(ROWS)[:, None]))

    def jvp(loop):
        f = functools.partial(saving, loop)
        return jax.jit(lambda *a: jax.jvp(f, a, tangents))(w, h0, buf0)

    ours = memento_loop(memory=2, buffers=lambda s: s[2])
    assert_close(jvp(ours), jvp(lax.while_loop))


def test_nested_loop_writing_the_buffers_in_every_mode():
    # Step k writes k % 3 rows from a nested memento.while_loop (Diffrax's save loop):
    # the loop of the step's JVP writes the tangent buffer through the nested loop's.
    w, b, h0 = params(4)

    def run(loop, inner, h0, buf0):
        def body(s):
            k, h, j, buf = s
            h = jnp.tanh(w @ h + b)

            def write(t):
                i, j, buf = t
                return i + 1, j + 1, buf.at[j].set(h * (i + 1.0))

            _, j, buf = inner(lambda t: t[0] < k % 3, write, (0, j, buf))
            return k + 1, h, j, buf

        return loop(lambda s: s[0] < 5, body, (0, h0, 0, buf0))[3]

    kw = dict(max_steps=3, memory=1, buffers=lambda t: t[2])
    ours = functools.partial(
        run,
        memento_loop(max_steps=6, memory=2, buffers=lambda s: s[3]),
        memento_loop(**kw),
    )
    ref = functools.partial(run, lax.while_loop, lax.while_loop)
    ref_rev = functools.partial(run, counted(5), bounded(3))
    buf0 = jnp.full((ROWS, H), 0.5)
    weights = jnp.arange(1.0, 1.0 + ROWS * H).reshape(ROWS, H) / ROWS
    dbuf = jnp.sin(weights)

    def modes(f, rev):
        g = lambda h, buf: jnp.sum(jnp.sin(rev(h, buf)) * weights)
        return [
            jax.jvp(f, (h0, buf0), (jnp.ones(H), dbuf)),
            jax.hessian(g)(h0, buf0),
            jax.grad(lambda buf: jnp.sum(jax.grad(g)(h0, buf) ** 2))(buf0),
        ]

    assert_close(jax.jit(lambda: modes(ours, ours))(), modes(ref, ref_rev))


# -- Equinox's users: one loop for forward and reverse mode ------------------------------


def test_equinox_module_state_forward_and_reverse():
    # The pattern of equinox.internal.while_loop(kind="checkpointed") users (Equinox
    # issue #927): a loop over an eqx.Module state differentiated in forward mode
    # (jax.jvp of the final state) and in reverse mode, by one definition.
    eqx = pytest.importorskip("equinox")

    class State(eqx.Module):
        step: jax.Array
        y: jax.Array
        v: jax.Array

    def run(loop, k, y0):
        def body(s):
            a = -k * jnp.sin(s.y)
            return State(s.step + 1, s.y + 0.05 * s.v, s.v + 0.05 * a)

        init = State(jnp.int32(0), y0, jnp.zeros_like(y0))
        return loop(lambda s: s.step < 40, body, init)

    ours = memento_loop(memory=4, max_steps=64)
    k, y0 = jnp.float64(1.7), jnp.array([0.3, 1.1])
    tangents = (jnp.float64(1.0), jnp.array([0.5, -1.0]))
    got = jax.jit(lambda *a: jax.jvp(functools.partial(run, ours), a, tangents))(k, y0)
    want = jax.jvp(functools.partial(run, lax.while_loop), (k, y0), tangents)
    assert int(got[0].step) == 40
    assert_close([(s.y, s.v) for s in got], [(s.y, s.v) for s in want])
    unrolled = counted(40)
    energy = lambda loop, k, y0: jnp.sum(run(loop, k, y0).y ** 2)
    assert_close(
        jax.jit(jax.grad(functools.partial(energy, ours), (0, 1)))(k, y0),
        jax.grad(functools.partial(energy, unrolled), (0, 1))(k, y0),
    )


# -- jvp_body_fun: a body with a jax.custom_vjp inside ------------------------------------


def _custom_tanh(scale):
    """tanh as a jax.custom_vjp whose rule is ``scale`` times the derivative (1: exact)."""

    @jax.custom_vjp
    def tanh(x):
        return jnp.tanh(x)

    tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda y, g: (scale * (1 - y**2) * g,))
    return tanh


def _twin_loss(loop, w, h0, tanh):
    b = jnp.linspace(-0.5, 0.5, H)
    step = lambda tanh: lambda s: (s[0] + 1, tanh(w @ s[1] + b))
    cond = lambda s: s[0] < N
    if loop == "twin":
        _, h = memento.while_loop(cond, step(tanh), (0, h0), memory=3, jvp_body_fun=step(jnp.tanh))
    else:
        _, h = lax.fori_loop(0, N, lambda _, s: step(tanh)(s), (0, h0))
    return jnp.sum(jnp.sin(h))


def _modes(f, w, h0):
    _, lin = jax.linearize(f, w, h0)
    return [
        jax.jvp(f, (w, h0), (w, h0)),
        jax.jacfwd(f, 1)(w, h0),
        lin(w, h0),
        jax.grad(lambda w: jax.jvp(lambda h: f(w, h), (h0,), (h0,))[1])(w),
        jax.hessian(f, 1)(w, h0),
        jax.grad(lambda h: jnp.sum(jax.grad(f)(w, h) ** 2))(h0),
    ]


def test_jvp_body_fun_takes_every_derivative_but_the_gradient():
    w, _, h0 = params(3)
    exact = _custom_tanh(1.0)
    twin = functools.partial(_twin_loss, "twin", tanh=exact)
    ref = functools.partial(_twin_loss, "counted", tanh=jnp.tanh)
    assert_close(jax.jit(_modes, static_argnums=0)(twin, w, h0), _modes(ref, w, h0))
    # Under vmap too.
    hs = jnp.stack([h0, -h0])
    batched = jax.jit(jax.vmap(jax.hessian(twin, 1), (None, 0)))(w, hs)
    assert_close(batched, jax.vmap(jax.hessian(ref, 1), (None, 0))(w, hs))
    # Without it, JAX refuses forward mode through the custom_vjp.
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):

        def plain(h):
            step = lambda s: (s[0] + 1, exact(w @ s[1]))
            return memento.while_loop(lambda s: s[0] < N, step, (0, h), memory=3)[1]

        jax.jvp(plain, (h0,), (h0,))


def test_the_gradient_runs_body_fun():
    # A rule twice the derivative shows which body each derivative takes: the gradient
    # body_fun's (and its program, that of the loop without jvp_body_fun), forward mode
    # jvp_body_fun's.
    w, _, h0 = params(4)
    doubled = _custom_tanh(2.0)
    twin = functools.partial(_twin_loss, "twin", tanh=doubled)
    custom = functools.partial(_twin_loss, "counted", tanh=doubled)
    assert_close(jax.grad(twin)(w, h0), jax.grad(custom)(w, h0))
    exact = functools.partial(_twin_loss, "counted", tanh=jnp.tanh)
    assert_close(jax.jvp(twin, (w, h0), (w, h0)), jax.jvp(exact, (w, h0), (w, h0)))

    def alone(w, h0):
        step = lambda s: (s[0] + 1, doubled(w @ s[1] + jnp.linspace(-0.5, 0.5, H)))
        _, h = memento.while_loop(lambda s: s[0] < N, step, (0, h0), memory=3)
        return jnp.sum(jnp.sin(h))

    temp = lambda f: jax.jit(jax.grad(f)).lower(w, h0).compile().memory_analysis()
    assert temp(twin).temp_size_in_bytes == temp(alone).temp_size_in_bytes


def test_jvp_body_fun_must_match_body_fun():
    h0 = jnp.ones(H)
    body = lambda s: (s[0] + 1, jnp.tanh(s[1]))
    other = lambda s: (s[0] + 1, jnp.tanh(s[1]).astype(jnp.float32))
    with pytest.raises(TypeError, match="jvp_body_fun must be the same function as body_fun"):
        memento.while_loop(lambda s: s[0] < N, body, (0, h0), memory=3, jvp_body_fun=other)

    def writes(at):
        def body(s):
            i, h, buf = s
            return i + 1, jnp.tanh(h), buf.at[at(i)].set(h)

        return body

    init = (0, h0, jnp.zeros((N + 1, H)))
    with pytest.raises(TypeError, match="writes the buffers differently"):
        memento.while_loop(
            lambda s: s[0] < N,
            writes(lambda i: i),
            init,
            memory=3,
            buffers=lambda s: s[2],
            jvp_body_fun=lambda s: (s[0] + 1, jnp.tanh(s[1]), s[2]),
        )
