"""A small sequence task for the cookbook: predict the next value of noisy sine waves.

Shared by the examples (Equinox, Flax NNX, Flax linen), so that each shows only how its
framework's model goes through `memento.scan`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


def noisy_sines(key: jax.Array, num_steps: int, batch: int) -> tuple[jax.Array, jax.Array]:
    """Inputs and next-step targets, both ``[num_steps, batch, 1]`` (time first, as scan).

    Each batch member is ``sin(omega t + phase)`` plus a little noise, with its own random
    frequency and phase; the target at step ``t`` is the clean value at ``t + 1``.
    """
    k_freq, k_phase, k_noise = jax.random.split(key, 3)
    omega = jax.random.uniform(k_freq, (batch,), minval=0.05, maxval=0.3)
    phase = jax.random.uniform(k_phase, (batch,), maxval=2 * jnp.pi)
    t = jnp.arange(num_steps + 1)[:, None]
    clean = jnp.sin(omega * t + phase)[..., None]
    noise = 0.05 * jax.random.normal(k_noise, (num_steps, batch, 1))
    return clean[:-1] + noise, clean[1:]


def example_arguments(argv=None, *, description: str | None = None) -> argparse.Namespace:
    """The recurrent examples' options: ``steps``, ``memory``, ``train_steps``.

    ``--small`` sets tiny sizes (the tests run every example that way).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=2000, help="sequence length")
    parser.add_argument("--memory", type=int, default=32, help="carries kept by the backward")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.steps, args.memory, args.train_steps = 60, 6, 3
    return args


def max_difference(a, b) -> float:
    """``max |a - b|`` over the leaves of two pytrees of the same structure."""
    return jax.tree.reduce(max, jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b))


def report_check(args: argparse.Namespace, grad_memento, grad_scan) -> None:
    """Prints how far memento's gradient is from ``lax.scan``'s."""
    difference = max_difference(grad_memento, grad_scan)
    print(
        f"T={args.steps}, memory={args.memory} carries: "
        f"max |grad - lax.scan grad| = {difference:.1e}"
    )
