"""plan / cost_table: closed forms and DP against the textbook oracle, replayed schedules."""

import math
import subprocess
import sys
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import memento
from memento.planning import (
    Op,
    _closed,
    _reference as ref,
    cost_table,
    plan,
    revolve_cost,
    simulate,
)

MSM_PARAMS = [(1, 1), (2, 1), (2, 2), (3, 2), (5, 4), (5, 5), (4, 1)]


def _replays(schedule, memory):
    result = simulate(schedule)
    assert result.forward_evaluations == schedule.cost
    assert result.peak_memory <= memory
    # The planner counts its peak from the rows (no replay): it must be the replay's.
    assert schedule.peak_memory == result.peak_memory
    # Stack depths (what executors lay out their slots from) against a plain replay.
    nh, ni = memento.planning.internals.stack_depths(schedule.actions)
    exp_h, exp_i = _replayed_depths(schedule.actions)
    np.testing.assert_array_equal(nh, exp_h)
    np.testing.assert_array_equal(ni, exp_i)
    return result


def _replayed_depths(actions):
    """stack_depths' oracle: a Python stack over the rows."""
    stack, out_h, out_i = [], [], []
    for op, arg, _ in actions.tolist():
        kind = "h" if op in (Op.SAVE_HIDDEN, Op.LOAD_HIDDEN, Op.FREE_HIDDEN) else "i"
        if op in (Op.FREE_HIDDEN, Op.FREE_INTERNAL):
            assert stack[-1] == (kind, arg)
            stack.pop()
            continue
        if op in (Op.SAVE_HIDDEN, Op.SAVE_INTERNAL):
            below = stack
            stack = [*stack, (kind, arg)]
        elif op in (Op.LOAD_INTERNAL, Op.BACKWARD_INTERNAL) or (op == Op.LOAD_HIDDEN and arg >= 0):
            below = stack[: stack.index((kind, arg))]
        else:
            below = stack
        out_h.append(sum(k == "h" for k, _ in below))
        out_i.append(sum(k == "i" for k, _ in below))
    return out_h, out_i


def test_stack_depths_refuses_out_of_stack_order():
    rows = [
        (Op.SAVE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 0), (Op.SAVE_HIDDEN, 1, 1),
        (Op.FREE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 1), (Op.BACKWARD_FUSED, 0, 2),
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"stack_depths: row 3 .* out of stack order"):
        memento.planning.internals.stack_depths(np.array(rows))


# ------------------------------------------------------------------- closed forms


def test_hsm_closed_form_equals_the_dp():
    table = ref.hsm_table(120, 12)
    for t in range(1, 121):
        for m in range(1, 13):
            assert _closed.hsm_cost(t, m) == table[t][m], (t, m)


def test_hsm_closed_form_is_griewank_walther():
    # The brief's form: r with binom(m+r-1, r-1) < t <= binom(m+r, r).
    for t in range(1, 400, 7):
        for m in range(1, 30, 3):
            r = 1
            while comb(m + r, r) < t:
                r += 1
            assert _closed.hsm_cost(t, m) == t + r * t - comb(m + r, r - 1)
            assert _closed.hsm_cost(t, m) == revolve_cost(t, m)


def test_ism_closed_form_equals_the_dp():
    table = ref.ism_table(120, 12)
    for t in range(0, 121):
        for m in range(1, 13):
            assert _closed.ism_cost(t, m) == table[t][m], (t, m)


def test_closed_form_splits_are_optimal():
    hsm, ism = ref.hsm_table(80, 9), ref.ism_table(80, 9)
    for t in range(2, 81):
        for m in range(2, 10):
            for high in (False, True):
                y = _closed.hsm_split(t, m, high)
                assert 1 <= y < t
                assert y + hsm[y][m] + hsm[t - y][m - 1] == hsm[t][m]
                y = 1 + _closed.ism_split(t - 1, m, high)
                assert 1 <= y <= t
                assert y + ism[y - 1][m] + ism[t - y][m - 1] == ism[t][m]


def test_msm_with_alpha_one_is_ism():
    table = ref.msm_table(60, 10, 1, 1)
    for t in range(1, 61):
        for m in range(1, 11):
            assert table[t][m] == _closed.ism_cost(t, m)


def test_closed_forms_are_exact_for_huge_sizes():
    # Python ints: no overflow, no float rounding.
    t = 10**12
    assert _closed.hsm_cost(t, 1) == t * (t + 1) // 2
    # binom(m+2, 2) < t <= binom(m+3, 3): r = 3.
    assert _closed.hsm_cost(t, 10**6) == 4 * t - comb(10**6 + 3, 2)


def test_paper_headline_ism_1000_steps_5_percent_memory():
    # Section 3.2: 95% of memory saved for t = 1000 at about 1.95 forwards per step.
    # Independently: the increments of C_ism(., 50) are 1 (50 times), then 2 (1275 times),
    # so C = 50 * 1 + 950 * 2.
    s = plan(1000, 50, policy="ism")
    assert s.cost == 50 + 950 * 2 == 1950
    assert s.cost_per_step == 1.95


