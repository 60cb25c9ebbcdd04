"""Small bodies on CPU: memento's gradient against the plan's model, by XLA's small-loop size.

GitHub issue 20: a 4-float cell ``h = tanh(W @ h + x)`` with ``W`` closed over and
differentiated, 100 slots, HSM, took 10x ``lax.scan(jax.checkpoint(cell))`` on CPU where
the plan's model (its evaluations per step, against the checkpointed scan's 2) predicts
2.4x. The cause is XLA:CPU, not the schedule: XLA:CPU compiles a while loop into one
kernel only when its cost model puts one iteration, nested loops included, under
``xla_cpu_small_while_loop_byte_threshold`` bytes (1 KiB by default); otherwise each
operation of each iteration is dispatched on its own (a fraction of a microsecond each).
The checkpointed scan's backward loop fits in 1 KiB; memento's backward loops, which nest
the recomputation inside the back-propagation, take about 1.3 KB for this cell, and run
op by op.

This benchmark measures, per threshold (each in its own process, since ``XLA_FLAGS`` is
read once), per cell and width, the steady time of the gradient of ``lax.scan``,
``lax.scan(jax.checkpoint(cell))`` and memento (HSM, 100 slots, rows and recursion), and
the model ratio ``plan.cost / (2 T)``:

- ``matvec``: ``tanh(W @ h + x)``, ``W`` (width x width) closed over, its gradient taken;
- ``elementwise``: ``tanh(1.01 h + x)``, no weights, the gradient of ``h0``.

Run:  PYTHONPATH=src python benchmarks/small_loops.py [--steps 1e5] [--widths 4,16,64,256]
      [--thresholds default,65536,1048576] [--repeats 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common

FLAG = "xla_cpu_small_while_loop_byte_threshold"
SLOTS = 100


def _losses(cell: str, width: int, T: int):
    """name -> (loss, argument) for one cell, all differentiating the same argument."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import memento

    xs = jnp.full((T, width), 1e-3, jnp.float32)
    h0 = jnp.ones(width, jnp.float32)
    W0 = jax.random.normal(jax.random.PRNGKey(0), (width, width), jnp.float32) * 0.5 / width**0.5

    def run(step, h, how):
        if how == "lax.scan":
            return lax.scan(step, h, xs)[0]
        if how == "lax.scan(checkpoint)":
            return lax.scan(jax.checkpoint(step), h, xs)[0]
        executor = how.removeprefix("memento ")
        return memento.scan(step, h, xs, memory=SLOTS, policy="hsm", executor=executor)[0]

    hows = ("lax.scan", "lax.scan(checkpoint)", "memento rows", "memento recursion")
    if cell == "matvec":
        return {
            how: (
                lambda W, how=how: run(lambda h, x: (jnp.tanh(W @ h + x), None), h0, how).sum(),
                W0,
            )
            for how in hows
        }
    return {
        how: (lambda h, how=how: run(lambda c, x: (jnp.tanh(1.01 * c + x), None), h, how).sum(), h0)
        for how in hows
    }


def _flat(row: dict) -> dict:
    """The row's ratios and times as scalar columns (the docs' results tables show those)."""
    short = {"lax.scan": "lax_scan", "lax.scan(checkpoint)": "checkpoint",
             "memento rows": "rows", "memento recursion": "recursion"}  # fmt: skip
    flat = {f"{short[h]}_s": s for h, s in row["seconds"].items()}
    flat |= {f"{short[h]}_vs_checkpoint": r for h, r in row["vs_checkpoint"].items()}
    flat |= {f"{short[h]}_vs_model": r for h, r in row["vs_model"].items()}
    flat.pop("checkpoint_vs_checkpoint")
    return flat


def child(args) -> list[dict]:
    import jax

    import memento

    rows = []
    T = int(float(args.steps))
    model = memento.plan(T, SLOTS, policy="hsm").cost / (2 * T)
    for cell in ("matvec", "elementwise"):
        for width in [int(w) for w in args.widths.split(",")]:
            grads = {}
            for how, (loss, arg) in _losses(cell, width, T).items():
                g = jax.jit(jax.grad(loss))
                jax.block_until_ready(g(arg))
                grads[how] = lambda g=g, arg=arg: g(arg)
            times = _common.time_round_robin(grads, repeats=args.repeats)
            med = {how: _common.median(v) for how, v in times.items()}
            ckpt = med["lax.scan(checkpoint)"]
            row = {
                "threshold": args.threshold,
                "cell": cell,
                "width": width,
                "T": T,
                "model": model,
                "seconds": med,
                "vs_checkpoint": {how: s / ckpt for how, s in med.items()},
                "vs_model": {
                    how: med[how] / ckpt / model for how in ("memento rows", "memento recursion")
                },
            }
            row.update(_flat(row))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default="1e5")
    parser.add_argument("--widths", default="4,16,64,256")
    parser.add_argument("--thresholds", default="default,65536,1048576")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "small_loops.json")
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threshold", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows = []
    for threshold in args.thresholds.split(","):
        env = dict(os.environ)
        if threshold != "default":
            flags = env.get("XLA_FLAGS", "")
            env["XLA_FLAGS"] = f"{flags} --xla_backend_extra_options={FLAG}={threshold}".strip()
        cmd = [sys.executable, __file__, "--child", "--threshold", threshold,
               "--steps", args.steps, "--widths", args.widths, "--repeats", str(args.repeats)]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for r in rows[-len(args.widths.split(",")) * 2 :]:
            vs = r["vs_checkpoint"]
            print(
                f"threshold {r['threshold']:>8}  {r['cell']:<11} w={r['width']:<4} "
                f"model {r['model']:.2f}x  rows {vs['memento rows']:.2f}x  "
                f"recursion {vs['memento recursion']:.2f}x  lax.scan {vs['lax.scan']:.2f}x  "
                f"(checkpoint {r['seconds']['lax.scan(checkpoint)'] * 1e3:.1f} ms)",
                flush=True,
            )
    import jax  # noqa: F401  (machine info)

    _common.write_json(
        args.out, {"machine": _common.machine(), "git": _common.git_state(), "rows": rows}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
