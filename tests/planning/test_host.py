"""Two-level plans (``memento.plan(..., host_memory=)``): exact against an exhaustive
search, equal to checkpoint_schedules' DiskRevolve / H-Revolve under their additive model,
equal to today's plans without host slots, monotone, and replayed by the simulator."""

import math

import numpy as np
import pytest
from _brute import search
from hypothesis import given, settings, strategies as st

import memento
from memento.planning import Op, ScheduleError, _host, _msm, hsm_cost, plan, simulate
from memento.planning._schedule import charges_of

COSTS = [((0.5, 0.5), "none"), ((1.5, 2.5), "step"), ((3.0, 1.0), "none"), ((2.0, 2.0), "step")]


def _plan(t, m, policy="hsm", alpha=None, beta=None, **kw):
    return plan(t, m, policy=policy, alpha=alpha, beta=beta, **kw)


def _checked(s):
    """Replays a two-level schedule; its cost, peaks and budgets are the replay's."""
    r = simulate(s)
    assert r.cost == s.cost  # counted the same way, to the last bit
    assert r.peak_memory <= s.memory
    assert r.peak_host_memory <= s.host_memory
    return r


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("cost, overlap", COSTS)
def test_hsm_is_optimal_over_all_two_level_schedules(cost, overlap):
    charges = charges_of(*cost, 1, overlap)
    for t in range(1, 7):
        for m in range(1, 4):
            for host in (1, 2, math.inf):
                s = _plan(t, m, host_memory=host, transfer_cost=cost, overlap=overlap)
                best = search(
                    t, m, hidden=True, internal=False, fused=True, counts_initial=True,
                    host_memory=2 * t if host == math.inf else host, host_charges=charges,
                )  # fmt: skip
                assert math.isclose(s.cost, best), (t, m, host, s.cost, best)
                _checked(s)


