"""How fast is the planner? Medians of repeated `memento.plan` calls, and checkpoint_schedules.

Run: ``python benchmarks/planner.py [--quick] [--full]``. Prints a table and writes
``benchmarks/results/planner.json``. Never part of pytest (timings are noisy; compare the
ratios measured in the same process).

Cases:
- HSM and ISM at t = 100,000 and m = 100 (closed forms, vectorised leaves): target 50 ms.
- MSM at m = 200: the exact table, column by column (``_msm.py``), at t = 1,000, 2,000 and
  10,000 with alpha = 5 (target 1 s at 10,000), and at 10,000 with alpha = 5, beta = 2 and
  alpha = 2. Beside it the O(t^2 m) row-by-row table it replaced (the tests' oracle), timed
  at t = 2,000 and extrapolated (t^2 m) to 10,000 unless ``--full``.
- checkpoint_schedules' ``MixedCheckpointSchedule`` against memento's MSM at alpha = 1,
  side by side. What each counts: Mixed's cost (``mixed_steps_tabulation(n, s)[n, s, 2]``)
  is every forward step, first sweep and the forward-reverse (fused) steps included, with
  ``s`` checkpoint units that also hold the initial state when it is needed: memento's C(t,
  m) with m = s. The models differ, so the costs differ: Mixed's "adjoint dependency" data
  are internal states *without* the output state, kept only for the first step of a
  subproblem; the paper's internal states contain the output state (section 3.2). memento's
  C_msm(n, s, alpha=1) is therefore lower; memento's C_msm(n, s + 1, alpha >= 2, beta = 1)
  is the closest model and never above Mixed (checked at small n).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import warnings

import numpy as np

import memento
from memento.planning import _closed, _msm

RESULTS = pathlib.Path(__file__).parent / "results" / "planner.json"


def median_time(fn, repeats: int) -> tuple[float, object]:
    times = []
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def mixed_schedule(n: int, s: int) -> tuple[int, int]:
    """Runs checkpoint_schedules' Mixed schedule to the end: (cost, forward steps counted)."""
    from checkpoint_schedules import EndReverse, Forward, MixedCheckpointSchedule, StorageType
    from checkpoint_schedules.mixed import mixed_steps_tabulation

    schedule = MixedCheckpointSchedule(n, s, storage=StorageType.RAM)
    forwards = 0
    for action in schedule:
        if isinstance(action, Forward):
            forwards += action.n1 - action.n0
        elif isinstance(action, EndReverse):
            break
    cost = int(mixed_steps_tabulation(n, min(s, n - 1))[n, min(s, n - 1), 2])
    return cost, forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller peers")
    parser.add_argument(
        "--full", action="store_true", help="time the O(t^2 m) MSM table at t=10,000"
    )
    args = parser.parse_args()
    repeats = 3 if args.quick else 9
    rows = []

    def record(name, seconds, **extra):
        rows.append({"case": name, "median_s": seconds, **extra})
        fields = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{name:<44} {seconds * 1e3:10.1f} ms  {fields}", flush=True)

    print(f"{'case':<44} {'median':>13}")
    for policy in ("hsm", "ism"):
        seconds, s = median_time(lambda p=policy: memento.plan(100_000, 100, policy=p), repeats)
        record(
            f"plan(100_000, 100, policy={policy!r})",
            seconds,
            cost=s.cost,
            rows=len(s.actions),
            actions_mib=round(s.actions.nbytes / 2**20, 2),
            target_s=0.05,
        )
    seconds, _ = median_time(lambda: _closed.hsm_cost(100_000, 100), repeats)
    record("C_hsm(100_000, 100) closed form only", seconds)

    # MSM: the exact table, column by column.
    for t, alpha, beta in (
        (1000, 5, 5),
        (2000, 5, 5),
        (10_000, 5, 5),
        (10_000, 5, 2),
        (10_000, 2, 2),
    ):
        seconds, s = median_time(
            lambda t=t, a=alpha, b=beta: memento.plan(t, 200, policy="msm", alpha=a, beta=b),
            max(1, repeats // 3),
        )
        target = {"target_s": 1.0} if (t, alpha, beta) == (10_000, 5, 5) else {}
        record(f"plan({t}, 200, msm, alpha={alpha}, beta={beta})", seconds, cost=s.cost, **target)
    # The O(t^2 m) row-by-row table it replaced.
    seconds, _ = median_time(lambda: _msm.msm_tables_full(2000, 200, 5, 5), 1)
    record("msm_tables_full(2000, 200, 5, 5) (before)", seconds)
    if args.full:
        seconds, _ = median_time(lambda: _msm.msm_tables_full(10_000, 200, 5, 5), 1)
        record("msm_tables_full(10_000, 200, 5, 5) (before)", seconds)
    else:
        record("msm_tables_full(10_000, 200, 5, 5) (before) extrapolated", seconds * 25)

    # Mixed vs memento MSM alpha = 1, side by side, same process.
    try:
        import checkpoint_schedules  # noqa: F401
        import numba  # noqa: F401  (without numba, Mixed memoises in pure Python: hours)

        have_peer = True
    except ImportError as err:
        have_peer = False
        print(f"checkpoint_schedules / numba unavailable ({err}); skipping the peer")
    if have_peer:
        from checkpoint_schedules.mixed import mixed_steps_tabulation

        warnings.simplefilter("ignore")
        mixed_schedule(20, 5)  # compile numba's tabulation once, outside the timings
        sizes = [(2_000, 100), (10_000, 100)] if not args.quick else [(2_000, 100)]
        for n, s in sizes:
            t_mixed, (c_mixed, fwd) = median_time(lambda n=n, s=s: mixed_schedule(n, s), 1)
            t_ours, ours = median_time(
                lambda n=n, s=s: memento.plan(n, s, policy="msm", alpha=1), repeats
            )
            record(f"checkpoint_schedules Mixed({n}, {s})", t_mixed, cost=c_mixed, forwards=fwd)
            t_tab, _ = median_time(lambda n=n, s=s: mixed_steps_tabulation(n, s), 1)
            record(f"  of which its numba DP table ({n}, {s})", t_tab)
            record(
                f"memento plan({n}, {s}, msm, alpha=1)",
                t_ours,
                cost=ours.cost,
                speedup=round(t_mixed / t_ours, 1),
                speedup_vs_table=round(t_tab / t_ours, 1),
            )
        # The closest model: exact MSM table with beta = 1 and one more slot.
        n, s = 400, 20
        tab = mixed_steps_tabulation(n, s)
        table = memento.cost_table(n, s + 1, policy="msm", alpha=2, beta=1)
        diff = [
            int(tab[k, min(j, k - 1), 2]) - int(table[k, min(j, k - 1) + 1])
            for k in range(2, n + 1)
            for j in range(1, s + 1)
        ]
        rows.append(
            {
                "case": f"Mixed(n, s) - C_msm(n, s+1, alpha=2, beta=1), n<={n}, s<={s}",
                "min": min(diff),
                "max": max(diff),
                "equal_fraction": round(float(np.mean(np.array(diff) == 0)), 3),
            }
        )
        print(rows[-1])

    # Heterogeneous chain.
    seconds, s = median_time(
        lambda: memento.plan_chain([1, 2] * 50, [1] * 101, [4, 3] * 50, 40), max(1, repeats // 3)
    )
    record("plan_chain(100 steps, budget 40)", seconds, cost=s.cost)
    seconds, r = median_time(lambda: memento.plan(10_000, 20, policy="hsm").simulate(), 1)
    record("simulate(plan(10_000, 20))", seconds, forward_evaluations=r.forward_evaluations)

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {"python": sys.version, "results": rows}
    RESULTS.write_text(json.dumps(payload, indent=2, default=int) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
