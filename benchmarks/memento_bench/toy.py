"""MixFlow-MG's motivating example (Eq. 9, Listing 4), written against memento's API.

MAML-like: the meta-parameters are the initial inner parameters, ``theta_0 = eta``; the
inner loss is an L2 loss independent of ``eta``; T plain SGD steps. The inner model is
an M-step map of a ``B x D`` batch:

    y_0 = x @ theta,    y_i = i * (2 + sin(y_{i-1})) ** cos(y_{i-1}),  i = 1..M,

so M stretches the inner computation graph without adding parameters. The map is a
``lax.scan`` over i (``variant="scan"``) or a Python loop (``variant="unrolled"``, the
paper's "loop fusion" variant).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from memento.meta import inner_loop

LEARNING_RATE = 1e-3

# name -> (how the inner gradient is taken, per-step remat with saved inner gradients,
#          block remat: jax.checkpoint on each map i of Eq. 9)
IMPLEMENTATIONS: dict[str, tuple[Literal["revrev", "listing", "fwdrev"], bool, bool]] = {
    # The default autodiff implementation (Algorithm 1): jax.grad of jax.grad.
    "default": ("revrev", False, False),
    # The default with block remat too, to show what remat alone buys it.
    "default+block": ("revrev", False, True),
    # A transcription of the paper's Listing 1 idea: a custom VJP that differentiates the
    # gradient w.r.t. *every* argument, the inner batch included.
    "listing": ("listing", False, False),
    # memento's API: inner_loop with fwdrev_grad, without and with section 4's per-step
    # remat (saving inner gradients), then also with block remat of the map.
    "memento": ("fwdrev", False, False),
    "memento+remat": ("fwdrev", True, False),
    "memento+remat+block": ("fwdrev", True, True),
}


def toy_apply(theta, x, num_maps: int, variant: str, block_remat: bool = False):
    """The inner model of Eq. 9; `block_remat` checkpoints each map (section 4)."""
    y = x @ theta

    def f(y, i):
        return i * (2.0 + jnp.sin(y)) ** jnp.cos(y), None

    if block_remat:
        f = jax.checkpoint(f)

    if variant == "unrolled":
        for i in range(1, num_maps + 1):
            y, _ = f(y, float(i))
    else:
        y, _ = jax.lax.scan(f, y, jnp.arange(1, num_maps + 1, dtype=y.dtype))
    return y


def make_toy_task(
    *,
    num_maps: int,
    variant: str = "scan",
    implementation: str = "memento",
    batch: int = 256,
    dim: int = 512,
    num_steps: int = 2,
    seed: int = 0,
) -> tuple[Callable, tuple[Any, ...]]:
    """Returns ``(meta_grad_fn, args)``: the meta-gradient of the toy task w.r.t. eta.

    Args:
        num_maps: M in Eq. 9.
        variant: ``"scan"`` or ``"unrolled"``.
        implementation: A key of `IMPLEMENTATIONS`.
        batch, dim, num_steps: B, D and T.
        seed: For the synthetic data.
    """
    how, remat, block_remat = IMPLEMENTATIONS[implementation]
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    eta = jax.random.normal(k1, (dim, dim)) / jnp.sqrt(dim)
    xs, targets = jax.random.normal(k2, (2, num_steps, batch, dim))
    val_x, val_target = jax.random.normal(k3, (2, batch, dim))

    def loss(theta, x, target):
        return jnp.mean((toy_apply(theta, x, num_maps, variant, block_remat) - target) ** 2)

    def inner_loss(theta, _eta, batch):
        return loss(theta, *batch)

    def meta_loss(eta, xs, targets, val_x, val_target):
        if how == "listing":
            grad_fn = _all_inputs_fwdrev(loss)

            def step(theta, batch):
                return theta - LEARNING_RATE * grad_fn(theta, *batch), None

            theta, _ = jax.lax.scan(step, eta, (xs, targets))
        else:
            theta = inner_loop(
                inner_loss,
                optax.sgd(LEARNING_RATE),
                eta,
                None,
                (xs, targets),
                mode=how,
                remat=remat,
            )
        return loss(theta, val_x, val_target)

    return jax.grad(meta_loss), (eta, xs, targets, val_x, val_target)


def _all_inputs_fwdrev(loss):
    """A forward-over-reverse gradient that, like MixFlow-MG's Listing 1, pulls cotangents
    back to every input (parameters and data alike) instead of only the perturbed ones."""

    @jax.custom_vjp
    def grad_fn(theta, *inputs):
        return jax.grad(loss)(theta, *inputs)

    def fwd(theta, *inputs):
        return grad_fn(theta, *inputs), (theta, inputs)

    def bwd(res, ct):
        theta, inputs = res
        full = jax.grad(loss, argnums=tuple(range(len(inputs) + 1)))
        return jax.jvp(lambda t: full(t, *inputs), (theta,), (ct,))[1]

    grad_fn.defvjp(fwd, bwd)
    return grad_fn