@pytest.mark.parametrize("alpha, beta", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("cost, overlap", COSTS[:3])
def test_msm_is_optimal_over_all_two_level_schedules(alpha, beta, cost, overlap):
    charges = charges_of(*cost, alpha, overlap)
    for t in range(1, 6):
        for m in range(1, 4):
            for host in (1, 2, math.inf):
                s = _plan(
                    t, m, "msm", alpha, beta, host_memory=host, transfer_cost=cost,
                    overlap=overlap,
                )  # fmt: skip
                best = search(
                    t, m, hidden=True, internal=True, fused=True, counts_initial=True,
                    alpha=alpha, beta=beta, host_charges=charges,
                    host_memory=2 * alpha * t if host == math.inf else host,
                )  # fmt: skip
                assert math.isclose(s.cost, best), (t, m, host, s.cost, best)
                _checked(s)


def test_the_table_is_what_the_schedule_costs():
    for policy, alpha in (("hsm", None), ("msm", 3)):
        for host in (3, math.inf):
            s = _plan(60, 4, policy, alpha, host_memory=host, transfer_cost=(1.7, 0.6))
            h = None if host == math.inf else host
            ch = _host.TransferCharges.of(1.7, 0.6, alpha or 1, "step")
            c, _, _ = _host.host_tables(60, 3, h, alpha or 1, alpha or 1, policy == "msm", ch)
            assert math.isclose(c[0, 60, 3, 0 if h is None else h], s.cost)


# --------------------------------------------------------------------------- peers


def test_equals_disk_revolve_with_additive_costs():
    # checkpoint_schedules' disk-revolve (Aupy et al. 2016): cm memory slots, unbounded
    # disk, costs added in full. Its l steps with l+1 adjoints are our t = l+1 steps with
    # uf = ub = 1; its root may write x_0 to disk and free its memory slot, i.e. our
    # subproblem whose base is the working state, kept on the device or the host.
    disk = pytest.importorskip("checkpoint_schedules.hrevolve_sequences.disk_revolve")
    L = 40
    for cm in (1, 2, 3, 5):
        for wd, rd in ((0.5, 0.5), (2.0, 3.0), (5.0, 1.0), (0.0, 0.0)):
            theirs = disk.get_opt_inf_table(L, cm, 1, 1, rd, wd, False)
            ch = _host.TransferCharges.of(wd, rd, 1, "none")
            c, _, _ = _host.host_tables(L + 1, cm, None, 1, 1, False, ch)
            for t in range(1, L + 2):
                ours = min(c[0, t, cm - 1, 0], wd + c[1, t, cm, 0])
                assert math.isclose(ours, theirs[t - 1]), (cm, wd, rd, t)


def test_equals_h_revolve_with_two_levels():
    # H-Revolve (Herrmann and Pallez 2020), K = 2: memory (free transfers) and a disk
    # of c1 slots whose count includes the root's base when it is written there.
    hrev = pytest.importorskip("checkpoint_schedules.hrevolve_sequences.hrevolve")
    L = 30
    for c0, c1 in ((1, 1), (2, 2), (3, 4), (2, 6)):
        for w, r in ((0.5, 0.5), (2.0, 3.0), (5.0, 1.0)):
            _, opt = hrev.get_hopt_table(L, (c0, c1), (0, w), (0, r), 1, 1)
            ch = _host.TransferCharges.of(w, r, 1, "none")
            c, _, _ = _host.host_tables(L + 1, c0, c1, 1, 1, False, ch)
            for t in range(1, L + 2):
                ours = min(c[0, t, c0 - 1, c1], w + c[1, t, c0, c1 - 1])
                assert math.isclose(ours, opt[1][t - 1][c1]), (c0, c1, w, r, t)


# --------------------------------------------------------------------------- one level


@pytest.mark.parametrize(
    "policy, alpha, beta", [("hsm", None, None), ("msm", 3, 2), ("ism", 2, None), ("auto", 3, None)]
)
def test_no_host_memory_is_todays_plan(policy, alpha, beta):
    for t, m in ((1, 3), (50, 4), (300, 17)):
        today = plan(t, m, policy=policy, alpha=alpha, beta=beta)
        for host in (0, None):
            s = plan(t, m, policy=policy, alpha=alpha, beta=beta, host_memory=host)
            assert s.cost == today.cost and s.policy == today.policy
            np.testing.assert_array_equal(s.actions, today.actions)
        s = plan(t, m, policy=policy, alpha=alpha, beta=beta, host_memory=0, transfer_cost=2.0)
        np.testing.assert_array_equal(s.actions, today.actions)


@pytest.mark.parametrize("alpha, beta", [(1, 1), (2, 1), (3, 3), (5, 2)])
def test_zero_host_slots_is_the_one_level_recursion(alpha, beta):
    ch = _host.TransferCharges.of(1.0, 1.0, alpha, "step")
    T, M = 60, 12
    c, _, _ = _host.host_tables(T, M - 1, 0, alpha, beta, True, ch)
    full, _, _ = _msm.msm_tables_full(T, M, alpha, beta)
    np.testing.assert_array_equal(c[0, 1:, :, 0], full[1:, 1:])
    if alpha == 1:
        c, _, _ = _host.host_tables(T, M - 1, 0, 1, 1, False, ch)
        for t in range(1, T + 1):
            for m in range(1, M + 1):
                assert c[0, t, m - 1, 0] == hsm_cost(t, m)


# --------------------------------------------------------------------------- monotone


def test_more_host_memory_or_cheaper_transfers_never_cost_more():
    for policy, alpha in (("hsm", None), ("msm", 2)):
        for m in (1, 2, 5):
            costs = [
                _plan(80, m, policy, alpha, host_memory=h, transfer_cost=1.5).cost
                for h in (0, 1, 2, 3, 5, 8, math.inf)
            ]
            assert costs == sorted(costs, reverse=True), costs
            by_cost = [
                _plan(80, m, policy, alpha, host_memory=4, transfer_cost=c).cost
                for c in (0.0, 0.5, 1.0, 1.5, 3.0, 10.0, 100.0)
            ]
            assert by_cost == sorted(by_cost), by_cost
            # Copies that one step hides are free: k * c <= 1 for every state size k.
            assert by_cost[0] == by_cost[1]
            if policy == "hsm":
                assert by_cost[0] == by_cost[2]


def test_free_unbounded_host_stores_everything():
    # Transfers that a step hides cost nothing: HSM keeps every hidden state (2t - 1),
    # MSM every internal state but the last (t), whatever the device budget.
    assert _plan(500, 1, host_memory=math.inf, transfer_cost=1.0).cost == 999
    assert _plan(500, 1, "msm", 4, host_memory=math.inf, transfer_cost=0.25).cost == 500


def test_dear_transfers_fall_back_to_the_device_plan():
    for m in (2, 6):
        s = _plan(200, m, host_memory=math.inf, transfer_cost=1000.0)
        assert s.cost == plan(200, m, policy="hsm").cost
        assert _checked(s).host_stores == 0


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 40),
    m=st.integers(1, 6),
    host=st.sampled_from([1, 2, 3, 7, math.inf]),
    write=st.floats(0, 6),
    read=st.floats(0, 6),
    overlap=st.sampled_from(["step", "none"]),
    msm=st.sampled_from([None, (1, 1), (2, 1), (3, 3), (4, 2)]),
)
def test_random_plans_replay_within_both_budgets(t, m, host, write, read, overlap, msm):
    policy, alpha, beta = ("hsm", None, None) if msm is None else ("msm", *msm)
    kw = dict(transfer_cost=(write, read), overlap=overlap)
    s = _plan(t, m, policy, alpha, beta, host_memory=host, **kw)
    r = _checked(s)
    assert r.forward_evaluations >= t
    # Never worse than the device alone, nor than fewer host slots.
    assert s.cost <= plan(t, m, policy=policy, alpha=alpha, beta=beta).cost
    if host != math.inf and host > 1:
        assert s.cost <= _plan(t, m, policy, alpha, beta, host_memory=host - 1, **kw).cost


