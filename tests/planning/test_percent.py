"""``memory="5%"``: a share of what storing every step takes, read once for every entry
point (`memento.planning.internals.parse_memory`), resolved where the need is known."""

import pytest

import memento
from memento.planning import plan
from memento.planning.internals import Percent, parse_memory, plan_layers, to_slots


@pytest.mark.parametrize(
    ("text", "percent"), [("5%", 5.0), (" 0.5 % ", 0.5), ("100%", 100.0), (".25%", 0.25)]
)
def test_parse_reads_percentages(text, percent):
    assert parse_memory(text, name="f") == Percent(percent)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0%", r"memory='0%' is outside \(0%, 100%\]"),
        ("150%", r"memory='150%' is outside \(0%, 100%\]; 100% stores every step"),
        ("-5%", r"cannot read memory='-5%' as a percentage; write a number in \(0, 100\]"),
        ("abc%", r"cannot read memory='abc%' as a percentage"),
        ("5%%", r"cannot read memory='5%%' as a percentage"),
    ],
)
def test_bad_percentages_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=f"^f: {message}"):
        parse_memory(text, name="f")


def test_share_is_the_floor_computed_exactly():
    # 0.1% of 1000 is exactly 1 (a float product would give 0.9999999999999999 for some
    # decimals); 5% of 999 is 49.95, floored.
    assert to_slots(Percent(0.1), 8, name="f", need=1000) == 1
    assert to_slots(Percent(5.0), 8, name="f", need=999) == 49
    assert to_slots(Percent(100.0), 8, name="f", need=999) == 999
    # 57 / 100 * 100 is 56.99999999999999 in floats; the share is read from the decimal.
    assert to_slots(Percent(57.0), 8, name="f", need=100) == 57
    assert to_slots(Percent(0.57), 8, name="f", need=10_000) == 57


def test_share_below_one_slot_names_the_least_percentage():
    with pytest.raises(
        ValueError,
        match=r"^f: memory='0.01%' of 1000 slots \(storing every step\) is less than one; pass at least '0.1%', or memory=1",
    ):
        to_slots(Percent(0.01), 8, name="f", need=1000)


def test_percent_needs_a_total():
    with pytest.raises(TypeError, match="needs a total"):
        to_slots(Percent(5.0), 8, name="f")


@pytest.mark.parametrize("policy", ["auto", "ism", "msm"])
@pytest.mark.parametrize(("t", "alpha"), [(1, 1), (50, 1), (200, 3), (97, 5)])
def test_hundred_percent_is_the_store_everything_plan(policy, t, alpha):
    s = plan(t, "100%", policy=policy, alpha=alpha)
    assert s.memory == t * alpha
    assert s.cost == plan(t, t * alpha, policy=policy, alpha=alpha).cost == t
    assert s.simulate().forward_evaluations == t


@pytest.mark.parametrize(("t", "alpha", "percent"), [(1000, 1, 5), (1000, 3, 5), (333, 7, 2.5)])
def test_a_percentage_plans_the_floor_of_its_share(t, alpha, percent):
    s = plan(t, f"{percent}%", policy="msm", alpha=alpha)
    slots = int(percent * t * alpha // 100)
    assert s.memory == slots
    assert s.cost == plan(t, slots, policy="msm", alpha=alpha).cost


def test_hsm_percentage_counts_carries():
    assert plan(400, "5%", policy="hsm").memory == 20
    assert memento.plan(400, "100%", policy="hsm").cost == 2 * 400 - 1


def test_plan_refuses_bytes_and_small_shares():
    with pytest.raises(
        TypeError,
        match=r"memento.plan: memory must be an int, got '5MiB' \(str\); pass the budget in slots of one hidden state, e.g. 10, or a percentage such as '5%' \(plan counts slots: for bytes, divide by the carry's size\)",
    ):
        plan(100, "5MiB")
    with pytest.raises(
        ValueError,
        match=r"memento.plan: memory='0.5%' of 100 slots \(every step's internal state\) is less than one; pass at least '1%'",
    ):
        plan(100, "0.5%")


def test_layers_percentage_is_a_share_of_every_internal_state():
    flops, hidden, internal = [3.0, 1.0, 2.0], [8, 16, 8, 8], [40, 40, 24]
    everything = plan_layers(
        flops, hidden, internal, parse_memory("100%", name="f"), "auto", name="f"
    )
    assert everything.budget_bytes == sum(internal)
    assert everything.evaluations().tolist() == [1, 1, 1]
    half = plan_layers(flops, hidden, internal, parse_memory("20%", name="f"), "auto", name="f")
    assert half.budget_bytes == 20 and half.schedule.simulate().peak_memory * half.unit_bytes <= 20
