"""Baselines: replayed by the simulator, costs equal to their closed forms."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from memento.planning import _baselines as bl, cost_table, plan
from memento.planning._schedule import Op, Schedule

GRID = [1, 2, 3, 4, 5, 7, 10, 16, 33, 100, 257]


def _hsm_oracle(max_steps: int, max_memory: int) -> np.ndarray:
    """HSM optimum C(t, m) by the paper's Algorithm 1 (O(t^2 m)); index [t, m]."""
    c = np.full((max_steps + 1, max_memory + 1), np.inf)
    c[0, 1:] = 0
    for m in range(1, max_memory + 1):
        for t in range(1, max_steps + 1):
            if m == 1 or t == 1:
                c[t, m] = t * (t + 1) // 2
            else:
                y = np.arange(1, t)
                c[t, m] = np.min(y + c[y, m] + c[t - y, m - 1])
    return c


HSM = _hsm_oracle(60, 8)


def _check(s: Schedule) -> None:
    """The replay accepts the schedule and agrees with its cost and memory."""
    sim = s.simulate()
    assert sim.forward_evaluations == s.cost
    assert sim.peak_memory == s.memory
    assert s.peak_memory == s.memory


@pytest.mark.parametrize("t", GRID)
def test_store_all(t):
    s = bl.store_all(t)
    _check(s)
    assert (s.cost, s.memory, s.policy) == (t, t, "store_all")
    assert np.all(s.executable()[:, 0] != Op.BACKWARD_FUSED)
    assert bl.store_all(t, alpha=5, beta=4).memory == 4 * t


