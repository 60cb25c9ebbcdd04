"""walk: the one row walk that simulate, step_evaluations and the row executors share."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from memento.planning import (
    Op,
    Schedule,
    ScheduleError,
    chen_sqrt,
    plan,
    plan_chain,
    revolve,
    simulate,
    step_evaluations,
    walk,
)


def schedules():
    yield plan(1, 1, policy="hsm")
    yield plan(13, 3, policy="hsm")
    yield plan(13, 4, policy="ism", alpha=2)
    yield plan(17, 6, policy="msm", alpha=3, beta=2)
    yield plan_chain([5, 1, 7, 2], [2, 1, 3, 1, 1], [4, 3, 5, 3], 6)
    yield plan_chain([1], [1, 1], [2], 1)
    yield chen_sqrt(16)
    yield revolve(20, 3)


def naive_evaluations(s: Schedule) -> np.ndarray:
    """Each evaluating row counted directly from the rows, with no replay."""
    counts = np.zeros(s.num_steps, np.int64)
    for op, arg, pos in s.actions.tolist():
        if op == Op.ADVANCE:
            counts[pos : pos + arg] += 1
        elif op in (Op.SAVE_INTERNAL, Op.HOST_SAVE_INTERNAL, Op.BACKWARD_FUSED):
            counts[pos] += 1
    return counts


@pytest.mark.parametrize("s", list(schedules()), ids=repr)
def test_rows_and_counts(s):
    rows = list(walk(s))
    assert [tuple(r[1:4]) for r in rows] == [tuple(a) for a in s.actions.tolist()]
    assert [r.index for r in rows] == list(range(len(s.actions)))
    assert all(isinstance(r.op, Op) for r in rows)
    # The sweep: a prefix of the rows, ending with the first backward row.
    sweep = [r.sweep for r in rows]
    n_sweep = sum(sweep)
    assert sweep == [True] * n_sweep + [False] * (len(rows) - n_sweep)
    assert rows[n_sweep - 1].op in (Op.BACKWARD_FUSED, Op.BACKWARD_INTERNAL)
    assert n_sweep - 1 == simulate(s).sweep_length
    # Every step once in the sweep, in order.
    swept = [p for r in rows[: n_sweep - 1] for p in r.steps]
    assert swept == list(range(len(swept))) and len(swept) >= s.num_steps - 1
    counts = step_evaluations(s)
    assert counts.dtype == np.int64 and (counts >= 1).all()
    np.testing.assert_array_equal(counts, naive_evaluations(s))
    costs = np.ones(s.num_steps, np.int64) if s.forward_costs is None else s.forward_costs
    assert int(np.dot(counts, costs)) == s.cost == simulate(s).forward_evaluations


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 30), st.integers(1, 8), st.sampled_from(["hsm", "ism", "msm"]))
def test_random_plans(t, m, policy):
    kw = {"hsm": {}, "ism": {"alpha": 2}, "msm": {"alpha": 2, "beta": 1}}[policy]
    s = plan(t, m + kw.get("alpha", 0), policy=policy, **kw)  # at least one internal state
    assert int(step_evaluations(s).sum()) == s.cost == simulate(s).forward_evaluations


def test_state_while_walking():
    s = plan(6, 2, policy="hsm")
    w = walk(s)
    for row in w:
        if row.op == Op.SAVE_HIDDEN:
            assert w.hidden[row.arg] == row.pos and w.holds(row.pos)
        if row.op == Op.ADVANCE:
            assert w.cur == row.pos + row.arg
        if row.op in (Op.BACKWARD_FUSED, Op.BACKWARD_INTERNAL):
            assert w.cur is None
    assert w.hidden == {} and w.internal == {} and w.sweep_length is not None


def test_broken_rows_raise_with_the_walks_name():
    # h_1 loaded from a slot that holds nothing.
    rows = [(0, 1, 0), (6, 0, 1), (3, 0, 0), (6, 0, 0)]
    s = Schedule(num_steps=2, memory=2, policy="test", cost=3, actions=rows)
    with pytest.raises(ScheduleError, match=r"^memento\.planning\.walk: row 2 \(3, 0, 0\): "):
        list(walk(s))
    with pytest.raises(ScheduleError, match=r"^memento\.simulate: row 2 "):
        simulate(s)
    with pytest.raises(ScheduleError, match=r"^memento\.planning\.walk: row 2 "):
        step_evaluations(s)
    unfinished = Schedule(num_steps=2, memory=2, policy="test", cost=2, actions=rows[:2])
    with pytest.raises(ScheduleError, match=r"steps 0\.\.0 were never back-propagated"):
        list(walk(unfinished))


@pytest.mark.parametrize(
    "kw",
    [
        dict(policy="msm", alpha=2, beta=1, transfer_cost=0.3),  # host internal states
        dict(policy="hsm", transfer_cost=0.3),  # host hidden states
        dict(policy="msm", alpha=2, beta=1, transfer_cost=0.3, host_memory=4),
    ],
    ids=repr,
)
def test_two_level_plans(kw):
    kw = {"host_memory": math.inf, "overlap": "none", **kw}
    s = plan(20, 4, **kw)
    assert (s.actions[:, 0] >= Op.HOST_SAVE_HIDDEN).any()
    w = walk(s)
    rows = []
    for row in w:
        rows.append(row)
        if row.op == Op.HOST_SAVE_HIDDEN:
            assert w.host_hidden[row.arg] == row.pos and w.cur == row.pos
        elif row.op == Op.HOST_SAVE_INTERNAL:
            assert w.host_internal[row.arg] == row.pos and w.cur == row.pos + 1
            assert row.steps == range(row.pos, row.pos + 1)
        elif row.op in (Op.HOST_LOAD_HIDDEN, Op.HOST_LOAD_INTERNAL):
            assert w.cur == row.pos and not row.sweep
        elif row.op == Op.HOST_BACKWARD_INTERNAL:
            assert w.cur is None
    assert w.host_hidden == {} and w.host_internal == {}
    assert [tuple(r[1:4]) for r in rows] == [tuple(a) for a in s.actions.tolist()]
    counts = step_evaluations(s)
    np.testing.assert_array_equal(counts, naive_evaluations(s))
    r = simulate(s)
    assert r.sweep_length == w.sweep_length
    assert int(counts.sum()) == r.forward_evaluations == s.cost - r.transfer_time


def test_a_sweep_that_ends_with_a_host_backward():
    rows = [(Op.HOST_SAVE_INTERNAL, 0, 0), (Op.HOST_BACKWARD_INTERNAL, 0, 0),
            (Op.HOST_FREE_INTERNAL, 0, 0)]  # fmt: skip
    s = Schedule(num_steps=1, memory=1, policy="test", cost=1, actions=rows, host_memory=1)
    assert [r.sweep for r in walk(s)] == [True, True, False]
    np.testing.assert_array_equal(step_evaluations(s), [1])
    r = simulate(s)
    assert (r.sweep_length, r.forward_evaluations, r.peak_host_memory) == (1, 1, 1)
    assert (r.host_stores, r.host_loads) == (1, 1)


@pytest.mark.parametrize(
    "rows, message",
    [
        # A host load in the first sweep.
        ([(0, 1, 0), (9, 0, 1), (11, 0, 1), (6, 0, 1), (11, 0, 1), (14, 0, 1), (3, -1, 0),
          (6, 0, 0)], r"row 2 \(11, 0, 1\): only ADVANCE and SAVE rows"),
        # A live host slot overwritten.
        ([(9, 0, 0), (0, 1, 0), (9, 0, 1), (6, 0, 1)],
         r"row 2 \(9, 0, 1\): cannot copy h_1 to host hidden slot 0"),
        # A host internal state back-propagated out of order.
        ([(10, 0, 0), (6, 0, 1), (13, 1, 0)],
         r"row 2 \(13, 1, 0\): cannot back-propagate step 0 from host internal slot 1"),
        # A host internal slot freed that holds another step.
        ([(10, 0, 0), (6, 0, 1), (13, 0, 0), (15, 0, 1)],
         r"row 3 \(15, 0, 1\): host internal slot 0 does not hold step 1"),
    ],
)  # fmt: skip
def test_broken_host_rows_raise_with_the_walks_name(rows, message):
    s = Schedule(num_steps=2, memory=3, policy="test", cost=0, actions=rows, host_memory=9)
    with pytest.raises(ScheduleError, match=r"^memento\.planning\.walk: " + message):
        list(walk(s))
    with pytest.raises(ScheduleError, match=r"^memento\.simulate: " + message):
        simulate(s)
