"""inner_loop: meta-gradients in every mode equal reverse-over-reverse through a plain loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import memento
from memento.meta import inner_loop

T = 4


def inner_loss(params, eta, batch):
    """A two-layer regressor whose per-example loss weights depend on eta."""
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    weights = jax.nn.softplus(batch["x"] @ eta["weighting"])
    return jnp.mean(weights * (h @ params["v"] - batch["y"]) ** 2)


def val_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((h @ params["v"] - batch["y"]) ** 2)


def make_optimizer(eta):
    """Adam (eps_root > 0) with learned per-parameter learning rates."""
    per_param = optax.stateless(
        lambda updates, _: jax.tree.map(lambda u, lr: -jnp.exp(lr) * u, updates, eta["log_lr"])
    )
    return optax.chain(optax.scale_by_adam(eps_root=1e-10), per_param)


def make_problem(seed=0, num_steps=T):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    init = {
        "w": jax.random.normal(ks[0], (3, 5)),
        "b": 0.1 * jax.random.normal(ks[1], (5,)),
        "v": jax.random.normal(ks[2], (5,)),
    }
    # eta reaches the inner loop three ways: the initial point (MAML), the optimiser's
    # per-parameter learning rates, and the inner loss's weighting.
    eta = {
        "init": init,
        "log_lr": jax.tree.map(lambda p: jnp.full(p.shape, -2.5), init),
        "weighting": 0.3 * jax.random.normal(ks[3], (3,)),
    }
    batches = {
        "x": jax.random.normal(ks[4], (num_steps, 8, 3)),
        "y": jax.random.normal(ks[5], (num_steps, 8)),
    }
    val = {"x": batches["x"][0] + 0.5, "y": batches["y"][0]}
    return eta, batches, val


def reference_meta_loss(eta, batches, val):
    """Algorithm 1 of MixFlow-MG, written as a Python loop with jax.grad."""
    opt = make_optimizer(eta)
    params = eta["init"]
    state = opt.init(params)
    for t in range(batches["x"].shape[0]):
        batch = jax.tree.map(lambda b, t=t: b[t], batches)
        g = jax.grad(inner_loss)(params, eta, batch)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return val_loss(params, val)


@functools.cache
def reference_meta_value_and_grad(seed):
    """The plain loop's value and jax.grad, compiled once per problem (float64)."""
    with jax.enable_x64(True):
        return jax.jit(jax.value_and_grad(reference_meta_loss))(*make_problem(seed))


def reference_meta_grad(seed):
    return reference_meta_value_and_grad(seed)[1]


def meta_loss(eta, batches, val, **options):
    params = inner_loop(inner_loss, make_optimizer, eta["init"], eta, batches, **options)
    return val_loss(params, val)


def assert_trees_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12), a, b)


# (mode, remat, save_inner_grads, memory): every mode, each remat option, and a
# memento.scan budget across inner steps composed with each mode.
CASES = [
    ("fwdrev", False, False, None),
    ("fwdrev", True, True, None),
    ("revfwd", True, False, None),
    ("revrev", True, True, None),
    ("fwdrev", True, True, 2),
    ("revfwd", False, False, 2),
]


@pytest.mark.parametrize("mode,remat,save,memory", CASES)
def test_meta_gradient_equals_reverse_over_reverse(x64, mode, remat, save, memory):
    eta, batches, val = make_problem()
    want_value, want = reference_meta_value_and_grad(0)
    options = dict(mode=mode, remat=remat, save_inner_grads=save, memory=memory)
    value, got = jax.jit(jax.value_and_grad(lambda e, b, v: meta_loss(e, b, v, **options)))(
        eta, batches, val
    )
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(got))
    assert_trees_close(got, want)
    # The forward value is the plain loop's too (the same program as the gradient).
    np.testing.assert_allclose(value, want_value)


@pytest.mark.parametrize("mode", ["fwdrev", "revrev"])
def test_vmap_over_tasks(x64, mode):
    problems = [make_problem(seed) for seed in (1, 2)]
    etas, batches, vals = (jax.tree.map(lambda *x: jnp.stack(x), *p) for p in zip(*problems))
    got = jax.jit(jax.vmap(jax.grad(lambda e, b, v: meta_loss(e, b, v, mode=mode))))(
        etas, batches, vals
    )
    want = jax.tree.map(lambda *x: jnp.stack(x), *(reference_meta_grad(s) for s in (1, 2)))
    assert_trees_close(got, want)


