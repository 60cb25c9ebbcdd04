"""Flax linen: a GRU trained through `memento.scan`, parameters as a pytree.

Linen keeps parameters outside the module, so the loop body calls ``cell.apply(params,
...)`` and the gradient w.r.t. ``params`` is ``lax.scan``'s, while the backward pass
keeps only ``memory`` carries. The script first checks that gradient against
``lax.scan``'s, then trains a few Adam steps.

    python examples/flax_linen_rnn.py [--steps 2000] [--memory 32] [--small]
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _sequences import example_arguments, noisy_sines, report_check

import memento

HIDDEN = 32


class Step(nn.Module):
    """One step: the GRU cell, then a linear readout of the new carry."""

    @nn.compact
    def __call__(self, h, x):
        h, _ = nn.GRUCell(features=HIDDEN)(h, x)
        return h, nn.Dense(1)(h)


def loss(params, xs, targets, memory):
    """Mean squared error of the next-value predictions over the whole sequence."""

    def step(h, inputs):
        x, target = inputs  # [batch, 1] each
        h, prediction = Step().apply(params, h, x)
        return h, jnp.mean((prediction - target) ** 2)

    h0 = jnp.zeros((xs.shape[1], HIDDEN))
    _, errors = memento.scan(step, h0, (xs, targets), memory=memory)  # memory=None: lax.scan
    return jnp.mean(errors)


value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=3)


def main(argv=None):
    args = example_arguments(argv, description=__doc__)
    xs, targets = noisy_sines(jax.random.PRNGKey(1), args.steps, batch=16)
    params = Step().init(jax.random.PRNGKey(0), jnp.zeros((16, HIDDEN)), xs[0])

    _, g_memento = value_and_grad(params, xs, targets, args.memory)
    _, g_scan = value_and_grad(params, xs, targets, None)
    report_check(args, g_memento, g_scan)

    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, xs, targets):
        value, grads = value_and_grad(params, xs, targets, args.memory)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = optimizer.init(params)
    for i in range(args.train_steps):
        params, opt_state, value = train_step(params, opt_state, xs, targets)
        if i % 10 == 0 or i == args.train_steps - 1:
            print(f"train step {i:3d}: loss {float(value):.4f}")


if __name__ == "__main__":
    main()
