"""The policy type, its validation, and ``policy="auto"``: the fastest plan that fits.

``"auto"`` is what `memento.scan` runs by default and what ``memento plan`` reports: of
HSM, ISM and MSM (Gruslys et al. 2016), the plan with the least `predicted_work` for
``num_steps`` steps in ``memory`` slots, given alpha, the slots one internal state takes.
It is NumPy planner logic; the executors only measure alpha and call `plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, cast

import numpy as np

from ._closed import hsm_cost, ism_cost
from ._msm import msm_estimate_s
from ._schedule import Op, Schedule

__all__ = ["INTERNAL_STATE_CHARGE", "POLICIES", "Policy", "check_policy", "predicted_work"]

Policy = Literal["auto", "hsm", "ism", "msm"]
POLICIES: tuple[Policy, ...] = ("auto", "hsm", "ism", "msm")


def check_policy(fn: str, policy) -> Policy:
    """``policy`` if it is one of `POLICIES`, else a ValueError naming the function ``fn``.

    The one place a policy is validated: `plan`, `cost_table`, `plan_estimate` and
    `memento.scan` (before tracing) call it.
    """
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(
            f"{fn}: unknown policy {policy!r}; pass one of 'auto' (the least predicted "
            "work of the three below), 'hsm' (hidden states), 'ism' (internal states) or "
            "'msm' (mixed, needs alpha)"
        )
    return cast(Policy, policy)


# "auto" skips MSM when its exact table is estimated to take longer than this to plan:
# HSM and ISM have fast closed forms, MSM a table quadratic in the number of steps.
_MSM_AUTO_SECONDS = 1.0

# What "auto" charges for storing one internal state, in forward evaluations. Measured
# (benchmarks/rnn.py and a pool microbenchmark, LSTM H=64 on CPU): writing a step's
# residuals to the word pool and reading them back costs about 0.15 of a forward.
INTERNAL_STATE_CHARGE = 0.25


def predicted_work(schedule: Schedule) -> float:
    """Forward evaluations plus `INTERNAL_STATE_CHARGE` per internal state stored.

    The paper counts forward evaluations only; "auto" minimises this instead, so that a
    plan storing internal states must save more than their memory traffic. With a byte
    pool the charge was about one forward (bitcasts that add a byte axis are not free in
    XLA:CPU) and MSM never won; with the word pool it is a fraction (see
    ``memento.loops._pool``).
    """
    saves = int(np.count_nonzero(schedule.actions[:, 0] == Op.SAVE_INTERNAL))
    return schedule.cost + INTERNAL_STATE_CHARGE * saves


def auto_uses_msm(num_steps: int, memory: int, alpha: int) -> bool:
    """Whether "auto" plans MSM too: alpha >= 2 and its exact table is quick to fill."""
    return alpha > 1 and msm_estimate_s(num_steps, memory, alpha, alpha) <= _MSM_AUTO_SECONDS


def plan_auto(
    num_steps: int, memory: int, alpha: int, exact: Callable[[str, int | None], Schedule]
) -> Schedule:
    """The schedule of least `predicted_work` among HSM, ISM and MSM (beta = alpha).

    ``exact(policy, alpha)`` plans one policy for these ``num_steps`` and ``memory`` (it is
    `plan`; taken as an argument so that this module does not import the DP's). All three
    fit the budget exactly: the executor stores every state in one stack-allocated pool.
    """
    # HSM and ISM are priced from their closed forms before any row is emitted (ISM
    # stores every step's internal state once: t saves), so only the winner is unrolled.
    # MSM, when cheap enough to plan, is planned and priced from its rows.
    hsm_work = float(hsm_cost(num_steps, memory))
    ism_work = (
        ism_cost(num_steps, memory // alpha) + INTERNAL_STATE_CHARGE * num_steps
        if memory >= alpha
        else math.inf
    )
    best = exact("hsm", None) if hsm_work <= ism_work else exact("ism", alpha)
    if auto_uses_msm(num_steps, memory, alpha):
        msm = exact("msm", alpha)
        best = min([best, msm], key=lambda s: (predicted_work(s), s.peak_memory))
    return best
