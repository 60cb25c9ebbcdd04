"""Flax NNX: a GRU trained through `memento.scan` with ``nnx.jit`` and ``nnx.value_and_grad``.

NNX modules are mutable Python objects; a loop body that closes over one is fine for
`memento.scan`, which returns the gradient for the closed-over parameters as ``lax.scan``
would while the backward pass keeps only ``memory`` carries. The script first checks that
gradient against ``lax.scan``'s, then trains a few Adam steps with ``nnx.Optimizer``.

    python examples/flax_nnx_rnn.py [--steps 2000] [--memory 32] [--small]
"""

import functools

import jax
import jax.numpy as jnp
import optax
from _sequences import example_arguments, noisy_sines, report_check
from flax import nnx

import memento

HIDDEN = 32


class GRU(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.cell = nnx.GRUCell(1, hidden, rngs=rngs)
        self.readout = nnx.Linear(hidden, 1, rngs=rngs)


def loss(model: GRU, xs, targets, memory):
    """Mean squared error of the next-value predictions over the whole sequence."""

    def step(h, inputs):
        x, target = inputs  # [batch, 1] each
        h, _ = model.cell(h, x)  # nnx.GRUCell: (carry, x) -> (carry, y), batched
        return h, jnp.mean((model.readout(h) - target) ** 2)

    h0 = jnp.zeros((xs.shape[1], HIDDEN))
    _, errors = memento.scan(step, h0, (xs, targets), memory=memory)  # memory=None: lax.scan
    return jnp.mean(errors)


@functools.partial(nnx.jit, static_argnums=3)
def value_and_grad(model, xs, targets, memory):
    return nnx.value_and_grad(loss)(model, xs, targets, memory)


def main(argv=None):
    args = example_arguments(argv, description=__doc__)
    model = GRU(HIDDEN, nnx.Rngs(0))
    xs, targets = noisy_sines(jax.random.PRNGKey(1), args.steps, batch=16)

    _, g_memento = value_and_grad(model, xs, targets, args.memory)
    _, g_scan = value_and_grad(model, xs, targets, None)
    report_check(args, g_memento, g_scan)

    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, xs, targets):
        value, grads = nnx.value_and_grad(loss)(model, xs, targets, args.memory)
        optimizer.update(model, grads)
        return value

    for i in range(args.train_steps):
        value = train_step(model, optimizer, xs, targets)
        if i % 10 == 0 or i == args.train_steps - 1:
            print(f"train step {i:3d}: loss {float(value):.4f}")


if __name__ == "__main__":
    main()
