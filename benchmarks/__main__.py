"""``python -m benchmarks``: every benchmark by the question it answers.

    python -m benchmarks --list                 # the suites, what each measures, its results
    python -m benchmarks planner                # run one suite (its own options follow)
    python -m benchmarks pareto --quick

A suite is one script of this folder, run as its own process from the repository root
with ``src/`` first on ``PYTHONPATH``; arguments after the suite's name go to it
(``python -m benchmarks planner --help`` shows them). Each writes its results to the
file ``--list`` shows, under ``benchmarks/results/``. Never part of plain ``pytest``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclasses.dataclass(frozen=True)
class Suite:
    """One benchmark: the script that runs it, what it measures, where it writes."""

    script: str
    measures: str
    results: str  # under benchmarks/results/
    needs: str = "CPU"


SUITES: dict[str, Suite] = {
    "pareto": Suite(
        "pareto.py",
        "memento.scan at its peers' own temp bytes (nested sqrt(T), checkpoint per step): "
        "memory and time as ratios",
        "pareto.json",
    ),
    "planner": Suite(
        "planner.py", "memento.plan's planning time, against checkpoint_schedules", "planner.json"
    ),
    "scan-executors": Suite(
        "recursion.py",
        "memento.scan's executors: HSM as schedule rows against the device recursion",
        "recursion.json",
    ),
    "iterations": Suite(
        "iterations.py",
        "loop iterations per step of a budgeted gradient, by executor, policy and unroll",
        "iterations.json",
    ),
    "msm-vs-hsm": Suite(
        "msm_vs_hsm.py", "whether MSM's fewer evaluations show in time, by body", "msm_vs_hsm.json"
    ),
    "small-loops": Suite(
        "small_loops.py",
        "small bodies on CPU: measured time against the plan's model",
        "small_loops.json",
    ),
    "loop-ops": Suite(
        "loop_ops.py",
        "operations per loop body on CPU: checkpoint per step against nested sqrt(T)",
        "loop_ops.json",
    ),
    "first-call": Suite(
        "first_call.py",
        "the first call of a budgeted gradient (trace, plan, compile, run) by stage",
        "first_call.json",
    ),
    "long-loops": Suite(
        "long.py", "very long loops, T = 1e3..1e8: time and memory of a gradient", "long.json"
    ),
    "trip-count": Suite(
        "trip_count.py",
        "a loop of known trip count against one whose bound XLA cannot see",
        "trip_count.json",
    ),
    "storage": Suite(
        "pool.py",
        "storing a step's residuals: memento.scan's typed pools against others",
        "pool.json",
    ),
    "rnn": Suite(
        "rnn.py", "an LSTM's gradient under a budget: memento.scan against its peers", "rnn.json"
    ),
    "while-loop": Suite(
        "while_loop.py",
        "memento.while_loop against Equinox's checkpointed while loop",
        "while_loop.json",
    ),
    "online-policy": Suite(
        "online_policy.py",
        "memento.while_loop's online checkpointing against the offline optimum, every n",
        "online_policy.json",
    ),
    "chain": Suite(
        "chain.py",
        "memento.chain on heterogeneous layer stacks against JAX's rematerialisation",
        "chain.json",
    ),
    "host-memory": Suite(
        "offload.py",
        "memento.scan(host_memory=) against recomputation at equal device memory",
        "offload.json (gpu/offload.json on a GPU)",
    ),
    "host-plan": Suite(
        "offload_plan.py",
        "what host memory buys under the planner's model (two-level against device-only)",
        "offload_plan.json",
    ),
    "host-copy": Suite(
        "host_copy.py",
        "time to copy one slot between the device and pinned host memory",
        "host_copy.json",
    ),
    "device-budget": Suite(
        "device_budget.py",
        "device bytes of a two-level plan against its budget",
        "device_budget.json",
    ),
    "device-budget-by-carry": Suite(
        "device_budget_by_carry.py",
        "device temporary bytes of one- and two-level plans, by carry size",
        "device_budget_by_carry.json",
    ),
    "torch": Suite(
        "torch_rnn.py",
        "memento.torch.scan against PyTorch's checkpointing on an LSTM cell loop",
        "torch_rnn.json (gpu/torch_rnn.json on a GPU)",
        needs="torch",
    ),
    "torch-chain": Suite(
        "torch_chain.py",
        "memento.torch.checkpoint_sequential against torch.utils.checkpoint's",
        "torch_chain.json (gpu/torch_chain.json on a GPU)",
        needs="torch",
    ),
    "metagrad": Suite(
        "metagrad.py",
        "meta-gradients: mixed mode (MixFlow-MG) against JAX's default, by inner steps",
        "metagrad.json",
    ),
    "diffrax": Suite(
        "diffrax_adjoints.py",
        "a neural ODE's gradient: memento's adjoint against Diffrax's own",
        "diffrax.json",
        needs="diffrax",
    ),
    "sharded": Suite(
        "sharded.py",
        "budgeted gradients over 8 devices, data and model parallel",
        "sharded.json",
        needs="8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)",
    ),
    "gpu-rnn": Suite(
        "gpu_rnn.py",
        "an LSTM's gradient on a GPU: device memory and time",
        "gpu/gpu_rnn.json",
        needs="GPU",
    ),
    "gpu-policy": Suite(
        "gpu_policy.py",
        "one gradient under each policy and executor on a GPU (takes OUT.json)",
        "the path given",
        needs="GPU",
    ),
    "xla-flags": Suite(
        "xla_flags.py",
        "one gradient under this process's XLA_FLAGS (prints; writes nothing)",
        "none",
    ),
}


def listing() -> str:
    """The suites, one line each with what it measures, and its results file and needs."""
    width = max(map(len, SUITES))
    lines = ["suites (python -m benchmarks SUITE [its options]):"]
    for name, s in SUITES.items():
        missing = "" if (HERE / s.script).exists() else "  [script not in this checkout]"
        lines.append(f"  {name:<{width}}  {s.measures}{missing}")
        lines.append(f"  {'':<{width}}    {s.script} -> results/{s.results}; needs {s.needs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run one benchmark suite by name; --list shows them.",
    )
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument("suite", nargs="?", help="the suite to run (see --list)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options for the suite")
    args = parser.parse_args(argv)
    if args.list or args.suite is None:
        print(listing())
        return 0
    suite = SUITES.get(args.suite)
    if suite is None:
        print(
            f"python -m benchmarks: no suite {args.suite!r}; --list shows the "
            f"{len(SUITES)} suites.",
            file=sys.stderr,
        )
        return 2
    script = HERE / suite.script
    if not script.exists():
        print(f"python -m benchmarks: {suite.script} is not in this checkout.", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    return subprocess.call([sys.executable, str(script), *args.args], cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