# --------------------------------------------------------------------------- simulator


def _sched(rows, t, m=3, host=2, alpha=1):
    return memento.planning.Schedule(
        num_steps=t, memory=m, policy="hsm", cost=0, actions=np.array(rows), alpha=alpha,
        host_memory=host, transfer_cost=(3.0, 2.0), overlap="none",
    )  # fmt: skip


def test_simulator_counts_transfers_and_checks_the_host_budget():
    rows = [
        (Op.ADVANCE, 1, 0), (Op.HOST_SAVE_HIDDEN, 0, 1), (Op.ADVANCE, 1, 1),
        (Op.BACKWARD_FUSED, 0, 2), (Op.HOST_LOAD_HIDDEN, 0, 1), (Op.BACKWARD_FUSED, 0, 1),
        (Op.HOST_FREE_HIDDEN, 0, 1), (Op.LOAD_HIDDEN, -1, 0), (Op.BACKWARD_FUSED, 0, 0),
    ]  # fmt: skip
    r = simulate(_sched(rows, 3))
    assert (r.forward_evaluations, r.host_stores, r.host_loads) == (5, 1, 1)
    assert r.transfer_time == 5.0 and r.cost == 10.0 and r.peak_host_memory == 1
    with pytest.raises(
        ScheduleError, match=r"row 1 .* 1 host slots in use, over the host budget of 0"
    ):
        simulate(_sched(rows, 3, host=0))
    bad = list(rows)
    bad[4] = (Op.HOST_LOAD_HIDDEN, 1, 1)
    with pytest.raises(ScheduleError, match=r"row 4 .* host hidden slot 1 does not hold h_1"):
        simulate(_sched(bad, 3))


def test_simulator_host_internal_states():
    rows = [
        (Op.HOST_SAVE_INTERNAL, 0, 0), (Op.BACKWARD_FUSED, 0, 1),
        (Op.HOST_BACKWARD_INTERNAL, 0, 0), (Op.HOST_FREE_INTERNAL, 0, 0),
    ]  # fmt: skip
    r = simulate(_sched(rows, 2, host=2, alpha=2))
    assert r.peak_host_memory == 2 and r.forward_evaluations == 2
    assert r.transfer_time == 2 * 3.0 + 2 * 2.0
    with pytest.raises(ScheduleError, match="over the host budget of 1"):
        simulate(_sched(rows, 2, host=1, alpha=2))


