"""optax + `memento.meta`: meta-learn the learning rate of a long inner training run.

The inner loop is plain ``optax.sgd`` on a linear regression, run for many steps; the
meta-parameter is its log learning rate, and the meta-loss is the validation error after
the last inner step. `memento.meta.inner_loop` differentiates through the whole run
forward-over-reverse, and with ``memory=`` it runs the inner steps through
`memento.scan`: the outer backward pass keeps a fixed number of inner states instead of
one per step. The script checks that meta-gradient against the one that stores every
step, then takes a few outer Adam steps.

    python examples/optax_meta.py [--inner-steps 500] [--memory 16] [--small]
"""

import argparse

import jax
import jax.numpy as jnp
import optax

from memento.meta import inner_loop

DIM = 16


def inner_loss(theta, _eta, batch):
    x, y = batch
    return jnp.mean((x @ theta - y) ** 2)


def meta_loss(log_lr, batches, val, memory):
    theta0 = jnp.zeros(DIM)
    # The optimiser depends on eta, so inner_loop takes a function eta -> optax transformation.
    theta = inner_loop(
        inner_loss, lambda lr: optax.sgd(jnp.exp(lr)), theta0, log_lr, batches, memory=memory
    )
    return inner_loss(theta, None, val)


meta_value_and_grad = jax.jit(jax.value_and_grad(meta_loss), static_argnums=3)


def regression_data(key, inner_steps, batch=32):
    k_w, k_x, k_v = jax.random.split(key, 3)
    w = jax.random.normal(k_w, (DIM,))
    xs = jax.random.normal(k_x, (inner_steps, batch, DIM))
    x_val = jax.random.normal(k_v, (4 * batch, DIM))
    return (xs, xs @ w), (x_val, x_val @ w)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner-steps", type=int, default=500)
    parser.add_argument("--memory", type=int, default=16, help="inner states kept")
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.inner_steps, args.memory, args.outer_steps = 40, 4, 3
    log_lr = jnp.log(1e-3)
    batches, val = regression_data(jax.random.PRNGKey(0), args.inner_steps)

    _, g_budget = meta_value_and_grad(log_lr, batches, val, args.memory)
    _, g_all = meta_value_and_grad(log_lr, batches, val, None)
    print(
        f"{args.inner_steps} inner SGD steps: meta-gradient {float(g_budget):.6g} with "
        f"memory={args.memory}, {float(g_all):.6g} storing every step"
    )

    outer = optax.adam(0.1)
    state = outer.init(log_lr)
    for i in range(args.outer_steps):
        batches, val = regression_data(jax.random.PRNGKey(i + 1), args.inner_steps)
        value, grad = meta_value_and_grad(log_lr, batches, val, args.memory)
        updates, state = outer.update(grad, state)
        log_lr = optax.apply_updates(log_lr, updates)
        if i % 5 == 0 or i == args.outer_steps - 1:
            print(
                f"outer step {i:3d}: validation loss {float(value):.4f}, lr {jnp.exp(log_lr):.2e}"
            )


if __name__ == "__main__":
    main()
