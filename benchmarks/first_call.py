"""The first call of a budgeted scan's gradient, by stage, number of steps and policy.

GitHub issue 20: on a GPU, XLA compiled the rows executor's schedule (a constant of O(T)
in the program) slowly. This splits the first call of ``jax.jit(jax.grad(loss))`` of a
4-float ``tanh`` scan into planning (host: `memento.loops.scan_schedule`, which traces the
body abstractly and runs the planner), lowering (trace, the rest of the planning work,
StableHLO) and compiling, for T = 10^3 .. 10^6 and the policies hsm (rows and recursion),
ism, msm and auto, and records the size of the lowered StableHLO text (constants
included): neither it nor the compile time may grow with T.

Run:  PYTHONPATH=src python benchmarks/first_call.py [--steps 1e3,1e4,1e5,1e6] [--run]
(``--run`` also times the first run; ``--lower-only`` skips compiling.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp

import memento
from memento.loops import _choice
from memento.planning import _choose

# (label, policy, executor)
CASES = (
    ("hsm-rows", "hsm", "rows"),
    ("hsm-recursion", "hsm", "recursion"),
    ("ism", "ism", "rows"),
    ("msm", "msm", "rows"),
    ("auto", "auto", "auto"),
)
MEMORY = 100


def tanh_loss(T: int, policy: str, executor: str, memory: int = MEMORY):
    """A 4-float ``tanh`` scan of T steps and its loss, as a function of the initial carry."""
    xs = jnp.full((T,), 1e-3, jnp.float32)

    def cell(c, x):
        return jnp.tanh(c * 1.01 + x), None

    def loss(c0):
        return memento.scan(cell, c0, xs, memory=memory, policy=policy, executor=executor)[0].sum()

    return loss, cell, xs


def measure(T: int, policy: str, executor: str, *, compile_: bool, run: bool) -> dict:
    _choose._plan.cache_clear()
    _choice._compile.cache_clear()
    loss, cell, xs = tanh_loss(T, policy, executor)
    c0 = jnp.ones(4, jnp.float32)
    start = time.perf_counter()
    schedule = memento.loops.scan_schedule(
        cell, c0, xs, memory=MEMORY, policy=policy, executor=executor, wrt=("init",)
    )
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).lower(c0)
    lower_s = time.perf_counter() - start
    text = lowered.as_text()
    row = {"T": T, "policy": policy, "executor": executor, "chosen": schedule.policy,
           "cost": int(schedule.cost), "plan_s": plan_s, "lower_s": lower_s,
           "stablehlo_chars": len(text), "stablehlo_lines": text.count("\n")}  # fmt: skip
    if compile_:
        start = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = time.perf_counter() - start
        if run:
            start = time.perf_counter()
            jax.block_until_ready(compiled(c0))
            row["first_run_s"] = time.perf_counter() - start
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "first_call.json"))
    parser.add_argument("--steps", default="1e3,1e4,1e5,1e6")
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    parser.add_argument("--lower-only", action="store_true")
    parser.add_argument("--run", action="store_true")
    parser.add_argument(
        "--run-max-steps",
        type=float,
        default=1e4,
        help="with --run, time the first run only up to this T",
    )
    args = parser.parse_args(argv)
    rows = []
    wanted = args.cases.split(",")
    for steps in (int(float(s)) for s in args.steps.split(",")):
        for label, policy, executor in CASES:
            if label not in wanted:
                continue
            run = args.run and steps <= args.run_max_steps
            row = {"case": label, **measure(steps, policy, executor, compile_=not args.lower_only,
                                             run=run)}  # fmt: skip
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    data = {"machine": _common.machine(), "backend": jax.default_backend(),
            "git": _common.git_state(), "memory": MEMORY, "rows": rows}  # fmt: skip
    print(_common.write_json(args.out, data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
