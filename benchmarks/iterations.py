"""Loop iterations per step of a budgeted scan's gradient, by executor, policy and unroll.

GitHub issue 20: on a GPU a small body is launch-bound, each iteration of a while loop
costing several microseconds (its kernels, and its predicate read back by the host),
so what matters there is how many loop iterations each step pays, forward and backward,
not only how many forward evaluations (the planner's cost). Counted exactly on the host,
from what each executor runs:

- rows (`memento.loops._interpreter`): from the `Program` memento compiles for the scan
  (`memento.loops.scan_schedule` with ``executor="rows"``): the first sweep's scan, the
  backward's outer loop (a step each), its inner loop over primal rows (a row each,
  entered once per step), and each advance's loop (k steps an iteration with
  ``unroll=k``, the rest one at a time);
- recursion (`memento.loops._recursion`): its backward re-enacted in Python, push by
  push with `memento.planning.internals.hsm_split`: the outer loop, the segment loop, each
  advance's loop and each split's search for its level.

Each figure is per step of the scan: ``iterations`` (loop bodies run), ``entries``
(loops entered: each evaluates its predicate once more, even when it runs no
iteration), ``branches`` (``cond``/``switch`` run; on a GPU each reads its index back
too) and ``evaluations`` (forward evaluations of the body, the planner's cost).

Run:  PYTHONPATH=src python benchmarks/iterations.py [--steps 1e3,1e4] [--unroll 1,4]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax.numpy as jnp
import numpy as np

import memento
from memento.loops import _interpreter
from memento.planning import Op
from memento.planning.internals import hsm_split

MEMORY = 100
CASES = (("hsm", "rows"), ("ism", "rows"), ("msm", "rows"), ("hsm", "recursion"))


def _cell(c, x):
    return jnp.tanh(c * 1.01 + x), None


def _advance(n: int, k: int) -> tuple[int, int]:
    """(iterations, entries) of `advance_steps` over n steps with unroll k."""
    if k <= 1:
        return n, 1
    return n // k + n % k, 2


def rows_counts(num_steps: int, policy: str, unroll: int) -> dict:
    c0 = jnp.ones(4, jnp.float32)
    xs = jnp.full((num_steps,), 1e-3, jnp.float32)
    schedule = memento.loops.scan_schedule(
        _cell, c0, xs, memory=MEMORY, policy=policy, executor="rows", wrt=("init",)
    )
    prog = _interpreter.compile_schedule(schedule)
    t = num_steps
    n_sweep = t - 1 if prog.fused_last else t
    fw = {"iterations": n_sweep // unroll, "entries": 1, "branches": 0}
    if prog.sweep_saves_internal or prog.sweep_host_saves_internal:
        fw["branches"] = n_sweep  # a cond (or switch) per step
    rows = prog.primal_rows
    ops = set(rows[:, 0].tolist())
    adv = rows[rows[:, 0] == _interpreter._BRANCH[Op.ADVANCE], 1].astype(np.int64)
    it, en = _advance_all(adv, unroll)
    per_row_branches = 1 + sum(
        int(_interpreter._BRANCH[op] in ops) for op in (Op.SAVE_INTERNAL, Op.HOST_SAVE_INTERNAL)
    )
    kinds = sum([prog.any_fused, prog.any_internal, prog.any_host_internal])
    bw = {
        "iterations": (t - 1) + len(rows) + it,
        "entries": 1 + (t - 1 if len(rows) else 0) + en,
        "branches": len(rows) * per_row_branches + (t - 1 if kinds > 1 else 0),
    }
    return {"forward": fw, "backward": bw, "evaluations": int(schedule.cost),
            "chosen": schedule.policy}  # fmt: skip


def _advance_all(counts: np.ndarray, k: int) -> tuple[int, int]:
    if k <= 1:
        return int(counts.sum()), len(counts)
    return int((counts // k + counts % k).sum()), 2 * len(counts)


def _level(t: int, m: int) -> int:
    """The recursion's search: the smallest w >= 1 with binom(m + w, w) >= t."""
    w = 1
    while math.comb(m + w, w) < t:
        w += 1
    return w


def recursion_counts(num_steps: int, unroll: int) -> dict:
    """The recursion's loops re-enacted (`memento.loops._recursion.backward`)."""
    t, slots = num_steps, MEMORY
    pushes = memento.loops._recursion.first_pushes(t, slots)
    stack = [0, *pushes] + [0] * slots
    depth = len(pushes)
    it = en = evals = 0
    levels: dict[tuple[int, int], int] = {}

    def level(tt, m):
        if (tt, m) not in levels:
            levels[(tt, m)] = _level(tt, m)
        return levels[(tt, m)]

    en += 1  # the outer loop
    for e in range(t - 2, -1, -1):
        it += 1
        if depth > 0 and stack[depth] > e:
            depth -= 1
        b = stack[depth]
        if slots > 1:
            en += 1  # the segment loop
            p, push = b, True
            while push and p < e:
                it += 1
                ok = e - p + 1 >= 3 and slots - depth >= 2
                tt, m = (e - p + 1, slots - depth) if ok else (3, 2)
                w = level(tt, m)
                it, en = it + (w - 1), en + 1  # the level's search loop
                q = p + hsm_split(tt, m) if ok else 2**31 - 1
                to = min(q, e)
                a, b_ = _advance(to - p, unroll)
                it, en, evals = it + a, en + b_, evals + (to - p)
                push = q < e
                if push:
                    depth += 1
                    stack[depth] = q
                p = to
        else:
            a, b_ = _advance(e - b, unroll)
            it, en, evals = it + a, en + b_, evals + (e - b)
    fw = {"iterations": (t - 1) // unroll, "entries": 1, "branches": 0}
    bw = {"iterations": it, "entries": en, "branches": 0}
    # The forward's t evaluations, the backward's recomputation and its t fused VJPs.
    return {"forward": fw, "backward": bw, "evaluations": t + evals + (t - 1),
            "chosen": "hsm"}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "iterations.json"))
    parser.add_argument("--steps", default="1e3,1e4")
    parser.add_argument("--unroll", default="1,4")
    args = parser.parse_args(argv)
    out = []
    for steps in (int(float(s)) for s in args.steps.split(",")):
        for k in (int(u) for u in args.unroll.split(",")):
            for policy, executor in CASES:
                if executor == "rows":
                    c = rows_counts(steps, policy, k)
                else:
                    c = recursion_counts(steps, k)
                row = {"T": steps, "policy": policy, "executor": executor, "unroll": k,
                       "chosen": c["chosen"], "evaluations_per_step": c["evaluations"] / steps}  # fmt: skip
                for part in ("forward", "backward"):
                    for key, v in c[part].items():
                        row[f"{part}_{key}_per_step"] = round(v / steps, 3)
                out.append(row)
                print(row, file=sys.stderr, flush=True)
    data = {"machine": _common.machine(), "git": _common.git_state(), "memory": MEMORY,
            "rows": out}  # fmt: skip
    print(_common.write_json(args.out, data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
