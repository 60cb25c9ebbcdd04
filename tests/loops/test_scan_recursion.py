"""memento.scan's HSM as the device recursion (`memento.loops._recursion`), used for long
scans: the same evaluations as the optimal schedule, O(1) trace size in the length.

The conformance suite (tests/conformance) runs its whole catalogue through this path too
(variants ``hsm-rec-*``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_scan import COUNTS_RUN, counting_cell, rnn_params, x64  # noqa: F401 (x64: float64, autouse)

import memento
from memento.loops import _recursion
from memento.planning import Op, internals


@pytest.mark.parametrize("t", [1, 2, 3, 7, 30, 200])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 12])
def test_first_pushes_are_the_schedules_first_sweep(t, m):
    # The hidden states the optimal HSM schedule keeps before its first backward.
    rows = memento.plan(t, m, policy="hsm").actions
    first_bw = int(np.flatnonzero(rows[:, 0] == Op.BACKWARD_FUSED)[0])
    sweep = rows[:first_bw]
    saved = sweep[sweep[:, 0] == Op.SAVE_HIDDEN, 2].tolist()
    assert _recursion.first_pushes(t, m) == saved


@COUNTS_RUN
@pytest.mark.parametrize("memory", [1, 2, 3, 5, 24, 100])
def test_evaluations_equal_the_optimal_schedule(memory):
    t = 23
    w, h0, xs = rnn_params(t=t)
    counts = {"forward": 0, "backward": 0}
    cell = counting_cell(w, counts)

    def loss(h0, xs):
        h, ys = memento.scan(cell, h0, xs, memory=memory, policy="hsm", executor="recursion")
        return h.sum() + ys.sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(grad(h0, xs))
    counts.update(forward=0, backward=0)
    got = jax.block_until_ready(grad(h0, xs))  # cached: counts one run
    assert counts["forward"] == memento.plan(t, memory, policy="hsm").cost
    assert counts["backward"] == t  # once per step, never for recomputation

    def reference(h0, xs):
        h, ys = lax.scan(cell, h0, xs)
        return h.sum() + ys.sum()

    want = jax.grad(reference, argnums=(0, 1))(h0, xs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_slots_follow_the_budget():
    def temp(memory):
        def loss(c):
            def f(c, x):
                return jnp.tanh(c * 1.01 + x), None

            xs = jnp.zeros(5000, jnp.float32)
            return memento.scan(f, c, xs, memory=memory, policy="hsm", executor="recursion")[
                0
            ].sum()

        compiled = jax.jit(jax.grad(loss)).lower(jnp.ones(256, jnp.float32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    carry = 256 * 4
    assert temp(40) - temp(8) == pytest.approx(32 * carry, rel=0.05)


def test_long_scans_trace_in_constant_size():
    # Past recursion_min_steps() nothing on the trace path grows with the length: the
    # program of 10^8 steps is that of 2^20 (xs abstract, nothing is run).
    def hlo(t):
        def loss(c, xs):
            def f(c, x):
                return jnp.tanh(c * 1.01 + x), None

            return memento.scan(f, c, xs, memory=100, policy="hsm")[0].sum()

        xs = jax.ShapeDtypeStruct((t,), jnp.float32)
        return jax.jit(jax.grad(loss)).lower(jnp.ones(4), xs).as_text()

    assert internals.recursion_min_steps("cpu") <= 2**20
    small, large = hlo(2**20), hlo(10**8)
    assert len(large.splitlines()) == len(small.splitlines())


def test_scan_schedule_of_the_recursion_is_hsm():
    # What memento.loops.scan_schedule reports for a scan run as the recursion: the HSM
    # schedule, whose evaluations the recursion makes (above).
    w, h0, xs = rnn_params(t=40)

    def cell(h, x):
        return jnp.tanh(w @ h + x), None

    schedule = memento.loops.scan_schedule(
        cell, h0, xs, memory=5, policy="hsm", executor="recursion"
    )
    assert schedule.policy == "hsm"
    assert schedule.cost == memento.plan(40, 5, policy="hsm").cost
