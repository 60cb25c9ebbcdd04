"""Static plans (nested segments of static lengths): the planner's count of evaluations and
bytes against the simulator's replay, at sizes from one step to a million. NumPy only."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from memento.planning.internals import StaticPlan, nest_schedule, plan_static, static_plan


@pytest.mark.parametrize("budget", [10**4, 10**5, 10**6])
@pytest.mark.parametrize("num_steps", [1, 2, 999, 10**4, 10**6])
def test_every_planned_plan_replays_within_its_bytes(num_steps, budget):
    plan = plan_static(num_steps, budget, carry_bytes=16, residual_bytes=48, stream_bytes=32)
    if plan is None:
        return
    assert plan.num_steps == num_steps and plan.peak_bytes <= budget
    assert plan.evaluations >= num_steps
    if num_steps <= 10**4:
        schedule = nest_schedule(plan)
        replay = schedule.simulate()
        assert replay.forward_evaluations == plan.evaluations
        # The replay counts slots of a carry (alpha for an internal state) and h_0.
        assert replay.peak_memory <= math.ceil(plan.peak_bytes / 16) + 1


def test_a_budget_for_every_step_stores_every_step():
    plan = plan_static(1000, 10**9, carry_bytes=16, residual_bytes=48)
    assert plan.pieces == ((1000,),) and plan.evaluations == 1000


def test_fewer_bytes_cost_more_evaluations():
    costs = [
        plan_static(10**4, b, carry_bytes=16, residual_bytes=48).evaluations
        for b in (2 * 10**3, 10**4, 10**5, 10**6)
    ]
    assert costs == sorted(costs, reverse=True) and costs[-1] == 10**4


def test_static_plans_are_values():
    p = static_plan(100, (0, 3, 4), carry_bytes=8, residual_bytes=8)
    assert isinstance(p, StaticPlan) and p == static_plan(100, (0, 3, 4), carry_bytes=8,
                                                          residual_bytes=8)  # fmt: skip
    assert hash(p) == hash(static_plan(100, (0, 3, 4), carry_bytes=8, residual_bytes=8))


@settings(max_examples=60, deadline=None)
@given(
    num_steps=st.integers(1, 3000),
    carry=st.integers(1, 4096),
    residual=st.integers(1, 8192),
    stream=st.integers(0, 4096),
    share=st.floats(0.001, 1.5),
)
def test_random_sizes_plan_within_the_budget_and_replay(num_steps, carry, residual, stream, share):
    budget = share * num_steps * (residual + stream)
    plan = plan_static(
        num_steps, budget, carry_bytes=carry, residual_bytes=residual, stream_bytes=stream
    )
    if plan is None:
        smallest = plan_static(num_steps, math.inf, carry_bytes=carry, residual_bytes=residual,
                               stream_bytes=stream, fewest_bytes=True)  # fmt: skip
        assert smallest is not None and smallest.peak_bytes > budget
        return
    assert plan.num_steps == num_steps and plan.peak_bytes <= budget
    replay = nest_schedule(plan).simulate()
    assert replay.forward_evaluations == plan.evaluations
    assert plan.evaluations <= 4 * num_steps


def test_a_million_steps_plan_at_once():
    for budget in (10**4, 10**6, 10**8):
        plan = plan_static(10**6, budget, carry_bytes=16, residual_bytes=48, stream_bytes=32)
        assert plan is not None and plan.peak_bytes <= budget and plan.num_steps == 10**6


def test_static_plan_refuses_bad_sizes():
    for args in [(0, (0, 2)), (10, (0, 0))]:
        try:
            static_plan(*args, carry_bytes=1, residual_bytes=1)
        except ValueError as e:
            assert "memento.planning.static_plan" in str(e)
        else:
            raise AssertionError(args)
    assert np.isfinite(static_plan(10, (0, 3), carry_bytes=1, residual_bytes=1).evaluations)


def test_loops_of_one_trip_cost_no_iterations_or_starts():
    # XLA inlines a loop of one trip: segments of one step are straight-line code, so
    # checkpointing every step (lax.scan(jax.checkpoint(step))) is two loops of T trips.
    per_step = StaticPlan(((10_000, 1),), carry_bytes=16, residual_bytes=48)
    assert (per_step.loop_iterations, per_step.loop_starts) == (10_000, 2)
    assert StaticPlan(((1,),), 16, 48).loop_iterations == 0
    assert StaticPlan(((1,),), 16, 48).loop_starts == 0
    # Segments of two steps: a loop each way per segment, two trips each.
    pairs = StaticPlan(((5_000, 2),), carry_bytes=16, residual_bytes=48)
    assert pairs.loop_iterations == 5_000 * 2 + 5_000 + 5_000 * 4
    assert pairs.loop_starts == 1 + 5_000 + 1 + 5_000 * 2
    # Three levels whose innermost segments are one step: no refill or VJP loop starts
    # for them, the refills of the middle level's one-step segments included.
    three = StaticPlan(((10, 10, 1),), carry_bytes=16, residual_bytes=48)
    assert three.loop_starts == 1 + 10 + 1 + 100 * 1 + 0


def test_a_budget_for_every_step_stores_every_step_whatever_the_time_model_says():
    # lax.scan's own gradient where it fits, even for a time model that prefers another.
    def prefers_recomputing(plan):
        return -plan.evaluations

    plan = plan_static(1000, 10**9, carry_bytes=16, residual_bytes=48, seconds=prefers_recomputing)
    assert plan.pieces == ((1000,),)


def test_rewritten_bytes_count_every_store_into_a_stack_copied_whole():
    # A store into a stack of n entries copies n entries: a stack filled once copies n^2.
    sizes = dict(carry_bytes=16, residual_bytes=48, carry_rewrite_bytes=2, residual_rewrite_bytes=3)
    assert StaticPlan(((100,),), **sizes).rewritten_bytes == 100**2 * 3
    # Two levels: the K starts once, each of the K innermost segments' L internal states.
    assert StaticPlan(((10, 20),), **sizes).rewritten_bytes == 10**2 * 2 + 10 * 20**2 * 3
    # Three levels: also each outer segment's refilled buffer of K_2 - 1 starts.
    three = StaticPlan(((4, 5, 6),), **sizes).rewritten_bytes
    assert three == 4**2 * 2 + 4 * (5 - 1) ** 2 * 2 + 4 * 5 * 6**2 * 3
    assert StaticPlan(((10, 20), (7,)), 16, 48).rewritten_bytes == 0


def test_stacks_copied_whole_at_each_store_are_kept_short():
    # bfloat16 internal states on CPU: a stack of n of them costs n^2 copies, so the
    # plan that stores a long run of steps whole is no longer the fastest.
    from memento.planning.internals import loop_seconds

    def seconds(plan, step=3e-6):
        return loop_seconds(
            plan.evaluations, plan.loop_iterations, "static", step=step, backend="cpu",
            starts=plan.loop_starts, rewritten=plan.rewritten_bytes,
        )  # fmt: skip

    sizes = dict(carry_bytes=1024, residual_bytes=1536)
    budget = 4 * 2**20
    free = plan_static(3001, budget, **sizes, seconds=seconds)
    costly = plan_static(3001, budget, **sizes, residual_rewrite_bytes=512, seconds=seconds)

    def longest_stack(plan):
        return max(p[-1] if len(p) > 1 else p[0] for p in plan.pieces)

    assert longest_stack(free) > 500 and longest_stack(costly) <= 100, (free, costly)


def test_step_iterations_split_one_step_segments_from_the_other_loops():
    # A one-step segment's backward iteration runs its step again and back-propagates
    # it; every other per-step iteration does one of the two.
    assert StaticPlan(((100, 1),), 1, 1).step_iterations == (100, 100)
    # Two levels: forward, run again keeping residuals, back-propagated.
    assert StaticPlan(((10, 10),), 1, 1).step_iterations == (300, 0)
    # Steps stored whole: forward keeping residuals, back-propagated.
    assert StaticPlan(((10, 10), (7,)), 1, 1).step_iterations == (314, 0)
    # Three levels: each of the 5 outer segments runs its 3 later sub-segments again.
    assert StaticPlan(((5, 4, 5),), 1, 1).step_iterations == (100 + 5 * 3 * 5 + 200, 0)
    assert StaticPlan(((5, 4, 1),), 1, 1).step_iterations == (20 + 5 * 3, 20)
    for pieces in [((10, 10),), ((5, 4, 5),), ((100,),), ((10, 10), (7,))]:
        plan = StaticPlan(pieces, 1, 1)
        separate, fused = plan.step_iterations
        # Separate iterations: every evaluation, and a pullback per step.
        assert separate + fused == plan.evaluations + plan.num_steps


def test_loops_run_as_dataflow_graphs_cost_more_per_iteration_on_cpu():
    from memento.planning.internals import dataflow_loops, loop_seconds

    # An elementwise step: few operations per loop body, in order on every backend.
    assert dataflow_loops(0, 1, 12_000, "cpu") == (False, False)
    # A matrix-vector step: a one-step segment's body (the step and its VJP, whose
    # product is two) passes XLA:CPU's eight operations; the separate loops do not.
    assert dataflow_loops(1, 1, 1_500, "cpu") == (False, True)
    # Too small to matter: a loop touching under 1 KiB is compiled whole.
    assert dataflow_loops(1, 1, 256, "cpu") == (False, False)
    # Two carry leaves beside the product: every loop's body passes eight operations.
    assert dataflow_loops(1, 2, 20_000, "cpu") == (True, True)
    assert dataflow_loops(6, 2, 20_000, "gpu") == (False, False)

    def seconds(plan, flags):
        separate, fused = plan.step_iterations
        return loop_seconds(
            plan.evaluations, plan.loop_iterations, "static", step=1e-7, backend="cpu",
            starts=plan.loop_starts, dataflow=separate * flags[0] + fused * flags[1],
        )  # fmt: skip

    per_step, nest = StaticPlan(((3000, 1),), 64, 640), StaticPlan(((50, 60),), 64, 640)
    # Without the dataflow term one-step segments look faster (fewer iterations); with
    # it, as measured for such steps, the nest is.
    assert seconds(per_step, (False, False)) < seconds(nest, (False, False))
    assert seconds(per_step, (False, True)) > seconds(nest, (False, True))
    budget = 3000 * 64 + 4096
    sizes = dict(carry_bytes=64, residual_bytes=640)
    picks = {
        flags: plan_static(3000, budget, **sizes, seconds=lambda p, f=flags: seconds(p, f))
        for flags in [(False, False), (False, True)]
    }
    assert any(len(p) > 1 and p[-1] == 1 for p in picks[False, False].pieces), picks
    assert all(p[-1] > 1 for p in picks[False, True].pieces if len(p) > 1), picks


def test_a_tight_budget_finds_the_nest_whose_segments_divide_the_steps():
    # 10^4 steps of a 68-byte carry (internal state 196 bytes) in 8,361 bytes: the
    # balanced three-level split (31 x 32 x 10) leaves a remainder nest whose loops and
    # starts do not fit, but 50 x 20 x 10 divides the steps and does, with a quarter
    # fewer evaluations than the four-level nests that fit.
    sizes = dict(
        carry_bytes=68, residual_bytes=196, stream_bytes=4, level_bytes=640, piece_bytes=784,
        loop_bytes=960, start_bytes=68,
    )  # fmt: skip
    plan = plan_static(10_000, 8_361, **sizes)
    assert len(plan.pieces) == 1 and len(plan.pieces[0]) == 3, plan.pieces
    assert plan.num_steps == 10_000 and plan.peak_bytes <= 8_361
    assert plan.evaluations <= 29_600
    replay = nest_schedule(plan).simulate()
    assert replay.forward_evaluations == plan.evaluations


def test_one_step_bytes_count_only_in_plans_whose_segments_are_single_steps():
    # A one-step segment runs its step again and back-propagates it at once, holding
    # that step's gradient: the plans that have one pay ``one_step_bytes``, the others
    # nothing, and a planner given them trades one-step segments for longer ones.
    sizes = dict(carry_bytes=64, residual_bytes=640)
    per_step = StaticPlan(((1000, 1),), **sizes)
    nest = StaticPlan(((100, 10),), **sizes)
    deep = StaticPlan(((10, 10, 10),), **sizes)
    assert per_step.one_step_segments and not nest.one_step_segments
    assert not deep.one_step_segments and StaticPlan(((10, 100, 1),), **sizes).one_step_segments
    assert not StaticPlan(((1000,),), **sizes).one_step_segments  # stored whole
    for plan in (per_step, nest, deep):
        more = dataclasses.replace(plan, one_step_bytes=5000)
        assert more.peak_bytes == plan.peak_bytes + 5000 * plan.one_step_segments
    favoured = lambda p: 1.0 if p.one_step_segments else 2.0
    budget = per_step.peak_bytes + 100
    assert plan_static(1000, budget, **sizes, seconds=favoured).one_step_segments
    cheaper = plan_static(1000, budget, **sizes, one_step_bytes=budget, seconds=favoured)
    assert not cheaper.one_step_segments and cheaper.peak_bytes <= budget
    assert nest_schedule(cheaper).simulate().forward_evaluations == cheaper.evaluations


def test_a_negative_one_step_bytes_counts_only_in_plans_of_one_step_nests_alone():
    # XLA can keep less of a one-step segment than the count (not every residual at
    # once): a plan of such nests alone takes that saving; a plan that also runs longer
    # segments or steps stored whole, whose phases hold the counted step, does not.
    sizes = dict(carry_bytes=64, residual_bytes=640)
    only = StaticPlan(((500, 1), (50, 1)), **sizes)
    mixed = StaticPlan(((500, 1), (50,)), **sizes)
    for plan in (only, mixed):
        less = dataclasses.replace(plan, one_step_bytes=-300)
        assert less.peak_bytes == plan.peak_bytes - 300 * (plan is only)
    # A plan of one-step segments whose starts alone exceed the budget by less than the
    # saving is still found.
    budget = StaticPlan(((1000, 1),), **sizes).peak_bytes - 200
    favoured = lambda p: 1.0 if p.pieces == ((1000, 1),) else 2.0
    assert plan_static(1000, budget, **sizes, seconds=favoured).pieces != ((1000, 1),)
    found = plan_static(1000, budget, **sizes, one_step_bytes=-300, seconds=favoured)
    assert found.pieces == ((1000, 1),) and found.peak_bytes <= budget


def test_a_nests_outer_starts_past_the_cache_count_as_spilled():
    # Every step's start of a 1 KiB carry at 10^5 steps (100 MB) is stored once and read
    # back once, as a stack of internal states past the cache is; a nest's few starts
    # are not.
    sizes = dict(carry_bytes=1024, residual_bytes=3072)
    per_step = StaticPlan(((100_000, 1),), **sizes)
    assert per_step.spilled_bytes(32 * 2**20) == 100_000 * 1024
    assert StaticPlan(((20, 5000),), **sizes).spilled_bytes(32 * 2**20) == 0
    assert per_step.spilled_bytes(2**30) == 0
