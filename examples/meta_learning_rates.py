"""Learned per-parameter learning rates (Bengio 2000; Maclaurin et al. 2015).

eta holds one log learning rate per parameter entry; the inner optimiser is Adam's
direction scaled by exp(eta), so the optimiser itself depends on eta: inner_loop takes
a function eta -> optax transformation. Each outer step trains a fresh model for T inner
steps and moves eta to lower its validation loss. The task is
`memento_bench.tasks.make_task("learning_rates", ...)`, the one the benchmarks time.

    python examples/meta_learning_rates.py [--outer-steps 20] [--small]
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
from memento_bench.tasks import make_task, task_batches

CONFIG = tfm.TransformerConfig(vocab_size=32, seq_len=32, d_model=32, num_heads=2, num_layers=2)
SMALL = tfm.TransformerConfig(vocab_size=16, seq_len=8, d_model=8, num_heads=2, num_layers=1)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="a tiny model (for the tests)")
    args = parser.parse_args(argv)
    config = SMALL if args.small else CONFIG
    meta_loss, eta, first = make_task(
        "learning_rates", config, num_steps=args.inner_steps, batch_size=4
    )
    outer = optax.adam(5e-2)
    state = outer.init(eta)
    step = jax.jit(jax.value_and_grad(meta_loss))
    key = jax.random.PRNGKey(1)
    for i in range(args.outer_steps):
        key, k = jax.random.split(key)
        # The same initial model each outer step, fresh batches.
        data = {**task_batches(k, config, num_steps=args.inner_steps, batch_size=4),
                "init": first["init"]}  # fmt: skip
        loss, grads = step(eta, data)
        updates, state = outer.update(grads, state)
        eta = optax.apply_updates(eta, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            mean_lr = jnp.mean(jnp.exp(eta["head"]))
            print(f"outer step {i:3d}: validation loss {loss:.4f}, mean head lr {mean_lr:.2e}")


if __name__ == "__main__":
    main()
