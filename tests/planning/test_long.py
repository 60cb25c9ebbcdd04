"""Long loops: plans and tables refused up front when too large, progress, no replay."""

import numpy as np
import pytest

import memento
from memento.planning import plan, plan_estimate


def test_plan_refuses_huge_problems_up_front():
    _, nbytes = plan_estimate(10**8, 100)
    assert nbytes > 4 * 2**30
    with pytest.raises(ValueError, match=r"memento.plan: unrolling num_steps=100000000 .* GiB"):
        plan(10**8, 100)


def test_cost_table_refuses_huge_tables_up_front():
    # 10^6 x 10^4 float64 entries would be 74.5 GiB: refused before allocating anything.
    with pytest.raises(ValueError, match=r"memento.cost_table: a table of .* 74.5 GiB"):
        memento.cost_table(10**6, 10**4)


@pytest.mark.parametrize("policy,alpha", [("hsm", None), ("ism", 2), ("msm", 3)])
def test_progress_is_reported_up_to_one(policy, alpha):
    seen = []
    s = plan(
        20_000 if policy != "msm" else 600, 8, policy=policy, alpha=alpha, progress=seen.append
    )
    assert seen and seen[-1] == 1.0
    assert all(0.0 <= f <= 1.0 for f in seen)
    assert s.simulate().forward_evaluations == s.cost


def test_planned_rows_are_int32_and_peak_needs_no_replay():
    s = plan(200_000, 30, policy="hsm")
    assert s.actions.dtype == np.int32
    assert "_replay" not in s.__dict__  # peak_memory did not replay
    assert s.peak_memory == 30
    assert "_replay" not in s.__dict__