# ------------------------------------------------------------------- cost_table


@pytest.mark.parametrize("policy", ["hsm", "ism"])
def test_cost_table_equals_the_oracle(policy):
    table = ref.hsm_table(40, 8) if policy == "hsm" else ref.ism_table(40, 8)
    got = cost_table(40, 8, policy=policy)
    assert got.shape == (41, 9) and got.dtype == np.float64
    assert np.all(got[0] == 0)
    assert np.all(np.isinf(got[1:, 0]))
    assert all(got[t, m] == table[t][m] for t in range(41) for m in range(1, 9))


@pytest.mark.parametrize("alpha, beta", MSM_PARAMS)
def test_msm_cost_table_equals_the_oracle(alpha, beta):
    table = ref.msm_table(30, 9, alpha, beta)
    got = cost_table(30, 9, policy="msm", alpha=alpha, beta=beta)
    assert all(got[t, m] == table[t][m] for t in range(31) for m in range(1, 10))


def test_ism_cost_table_with_alpha_counts_whole_internal_states():
    got = cost_table(20, 7, policy="ism", alpha=3)
    assert np.all(np.isinf(got[1:, :3]))
    assert got[20, 6] == got[20, 7] == _closed.ism_cost(20, 2)


@pytest.mark.parametrize(
    "policy, alpha, beta", [("hsm", None, None), ("ism", None, None), ("msm", 3, 2)]
)
def test_cost_is_monotone(policy, alpha, beta):
    c = cost_table(60, 12, policy=policy, alpha=alpha, beta=beta)[1:, 1:]
    assert np.all(np.diff(c, axis=1) <= 0)  # more memory never costs more
    assert np.all(np.diff(c, axis=0) > 0)  # a longer loop always costs more


# ------------------------------------------------------------------- boundaries


def test_hsm_boundaries():
    for t in range(1, 30):
        assert plan(t, 1, policy="hsm").cost == t * (t + 1) // 2
        for m in range(max(1, t - 1), t + 3):
            assert plan(t, m, policy="hsm").cost == 2 * t - 1
        assert plan(t, 1, policy="hsm").counts_initial


def test_ism_boundaries():
    for t in range(1, 30):
        assert plan(t, 1, policy="ism").cost == t * (t + 1) // 2
        assert plan(t, t, policy="ism").cost == t
        assert plan(t, 2 * t, policy="ism", alpha=2).cost == t
        assert not plan(t, 1, policy="ism").counts_initial


def test_msm_boundaries():
    for t in range(1, 25):
        assert plan(t, 1, policy="msm", alpha=3).cost == t * (t + 1) // 2
        # Every step but the (fused) last kept as an internal state at beta.
        assert plan(t, 1 + (t - 1) * 2, policy="msm", alpha=3, beta=2).cost == t
        assert plan(1, 5, policy="msm", alpha=3).cost == 1


def test_msm_is_never_worse_than_hsm():
    for alpha, beta in MSM_PARAMS:
        msm = cost_table(40, 10, policy="msm", alpha=alpha, beta=beta)
        assert np.all(msm <= cost_table(40, 10))


# ------------------------------------------------------------------- replay


def test_every_plan_replays_on_a_grid():
    hsm, ism = ref.hsm_table(30, 8), ref.ism_table(30, 8)
    for t in range(1, 31):
        for m in range(1, 9):
            s = plan(t, m, policy="hsm")
            _replays(s, m)
            assert s.cost == hsm[t][m]
            saves = s.actions[s.actions[:, 0] == Op.SAVE_HIDDEN, 1]
            assert saves.size == 0 or 0 <= saves.min() <= saves.max() <= m - 2  # h_0 is -1
            for alpha in (1, 2):
                if m >= alpha:
                    s = plan(t, m, policy="ism", alpha=alpha)
                    _replays(s, m)
                    assert s.cost == ism[t][m // alpha]


@pytest.mark.parametrize("alpha, beta", MSM_PARAMS)
def test_every_msm_plan_replays_on_a_grid(alpha, beta):
    table = ref.msm_table(24, 9, alpha, beta)
    for t in range(1, 25):
        for m in range(1, 10):
            s = plan(t, m, policy="msm", alpha=alpha, beta=beta)
            _replays(s, m)
            assert s.cost == table[t][m]
            assert (s.alpha, s.beta) == (alpha, beta)


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 400),
    m=st.integers(1, 40),
    policy=st.sampled_from(["hsm", "ism", "msm"]),
    alpha=st.integers(1, 5),
    data=st.data(),
)
def test_random_plans_replay(t, m, policy, alpha, data):
    if policy == "hsm":
        s = plan(t, m, policy="hsm")
    elif policy == "ism":
        s = plan(t, max(m, alpha), policy="ism", alpha=alpha)
        m = max(m, alpha)
    else:
        t = min(t, 120)  # the exact MSM table is O(t^2 m)
        beta = data.draw(st.integers(1, alpha))
        s = plan(t, m, policy="msm", alpha=alpha, beta=beta)
    _replays(s, m)


