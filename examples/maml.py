"""MAML (Finn et al. 2017) on a small transformer: meta-learn the initial parameters.

eta is the inner loop's starting point, theta_0 = eta; each outer step adapts a copy to
T inner batches with Adam and moves eta to lower the adapted model's validation loss.
The meta-gradient runs forward-over-reverse (memento.meta.inner_loop's default). The
task itself is `memento_bench.tasks.make_task("maml", ...)`, the one the benchmarks time.

    python examples/maml.py [--outer-steps 20] [--small]
"""

import argparse
import sys
from pathlib import Path

# The task and its transformer live with the benchmarks (not in the memento package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import jax
import optax

from memento_bench import transformer as tfm
from memento_bench.tasks import make_task, task_batches

CONFIG = tfm.TransformerConfig(vocab_size=32, seq_len=32, d_model=32, num_heads=2, num_layers=2)
SMALL = tfm.TransformerConfig(vocab_size=16, seq_len=8, d_model=8, num_heads=2, num_layers=1)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="a tiny model (for the tests)")
    args = parser.parse_args(argv)
    config = SMALL if args.small else CONFIG
    meta_loss, eta, _ = make_task("maml", config, num_steps=args.inner_steps, batch_size=4)
    outer = optax.adam(1e-2)
    state = outer.init(eta)
    step = jax.jit(jax.value_and_grad(meta_loss))
    key = jax.random.PRNGKey(1)
    for i in range(args.outer_steps):
        key, k = jax.random.split(key)
        data = task_batches(k, config, num_steps=args.inner_steps, batch_size=4)
        loss, grads = step(eta, data)
        updates, state = outer.update(grads, state)
        eta = optax.apply_updates(eta, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            print(f"outer step {i:3d}: adapted validation loss {loss:.4f}")


if __name__ == "__main__":
    main()
