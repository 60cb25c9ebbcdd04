"""Diffrax: the gradient of a neural ODE solve, memento's adjoint against Diffrax's own.

A neural ODE, ``dy/dt = MLP(y)`` with ``y`` of width 16 and an MLP 16 -> 64 -> 64 -> 16
(tanh), solved by Tsit5 with ``ConstantStepSize`` over ``[0, 1]`` in T = 1e3, 1e4, 1e5
steps (``max_steps=T``), float32. Loss: the sum of squares of ``y(1)``; gradient with
respect to the MLP's weights, under ``jax.jit``.

Methods (``diffeqsolve(..., adjoint=...)``):

- ``memento``: ``memento.diffrax.CheckpointAdjoint(memory=32)``;
- ``rca_default``: ``diffrax.RecursiveCheckpointAdjoint()`` (checkpoints=None:
  Equinox's ``floor(sqrt(2 T + 1/4) - 1.5) + 1``, 44 / 141 / 446 at T = 1e3 / 1e4 / 1e5);
- ``rca_32``: ``diffrax.RecursiveCheckpointAdjoint(checkpoints=32)``, as many as memento;
- ``backsolve``: ``diffrax.BacksolveAdjoint()`` (solves the adjoint ODE backwards: no
  checkpoints, a different gradient, that of the continuous problem).

For each: ``first_s`` (trace + compile + first run of a fresh ``jax.jit``),
``compile_s``, ``steady_s`` (median of later runs: 3, or 1 at T = 1e5), ``temp_kib``
(``memory_analysis().temp_size_in_bytes``), and ``rel_diff``, the relative distance of
the gradient from ``memento``'s (float32 rounding for the checkpointed ones). One XLA
thread (``_common.use_one_thread``). A method whose run at one size takes longer than
``--max-run-s`` is not run at the next size; the skip is recorded.

(Not benchmarks/diffrax.py: run as a script, that name would shadow Diffrax itself.)

Run:  PYTHONPATH=src python benchmarks/diffrax_adjoints.py [--max-exp 5] [--out PATH]
Writes benchmarks/results/diffrax.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common

if __name__ == "__main__":
    _common.use_one_thread()

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import memento.diffrax

WIDTH, HIDDEN, MEMORY = 16, 64, 32
METHODS = ("memento", "rca_default", "rca_32", "backsolve")


def adjoint(method: str):
    if method == "memento":
        return memento.diffrax.CheckpointAdjoint(memory=MEMORY)
    if method == "rca_default":
        return diffrax.RecursiveCheckpointAdjoint()
    if method == "rca_32":
        return diffrax.RecursiveCheckpointAdjoint(checkpoints=MEMORY)
    if method == "backsolve":
        return diffrax.BacksolveAdjoint()
    raise ValueError(method)


def init_params(key):
    sizes = [WIDTH, HIDDEN, HIDDEN, WIDTH]
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n))
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def field(t, y, params):
    for i, (w, b) in enumerate(params):
        y = y @ w + b
        if i < len(params) - 1:
            y = jnp.tanh(y)
    return y


def make_loss(method: str, T: int):
    adj = adjoint(method)
    y0 = jnp.linspace(-1.0, 1.0, WIDTH)

    def loss(params):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 1.0, 1.0 / T, y0, params,
            max_steps=T, adjoint=adj,
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    return loss


def measure(method: str, T: int, params, runs: int) -> tuple[dict, jax.Array]:
    f = jax.jit(jax.grad(make_loss(method, T)))
    t0 = time.perf_counter()
    compiled = f.lower(params).compile()
    t1 = time.perf_counter()
    grads = jax.block_until_ready(compiled(params))
    t2 = time.perf_counter()
    times = [_common.time_once(lambda: compiled(params)) for _ in range(runs)]
    mem = compiled.memory_analysis()
    flat = jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(grads)])
    return {
        "method": method,
        "T": T,
        "first_s": t2 - t0,
        "compile_s": t1 - t0,
        "first_run_s": t2 - t1,
        "steady_s": statistics.median(times),
        "runs": runs,
        "temp_kib": mem.temp_size_in_bytes / 1024,
    }, flat


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-exp", type=int, default=5)
    parser.add_argument("--max-run-s", type=float, default=8.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "diffrax.json"))
    args = parser.parse_args(argv)
    params = init_params(jax.random.key(0))
    results, skipped, stopped = [], [], {}
    for e in range(3, args.max_exp + 1):
        T = 10**e
        runs = 3 if e < 5 else 1
        reference = None
        for method in METHODS:
            if method in stopped:
                skipped.append({"method": method, "T": T, "why": stopped[method]})
                continue
            r, g = measure(method, T, params, runs)
            if reference is None:
                reference = g
            r["rel_diff"] = float(jnp.linalg.norm(g - reference) / jnp.linalg.norm(reference))
            results.append(r)
            print(
                f"{method:12s} T={T:.0e} first {r['first_s']:.2f}s (compile "
                f"{r['compile_s']:.2f}) steady {r['steady_s']:.3f}s temp "
                f"{r['temp_kib']:.1f} KiB rel_diff {r['rel_diff']:.1e}",
                file=sys.stderr,
                flush=True,
            )
            if r["steady_s"] > args.max_run_s:
                stopped[method] = (
                    f"{r['steady_s']:.1f} s a run at T={T:.0e}, above --max-run-s "
                    f"{args.max_run_s}: about 10x that at the next size"
                )
    data = {
        "machine": _common.machine(),
        "problem": {
            "field": f"MLP {WIDTH}-{HIDDEN}-{HIDDEN}-{WIDTH}, tanh",
            "solver": "Tsit5, ConstantStepSize, t in [0, 1], dt0 = 1/T, max_steps = T",
            "dtype": "float32",
            "memory_slots": MEMORY,
            "reference_for_rel_diff": METHODS[0],
        },
        "results": results,
        "skipped": skipped,
    }
    print(_common.write_json(args.out, data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
