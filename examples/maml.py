"""MAML (Finn et al. 2017) on a small transformer: meta-learn the initial parameters.

eta is the inner loop's starting point, theta_0 = eta; each outer step adapts a copy to
T inner batches with Adam and moves eta to lower the adapted model's validation loss.
The meta-gradient runs forward-over-reverse (memento.meta.inner_loop's default).

    python examples/maml.py [--outer-steps 20]
"""

import argparse

import jax
import optax

from memento.meta import inner_loop
from memento.meta import transformer as tfm

CONFIG = tfm.TransformerConfig(vocab_size=32, seq_len=32, d_model=32, num_heads=2, num_layers=2)


def inner_loss(theta, _eta, tokens):
    return tfm.ntp_loss(theta, tokens, CONFIG)


def meta_loss(eta, train, val):
    # Adam needs eps_root > 0 for meta-gradients (inner_loop refuses 0).
    inner_opt = optax.adam(3e-3, eps_root=1e-12)
    theta = inner_loop(inner_loss, inner_opt, eta, eta, train)  # theta_0 = eta
    return tfm.ntp_loss(theta, val, CONFIG)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=2)
    args = parser.parse_args()
    eta = tfm.init_params(jax.random.PRNGKey(0), CONFIG)
    outer = optax.adam(1e-2)
    state = outer.init(eta)
    step = jax.jit(jax.value_and_grad(meta_loss))
    key = jax.random.PRNGKey(1)
    for i in range(args.outer_steps):
        key, k1, k2 = jax.random.split(key, 3)
        train = tfm.synthetic_tokens(
            k1, (args.inner_steps, 4, CONFIG.seq_len + 1), CONFIG.vocab_size
        )
        val = tfm.synthetic_tokens(k2, (4, CONFIG.seq_len + 1), CONFIG.vocab_size)
        loss, grads = step(eta, train, val)
        updates, state = outer.update(grads, state)
        eta = optax.apply_updates(eta, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            print(f"outer step {i:3d}: adapted validation loss {loss:.4f}")


if __name__ == "__main__":
    main()