@pytest.mark.parametrize("t", GRID)
def test_store_none(t):
    s = bl.store_none(t)
    _check(s)
    assert (s.cost, s.memory) == (t * (t + 1) // 2, 1)


@pytest.mark.parametrize("t", GRID)
@pytest.mark.parametrize(("alpha", "beta"), [(None, None), (3, 2), (5, 5), (11, 10)])
def test_chen_sqrt(t, alpha, beta):
    s = bl.chen_sqrt(t, alpha=alpha, beta=beta)
    _check(s)
    k = max(1, round(math.sqrt(t)))
    n = -(-t // k)
    last = t - (n - 1) * t // n
    # One first sweep plus one more pass over all segments but the last.
    assert s.cost == 2 * t - last
    a = alpha or 1
    b = beta or a
    lengths = np.diff([i * t // n for i in range(n + 1)])
    # The last segment runs with h_0 and the n - 2 inner boundaries stored, and its first
    # internal state takes alpha (its input is not stored); segment i < n - 1 runs with
    # i + 1 hidden states and all its internal states at beta.
    peaks = [max(n - 1, 1) + (a if n > 1 else b) + (lengths[-1] - 1) * b]
    peaks += [i + 1 + lengths[i] * b for i in range(n - 1)]
    assert s.memory == max(peaks)


def test_chen_sqrt_memory_is_the_papers():
    # Section 4.2: sqrt(t) hidden + sqrt(t) internal states without their input.
    for beta in (2, 5, 10):
        s = bl.chen_sqrt(1024, alpha=beta + 1, beta=beta)
        assert s.memory == 32 * (1 + beta)
        assert s.cost == 2 * 1024 - 32


@pytest.mark.parametrize("t", GRID)
@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_chen_recursive(t, k):
    s = bl.chen_recursive(t, k=k)
    _check(s)
    levels = math.ceil(math.log(t, k + 1) - 1e-9) if t > 1 else 0
    assert s.memory <= 1 + k * levels
    assert np.all(s.actions[:, 0] != Op.SAVE_INTERNAL)
    if t <= 60 and s.memory <= 8:
        assert s.cost >= HSM[t, s.memory]


def test_chen_recursive_bisection_is_logarithmic():
    s = bl.chen_recursive(1024, k=1)
    assert s.memory == 11  # h_0 and one state per halving
    # Each of the 10 levels advances over half of every segment; then t fused steps.
    assert s.cost == 10 * 1024 // 2 + 1024


@pytest.mark.parametrize("t", [t for t in GRID if t <= 60] + [60])
@pytest.mark.parametrize("snaps", range(1, 9))
def test_revolve_is_hsm_optimal(t, snaps):
    s = bl.revolve(t, snaps)
    _check(s)
    assert s.cost == bl.revolve_cost(t, snaps) == HSM[t, snaps]
    assert s.memory == min(snaps, t)
    assert np.all(s.actions[:, 0] != Op.SAVE_INTERNAL)


def test_revolve_cost_boundaries():
    # C(t, 1) = t(t+1)/2, C(t, m) = 2t - 1 for m >= t (section 3.1).
    for t in range(1, 200, 7):
        assert bl.revolve_cost(t, 1) == t * (t + 1) // 2
        assert bl.revolve_cost(t, t) == bl.revolve_cost(t, t + 5) == 2 * t - 1


def test_revolve_matches_planner():
    for t, m in [(1, 1), (10, 3), (100, 5), (1000, 10), (1000, 50)]:
        assert bl.revolve(t, m).cost == plan(t, m, policy="hsm").cost
    table = cost_table(300, 20, policy="hsm")
    for t in range(1, 301, 13):
        for m in range(1, 21):
            assert table[t, m] == bl.revolve_cost(t, m)


def test_baselines_never_beat_the_planner():
    # Section 4.1: every Chen strategy is a policy of the same model, so the DP optimum
    # at the same memory is at least as good.
    for t in (10, 50, 200):
        for beta in (1, 2, 4):
            s = bl.chen_sqrt(t, alpha=beta + 1, beta=beta)
            best = plan(t, s.memory, policy="msm", alpha=beta + 1, beta=beta)
            assert best.cost <= s.cost
        r = bl.chen_recursive(t, k=2)
        assert plan(t, r.memory, policy="hsm").cost <= r.cost


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 120),
    snaps=st.integers(1, 40),
    k=st.integers(1, 6),
    seg=st.integers(1, 40),
    beta=st.integers(1, 6),
    extra=st.integers(0, 3),
)
def test_baselines_replay(t, snaps, k, seg, beta, extra):
    schedules = [
        bl.store_all(t, alpha=beta + extra, beta=beta),
        bl.chen_sqrt(t, segment_length=seg, alpha=beta + extra, beta=beta),
        bl.chen_recursive(t, k=k),
        bl.revolve(t, snaps),
    ]
    for s in schedules:
        _check(s)
    assert schedules[-1].cost == bl.revolve_cost(t, snaps)
    assert bl.revolve_cost(t, snaps) <= schedules[2].cost or schedules[2].memory > snaps


def test_compare_to_bptt():
    c = bl.compare_to_bptt(bl.store_all(100))
    assert (c.cost, c.memory, c.bptt_memory) == (100, 100, 100)
    assert c.time_ratio == 1.0 and c.memory_saved == 0.0
    for alpha, beta in [(1, 1), (5, 4), (7, 7)]:
        s = bl.store_all(30, alpha=alpha, beta=beta)
        assert bl.compare_to_bptt(s).bptt_memory == s.memory
    c = bl.compare_to_bptt(bl.revolve(1000, 50), backward_cost=3.0)
    assert c.bptt_memory == 1001  # every internal state, plus h_0 which HSM counts
    assert c.cost_per_step == c.cost / 1000
    assert c.time_ratio == pytest.approx((c.cost + 3000) / 4000)
    assert c.memory_saved == pytest.approx(1 - 50 / 1001)


def test_compare_to_bptt_headline():
    # Gruslys et al. section 3.2: ISM at t = 1000, m = 50 saves 95% of the memory for
    # about a third more time than BPTT (backward = 2 forwards).
    c = bl.compare_to_bptt(plan(1000, 50, policy="ism"))
    assert c.memory_saved == pytest.approx(0.95)
    assert c.cost_per_step == pytest.approx(1.95, abs=0.01)
    assert c.time_ratio == pytest.approx(1.32, abs=0.01)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: bl.store_all(0), ValueError, r"store_all: num_steps must be >= 1, got 0"),
        (lambda: bl.store_none(2.5), TypeError, r"num_steps must be an integer, got 2.5"),
        (lambda: bl.revolve(10, 0), ValueError, r"revolve: snaps must be >= 1, got 0"),
        (lambda: bl.revolve(True, 2), TypeError, r"num_steps must be an integer, got True"),
        (lambda: bl.chen_recursive(10, k=0), ValueError, r"k must be >= 1, got 0"),
        (lambda: bl.chen_sqrt(10, segment_length=0), ValueError, r"segment_length must be"),
        (lambda: bl.chen_sqrt(10, alpha=2, beta=3), ValueError, r"alpha=2, beta=3"),
        (lambda: bl.store_all(10, alpha="5"), TypeError, r"alpha must be an integer"),
        (lambda: bl.compare_to_bptt("x"), TypeError, r"expected a Schedule"),
        (
            lambda: bl.compare_to_bptt(bl.store_all(3), backward_cost=-1),
            ValueError,
            r"backward_cost must be > 0, got -1",
        ),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
