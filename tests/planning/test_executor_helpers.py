"""The NumPy helpers every executor shares: budgets, where the sweep ends, evaluations
per step, and plan_chain_bytes. No jax here."""

import numpy as np
import pytest

import memento
from memento import planning
from memento.planning import Op, internals


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm"])
@pytest.mark.parametrize("t", [1, 2, 17, 200])
def test_step_evaluations_sum_to_cost_and_first_backward_ends_the_sweep(policy, t):
    for m in (3, 5, 40):
        s = memento.plan(t, m, policy=policy, alpha=None if policy == "hsm" else 3)
        counts = planning.step_evaluations(s)
        assert counts.sum() == s.cost and (counts >= 1).all() and counts[-1] == 1
        first = internals.first_backward(s.actions)
        assert first == s.simulate().sweep_length
        assert s.actions[first, 0] in (Op.BACKWARD_FUSED, Op.BACKWARD_INTERNAL)
        sweep = s.actions[:first]
        assert not np.isin(sweep[:, 0], [Op.LOAD_HIDDEN, Op.LOAD_INTERNAL]).any()


def test_step_evaluations_brute_force_and_first_backward_error():
    s = memento.plan(30, 4)
    brute = np.zeros(30, int)
    for op, arg, pos in s.actions.tolist():
        if op == Op.ADVANCE:
            brute[pos : pos + arg] += 1
        elif op in (Op.SAVE_INTERNAL, Op.BACKWARD_FUSED):
            brute[pos] += 1
    assert planning.step_evaluations(s).tolist() == brute.tolist()
    with pytest.raises(planning.ScheduleError, match="back-propagate no step"):
        internals.first_backward(np.array([[Op.ADVANCE, 1, 0]]))


def test_plan_chain_bytes_fits_the_byte_budget():
    costs = [3.0e6, 1.0, 5.0e5, 2.5e6]
    hidden = [4096, 16384, 16384, 1024, 64]
    internal = [40000, 40000, 20000, 3000]
    for budget in [4096, 10000, 30000, 10**9]:
        s, unit = internals.plan_chain_bytes(costs, hidden, internal, budget)
        s.simulate()
        # Sizes round up to units, the budget down; only h_0's own rounding may exceed it.
        floor = s.hidden_sizes[0] * unit
        assert s.memory * unit <= max(budget, floor) and s.peak_memory <= s.memory
    everything, _ = internals.plan_chain_bytes(costs, hidden, internal, 10**9)
    assert planning.step_evaluations(everything).tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot hold the input x_0 \\(4096 bytes\\)"):
        internals.plan_chain_bytes(costs, hidden, internal, 4000, name="f")


def test_budget_helpers():
    assert internals.parse_memory("1.5KiB", name="f") == planning.Bytes(1536)
    assert internals.parse_memory(7, name="f") == 7
    assert internals.to_slots(planning.bytes_budget(100), 32, name="f") == 3
    assert internals.internal_slots(40, 32) == 3
    with pytest.raises(ValueError, match="cannot hold even one carry of 64 bytes"):
        internals.to_slots(planning.Bytes(10), 64, name="f")
    s = internals.choose_schedule(50, 6, 3, "auto", name="f")
    assert s.memory == 6 and s.policy in ("hsm", "ism", "msm")


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm"])
@pytest.mark.parametrize("t", [1, 2, 17, 200])
def test_backward_runs_marks_steps_recorded_on_the_one_back_propagated_next(policy, t):
    """Oracle: tokens for every state. A row is marked iff it records step p from the
    output of the record that the next backward row (only FREE rows between) uses."""
    free = (Op.FREE_HIDDEN, Op.FREE_INTERNAL)
    for m in (3, 5, 40, 10**6):
        s = memento.plan(t, min(m, 3 * t + 1), policy=policy, alpha=None if policy == "hsm" else 3)
        marks = internals.backward_runs(s)
        rows = s.actions.tolist()
        cur, slots, starts, used = None, {}, {}, {}  # used: record row -> its backward row
        for i, (op, arg, _) in enumerate(rows):
            if op in (Op.SAVE_INTERNAL, Op.BACKWARD_FUSED):
                starts[i] = cur
                cur = ("out", i)
                if op == Op.SAVE_INTERNAL:
                    slots[arg] = i
                else:
                    used[i] = i
            elif op == Op.LOAD_INTERNAL:
                cur = ("out", slots[arg])
            elif op == Op.BACKWARD_INTERNAL:
                used[slots[arg]] = i
            elif op in (Op.ADVANCE, Op.LOAD_HIDDEN):
                cur = ("state", i)
            if op in (Op.BACKWARD_INTERNAL, Op.BACKWARD_FUSED):
                cur = None
        back = sorted(used.values())
        expect = np.zeros(len(rows), bool)
        for r, start in starts.items():
            if start is None or start[0] != "out" or r not in used:
                continue
            b, below = used[r], start[1]
            nxt = [x for x in back if x > b]
            if below in used and nxt and used[below] == nxt[0]:
                expect[r] = all(rows[k][0] in free for k in range(b + 1, nxt[0]))
        assert marks.tolist() == expect.tolist()
        assert not marks[[r[0] not in (Op.SAVE_INTERNAL, Op.BACKWARD_FUSED) for r in rows]].any()
        if policy == "hsm":
            assert not marks.any()  # no internal state: nothing to build on
        if m == 10**6 and policy != "hsm":  # every step stored: one run, one reverse pass
            assert marks.sum() == t - 1
