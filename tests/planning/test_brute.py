"""The dynamic programs equal an exhaustive search over all valid schedules (t <= 8, m <= 4)."""

import random

import pytest
from _brute import search

from memento.planning import _reference as ref, plan, plan_chain

T, M = 8, 4


def test_hsm_is_optimal_over_all_schedules():
    table = ref.hsm_table(T, M)
    for t in range(1, T + 1):
        for m in range(1, M + 1):
            best = search(t, m, hidden=True, internal=False, fused=True, counts_initial=True)
            assert best == table[t][m] == plan(t, m, policy="hsm").cost, (t, m)


def test_ism_is_optimal_over_all_schedules():
    table = ref.ism_table(T, M)
    for t in range(1, T + 1):
        for m in range(1, M + 1):
            best = search(t, m, hidden=False, internal=True, fused=False, counts_initial=False)
            assert best == table[t][m] == plan(t, m, policy="ism").cost, (t, m)


@pytest.mark.parametrize("alpha, beta", [(1, 1), (2, 1), (2, 2), (3, 2), (3, 3)])
def test_msm_is_optimal_over_all_schedules(alpha, beta):
    table = ref.msm_table(T, M, alpha, beta)
    for t in range(1, T + 1):
        for m in range(1, M + 1):
            best = search(
                t, m, hidden=True, internal=True, fused=True, counts_initial=True,
                alpha=alpha, beta=beta,
            )  # fmt: skip
            assert best == table[t][m] == plan(t, m, policy="msm", alpha=alpha, beta=beta).cost


def test_freeing_a_state_early_is_outside_the_papers_model():
    # The paper keeps each stored state until its steps are done. A schedule may instead
    # reload h_2, free it and keep step 2's internal state in its room: the simulator
    # accepts it and it is one evaluation cheaper. Documented, not modelled.
    kwargs = dict(hidden=True, internal=True, fused=True, counts_initial=True, alpha=3, beta=3)
    assert search(7, 4, **kwargs) == plan(7, 4, policy="msm", alpha=3).cost == 14
    assert search(7, 4, early_free=True, **kwargs) == 13


def test_chain_is_optimal_over_all_schedules():
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(1, 5)
        costs = [rng.randint(1, 4) for _ in range(n)]
        hidden = [rng.randint(1, 3) for _ in range(n + 1)]
        internal = [hidden[p] + rng.randint(1, 4) for p in range(n)]
        memory = rng.randint(hidden[0], hidden[0] + 7)
        best = search(
            n, memory, hidden=True, internal=True, fused=True, counts_initial=True,
            forward_costs=costs, hidden_sizes=hidden, internal_sizes=internal,
        )  # fmt: skip
        assert plan_chain(costs, hidden, internal, memory).cost == best
