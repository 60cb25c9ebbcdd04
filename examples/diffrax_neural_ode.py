"""Diffrax: a neural ODE fitted through ``memento.diffrax.CheckpointAdjoint``.

``diffeqsolve(..., adjoint=memento.diffrax.CheckpointAdjoint(memory=...))`` runs the
solver's steps through `memento.while_loop`: the backward pass keeps ``memory`` solver
states (the outputs saved at ``SaveAt(ts=...)`` take no slots) and recomputes the rest.
The script checks the gradient against Diffrax's ``RecursiveCheckpointAdjoint``, then
fits the vector field (an ``eqx.nn.MLP``) to a damped oscillator with a few Adam steps.

    python examples/diffrax_neural_ode.py [--steps 2000] [--memory 32] [--small]

``--steps`` is the number of fixed solver steps (Tsit5) over ``[0, 10]``.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _sequences import example_arguments, max_difference

import memento

T1 = 10.0


class Field(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, y, args):
        return self.mlp(y)


def solve(field, y0, ts, steps, adjoint):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        0.0,
        T1,
        T1 / steps,
        y0,
        saveat=diffrax.SaveAt(ts=ts),
        max_steps=steps,
        adjoint=adjoint,
    ).ys


def loss(field, y0, ts, data, steps, adjoint):
    return jnp.mean((solve(field, y0, ts, steps, adjoint) - data) ** 2)


# steps and the adjoint (its memory) are static: filter_jit keeps non-arrays static.
grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))


def main(argv=None):
    args = example_arguments(argv, description=__doc__)
    ts = jnp.linspace(0.0, T1, 100)
    y0 = jnp.array([2.0, 0.0])

    def target(t, y, args):  # a damped oscillator, the data to fit
        return jnp.stack([y[1], -y[0] - 0.1 * y[1]])

    data = solve(target, y0, ts, args.steps, diffrax.RecursiveCheckpointAdjoint())
    field = Field(eqx.nn.MLP(2, 2, 32, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0)))
    adjoint = memento.diffrax.CheckpointAdjoint(memory=args.memory)

    _, g_memento = grad(field, y0, ts, data, args.steps, adjoint)
    _, g_diffrax = grad(field, y0, ts, data, args.steps, diffrax.RecursiveCheckpointAdjoint())
    print(
        f"{args.steps} steps, memory={args.memory} solver states: "
        f"max |grad - RecursiveCheckpointAdjoint grad| = {max_difference(g_memento, g_diffrax):.1e}"
    )

    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(field, eqx.is_array))

    @eqx.filter_jit
    def train_step(field, opt_state):
        value, grads = grad(field, y0, ts, data, args.steps, adjoint)
        updates, opt_state = optimizer.update(grads, opt_state, field)
        return eqx.apply_updates(field, updates), opt_state, value

    for i in range(args.train_steps):
        field, opt_state, value = train_step(field, opt_state)
        if i % 10 == 0 or i == args.train_steps - 1:
            print(f"train step {i:3d}: loss {float(value):.4f}")


if __name__ == "__main__":
    main()