@pytest.mark.parametrize("memory", [2, None])
def test_inner_loss_closing_over_an_array_without_saved_inner_grads(x64, memory):
    # The inner loss closes over its data, and each inner step is rematerialised with
    # nothing saved: the step's pullback then holds that array itself. Adam, under a
    # memento.scan budget across inner steps, against the plain loop.
    eta, batches, val = make_problem(seed=3)
    features = jax.random.normal(jax.random.PRNGKey(7), (8, 3))

    def closing_loss(params, eta, batch):
        return inner_loss(params, eta, {"x": features + batch["x"], "y": batch["y"]})

    def meta(eta, inner):
        opt = optax.adam(0.05, eps_root=1e-8)
        return val_loss(inner(closing_loss, opt, eta["init"], eta, batches), val)

    def plain(loss, opt, params, eta, batches):
        state = opt.init(params)
        for t in range(T):
            batch = jax.tree.map(lambda b, t=t: b[t], batches)
            updates, state = opt.update(jax.grad(loss)(params, eta, batch), state, params)
            params = optax.apply_updates(params, updates)
        return params

    ours = functools.partial(inner_loop, save_inner_grads=False, memory=memory)
    got = jax.jit(jax.grad(functools.partial(meta, inner=ours)))(eta)
    want = jax.jit(jax.grad(functools.partial(meta, inner=plain)))(eta)
    assert_trees_close(got, want)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want)) > 0.01


def test_memory_budget_bounds_static_memory():
    """With memento.scan, the compiled meta-gradient's temp memory stops growing with T."""

    def temp_bytes(num_steps, memory):
        eta, batches, val = make_problem(num_steps=num_steps)
        fn = jax.grad(lambda e: meta_loss(e, batches, val, memory=memory))
        return jax.jit(fn).lower(eta).compile().memory_analysis().temp_size_in_bytes

    eta, _, _ = make_problem()
    state_bytes = 3 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eta["init"]))
    grow_remat = temp_bytes(12, None) - temp_bytes(4, None)
    grow_budget = temp_bytes(12, 2) - temp_bytes(4, 2)
    # Per-step rematerialisation stores every step's checkpoint: at least one loop state
    # (params and Adam's two moments) per extra step. Under the budget it stays flat.
    assert grow_remat >= 8 * state_bytes
    assert grow_budget <= 2 * state_bytes


def test_adam_with_eps_root_zero_is_refused():
    eta, batches, _ = make_problem()
    with pytest.raises(ValueError, match=r"inner_loop: the optimiser was built with eps_root=0"):
        inner_loop(inner_loss, optax.adam(1e-2), eta["init"], eta, batches)

    # The reason is real: an input feature that is zero in every example (padding, a
    # sparse feature) gives an exactly zero inner gradient row; through a matmul, the
    # infinite derivative of sqrt(nu) at 0 becomes NaN in the meta-gradient.
    x = batches["x"].at[:, :, 0].set(0.0)
    sparse = {"x": x, "y": batches["y"]}

    def meta(init, eps_root):
        opt = optax.adam(1e-2, eps_root=eps_root)
        batch = jax.tree.map(lambda b: b[0], sparse)
        g = jax.grad(val_loss)(init, batch)
        updates, _ = opt.update(g, opt.init(init), init)
        return val_loss(optax.apply_updates(init, updates), batch)

    assert np.isnan(np.asarray(jax.grad(meta)(eta["init"], 0.0)["w"])).any()
    assert np.isfinite(np.asarray(jax.grad(meta)(eta["init"], 1e-8)["w"])).all()


def test_clear_errors():
    eta, batches, _ = make_problem()
    with pytest.raises(ValueError, match=r"inner_loop: mode must be one of"):
        inner_loop(inner_loss, optax.sgd(0.1), eta["init"], eta, batches, mode="rev")
    with pytest.raises(TypeError, match=r"inner_loop: optimizer must be an optax"):
        inner_loop(inner_loss, lambda eta: 0.1, eta["init"], eta, batches)
    with pytest.raises(ValueError, match=r"inner_loop: batches must be a pytree"):
        inner_loop(
            inner_loss,
            optax.sgd(0.1),
            eta["init"],
            eta,
            {"x": jnp.ones((3, 2)), "y": jnp.ones((4,))},
        )


def test_exported():
    assert memento.meta.inner_loop is inner_loop
