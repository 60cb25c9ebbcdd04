"""Derivatives beyond the gradient through a long loop: temp memory and time, as ratios.

For a tanh RNN step (``h = tanh(W @ h + x)``, hidden ``--hidden``, ``--steps`` steps,
loss ``sum(ys) + sum(h)``), four derivatives, each compiled once and timed round-robin in
one process on CPU:

- ``grad``: ``jax.grad`` with respect to ``W``;
- ``grad_grad``: ``jax.grad`` of the squared norm of ``jax.grad`` with respect to the
  initial carry (reverse over reverse);
- ``hvp``: ``jax.jvp`` of ``jax.grad`` (forward over reverse);
- ``jacfwd``: ``jax.jacfwd`` with respect to the initial carry (forward mode).

Methods: ``lax.scan`` (stores everything), ``lax.scan(jax.checkpoint(step))``
(checkpoint per step), nested sqrt(T) (a ``lax.scan`` over segments, each a
``jax.checkpoint``-ed ``lax.scan``), and memento with ``memory`` set to nested sqrt(T)'s
gradient's temp bytes. Memory: ``memory_analysis().temp_size_in_bytes`` of the compiled
derivative. Every derivative is checked against ``lax.scan``'s before it is timed.

Run:  PYTHONPATH=src python benchmarks/higher_order.py [--steps 4000] [--hidden 64]
      [--rounds 5] [--out benchmarks/results/higher_order.json]
      (writes the JSON and, beside it, the Markdown tables: higher_order.md)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import memento


def nested(f, init, xs):
    """Nested sqrt(T): segments of a divisor of T near sqrt(T), each checkpointed."""
    t = xs.shape[0]
    seg = min((d for d in range(1, t + 1) if t % d == 0), key=lambda d: abs(d - math.sqrt(t)))

    @jax.checkpoint
    def segment(c, xs_seg):
        return lax.scan(f, c, xs_seg)

    c, ys = lax.scan(segment, init, xs.reshape(t // seg, seg, *xs.shape[1:]))
    return c, ys.reshape(t, *ys.shape[2:])


def derivatives(scan, xs):
    def loss(w, h0):
        c, ys = scan(lambda h, x: (jnp.tanh(w @ h + x), jnp.sum(h)), h0, xs)
        return jnp.sum(c) + jnp.sum(ys)

    return {
        "grad": jax.grad(loss),
        "grad_grad": jax.grad(lambda w, h0: jnp.sum(jax.grad(loss, 1)(w, h0) ** 2)),
        "hvp": lambda w, h0: jax.jvp(lambda w: jax.grad(loss)(w, h0), (w,), (jnp.cos(w),))[1],
        "jacfwd": jax.jacfwd(loss, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/higher_order.json")
    a = p.parse_args(argv)

    rng = np.random.default_rng(0)
    n = a.hidden
    w = jnp.asarray(rng.normal(size=(n, n)) / np.sqrt(n), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=n), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(a.steps, n)), jnp.float32)

    budget = _common.compile_fn(derivatives(nested, xs)["grad"], w, h0).temp_bytes
    methods = {
        "lax.scan": lax.scan,
        "checkpoint per step": lambda f, i, x: lax.scan(jax.checkpoint(f), i, x),
        "nested sqrt(T)": nested,
        "memento": lambda f, i, x: memento.scan(f, i, x, memory=f"{budget}B"),
    }
    rows, lines = {}, []
    for what in ("grad", "grad_grad", "hvp", "jacfwd"):
        compiled = {
            m: _common.compile_fn(derivatives(s, xs)[what], w, h0) for m, s in methods.items()
        }
        ref = compiled["lax.scan"].first_output
        for m, c in compiled.items():
            np.testing.assert_allclose(c.first_output, ref, rtol=2e-3, atol=2e-3, err_msg=m)
        times = _common.time_round_robin({m: c.call for m, c in compiled.items()}, repeats=a.rounds)
        base = compiled["lax.scan"]
        rows[what] = {
            m: {
                "temp_bytes": c.temp_bytes,
                "seconds": _common.median(times[m]),
                "compile_seconds": c.compile_s,
                "temp_vs_lax_scan": c.temp_bytes / max(base.temp_bytes, 1),
                "time_vs_lax_scan": _common.median(times[m]) / _common.median(times["lax.scan"]),
            }
            for m, c in compiled.items()
        }
        lines += [
            f"\n#### {what} (T = {a.steps}, hidden {n}; memento at memory={budget}B)\n",
            "| method | temp | temp / lax.scan | time | time / lax.scan |",
            "| --- | --- | --- | --- | --- |",
            *(
                f"| {m} | {r['temp_bytes'] / 1024:.0f} KiB | {r['temp_vs_lax_scan']:.3f}x | "
                f"{r['seconds'] * 1e3:.1f} ms | {r['time_vs_lax_scan']:.2f}x |"
                for m, r in rows[what].items()
            ),
        ]
    print("\n".join(lines))
    Path(a.out).with_suffix(".md").write_text("\n".join(lines).lstrip() + "\n")
    _common.write_json(
        a.out,
        {
            "benchmark": "higher_order",
            "date": datetime.date.today().isoformat(),
            "args": vars(a),
            "memory_bytes": budget,
            "machine": _common.machine(),
            "git": _common.git_state(),
            "load_average": os.getloadavg(),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
