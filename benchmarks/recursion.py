"""HSM as schedule rows against HSM as the device recursion; while_loop's time by budget.

Two questions behind `memento.planning.internals.recursion_min_steps("cpu")` and the budget claims of
`memento.while_loop`:

- ``scan``: the same gradient (``policy="hsm"``) run as a program of schedule rows
  (`_interpreter`) and as the recursion on the device (`_recursion`), forced either way,
  on three bodies: a 4-float ``tanh`` carry with no outputs; an RNN cell of width 4 with
  outputs and a weight gradient; the same at width 64. Steady-state time (median of 5)
  and the first call (trace + plan + compile + run) of ``jax.jit(jax.grad)``, with its
  lowering and compile times (``--cases`` picks other bodies and sizes).
- ``while_loop``: a 1000-step RK4 integration of a 4-to-W-to-4 tanh MLP (W = 8, 256),
  its gradient's steady time for budgets of 4 to 128 slots.

Run:  PYTHONPATH=src python benchmarks/recursion.py [--out PATH] [--no-scan | --no-while]
      (the while_loop sweep alone: ``--no-scan --out benchmarks/results/recursion_while.json``)
"""

from __future__ import annotations

import argparse
import statistics
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


def _steady(f, *args, repeats=5) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _scan_loss(body: str, T: int, memory: int, executor: str = "auto"):
    if body == "tanh4":
        xs = jnp.full((T,), 1e-3, jnp.float32)

        def loss(args):
            return memento.scan(
                lambda c, x: (jnp.tanh(c * 1.01 + x), None), args, xs, memory=memory,
                policy="hsm", executor=executor,
            )[0].sum()  # fmt: skip

        return loss, jnp.ones(4, jnp.float32)
    width = int(body.removeprefix("rnn"))
    w0 = jax.random.normal(jax.random.PRNGKey(0), (width, width)) / width**0.5
    xs = jnp.full((T, width), 1e-3, jnp.float32)

    def loss(w):
        def cell(h, x):
            h = jnp.tanh(w @ h + x)
            return h, h.sum()

        h, ys = memento.scan(
            cell, jnp.ones(width), xs, memory=memory, policy="hsm", executor=executor
        )
        return h.sum() + ys.sum()

    return loss, w0


CASES = "tanh4:1e4:100,tanh4:1e6:100,rnn4:1e5:100,rnn64:1e4:30"


def scan_rows(out: list, cases: str = CASES) -> None:
    for case in cases.split(","):
        body, steps, memory = case.split(":")
        T = int(float(steps))
        for path in ("rows", "recursion"):
            _choose._plan.cache_clear()
            _choice._compile.cache_clear()
            loss, arg = _scan_loss(body, T, int(memory), executor=path)
            grad, first = _common.first_call(jax.grad(loss), arg)
            row = {"body": body, "T": T, "memory": int(memory), "path": path, **first,
                   "steady_s": _steady(grad, arg)}  # fmt: skip
            out.append(row)
            print(row, file=sys.stderr, flush=True)


def while_budgets(out: list) -> None:
    for width in (8, 256):
        k = jax.random.split(jax.random.PRNGKey(0), 2)
        w1 = jax.random.normal(k[0], (width, 4)) * 0.3
        w2 = jax.random.normal(k[1], (4, width)) * 0.3

        def f(y, w1=w1, w2=w2):
            return w2 @ jnp.tanh(w1 @ y)

        def body(s, f=f):
            i, y = s
            h = 0.01
            k1 = f(y)
            k2 = f(y + h / 2 * k1)
            k3 = f(y + h / 2 * k2)
            k4 = f(y + h * k3)
            return i + 1, y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)

        for memory in (4, 8, 16, 32, 64, 128):

            def loss(y0, memory=memory, body=body):
                final = memento.while_loop(
                    lambda s: s[0] < 1000, body, (0, y0), max_steps=2000, memory=memory
                )
                return final[1].sum()

            row = {"width": width, "memory": memory,
                   "steady_s": _steady(jax.jit(jax.grad(loss)), jnp.ones(4))}  # fmt: skip
            out.append(row)
            print(row, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "recursion.json"))
    parser.add_argument("--cases", default=CASES, help="scan cases, body:steps:memory,...")
    parser.add_argument("--no-while", action="store_true", help="skip the while_loop sweep")
    parser.add_argument("--no-scan", action="store_true", help="skip the scan cases")
    args = parser.parse_args(argv)
    scan, loop = [], []
    if not args.no_scan:
        scan_rows(scan, args.cases)
    if not args.no_while:
        while_budgets(loop)
    data = {"machine": _common.machine(), "git": _common.git_state(), "scan": scan,
            "while_loop": loop}  # fmt: skip
    print(_common.write_json(args.out, data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
