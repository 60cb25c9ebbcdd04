"""Meta-learned loss weighting (after Hu et al. 2023): L = alpha(eta, x) * NTP(theta, x).

A second transformer (eta) scores each training sequence; its weight in (0, 2) scales
that sequence's next-token loss in the inner loop. Half the training sequences here are
noise, which does not help the validation loss; the script prints the mean weight of
clean and of noise sequences as meta-training goes. eta appears only inside the inner
loss, so its meta-gradient is made of mixed second derivatives d2L/(dtheta deta),
computed forward-over-reverse.

    python examples/loss_weighting.py [--outer-steps 20]
"""

import argparse

import jax
import jax.numpy as jnp
import optax

from memento.meta import inner_loop
from memento.meta import transformer as tfm

CONFIG = tfm.TransformerConfig(vocab_size=32, seq_len=32, d_model=32, num_heads=2, num_layers=2)


def weights(eta, tokens):
    score = jnp.mean(tfm.apply(eta, tokens[:, :-1], CONFIG)[..., 0], axis=-1)
    return 2.0 * jax.nn.sigmoid(score)


def inner_loss(theta, eta, tokens):
    return jnp.mean(weights(eta, tokens) * tfm.token_losses(theta, tokens, CONFIG))


def meta_loss(eta, theta0, train, val):
    theta = inner_loop(inner_loss, optax.adam(3e-3, eps_root=1e-12), theta0, eta, train)
    return tfm.ntp_loss(theta, val, CONFIG)


def make_batches(key, steps, batch):
    k1, k2 = jax.random.split(key)
    shape = (steps, batch, CONFIG.seq_len + 1)
    clean = tfm.synthetic_tokens(k1, shape, CONFIG.vocab_size)
    noise = jax.random.randint(k2, shape, 0, CONFIG.vocab_size)
    # First half of each batch follows the bigram chain, second half is uniform noise.
    return jnp.where(jnp.arange(batch)[None, :, None] < batch // 2, clean, noise)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=2)
    args = parser.parse_args()
    theta0 = tfm.init_params(jax.random.PRNGKey(0), CONFIG)
    eta = tfm.init_params(jax.random.PRNGKey(2), CONFIG)
    # A zero output head makes every weight start at exactly 1.
    eta["head"] = jnp.zeros_like(eta["head"])
    outer = optax.adam(1e-2)
    state = outer.init(eta)
    step = jax.jit(jax.value_and_grad(meta_loss))
    key = jax.random.PRNGKey(1)
    for i in range(args.outer_steps):
        key, k1, k2 = jax.random.split(key, 3)
        train = make_batches(k1, args.inner_steps, 8)
        val = tfm.synthetic_tokens(k2, (4, CONFIG.seq_len + 1), CONFIG.vocab_size)
        loss, grads = step(eta, theta0, train, val)
        updates, state = outer.update(grads, state)
        eta = optax.apply_updates(eta, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            w = weights(eta, train[0])
            print(
                f"outer step {i:3d}: validation loss {loss:.4f}, weight clean "
                f"{jnp.mean(w[:4]):.3f} vs noise {jnp.mean(w[4:]):.3f}"
            )


if __name__ == "__main__":
    main()
