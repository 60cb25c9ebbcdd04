"""memento.while_loop: buffers= (against Equinox), truncation reporting, large budgets."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memento

eqxi = pytest.importorskip("equinox.internal")

H, N = 3, 24


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def params(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(k[0], (H, H), jnp.float64) * 0.6
    b = jax.random.normal(k[1], (H,), jnp.float64)
    h0 = jax.random.normal(k[2], (H,), jnp.float64)
    return w, b, h0


def saving_loss(loop, w, b, h0, n, buf0):
    """A loop that saves its state into a preallocated buffer each step (SaveAt-like)."""

    def body(s):
        i, h, buf, acc = s
        h = jnp.tanh(w @ h + b)
        buf = buf.at[i].set(h * (i + 1.0))
        return i + 1, h, buf, acc + jnp.sum(h)

    init = (0, h0, buf0, jnp.float64(0.0))
    _, h, buf, acc = loop(lambda s: s[0] < n, body, init)
    weights = jnp.arange(1.0, 1.0 + buf.size).reshape(buf.shape) / buf.size
    return jnp.sum(jnp.sin(buf) * weights) + jnp.sum(h**2) + acc


def memento_loop(memory, max_steps=N):
    def loop(cond, body, init):
        return memento.while_loop(
            cond, body, init, max_steps=max_steps, memory=memory, buffers=lambda s: s[2]
        )

    return loop


def equinox_loop(cond, body, init):
    return eqxi.while_loop(
        cond, body, init, max_steps=N, kind="checkpointed", checkpoints=4,
        buffers=lambda s: s[2],
    )  # fmt: skip


@pytest.mark.parametrize("memory", [1, 8])
def test_buffers_match_equinox(memory):
    w, b, h0 = params()
    buf0 = jnp.full((N, H), 0.5)  # unwritten rows keep their value and gradient
    for n in (0, 7, N):
        args = (w, b, h0, n, buf0)
        grad = jax.grad(saving_loss, argnums=(1, 2, 3, 5))
        ours = jax.jit(grad, static_argnums=(0, 4))(memento_loop(memory), *args)
        ref = jax.jit(grad, static_argnums=(0, 4))(equinox_loop, *args)
        # The initial buffer's rows that the loop overwrites do not affect the result: their
        # true cotangent is zero. Equinox passes them the final buffer's cotangent (its
        # docs leave them unspecified: no location may be written twice); ours is exact.
        ref = (*ref[:3], ref[3].at[:n].set(0.0))
        for a, r in zip(ours, ref, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            saving_loss(memento_loop(memory), *args), saving_loss(equinox_loop, *args),
            rtol=1e-14,
        )  # fmt: skip


def test_buffers_are_not_checkpointed():
    # The kept carries exclude the buffer: temporary memory of the gradient stays near
    # that of the loop without any buffer, far below keeping the buffer in every slot.
    w, b, h0 = params()
    big = jnp.zeros((400, H))

    def temp(buffers):
        def loss(w, buf):
            def body(s):
                i, h, buf = s
                h = jnp.tanh(w @ h + b)
                return i + 1, h, buf.at[i].set(h)

            out = memento.while_loop(
                lambda s: s[0] < 300, body, (0, h0, buf), max_steps=400, memory=16,
                buffers=buffers,
            )  # fmt: skip
            return jnp.sum(out[2] ** 2)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, big).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    with_buffers, without = temp(lambda s: s[2]), temp(None)
    # Measured: 1.3x the buffer with buffers=, 17x (16 slots) without.
    assert with_buffers < 3 * big.nbytes and without > 10 * big.nbytes


def test_reading_a_buffer_in_the_body_is_refused():
    h0 = params()[2]

    def body(s):
        i, h, buf = s
        return i + 1, h + buf[0], buf.at[i].set(h)

    with pytest.raises(TypeError, match=r"memento\.while_loop: buffers are write-only"):
        memento.while_loop(
            lambda s: s[0] < 3, body, (0, h0, jnp.zeros((4, H))), max_steps=4, memory=2,
            buffers=lambda s: s[2],
        )  # fmt: skip
    with pytest.raises(TypeError, match="leaves of init_val"):
        memento.while_loop(
            lambda s: s[0] < 3, body, (0, h0, jnp.zeros((4, H))), max_steps=4, memory=2,
            buffers=lambda s: jnp.zeros(3),
        )  # fmt: skip


# ------------------------------------------------------------------------ truncation


def test_truncation_is_reported():
    w, b, h0 = params()

    def run(n, max_steps):
        def body(s):
            return s[0] + 1, jnp.tanh(w @ s[1] + b)

        return memento.while_loop(
            lambda s: s[0] < n, body, (0, h0), max_steps=max_steps, memory=3,
            return_truncated=True,
        )  # fmt: skip

    (i, _), truncated = jax.jit(run, static_argnums=1)(10, 5)
    assert int(i) == 5 and bool(truncated)
    (i, _), truncated = jax.jit(run, static_argnums=1)(4, 5)
    assert int(i) == 4 and not bool(truncated)
    (i, _), truncated = run(5, 5)  # stops on both at once: the predicate is false
    assert int(i) == 5 and not bool(truncated)
    (i, _), truncated = run(7, None)
    assert int(i) == 7 and not bool(truncated)
    # Per member under vmap; differentiable alongside.
    flags = jax.vmap(lambda n: run(n, 5)[1])(jnp.array([3, 9]))
    np.testing.assert_array_equal(np.asarray(flags), [False, True])


# ------------------------------------------------------------------------ large budgets


def test_budgets_above_64_slots_are_used():
    w, b, h0 = params()
    n = 150

    def loss(w, memory, max_steps):
        def body(s):
            return s[0] + 1, jnp.tanh(w @ s[1] + b)

        _, h = memento.while_loop(
            lambda s: s[0] < n, body, (0, h0), max_steps=max_steps, memory=memory
        )
        return jnp.sum(h**2)

    def ref(w):
        h = h0
        for _ in range(n):
            h = jnp.tanh(w @ h + b)
        return jnp.sum(h**2)

    expected = jax.grad(ref)(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 100 slots: planned, no cap
        g = jax.jit(jax.grad(loss), static_argnums=(1, 2))(w, 100, 200)
    np.testing.assert_allclose(np.asarray(g), np.asarray(expected), rtol=1e-12)
    with pytest.warns(UserWarning, match=r"memento.while_loop: a budget of 300 slots .* 128"):
        g = jax.jit(jax.grad(loss), static_argnums=(1, 2))(w, 300, 400)
    np.testing.assert_allclose(np.asarray(g), np.asarray(expected), rtol=1e-12)
