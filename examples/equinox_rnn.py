"""Equinox: a GRU trained through `memento.scan`, with ``eqx.filter_jit``/``eqx.filter_grad``.

The model is an ``eqx.Module`` (``eqx.nn.GRUCell`` and a linear readout); the loop body
closes over it, and `memento.scan` returns the gradient for the closed-over weights as
``lax.scan`` would, while the backward pass keeps only ``memory`` carries. The script
first checks that gradient against ``lax.scan``'s, then trains a few Adam steps.

    python examples/equinox_rnn.py [--steps 2000] [--memory 32] [--small]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import memento
from memento.apps.sequences import noisy_sines

HIDDEN = 32


class GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    readout: eqx.nn.Linear

    def __init__(self, hidden: int, key: jax.Array):
        k_cell, k_out = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(1, hidden, key=k_cell)
        self.readout = eqx.nn.Linear(hidden, 1, key=k_out)


def loss(model: GRU, xs, targets, memory):
    """Mean squared error of the next-value predictions over the whole sequence."""

    def step(h, inputs):
        x, target = inputs  # [batch, 1] each
        h = jax.vmap(model.cell)(x, h)
        error = jnp.mean((jax.vmap(model.readout)(h) - target) ** 2)
        return h, error

    h0 = jnp.zeros((xs.shape[1], HIDDEN))
    _, errors = memento.scan(step, h0, (xs, targets), memory=memory)  # memory=None: lax.scan
    return jnp.mean(errors), errors[-1]


# memory is a Python int (or None): filter_jit treats it as static.
grad = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000, help="sequence length")
    parser.add_argument("--memory", type=int, default=32, help="carries kept by the backward")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.steps, args.memory, args.train_steps = 60, 6, 3
    model = GRU(HIDDEN, jax.random.PRNGKey(0))
    xs, targets = noisy_sines(jax.random.PRNGKey(1), args.steps, batch=16)

    g_memento, _ = grad(model, xs, targets, args.memory)
    g_scan, _ = grad(model, xs, targets, None)
    diff = jax.tree.reduce(
        max, jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g_memento, g_scan)
    )
    print(f"T={args.steps}, memory={args.memory} carries: max |grad - lax.scan grad| = {diff:.1e}")

    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, xs, targets):
        grads, last = grad(model, xs, targets, args.memory)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, last

    for i in range(args.train_steps):
        model, opt_state, last = train_step(model, opt_state, xs, targets)
        if i % 10 == 0 or i == args.train_steps - 1:
            print(f"train step {i:3d}: last-step error {float(last):.4f}")


if __name__ == "__main__":
    main()
