"""Learned per-parameter learning rates (Bengio 2000; Maclaurin et al. 2015).

eta holds one log learning rate per parameter entry; the inner optimiser is Adam's
direction scaled by exp(eta), so the optimiser itself depends on eta: inner_loop takes
a function eta -> optax transformation. Each outer step trains a fresh model for T inner
steps and moves eta to lower its validation loss.

    python examples/meta_learning_rates.py [--outer-steps 20]
"""

import argparse

import jax
import jax.numpy as jnp
import optax

from memento.meta import inner_loop
from memento.meta import transformer as tfm

CONFIG = tfm.TransformerConfig(vocab_size=32, seq_len=32, d_model=32, num_heads=2, num_layers=2)


def inner_loss(theta, _eta, tokens):
    return tfm.ntp_loss(theta, tokens, CONFIG)


def inner_optimizer(eta):
    per_parameter = optax.stateless(
        lambda updates, _: jax.tree.map(lambda u, log_lr: -jnp.exp(log_lr) * u, updates, eta)
    )
    return optax.chain(optax.scale_by_adam(eps_root=1e-12), per_parameter)


def meta_loss(eta, theta0, train, val):
    theta = inner_loop(inner_loss, inner_optimizer, theta0, eta, train)
    return tfm.ntp_loss(theta, val, CONFIG)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=4)
    args = parser.parse_args()
    theta0 = tfm.init_params(jax.random.PRNGKey(0), CONFIG)
    eta = jax.tree.map(lambda p: jnp.full(p.shape, jnp.log(1e-3)), theta0)
    outer = optax.adam(5e-2)
    state = outer.init(eta)
    step = jax.jit(jax.value_and_grad(meta_loss))
    key = jax.random.PRNGKey(1)
    for i in range(args.outer_steps):
        key, k1, k2 = jax.random.split(key, 3)
        train = tfm.synthetic_tokens(
            k1, (args.inner_steps, 4, CONFIG.seq_len + 1), CONFIG.vocab_size
        )
        val = tfm.synthetic_tokens(k2, (4, CONFIG.seq_len + 1), CONFIG.vocab_size)
        loss, grads = step(eta, theta0, train, val)
        updates, state = outer.update(grads, state)
        eta = optax.apply_updates(eta, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            mean_lr = jnp.mean(jnp.exp(eta["head"]))
            print(f"outer step {i:3d}: validation loss {loss:.4f}, mean head lr {mean_lr:.2e}")


if __name__ == "__main__":
    main()
