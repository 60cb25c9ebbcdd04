"""The schedule to run for a measured step: `choose_policy` and `choose_schedule`."""

from __future__ import annotations

import functools

from ._auto import Charges, Policy, auto_policy
from ._dp import plan
from ._schedule import Schedule

__all__ = ["choose_policy", "choose_schedule"]


@functools.lru_cache(maxsize=256)
def _plan(num_steps: int, memory: int, policy: Policy, alpha: int | None) -> Schedule:
    return plan(num_steps, memory, policy=policy, alpha=alpha)


def choose_policy(
    num_steps: int,
    slots: int,
    alpha: int,
    policy: Policy,
    *,
    name: str,
    charges: Charges | None = None,
) -> Policy:
    """The policy `choose_schedule` plans: ``policy``, or what ``"auto"`` picks under
    the executor's ``charges`` (default: JAX's, `Charges()`; for HSM without planning it,
    see `memento.planning.internals.auto_policy`)."""
    if policy == "ism" and slots < alpha:
        raise ValueError(
            f"{name}: policy='ism' needs room for one internal state, {alpha} slots "
            f"(measured from the body's residuals); got {slots}. Raise memory or use "
            "policy='hsm' or 'auto'."
        )
    if policy != "auto":
        return policy
    return auto_policy(
        num_steps, slots, alpha, lambda p, a: _plan(num_steps, slots, p, a), charges or Charges()
    )


def choose_schedule(
    num_steps: int,
    slots: int,
    alpha: int,
    policy: Policy,
    *,
    name: str,
    charges: Charges | None = None,
) -> Schedule:
    """The schedule to run for ``num_steps`` steps in ``slots`` carry-sized slots.

    `memento.plan` with the measured alpha (``policy`` validated by the caller), cached.
    """
    policy = choose_policy(num_steps, slots, alpha, policy, name=name, charges=charges)
    try:
        return _plan(num_steps, slots, policy, None if policy == "hsm" else alpha)
    except ValueError as e:  # a plan too large to tabulate: say it as the caller
        raise ValueError(str(e).replace("memento.plan", name)) from None
