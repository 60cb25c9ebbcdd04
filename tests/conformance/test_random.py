"""A randomised differential test: memento.scan against lax.scan.

Hypothesis draws the length, budget, policy, the carry's pytree structure and dtypes,
``reverse``, ``unroll``, ``jit`` and ``vmap``; each example compares values, gradients
and Hessian-vector products (forward over reverse) in float64 or complex128.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from jax import lax

import memento

from ._variants import assert_close


@st.composite
def cases(draw):
    length = draw(st.integers(1, 12))
    policy = draw(st.sampled_from(["hsm", "ism", "msm", "auto"]))
    low = 1 if policy != "ism" else 4 * length + 8  # ISM needs room for an internal state
    memory = draw(st.integers(low, max(low, length + 3)))
    return {
        "length": length,
        "memory": memory,
        "bytes": draw(st.booleans()),  # the same budget as a byte count
        "policy": policy,
        "leaves": draw(st.integers(1, 3)),
        "complex": draw(st.booleans()),
        "int_leaf": draw(st.booleans()),
        "reverse": draw(st.booleans()),
        "unroll": draw(st.sampled_from([1, 2])),
        "jit": draw(st.booleans()),
        "vmap": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def problem(case):
    rng = np.random.default_rng(case["seed"])
    dtype = np.complex128 if case["complex"] else np.float64
    w = rng.normal(size=(3, 3)) * 0.5
    init = {f"h{i}": rng.normal(size=3).astype(dtype) for i in range(case["leaves"])}
    if case["int_leaf"]:
        init["n"] = np.int32(0)
    xs = rng.normal(size=(case["length"], 3))

    def body(c, x):
        out, ys = dict(c), {}
        for i in range(case["leaves"]):
            h = c[f"h{i}"]
            out[f"h{i}"] = jnp.tanh(w @ h + x * (i + 1)) + 0.1 * c["h0"]
            ys[f"y{i}"] = jnp.sum(jnp.abs(h) ** 2)
        if "n" in c:
            out["n"] = c["n"] + 1
        return out, ys

    return body, init, xs


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases())
def test_memento_scan_equals_lax_scan(case):
    body, init, xs = problem(case)
    kw = dict(reverse=case["reverse"], unroll=case["unroll"])

    def loss(scan, h0, xs):
        c = {**init, "h0": h0}
        c, ys = scan(body, c, xs, **kw)
        return sum(jnp.sum(jnp.abs(v) ** 2) for k, v in c.items() if k != "n") + sum(
            jnp.sum(y * jnp.arange(1, y.shape[0] + 1)) for y in ys.values()
        )

    memory = case["memory"]
    if case["bytes"]:
        carry = sum(np.asarray(v).nbytes for v in init.values())
        memory = memento.bytes_budget(memory * carry)

    def budgeted(f, c, xs, **kw):
        return memento.scan(f, c, xs, **kw, memory=memory, policy=case["policy"])

    def derivatives(scan, h0, xs):
        value = loss(scan, h0, xs)
        grad = jax.grad(loss, (1, 2))(scan, h0, xs)
        hvp = jax.jvp(lambda h: jax.grad(loss, 1)(scan, h, xs), (h0,), (jnp.ones_like(h0),))[1]
        return value, grad, hvp

    run = derivatives
    if case["jit"]:
        run = jax.jit(run, static_argnums=0)
    h0 = jnp.asarray(init["h0"])
    xs = jnp.asarray(xs)
    if case["vmap"]:
        h0, xs = jnp.stack([h0, 0.5 * h0]), jnp.stack([xs, xs[::-1]])
        vrun = run
        run = lambda scan, h, x: jax.vmap(lambda h, x: vrun(scan, h, x))(h, x)
    with jax.enable_x64(True):
        assert_close(run(budgeted, h0, xs), run(lax.scan, h0, xs), rtol=1e-9, atol=1e-9)
