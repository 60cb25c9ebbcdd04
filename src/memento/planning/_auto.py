"""The policy type, its validation, and ``policy="auto"``: the fastest plan that fits.

``"auto"`` is what `memento.scan` runs by default and what ``memento plan`` reports: of
HSM, ISM and MSM (Gruslys et al. 2016), the plan with the least `predicted_work` for
``num_steps`` steps in ``memory`` slots, given alpha, the slots one internal state takes.
It is NumPy planner logic; the executors only measure alpha and call `plan`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal, cast

import numpy as np

from ._closed import hsm_cost, ism_cost
from ._msm import msm_estimate_s
from ._schedule import Op, Schedule

__all__ = [
    "INTERNAL_STATE_CHARGE",
    "POLICIES",
    "Charges",
    "Policy",
    "check_policy",
    "predicted_work",
]

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

# What "auto" charges for storing one internal state, in forward evaluations, in JAX.
# Calibrated on an LSTM step on CPU (benchmarks/rnn.py, benchmarks/pool.py): writing a
# step's residuals to a pool and reading them back costs a fraction of a forward.
INTERNAL_STATE_CHARGE = 0.25


@dataclasses.dataclass(frozen=True)
class Charges:
    """What ``"auto"`` charges a plan beyond the paper's forward evaluations, in forward
    evaluations: the executor's costs that counting evaluations does not see.

    Attributes:
        internal: per internal state stored. JAX's executors copy a stored step's
            residuals into a pool and back: `INTERNAL_STATE_CHARGE`, a fraction of a
            forward (see ``memento.loops._pool``). `memento.torch` keeps the step's autograd graph as
            it is, copying nothing, and charges 0.
        rows_step: per step, for a plan that runs on the rows (ISM and MSM) where HSM
            would run as the recursion, which reads no schedule. 0 where the two cost
            alike per step (CPU); `memento.scan` passes a calibrated charge on a GPU
            (see ``memento.planning.internals.auto_charges``). The rows' extra is in the primal rows
            that the backward runs between its steps, about one per recomputation, so a
            plan that recomputes less than once a step is charged that fraction: one
            that stores every step (a budget for all of them) runs none and is charged
            nothing.
    """

    internal: float = INTERNAL_STATE_CHARGE
    rows_step: float = 0.0

    def __post_init__(self):
        for name in ("internal", "rows_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(
                    f"Charges: {name} must be a number >= 0 (forward evaluations), got {value!r}."
                )


def _checked(charges) -> Charges:
    if not isinstance(charges, Charges):
        raise TypeError(
            "memento.planning: charges must be a memento.planning.Charges (e.g. "
            f"Charges(internal=0.0)), got {charges!r}."
        )
    return charges


def predicted_work(schedule: Schedule, charges: Charges = Charges()) -> float:
    """Forward evaluations plus the executor's `Charges`: ``charges.internal`` per
    internal state stored, and, unless the plan is HSM, ``charges.rows_step`` per step
    or per recomputation, whichever is fewer (see `Charges`).

    The paper counts forward evaluations only; "auto" minimises this instead, so that a
    plan storing internal states must save more than their memory traffic, and a plan on
    the rows more than what the rows cost beyond the recursion.
    """
    charges = _checked(charges)
    saves = int(np.count_nonzero(schedule.actions[:, 0] == Op.SAVE_INTERNAL))
    rows = (
        0.0 if schedule.policy == "hsm" else rows_charge(schedule.num_steps, schedule.cost, charges)
    )
    return schedule.cost + charges.internal * saves + rows


def rows_charge(num_steps: int, cost: float, charges: Charges) -> float:
    """What a plan on the rows of ``cost`` forward evaluations for ``num_steps`` steps is
    charged for them: ``charges.rows_step`` per step, or per recomputation (``cost`` less
    the first sweep's ``num_steps``) where there are fewer: MSM and ISM run about one
    primal row per recomputation in their backward."""
    return charges.rows_step * min(num_steps, max(cost - num_steps, 0))


def auto_uses_msm(num_steps: int, memory: int, alpha: int) -> bool:
    """Whether "auto" plans MSM too: alpha >= 2 and its exact table is quick to fill."""
    return alpha > 1 and msm_estimate_s(num_steps, memory, alpha, alpha) <= _MSM_AUTO_SECONDS


def auto_policy(
    num_steps: int,
    memory: int,
    alpha: int,
    exact: Callable[[str, int | None], Schedule],
    charges: Charges = Charges(),
) -> Policy:
    """The policy of least `predicted_work` among HSM, ISM and MSM (beta = alpha), under
    the executor's ``charges``.

    ``exact(policy, alpha)`` plans one policy for these ``num_steps`` and ``memory`` (it is
    `plan`; taken as an argument so that this module does not import the DP's). HSM and
    ISM are priced from their closed forms (ISM stores every step's internal state once:
    t saves) and planned only to break an exact tie with MSM, by peak memory; MSM, when
    cheap enough to plan, is planned and priced from its rows. So an HSM pick costs no
    rows at all, and `memento.scan` can run it without any (`memento.loops._recursion`).
    """
    charges = _checked(charges)
    hsm_work = float(hsm_cost(num_steps, memory))
    ism = ism_cost(num_steps, memory // alpha) if memory >= alpha else None
    ism_work = (
        ism + charges.internal * num_steps + rows_charge(num_steps, ism, charges)
        if ism is not None
        else math.inf
    )
    best, work = ("hsm", hsm_work) if hsm_work <= ism_work else ("ism", ism_work)
    if auto_uses_msm(num_steps, memory, alpha):
        msm = exact("msm", alpha)
        msm_work = predicted_work(msm, charges)
        if msm_work < work or (
            msm_work == work
            and msm.peak_memory < exact(best, None if best == "hsm" else alpha).peak_memory
        ):
            best = "msm"
    return best


def plan_auto(
    num_steps: int, memory: int, alpha: int, exact: Callable[[str, int | None], Schedule]
) -> Schedule:
    """The schedule of `auto_policy`'s pick. All three policies fit the budget exactly:
    the executor stores every state in one stack-allocated pool."""
    policy = auto_policy(num_steps, memory, alpha, exact)
    return exact(policy, None if policy == "hsm" else alpha)