def test_stack_depths_refuses_host_rows():
    s = _plan(30, 3, host_memory=math.inf, transfer_cost=0.5)
    assert (s.actions[:, 0] >= Op.HOST_SAVE_HIDDEN).any()
    with pytest.raises(NotImplementedError, match=r"stack_depths: row \d+ .* host-memory row"):
        memento.planning.internals.stack_depths(s.actions)
    ex = s.executable()
    assert not np.isin(ex[:, 0], (Op.HOST_FREE_HIDDEN, Op.HOST_FREE_INTERNAL, Op.FREE_HIDDEN)).any()


def _depths_oracle(actions):
    """two_level_depths by a Python stack per level: (on_host, nh, ni) per executable row."""
    host_ops = {
        Op.HOST_SAVE_HIDDEN: ("h", "save"), Op.HOST_SAVE_INTERNAL: ("i", "save"),
        Op.HOST_LOAD_HIDDEN: ("h", "use"), Op.HOST_LOAD_INTERNAL: ("i", "use"),
        Op.HOST_BACKWARD_INTERNAL: ("i", "use"),
        Op.HOST_FREE_HIDDEN: ("h", "free"), Op.HOST_FREE_INTERNAL: ("i", "free"),
    }  # fmt: skip
    device_ops = {
        Op.SAVE_HIDDEN: ("h", "save"), Op.SAVE_INTERNAL: ("i", "save"),
        Op.LOAD_HIDDEN: ("h", "use"), Op.LOAD_INTERNAL: ("i", "use"),
        Op.BACKWARD_INTERNAL: ("i", "use"),
        Op.FREE_HIDDEN: ("h", "free"), Op.FREE_INTERNAL: ("i", "free"),
    }  # fmt: skip
    stacks = {False: [], True: []}  # (kind, slot) per level
    out = []
    for op, arg, _ in actions.tolist():
        host = op in host_ops
        kind, what = (host_ops if host else device_ops).get(op, (None, None))
        stack = stacks[host]
        if what == "free":
            assert stack[-1] == (kind, arg)
            stack.pop()
            continue
        if kind is None or (op == Op.LOAD_HIDDEN and arg == -1):
            below = stacks[False]  # rows without a slot: the device states live then
            out.append((False, sum(k == "h" for k, _ in below), sum(k == "i" for k, _ in below)))
            continue
        at = len(stack) if what == "save" else stack.index((kind, arg))
        below = stack[:at]
        out.append((host, sum(k == "h" for k, _ in below), sum(k == "i" for k, _ in below)))
        if what == "save":
            stack.append((kind, arg))
    return np.array(out, np.int64).reshape(-1, 3)


@pytest.mark.parametrize(
    "t, m, host, policy, cost",
    [(30, 3, math.inf, "hsm", 0.5), (20, 2, 3, "hsm", 2.0), (25, 4, 5, "msm", 0.3),
     (12, 3, math.inf, "msm", 1.5), (9, 1, 1, "hsm", 0.1)],
)  # fmt: skip
def test_two_level_depths_match_a_stack_per_level(t, m, host, policy, cost):
    alpha = 2 if policy == "msm" else None
    s = _plan(t, m, policy=policy, alpha=alpha, host_memory=host, transfer_cost=cost)
    on_host, nh, ni = memento.planning.internals.two_level_depths(s.actions)
    expected = _depths_oracle(s.actions)
    np.testing.assert_array_equal(np.stack([on_host, nh, ni], axis=1), expected)


