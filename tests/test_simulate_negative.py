"""`Schedule.simulate` rejects broken schedules: one test per failure branch, by message.

Each schedule here is a valid one with one row changed; `valid` shows the replay accepts
the original. Kept outside tests/planning; NumPy only, like the planner.

Three checks of the first sweep cannot fire on their own: "must walk the steps in order"
and both "must end at step t-1" messages. Inside the sweep only ADVANCE and SAVE rows
move the working state, and each of them already requires ``cur == pos``, so the sweep's
frontier always equals ``cur``; a backward of step t-1 has passed its own check first.
They stay in the simulator as a second line of defence and have no test here.
"""

import re

import pytest

from memento.planning import Op, Schedule, ScheduleError

A, SH, SI = Op.ADVANCE, Op.SAVE_HIDDEN, Op.SAVE_INTERNAL
LH, LI = Op.LOAD_HIDDEN, Op.LOAD_INTERNAL
BI, BF = Op.BACKWARD_INTERNAL, Op.BACKWARD_FUSED
FH, FI = Op.FREE_HIDDEN, Op.FREE_INTERNAL

# t = 3, hidden states only: store h_1, finish the sweep fused, then recompute.
HSM = [(A, 1, 0), (SH, 0, 1), (A, 1, 1), (BF, 0, 2), (LH, 0, 1), (BF, 0, 1), (FH, 0, 1),
       (LH, -1, 0), (BF, 0, 0)]  # fmt: skip
# t = 2, internal states: store step 0, fuse step 1, back-propagate step 0 from its slot.
ISM = [(SI, 0, 0), (BF, 0, 1), (BI, 0, 0), (FI, 0, 0)]


def schedule(rows, *, num_steps, memory, alpha=1, beta=1, counts_initial=True):
    return Schedule(
        num_steps=num_steps,
        memory=memory,
        policy="test",
        cost=0,
        actions=[(int(op), arg, pos) for op, arg, pos in rows],
        alpha=alpha,
        beta=beta,
        counts_initial=counts_initial,
    )


def hsm(rows=HSM, memory=2):
    return schedule(rows, num_steps=3, memory=memory)


def ism(rows=ISM, memory=2, **kw):
    return schedule(rows, num_steps=2, memory=memory, counts_initial=False, **kw)


def replace(rows, i, row):
    return [*rows[:i], row, *rows[i + 1 :]]


def rejects(s, message, row=None):
    prefix = "memento\\.simulate: " + (
        "" if row is None else re.escape(f"row {row} {tuple(int(v) for v in s.actions[row])}: ")
    )
    with pytest.raises(ScheduleError, match=prefix + message):
        s.simulate()


def test_valid():
    assert hsm().simulate().forward_evaluations == 5
    assert ism().simulate().forward_evaluations == 2
    assert issubclass(ScheduleError, ValueError)


@pytest.mark.parametrize(
    "row",
    [(A, 0, 0), (A, 1, 1), (A, 4, 0)],  # no steps; not from the current state; past h_t
    ids=["zero", "not-current", "past-h_t"],
)
def test_advance(row):
    rejects(
        hsm(replace(HSM, 0, row)), r"cannot advance \d+ from position \d+ \(current 0, t=3\)", 0
    )


@pytest.mark.parametrize("row", [(SH, 0, 0), (SH, -2, 1)], ids=["not-current", "negative-slot"])
def test_save_hidden(row):
    rejects(hsm(replace(HSM, 1, row)), r"cannot save h_\d in hidden slot -?\d \(current 1\)", 1)


def test_save_hidden_into_a_live_slot():
    rows = [(A, 1, 0), (SH, 0, 1), (SH, 0, 1), *HSM[2:]]
    rejects(hsm(rows, memory=3), re.escape("cannot save h_1 in hidden slot 0 (current 1)"), 2)


def test_save_internal():
    rejects(
        ism(replace(ISM, 0, (SI, 0, 1))),
        re.escape("cannot save step 1 in internal slot 0 (current 0)"),
        0,
    )


def test_load_hidden():
    rejects(hsm(replace(HSM, 4, (LH, 1, 1))), re.escape("hidden slot 1 does not hold h_1"), 4)
    rejects(hsm(replace(HSM, 7, (LH, -1, 1))), re.escape("hidden slot -1 does not hold h_1"), 7)


def test_load_internal():
    # Step 1 recomputed from the output of internal slot 0 (which holds step 0): fine.
    rows = [(SI, 0, 0), (BF, 0, 1), (LI, 0, 1), *ISM[2:]]
    ism(rows).simulate()
    rejects(ism(replace(rows, 2, (LI, 0, 2))), re.escape("internal slot 0 does not hold step 1"), 2)


def test_backward_internal():
    rejects(
        ism(replace(ISM, 2, (BI, 1, 0))),
        re.escape("cannot back-propagate step 0 from internal slot 1; expected step 0"),
        2,
    )


def test_backward_fused_out_of_order():
    rows = [*HSM[:5], (A, 1, 1), (BF, 0, 2)]  # step 2 again, instead of step 1
    rejects(
        hsm(rows), re.escape("cannot back-propagate step 2 fused (current 2, expected step 1)"), 6
    )
    rows = [*HSM[:4], (LH, -1, 0), (BF, 0, 0)]
    rejects(
        hsm(rows), re.escape("cannot back-propagate step 0 fused (current 0, expected step 1)"), 5
    )


def test_free_hidden():
    rejects(hsm(replace(HSM, 6, (FH, 0, 2))), re.escape("hidden slot 0 does not hold h_2"), 6)


def test_free_internal():
    rejects(ism(replace(ISM, 3, (FI, 0, 1))), re.escape("internal slot 0 does not hold step 1"), 3)


def test_free_the_input_of_a_reduced_internal_state():
    # Section 3.4: step 1's internal state takes beta < alpha slots because h_1 is held;
    # freeing h_1 while it is still stored that way loses its input.
    rows = [(A, 1, 0), (SH, 0, 1), (SI, 0, 1), (BF, 0, 2), (FH, 0, 1)]
    s = schedule(rows, num_steps=3, memory=10, alpha=3, beta=2)
    rejects(s, re.escape("frees h_1, the input of internal slot 0 stored without it"), 4)


def test_unknown_op():
    rejects(hsm(replace(HSM, 1, (42, 0, 1))), "unknown op 42", 1)


def test_first_sweep_walks_in_order():
    rows = [(A, 1, 0), (SH, 0, 1), (LH, -1, 0), (A, 2, 0), (BF, 0, 2), *HSM[4:]]
    rejects(hsm(rows), "only ADVANCE and SAVE rows may come before the first backward", 2)


def test_over_budget():
    rejects(hsm(memory=1), re.escape("2 slots in use, over the budget of 1"), 1)


def test_steps_never_back_propagated():
    with pytest.raises(
        ScheduleError, match=r"^memento\.simulate: steps 0\.\.0 were never back-propagated$"
    ):
        hsm(HSM[:6]).simulate()
