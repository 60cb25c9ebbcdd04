"""The platform the planner's time model assumes comes from the loop's inputs (a
committed array's device), else the default device, else JAX's default backend."""

import jax
import jax.numpy as jnp
import pytest

import memento
from memento.loops._body import platform
from memento.planning import internals


def cell(c, x):
    return jnp.tanh(c * x), jnp.sum(c)


def test_platform_of_committed_inputs_and_the_default_device():
    cpu = jax.devices("cpu")[0]
    assert platform(jax.device_put(jnp.ones(3), cpu)) == "cpu"
    assert platform(jnp.ones(3), 1.0, None) == jax.default_backend()
    with jax.default_device(cpu):
        assert platform() == "cpu"

    @jax.jit
    def traced(x):
        assert platform(x) == jax.default_backend()  # a tracer has no device
        return x

    traced(jnp.ones(2))


@pytest.mark.usefixtures("on_cpu")
def test_the_plan_follows_the_platform(monkeypatch):
    """On a GPU an HSM plan runs as the recursion from the first step (no rows to compile);
    on CPU from 2**16 steps. The planner sees the platform it is given."""
    from memento.loops import _scan

    seen = []
    original = _scan.choose

    def spy(*args, **kwargs):
        seen.append(kwargs["backend"])
        return original(*args, **kwargs)

    monkeypatch.setattr(_scan, "choose", spy)
    xs = jnp.ones((50, 4))
    s = memento.loops.scan_schedule(cell, jnp.ones(4), xs, memory=3, policy="hsm")
    assert seen == ["cpu"] and s.policy == "hsm"
    assert internals.recursion_min_steps("gpu") == 1 < internals.recursion_min_steps("cpu")