def test_two_level_depths_refuses_a_release_out_of_order():
    rows = [
        (Op.HOST_SAVE_HIDDEN, 0, 0), (Op.ADVANCE, 1, 0), (Op.HOST_SAVE_HIDDEN, 1, 1),
        (Op.HOST_FREE_HIDDEN, 0, 0),
    ]  # fmt: skip
    with pytest.raises(ScheduleError, match=r"two_level_depths: row 3 .* out of stack order"):
        memento.planning.internals.two_level_depths(np.array(rows))


# --------------------------------------------------------------------------- errors


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"memento.plan: host_memory=4 needs transfer_cost"):
        plan(10, 3, host_memory=4)
    with pytest.raises(ValueError, match=r"transfer_cost/overlap .* pass host_memory="):
        plan(10, 3, transfer_cost=1.0)
    with pytest.raises(ValueError, match=r"host_memory must be >= 0 slots, got -1"):
        plan(10, 3, host_memory=-1, transfer_cost=1.0)
    with pytest.raises(TypeError, match=r"host_memory must be an int .* got 2.5"):
        plan(10, 3, host_memory=2.5, transfer_cost=1.0)
    with pytest.raises(TypeError, match=r"host_memory must be an int .* got True"):
        plan(10, 3, host_memory=True, transfer_cost=1.0)
    with pytest.raises(ValueError, match=r"transfer_cost must be finite and >= 0"):
        plan(10, 3, host_memory=4, transfer_cost=-1.0)
    with pytest.raises(ValueError, match=r"transfer_cost must be finite"):
        plan(10, 3, host_memory=4, transfer_cost=(1.0, math.nan))
    with pytest.raises(ValueError, match=r"one number or a \(write, read\) pair"):
        plan(10, 3, host_memory=4, transfer_cost=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match=r"overlap must be 'step' .* got 'full'"):
        plan(10, 3, host_memory=4, transfer_cost=1.0, overlap="full")  # pyright: ignore[reportArgumentType]
    with pytest.raises(NotImplementedError, match=r"policy='hsm' or 'msm' .*'ism'"):
        plan(10, 3, policy="ism", host_memory=4, transfer_cost=1.0)
    with pytest.raises(ValueError, match=r"two-level table .* would take about"):
        plan(10**6, 1000, host_memory=math.inf, transfer_cost=1.0)


def test_extremes():
    # One step: a fused step, no transfer; one device slot (h_0 only) with a host.
    assert _plan(1, 1, host_memory=math.inf, transfer_cost=5.0).cost == 1
    s = _plan(50, 1, host_memory=3, transfer_cost=0.0, overlap="none")
    assert _checked(s).peak_memory == 1 and s.cost < 50 * 51 // 2
    # A huge host budget is the unbounded plan; a huge device budget needs no host.
    big = _plan(40, 3, host_memory=10**12, transfer_cost=2.0)
    assert big.cost == _plan(40, 3, host_memory=math.inf, transfer_cost=2.0).cost
    assert _plan(40, 10**9, host_memory=math.inf, transfer_cost=2.0).cost == 79


def test_compare_to_bptt_refuses_two_level_schedules():
    s = _plan(20, 3, host_memory=2, transfer_cost=1.0)
    with pytest.raises(NotImplementedError, match=r"compare_to_bptt: a two-level schedule"):
        memento.planning.compare_to_bptt(s)


def test_auto_with_host_memory_plans_hsm_or_msm():
    # plan's default policy is auto; two-level plans are HSM (alpha 1) or MSM (alpha >= 2).
    import math

    import memento

    hsm = memento.plan(40, 4, host_memory=math.inf, transfer_cost=0.5, policy="hsm")
    auto = memento.plan(40, 4, host_memory=math.inf, transfer_cost=0.5)
    assert (auto.policy, auto.cost) == ("hsm", hsm.cost)
    msm = memento.plan(30, 6, host_memory=8, transfer_cost=0.5, alpha=3, policy="msm")
    auto = memento.plan(30, 6, host_memory=8, transfer_cost=0.5, alpha=3)
    assert (auto.policy, auto.cost) == ("msm", msm.cost)
    assert auto.simulate().forward_evaluations + auto.simulate().transfer_time == auto.cost
