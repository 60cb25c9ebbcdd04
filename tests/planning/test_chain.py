"""plan_chain: heterogeneous chains (appendix C) with MSM's choices, replayed."""

import random

import pytest
from hypothesis import given, settings, strategies as st

import memento
from memento.planning import plan, plan_chain, simulate


def test_uniform_chain_is_msm():
    # Unit costs and hidden sizes, internal size alpha: MSM with beta = alpha - 1 (the
    # input's share dropped when the input is held).
    for n in range(1, 16):
        for m in range(1, 12):
            for alpha in (2, 3, 5):
                s = plan_chain([1] * n, [1] * (n + 1), [alpha] * n, m)
                msm = plan(n, m, policy="msm", alpha=alpha, beta=alpha - 1)
                assert s.cost == msm.cost, (n, m, alpha)
                result = simulate(s)
                assert result.forward_evaluations == s.cost and result.peak_memory <= m


def test_costs_weight_the_evaluations():
    # Everything fits: each step once in the sweep, the last fused, the others kept as
    # internal states and back-propagated from them.
    s = plan_chain([5, 1, 7], [1, 1, 1, 1], [3, 3, 3], 100)
    assert s.cost == 13
    assert simulate(s).forward_evaluations == 13
    # Only h_0 fits: recompute from it for each step (eq. 24).
    s = plan_chain([5, 1, 7], [2, 1, 1, 1], [3, 3, 3], 2)
    assert s.cost == 3 * 5 + 2 * 1 + 1 * 7


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_chains_replay(data):
    n = data.draw(st.integers(1, 14))
    costs = data.draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    hidden = data.draw(st.lists(st.integers(1, 4), min_size=n + 1, max_size=n + 1))
    extra = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    internal = [h + e for h, e in zip(hidden, extra, strict=False)]
    memory = data.draw(st.integers(hidden[0], hidden[0] + 20))
    s = plan_chain(costs, hidden, internal, memory)
    result = simulate(s)
    assert result.forward_evaluations == s.cost
    assert result.peak_memory <= memory
    assert s.policy == "chain" and s.forward_costs == tuple(costs)


def test_more_memory_never_costs_more():
    rng = random.Random(0)
    n = 10
    costs = [rng.randint(1, 5) for _ in range(n)]
    hidden = [rng.randint(1, 3) for _ in range(n + 1)]
    internal = [h + rng.randint(1, 4) for h in hidden[:n]]
    prev = None
    for memory in range(hidden[0], hidden[0] + 30):
        c = plan_chain(costs, hidden, internal, memory).cost
        assert prev is None or c <= prev
        prev = c


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (([], [1], [], 3), ValueError, r"memento\.plan_chain: forward_costs is empty"),
        (([1, 1], [1, 1], [3, 3], 3), ValueError, r"hidden_sizes must have 3 entries, got 2"),
        (([1, 1], [1, 1, 1], [3], 3), ValueError, r"internal_sizes must have 2 entries"),
        (([1, 1.5], [1, 1, 1], [3, 3], 3), TypeError, r"forward_costs must hold ints, got 1\.5"),
        (([1, 0], [1, 1, 1], [3, 3], 3), ValueError, r"forward_costs entries must be >= 1"),
        (([1, 1], [1, 1, 1], [3, 1], 3), ValueError, r"internal_sizes\[1\]=1 must exceed"),
        (([1, 1], [2, 1, 1], [3, 3], 1), ValueError, r"memory=1 is below the minimum.*>= 2"),
        (([1, 1], [1, 1, 1], [3, 3], 2.0), TypeError, r"memory must be an int, got 2\.0"),
        (("ab", [1, 1, 1], [3, 3], 3), TypeError, r"forward_costs must be a sequence"),
        (([1] * 300, [1] * 301, [3] * 300, 10**6), ValueError, r"coarser units"),
    ],
)
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        plan_chain(*args)


def test_public_name():
    assert memento.plan_chain is plan_chain


def test_hidden_states_only_is_hsm():
    # internal=False: no internal state is stored; with unit sizes this is BPTT-HSM.
    for n in range(1, 14):
        for m in range(1, 8):
            s = plan_chain([1] * n, [1] * (n + 1), [3] * n, m, internal=False)
            assert not (s.actions[:, 0] == memento.Op.SAVE_INTERNAL).any()
            assert s.cost == plan(n, m, policy="hsm").cost, (n, m)
            assert s.internal_sizes == (3,) * n
            result = simulate(s)
            assert result.forward_evaluations == s.cost and result.peak_memory <= m
            assert s.cost >= plan_chain([1] * n, [1] * (n + 1), [3] * n, m).cost
