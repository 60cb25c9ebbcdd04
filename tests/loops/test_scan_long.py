"""memento.scan at T = 10^6: traced and lowered with no replay of the schedule."""

import jax
import jax.numpy as jnp
import pytest

import memento
from memento.planning import _schedule


def test_million_step_gradient_lowers_without_a_replay(monkeypatch):
    def no_replay(*_):
        raise AssertionError("the schedule was replayed on the trace path")

    monkeypatch.setattr(_schedule, "simulate", no_replay)
    monkeypatch.setattr(_schedule.Schedule, "simulate", no_replay)

    def loss(c):
        def f(c, x):
            return jnp.tanh(c * 1.01 + x), None

        return memento.scan(f, c, jnp.zeros(10**6), memory=100)[0].sum()

    lowered = jax.jit(jax.grad(loss)).lower(jnp.ones(2))
    assert lowered.out_info.shape == (2,)
    with pytest.raises(AssertionError, match="replayed"):
        memento.plan(10, 3).simulate()