def test_long_loops_need_no_recursion_and_stay_small():
    s = plan(100_000, 3, policy="hsm")
    assert s.cost == _closed.hsm_cost(100_000, 3)
    # The schedule holds its rows only: a few per step, not t * m table entries.
    assert len(s.actions) < 12 * 100_000
    s = plan(20_000, 50, policy="ism")
    assert len(s.actions) < 12 * 20_000
    assert simulate(s).forward_evaluations == s.cost


def test_first_sweep_is_a_prefix():
    s = plan(50, 6, policy="hsm")
    sweep = s.actions[: simulate(s).sweep_length]
    assert set(sweep[:, 0].tolist()) <= {0, 1}  # ADVANCE and SAVE_HIDDEN only


def test_repr_and_counts():
    s = plan(10, 4, policy="hsm")
    assert "cost=24" in repr(s) and s.cost == 24


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((0, 4), {}, ValueError, r"memento\.plan: num_steps must be >= 1, got 0"),
        ((10, 0), {}, ValueError, r"memory must be >= 1 slot, got 0"),
        ((10.5, 4), {}, TypeError, r"num_steps must be an int, got 10\.5 \(float\)"),
        ((True, 4), {}, TypeError, r"num_steps must be an int, got True \(bool\)"),
        ((10, "4"), {}, TypeError, r"memory must be an int, got '4'"),
        ((10, 4), {"policy": "abc"}, ValueError, r"unknown policy 'abc'; pass one of 'auto'"),
        (
            (10, 4),
            {"policy": "hsm", "alpha": 2},
            ValueError,
            r"alpha/beta .* apply to policy='ism' or 'msm'",
        ),
        ((10, 4), {"policy": "msm"}, ValueError, r"policy='msm' needs alpha"),
        ((10, 4), {"policy": "msm", "alpha": 0}, ValueError, r"alpha must be >= 1, got 0"),
        ((10, 4), {"policy": "msm", "alpha": 2, "beta": 3}, ValueError, r"1 <= beta <= alpha=2"),
        ((10, 4), {"policy": "msm", "alpha": 2, "beta": 0}, ValueError, r"got 0"),
        ((10, 4), {"policy": "msm", "alpha": 2.0}, TypeError, r"alpha must be an int"),
        ((10, 4), {"policy": "ism", "beta": 1}, ValueError, r"beta=1 applies to policy='msm'"),
        ((10, 2), {"policy": "ism", "alpha": 3}, ValueError, r"below policy='ism''s minimum"),
        ((10**8, 4), {}, ValueError, r"about 500000000 schedule rows"),
        ((10**6, 1000), {"policy": "msm", "alpha": 5}, ValueError, r"would take about \d+ min"),
        (
            (10**6, 400),
            {"policy": "msm", "alpha": 5},
            ValueError,
            r"\(O\(t m\)\) would take about .* and 4\.9 GiB \(the limits are 2 min and 4 GiB\)",
        ),
    ],
)
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        plan(*args, **kwargs)


def test_cost_table_errors_name_cost_table():
    with pytest.raises(ValueError, match=r"memento\.cost_table: num_steps must be >= 1"):
        cost_table(0, 3)
    with pytest.raises(ValueError, match=r"memento\.cost_table: .*would take about"):
        cost_table(10**6, 1000, policy="msm", alpha=5)


def test_public_names():
    assert memento.plan is plan and memento.cost_table is cost_table


def test_planning_does_not_import_jax():
    code = (
        "import sys; import memento; import memento.planning; "
        "memento.plan(10, 3); memento.cost_table(5, 2); "
        "memento.plan_chain([1, 2], [1, 1, 1], [3, 3], 4); "
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_paper_upper_bounds_hold():
    # Appendix B, Proposition 1: C(t, m) <= m t^(1 + 1/m); section 3.5: C(t, m) <
    # 4 t^(1 + 1/m) for t < 10^5, m < 10^3 (checked numerically in the paper).
    for t in [1, 2, 3, 7, 50, 999, 12_345, 99_999]:
        for m in [1, 2, 3, 5, 10, 100, 999]:
            c = _closed.hsm_cost(t, m)
            assert c <= m * t ** (1 + 1 / m) + 1e-9
            assert c < 4 * t ** (1 + 1 / m)
    # Appendix B.2: C(t, m) <= (a + 1) t whenever t <= m^a / a!.
    for m in [2, 5, 10, 40]:
        for a in [1, 2, 3]:
            t = m**a // math.factorial(a)
            if t >= 1:
                assert _closed.hsm_cost(t, m) <= (a + 1) * t
