"""The typed pools: exact round trips for every dtype, tangents, sizes within the budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memento
from memento.loops import _pool


def _pools(hidden, internal):
    avals = lambda xs: [jax.typeof(x) for x in xs]
    # room for one hidden state below one internal state, and one internal state alone
    return _pool.Pools.of(avals(hidden), avals(internal), np.array([[1, 1], [0, 1]]))


def _every_dtype():
    return [
        jnp.arange(6, dtype=jnp.float64).reshape(2, 3) / 7,
        jnp.array([1.5, -2.25], jnp.bfloat16),
        jnp.array([0.5, 3.0], jnp.float16),
        jnp.array([[1, -2]], jnp.int32),
        jnp.array([True, False, True]),
        jnp.array(3, jnp.uint8),
        jnp.array([0.1], jnp.float32),
        jnp.array([1 + 2j, -0.5j], jnp.complex64),
        jnp.array([[3 - 1j]], jnp.complex128),
        jax.random.split(jax.random.key(3), 2),
        jnp.asarray(0.25),  # weakly typed
    ]


def _same(a, b):
    assert jax.typeof(a) == jax.typeof(b)  # dtype, shape and weak type
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_write_read_round_trip_every_dtype():
    with jax.enable_x64(True):
        leaves = _every_dtype()
        hidden = [jnp.ones(3), jnp.array([7], jnp.int32)]
        p = _pools(hidden, leaves)
        pools = p.allocate()
        # typed: no words, no bitcasts
        assert [x.dtype for x in pools] == [g[0] for g in p.groups]
        pools = p.write(pools, 0, 0, hidden, "h")
        pools = p.write(pools, 1, 0, leaves, "i")  # above the hidden state
        for a, b in zip(leaves, p.read(pools, 1, 0, "i")):
            _same(a, b)
        for a, b in zip(hidden, p.read(pools, 0, 0, "h")):
            _same(a, b)
        # a masked write changes nothing
        same = p.write(pools, 1, 0, [x * 0 for x in leaves[:1]], "i", when=False)
        for a, b in zip(same, pools):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tangents_flow_through_the_pools():
    # The word pool's bitcasts dropped tangents: jvp(grad) through a budgeted scan was wrong.
    with jax.enable_x64(True):
        leaves = [jnp.arange(3.0), jnp.array([1 + 1j], jnp.complex128)]
        p = _pools([jnp.ones(2)], leaves)

        def round_trip(leaves):
            return p.read(p.write(p.allocate(), 1, 0, leaves, "i"), 1, 0, "i")

        tangents = [jnp.array([1.0, -2.0, 3.0]), jnp.array([2j])]
        _, out = jax.jvp(round_trip, (leaves,), (tangents,))
        for a, b in zip(out, tangents):
            _same(a, b)


@pytest.mark.parametrize("policy,alpha", [("hsm", None), ("ism", 3), ("msm", 3), ("msm", 8)])
@pytest.mark.parametrize("steps,memory", [(1, 8), (40, 8), (97, 24), (300, 60)])
def test_pools_fit_the_budget(policy, alpha, steps, memory):
    from memento.loops import _choice

    schedule = memento.plan(steps, memory, policy=policy, alpha=alpha)
    prog = _choice._compile(schedule)
    assert not np.isin(prog.primal_rows[:, 0], (-1,)).any()
    # a carry of 4 float32 numbers; an internal state of alpha carries, output included
    carry = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    internal = [jax.ShapeDtypeStruct((4 * (alpha or 1),), jnp.float32)]
    p = _pool.Pools.of(carry, internal, prog.tops)
    # h_0 is the caller's input, not in the pool; HSM and MSM count it in the budget.
    assert p.sizes[0] <= 4 * (memory - int(schedule.counts_initial))


def test_out_of_stack_order_is_refused():
    Op = memento.Op
    rows = [
        (Op.SAVE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 0), (Op.SAVE_HIDDEN, 1, 1),
        (Op.FREE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 1), (Op.BACKWARD_FUSED, 0, 2),
    ]  # fmt: skip
    schedule = memento.Schedule(3, 9, "x", 0, np.array(rows))
    with pytest.raises(ValueError, match="out of stack order"):
        _pool.stack_rows(schedule)


@pytest.mark.parametrize("policy,memory", [("hsm", 3), ("ism", 30), ("msm", 6), ("msm", 11)])
def test_layout_is_exact_and_fits_the_budget(monkeypatch, policy, memory):
    # Each leaf keeps its shape (and its sharding): gradients equal lax.scan's, and the
    # pools fit the budget (MSM re-plans when pools of several shapes peak apart).
    from jax import lax

    from memento.loops import _interpreter

    used = []
    real = _interpreter.pool_bytes
    monkeypatch.setattr(
        "memento.loops._choice.pool_bytes", lambda *a: used.append(real(*a)) or used[-1]
    )
    with jax.enable_x64(True):
        w = jax.random.normal(jax.random.PRNGKey(0), (4, 4), jnp.float64) * 0.5
        xs = jax.random.normal(jax.random.PRNGKey(1), (30, 4), jnp.float64)

        def loss(w, scan):
            def cell(c, x):  # carry (4,) and (2,); residuals of several shapes
                h, g = c
                h = jnp.tanh(w @ h + x)
                g = jnp.sin(g * h[:2]) + jnp.outer(h, h)[0, :2]
                return (h, g), jnp.sum(h**2) + jnp.sum(g)

            (h, g), ys = scan(cell, (jnp.ones(4), jnp.ones(2)), xs)
            return ys.sum() + h.sum() + g.sum()

        ours = lambda f, i, x: memento.scan(f, i, x, memory=memory, policy=policy, executor="rows")
        grad = jax.jit(jax.grad(loss), static_argnums=1)
        np.testing.assert_allclose(grad(w, ours), grad(w, lax.scan), rtol=1e-10, atol=1e-12)
        assert used and used[-1] <= memory * 6 * 8  # slots of one carry, 6 float64 numbers
        # The hessian's second derivative runs the loop of the step's JVP: its carry and
        # the carry's tangent, 12 numbers per slot.
        used.clear()
        hessian = jax.jit(jax.hessian(loss), static_argnums=1)
        np.testing.assert_allclose(hessian(w, ours), hessian(w, lax.scan), rtol=1e-9, atol=1e-10)
    assert used and used[-1] <= memory * 12 * 8
