"""Meta-learned loss weighting (after Hu et al. 2023): L = alpha(eta, x) * NTP(theta, x).

A second transformer (eta) scores each training sequence; its weight in (0, 2) scales
that sequence's next-token loss in the inner loop. Half the training sequences here are
noise, which does not help the validation loss; the script prints the mean weight of
clean and of noise sequences as meta-training goes. eta appears only inside the inner
loss, so its meta-gradient is made of mixed second derivatives d2L/(dtheta deta),
computed forward-over-reverse. The task is
`memento_bench.tasks.make_task("loss_weighting", ...)`, the one the benchmarks time.

    python examples/loss_weighting.py [--outer-steps 20] [--small]
"""

import argparse
import sys
from pathlib import Path

# The task and its transformer live with the benchmarks (not in the memento package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import jax
import jax.numpy as jnp
import optax

from memento_bench import transformer as tfm
from memento_bench.tasks import make_task, sequence_weights, task_batches

CONFIG = tfm.TransformerConfig(vocab_size=32, seq_len=32, d_model=32, num_heads=2, num_layers=2)
SMALL = tfm.TransformerConfig(vocab_size=16, seq_len=8, d_model=8, num_heads=2, num_layers=1)
BATCH = 8


def with_noise(key, config, train):
    """The second half of each inner batch replaced by uniform noise."""
    noise = jax.random.randint(key, train.shape, 0, config.vocab_size)
    return jnp.where(jnp.arange(BATCH)[None, :, None] < BATCH // 2, train, noise)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="a tiny model (for the tests)")
    args = parser.parse_args(argv)
    config = SMALL if args.small else CONFIG
    meta_loss, eta, first = make_task(
        "loss_weighting", config, num_steps=args.inner_steps, batch_size=BATCH
    )
    # A zero output head makes every weight start at exactly 1.
    eta["head"] = jnp.zeros_like(eta["head"])
    outer = optax.adam(1e-2)
    state = outer.init(eta)
    step = jax.jit(jax.value_and_grad(meta_loss))
    key = jax.random.PRNGKey(1)
    for i in range(args.outer_steps):
        key, k_data, k_noise = jax.random.split(key, 3)
        data = task_batches(k_data, config, num_steps=args.inner_steps, batch_size=BATCH)
        data = {**data, "train": with_noise(k_noise, config, data["train"]), "init": first["init"]}
        loss, grads = step(eta, data)
        updates, state = outer.update(grads, state)
        eta = optax.apply_updates(eta, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            w = sequence_weights(eta, data["train"][0], config)
            print(
                f"outer step {i:3d}: validation loss {loss:.4f}, weight clean "
                f"{jnp.mean(w[: BATCH // 2]):.3f} vs noise {jnp.mean(w[BATCH // 2 :]):.3f}"
            )


if __name__ == "__main__":
    main()
