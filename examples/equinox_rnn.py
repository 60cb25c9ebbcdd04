"""Equinox: a GRU trained through `memento.scan`, with ``eqx.filter_jit``/``eqx.filter_grad``.

The model is an ``eqx.Module`` (``eqx.nn.GRUCell`` and a linear readout); the loop body
closes over it, and `memento.scan` returns the gradient for the closed-over weights as
``lax.scan`` would, while the backward pass keeps only ``memory`` carries. The script
first checks that gradient against ``lax.scan``'s, then trains a few Adam steps.

    python examples/equinox_rnn.py [--steps 2000] [--memory 32] [--small]
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _sequences import example_arguments, noisy_sines, report_check

import memento

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
    args = example_arguments(argv, description=__doc__)
    model = GRU(HIDDEN, jax.random.PRNGKey(0))
    xs, targets = noisy_sines(jax.random.PRNGKey(1), args.steps, batch=16)

    g_memento, _ = grad(model, xs, targets, args.memory)
    g_scan, _ = grad(model, xs, targets, None)
    report_check(args, g_memento, g_scan)

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
