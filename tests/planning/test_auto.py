"""``plan(..., policy="auto")``: the least predicted work of HSM, ISM and MSM."""

import pytest

import memento
from memento.planning import Charges, plan, plan_estimate, predicted_work
from memento.planning.internals import INTERNAL_STATE_CHARGE, auto_policy


@pytest.mark.parametrize("t", [1, 2, 7, 30, 120])
@pytest.mark.parametrize("m", [1, 2, 4, 9, 40])
@pytest.mark.parametrize("alpha", [1, 2, 3, 6])
def test_auto_is_the_least_predicted_work(t, m, alpha):
    got = plan(t, m, policy="auto", alpha=alpha)
    candidates = [plan(t, m, policy="hsm"), plan(t, m, policy="msm", alpha=alpha)]
    if m >= alpha:
        candidates.append(plan(t, m, policy="ism", alpha=alpha))
    if alpha == 1:  # MSM is not planned: with alpha = 1 it is ISM's recursion
        candidates.pop(1)
    best = min(predicted_work(s) for s in candidates)
    assert predicted_work(got) == best
    assert got.simulate().peak_memory <= m + (got.policy == "ism")  # ISM's h_0 is free
    assert got.alpha == (1 if got.policy == "hsm" else alpha)


def test_predicted_work_charges_internal_states():
    s = plan(10, 10, policy="ism")
    assert predicted_work(s) == s.cost + 10 * INTERNAL_STATE_CHARGE
    assert predicted_work(plan(10, 4, policy="hsm")) == plan(10, 4, policy="hsm").cost


def test_predicted_work_charges_the_rows_per_step_or_recomputation_but_for_hsm():
    c = Charges(internal=0.5, rows_step=1.25)
    ism, msm, hsm = (
        plan(10, 1, policy="ism"),
        plan(40, 9, policy="msm", alpha=3),
        plan(40, 4, policy="hsm"),
    )
    assert ism.cost >= 20 and msm.cost >= 80  # at least one recomputation a step
    assert predicted_work(ism, c) == ism.cost + 10 * 0.5 + 10 * 1.25
    saves = int((msm.actions[:, 0] == memento.Op.SAVE_INTERNAL).sum())
    assert predicted_work(msm, c) == msm.cost + saves * 0.5 + 40 * 1.25
    assert predicted_work(hsm, c) == hsm.cost  # HSM runs as the recursion: no rows
    # Fewer recomputations than steps: charged per recomputation; none: nothing.
    some, none = plan(10, 7, policy="ism"), plan(10, 10, policy="ism")
    assert 10 < some.cost < 20 and none.cost == 10
    assert predicted_work(some, c) == some.cost + 10 * 0.5 + (some.cost - 10) * 1.25
    assert predicted_work(none, c) == 10 + 10 * 0.5


@pytest.mark.parametrize("t,alpha", [(1, 1), (50, 1), (50, 4), (1000, 8)])
def test_a_budget_for_every_step_stores_every_step_whatever_the_rows_cost(t, alpha):
    # The rows' charge is for recomputing; a plan that stores every internal state runs
    # no primal rows (the H200 session of 2026-11-27 planned HSM here, twice the work).
    def exact(policy, a):
        return plan(t, t * alpha, policy=policy, alpha=a)  # pyright: ignore[reportArgumentType]

    for rows_step in (0.0, 1.25, 100.0):
        got = auto_policy(t, t * alpha, alpha, exact, Charges(rows_step=rows_step))
        assert exact(got, None if got == "hsm" else alpha).cost == t, (rows_step, got)


@pytest.mark.parametrize("t,m,alpha", [(1000, 250, 8), (200, 20, 3), (50, 12, 2), (30, 31, 1)])
def test_a_rows_charge_moves_auto_to_hsm_only_as_far_as_it_outweighs(t, m, alpha):
    def exact(policy, a):
        return plan(t, m, policy=policy, alpha=a)  # pyright: ignore[reportArgumentType]

    for rows_step in (0.0, 0.1, 0.5, 1.25, 4.0):
        c = Charges(rows_step=rows_step)
        got = auto_policy(t, m, alpha, exact, c)
        works = {"hsm": float(plan(t, m, policy="hsm").cost)}
        if m >= alpha and alpha > 1:
            works["msm"] = predicted_work(exact("msm", alpha), c)
        if m >= alpha:
            works["ism"] = predicted_work(exact("ism", alpha), c)
        assert works[got] == min(works.values()), (rows_step, got, works)
    if m < t * alpha:  # else ISM stores every step: no rows to charge (test below)
        assert auto_policy(t, m, alpha, exact, Charges(rows_step=t)) == "hsm"


def test_charges_are_checked():
    with pytest.raises(TypeError, match=r"charges must be a memento\.planning\.Charges"):
        predicted_work(plan(10, 4, policy="hsm"), 0.0)  # pyright: ignore[reportArgumentType]
    for bad in (-1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="Charges: rows_step must be a number >= 0"):
            Charges(rows_step=bad)  # pyright: ignore[reportArgumentType]


def test_auto_defaults_alpha_to_one():
    a, b = plan(50, 5, policy="auto"), plan(50, 5, policy="auto", alpha=1)
    assert (a.policy, a.alpha, a.cost) == (b.policy, b.alpha, b.cost) == ("ism", 1, 125)
    assert plan_estimate(1000, 50, policy="auto", alpha=3)[0] > 0


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (
            lambda: plan(10, 4, policy="auto", beta=2),
            ValueError,
            "memento.plan: beta=2 applies to policy='msm' only; 'auto' plans MSM with beta",
        ),
        (
            lambda: plan(10, 4, policy="auto", alpha=0),
            ValueError,
            "memento.plan: alpha must be >= 1, got 0",
        ),
        (
            lambda: memento.cost_table(10, 4, policy="auto"),
            ValueError,
            "memento.cost_table: policy='auto' picks a policy per plan",
        ),
        (
            lambda: plan(10, 4, policy="fastest"),
            ValueError,
            "memento.plan: unknown policy 'fastest'; pass one of 'auto'",
        ),
    ],
)
def test_auto_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
