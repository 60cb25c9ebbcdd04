"""A small sequence task for the cookbook: predict the next value of noisy sine waves.

Shared by the examples (Equinox, Flax NNX, Flax linen), so that each shows only how its
framework's model goes through `memento.scan`.
"""

from __future__ import annotations

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
