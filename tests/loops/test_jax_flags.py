"""memento under JAX's upcoming defaults: ``JAX_REMAT3``, ``JAX_CUSTOM_VJP3`` and
``JAX_SCAN3`` (each a config flag JAX plans to turn on).

Each flag is set before JAX is imported, so each case runs in a subprocess. The gradients
of `memento.scan` (every executor and policy), `memento.while_loop` and an inner training
loop (`memento.meta.inner_loop`, with a Python float hyperparameter: the case that
``JAX_REMAT3`` once broke) are compared with an unrolled loop's, in float64.

``JAX_SCAN3`` in JAX 0.10 is not finished in JAX itself: ``lax.scan`` then has no batching
rule and no VJP of its own, and refuses NumPy ``xs`` (``TracerArrayConversionError``).
memento's gradients are exact under it; ``vmap`` of them fails inside JAX's scan, with
JAX's own error, exactly as ``vmap`` of ``lax.scan`` does. ``JAX_CUSTOM_VJP3`` has no JVP
of a custom VJP with symbolic zeros, so `memento.fwdrev_grad` defines its rule without
them under that flag (every float input then counts as perturbed).
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import memento

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 3))) * 0.5
    h0 = jnp.asarray(rng.normal(size=3))
    T = 16  # every budget below recomputes (a plan past store-all)
    xs = jnp.asarray(rng.normal(size=(T, 3)))

    def cell(h, x):
        h = jnp.tanh(w @ h + x)
        return h, h.sum()

    def unrolled(h0, xs):
        total = 0.0
        for i in range(xs.shape[0]):
            h0, y = cell(h0, xs[i])
            total = total + y
        return h0.sum() + total

    want = jax.jit(jax.grad(unrolled, (0, 1)))(h0, xs)
    vmap_ok = sys.argv[1] != "jax_scan3"
    cases = [("hsm", "rows", 4), ("hsm", "recursion", 4), ("ism", "rows", 20),
             ("msm", "rows", 6), ("auto", "auto", "1KiB")]
    for policy, executor, memory in cases:
        def loss(h0, xs):
            h, ys = memento.scan(cell, h0, xs, memory=memory, policy=policy, executor=executor)
            return h.sum() + ys.sum()
        def grads(h0, xs):  # the gradient and its vmap: one program
            g = jax.grad(loss, (0, 1))(h0, xs)
            v = jax.vmap(jax.grad(loss), (0, None))(jnp.stack([h0, h0]), xs) if vmap_ok else None
            return g, v
        g, v = jax.jit(grads)(h0, xs)
        for a, r in zip(g, want):
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12)
        if vmap_ok:
            np.testing.assert_allclose(v[1], want[0], rtol=1e-12, atol=1e-12)

    def while_loss(h0):
        def body(c):
            i, h = c
            return i + 1, cell(h, xs[i])[0]
        return memento.while_loop(lambda c: c[0] < T, body, (0, h0), memory=5)[1].sum()

    def while_ref(h0):
        for i in range(T):
            h0 = cell(h0, xs[i])[0]
        return h0.sum()

    got, ref = jax.jit(jax.grad(while_loss))(h0), jax.jit(jax.grad(while_ref))(h0)
    np.testing.assert_allclose(got, ref, rtol=1e-12)

    params = {"w": jnp.asarray(rng.normal(size=(3,)))}
    batches = jnp.asarray(rng.normal(size=(5, 4, 3)))

    def inner(p, eta, batch):
        return eta * jnp.mean((batch @ p["w"] - 1.0) ** 2) + jnp.sum(p["w"] ** 2) * 0.01

    def meta(eta, memory):
        opt = lambda eta: optax.sgd(0.1 * eta)
        out = memento.meta.inner_loop(inner, opt, params, eta, batches, memory=memory)
        return jnp.sum(out["w"] ** 2)

    def meta_unrolled(eta):
        p = params
        for batch in batches:
            g = jax.grad(inner)(p, eta, batch)
            p = jax.tree.map(lambda a, d: a - 0.1 * eta * d, p, g)
        return jnp.sum(p["w"] ** 2)

    want = jax.jit(jax.grad(meta_unrolled))(0.2)
    for memory in (2, "1KiB"):
        np.testing.assert_allclose(jax.grad(meta)(0.2, memory), want, rtol=1e-12)  # eager
    print("ok")
    """
)


@pytest.mark.parametrize("flag", ["jax_remat3", "jax_custom_vjp3", "jax_scan3"])
def test_gradients_exact_under_upcoming_jax_defaults(flag):
    if not hasattr(jax.config, flag):
        pytest.skip(f"this JAX ({jax.__version__}) has no {flag} flag")
    env = {**os.environ, flag.upper(): "1", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, flag], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_lax_scan_itself_lacks_vmap_under_scan3():
    """The one failure above is JAX's: vmap of ``lax.scan`` under ``JAX_SCAN3``. When JAX
    adds the rule this test fails, and memento's vmap case should join the others."""
    if not hasattr(jax.config, "jax_scan3"):
        pytest.skip(f"this JAX ({jax.__version__}) has no jax_scan3 flag")
    code = (
        "import jax, jax.numpy as jnp\n"
        "f = lambda h: jax.lax.scan(lambda c, x: (c * x, None), h, jnp.ones(3))[0]\n"
        "jax.vmap(f)(jnp.ones(2))\n"
    )
    env = {**os.environ, "JAX_SCAN3": "1", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "vmap" in run.stderr, run.stderr[-2000:]
