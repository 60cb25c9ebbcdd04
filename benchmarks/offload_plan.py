"""What does host memory buy? Two-level plans against the device-only plan (planner only).

Run: ``python benchmarks/offload_plan.py [--quick]``. Prints a table and writes
``benchmarks/results/offload_plan.json``. Never part of pytest. NumPy only (no JAX).

For each number of steps t, device budget m (slots, h_0 included), host budget (unbounded
or a few slots) and transfer cost c (forward-step units per slot, both ways, with
``overlap="step"``: a copy hides behind one step of compute), the cost of the optimal
two-level plan (`memento.plan(t, m, host_memory=..., transfer_cost=c)`) against the optimal
device-only plan of the same policy (`memento.plan(t, m)`), as cost per step and their ratio.

One two-level table (``_host.host_tables``) holds the costs of every device budget up to
the largest, so each (t, host, c) is planned once; its time is reported (planning time
by size). The table is O(t^2 m h): at t = 10,000 only small device budgets (0.1%, 0.2%)
fit the few minutes a run may take; t = 1,000 covers 1% to 25%. A few of the plans are
rebuilt with `memento.plan` and replayed by the simulator (``replayed``), whose cost must
equal the table's.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time

import memento
from memento.planning import _host, hsm_cost

RESULTS = pathlib.Path(__file__).parent / "results" / "offload_plan.json"


def device_only(t: int, m: int, policy: str, alpha: int) -> float:
    if policy == "hsm":
        return hsm_cost(t, m)
    return memento.plan(t, m, policy="msm", alpha=alpha).cost


def sweep(t, budgets, host, costs, policy="hsm", alpha=1, replay=()):
    """Rows for every budget in ``budgets`` and cost in ``costs`` at one (t, host)."""
    rows = []
    h = None if host == math.inf else host
    d = max(budgets) - 1
    for c in costs:
        ch = _host.TransferCharges.of(c, c, alpha, "step")
        start = time.perf_counter()
        table, _, _ = _host.host_tables(t, d, h, alpha, alpha, policy == "msm", ch)
        seconds = time.perf_counter() - start
        for m in budgets:
            two = float(table[0, t, m - 1, 0 if h is None else h])
            one = device_only(t, m, policy, alpha)
            row = {
                "num_steps": t,
                "policy": policy,
                "alpha": alpha,
                "memory": m,
                "memory_percent": 100 * m / t,
                "host_memory": None if h is None else h,
                "transfer_cost": c,
                "overlap": "step",
                "cost": two,
                "cost_per_step": two / t,
                "device_only_cost": one,
                "device_only_per_step": one / t,
                "speedup": one / two,
                "table_seconds": seconds,
                "table_device_slots": d + 1,
            }
            if (m, c) in replay:
                s = memento.plan(
                    t,
                    m,
                    policy="hsm" if policy == "hsm" else "msm",
                    alpha=None if policy == "hsm" else alpha,
                    host_memory=host,
                    transfer_cost=c,
                )
                r = s.simulate()
                assert math.isclose(r.cost, two), (t, m, host, c, r.cost, two)
                row["replayed"] = {
                    "cost": r.cost,
                    "forward_evaluations": r.forward_evaluations,
                    "transfer_time": r.transfer_time,
                    "peak_memory": r.peak_memory,
                    "peak_host_memory": r.peak_host_memory,
                    "host_stores": r.host_stores,
                    "host_loads": r.host_loads,
                }
            rows.append(row)
            print(
                f"t={t:>6} {policy} m={m:>4} ({100 * m / t:5.1f}%) host={host!s:>4} c={c:>5}:"
                f" {two / t:7.3f}/step vs device-only {one / t:7.3f}/step"
                f" ({one / two:5.2f}x)  table {seconds:6.2f} s",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="t = 1,000 only, fewer costs")
    args = parser.parse_args()
    costs = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0]
    if args.quick:
        costs = [0.5, 2.0, 10.0]
    rows = []
    t = 1000
    rows += sweep(t, [10, 20, 50, 100, 250], math.inf, costs, replay={(10, 2.0), (50, 0.5)})
    rows += sweep(t, [10, 20, 50], 8, costs, replay={(10, 2.0)})
    rows += sweep(t, [10, 20, 50], math.inf, costs[1::2], policy="msm", alpha=3)
    if not args.quick:
        rows += sweep(10_000, [10, 20], math.inf, [0.5, 2.0, 10.0], replay={(10, 2.0)})
    payload = {
        "benchmark": "offload_plan",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "note": "costs in forward-step units (first sweep included); overlap='step'",
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
