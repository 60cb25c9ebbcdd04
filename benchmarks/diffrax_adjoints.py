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

``--part saveat`` (float64; writes benchmarks/results/diffrax_saveat.json): temporary
memory of the gradient at default settings, ``CheckpointAdjoint(memory=32)`` against
``RecursiveCheckpointAdjoint(checkpoints=32)``, for ``SaveAt(ts=200 times)``,
``SaveAt(steps=True)`` and ``SaveAt(dense=True)`` on an adaptive Tsit5 solve; and the time
of four gradients as ratios memento / ``RecursiveCheckpointAdjoint`` at equal checkpoints
(median of ``--repeats`` round-robin runs): a neural ODE in ``--fixed-steps`` fixed steps
(32 slots), adaptive ``SaveAt(ts=100 times)`` (8 slots), ``vmap`` over 8 adaptive solves
whose members take different numbers of steps (8 slots), adaptive ``SaveAt(ts=2 times)``
(16 slots).
"""

from __future__ import annotations

import argparse
import functools
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


# ----------------------------------------------------------------------------------------
# --part saveat: memory at default settings, and time on the four cases


def duffing(t, y, a):
    x, v = y[0], y[1]
    return jnp.stack([v, -a[0] * x - a[1] * v - a[2] * x**3 + 0.3 * jnp.cos(t)])


DUFFING_ARGS = np.array([1.2, 0.15, 0.4])


def duffing_loss(adj, saveat, *, t1=40.0, rtol=1e-6):
    """The adaptive Duffing problem: Tsit5 with a PID controller, float64."""

    def loss(y0, a):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(duffing), diffrax.Tsit5(), 0.0, t1, 0.1, y0, a, saveat=saveat,
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=rtol),
            adjoint=adj, max_steps=4096,
        )  # fmt: skip
        out = sum(
            jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2)
            for y in jax.tree_util.tree_leaves(sol.ys)
        )
        if saveat.dense:
            out = out + jnp.sum(jax.vmap(sol.evaluate)(jnp.linspace(0.1, t1 - 0.1, 50)) ** 2)
        return out

    return loss


def saveat_memory(slots: int = 32) -> list[dict]:
    """Temporary memory of jit(grad) at default settings against RecursiveCheckpointAdjoint
    with as many checkpoints, for SaveAt(ts=200 times), SaveAt(steps=True), dense=True."""
    cases = {
        "ts_200": diffrax.SaveAt(ts=jnp.linspace(0.0, 40.0, 200)),
        "steps": diffrax.SaveAt(steps=True),
        "dense": diffrax.SaveAt(dense=True),
    }
    y0, a = jnp.array([1.0, -0.5]), jnp.asarray(DUFFING_ARGS)
    rows = []
    for name, saveat in cases.items():
        temp = {}
        for method, adj in (
            ("memento", memento.diffrax.CheckpointAdjoint(memory=slots)),
            ("rca", diffrax.RecursiveCheckpointAdjoint(checkpoints=slots)),
        ):
            f = jax.jit(jax.grad(duffing_loss(adj, saveat), argnums=(0, 1)))
            temp[method] = f.lower(y0, a).compile().memory_analysis().temp_size_in_bytes
        rows.append({
            "case": name, "slots": slots, "memento_temp_bytes": temp["memento"],
            "rca_temp_bytes": temp["rca"], "ratio": temp["memento"] / temp["rca"],
        })  # fmt: skip
        print(f"memory {name:8s} {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def speed_cases(repeats: int, fixed_steps: int, only: str = "") -> list[dict]:
    """Gradient time, memento / RecursiveCheckpointAdjoint at equal checkpoints, on the
    four cases of issue 21 (median of ``repeats`` round-robin runs)."""
    y0, a = jnp.array([1.0, -0.5]), jnp.asarray(DUFFING_ARGS)
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), init_params(jax.random.key(0)))

    def neural(adj):
        def loss(p):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 1.0, 1.0 / fixed_steps,
                jnp.linspace(-1.0, 1.0, WIDTH), p, max_steps=fixed_steps, adjoint=adj,
            )  # fmt: skip
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss)), (params,)

    def duff(adj, saveat, **kw):
        return jax.jit(jax.grad(duffing_loss(adj, saveat, **kw), argnums=(0, 1))), (y0, a)

    def batched(adj):
        y0s = y0 * jnp.linspace(0.3, 2.5, 8)[:, None]  # members take different step counts
        g = jax.grad(duffing_loss(adj, diffrax.SaveAt(t1=True)), argnums=(0, 1))
        return jax.jit(jax.vmap(g, in_axes=(0, None))), (y0s, a)

    cases = {
        f"neural_ode_{fixed_steps}_fixed_steps_32_slots": (neural, 32, {}),
        "adaptive_duffing_ts100_8_slots": (
            lambda adj: duff(adj, diffrax.SaveAt(ts=jnp.linspace(0.0, 40.0, 100))), 8, {}),
        "vmap_8_adaptive_solves_8_slots": (batched, 8, {}),
        "adaptive_ts2_16_slots": (
            lambda adj: duff(adj, diffrax.SaveAt(ts=jnp.array([10.0, 40.0]))), 16, {}),
    }  # fmt: skip
    rows = []
    for name, (build, slots, _) in cases.items():
        if only and not any(k in name for k in only.split(",")):
            continue
        calls = {}
        for method, adj in (
            ("memento", memento.diffrax.CheckpointAdjoint(memory=slots)),
            ("rca", diffrax.RecursiveCheckpointAdjoint(checkpoints=slots)),
        ):
            f, args = build(adj)
            compiled = f.lower(*args).compile()
            jax.block_until_ready(compiled(*args))
            calls[method] = functools.partial(compiled, *args)
        times = _common.time_round_robin(calls, repeats=repeats)
        m, r = _common.median(times["memento"]), _common.median(times["rca"])
        # The spread on a loaded machine: each round's ratio (the two ran back to back),
        # and the ratio of the fastest runs.
        rounds = sorted(a / b for a, b in zip(times["memento"], times["rca"]))
        rows.append({
            "case": name, "slots": slots, "memento_s": m, "rca_s": r, "ratio": m / r,
            "round_ratios_min_median_max": [rounds[0], _common.median(rounds), rounds[-1]],
            "ratio_of_fastest": min(times["memento"]) / min(times["rca"]),
        })  # fmt: skip
        print(
            f"speed {name:40s} ratio {m / r:.2f} ({m:.4f} s / {r:.4f} s); rounds "
            f"{rounds[0]:.2f}..{rounds[-1]:.2f}, fastest {rows[-1]['ratio_of_fastest']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def main_saveat(args) -> int:
    jax.config.update("jax_enable_x64", True)
    data = {
        "machine": _common.machine(),
        "problem": {
            "memory": "adaptive Tsit5 on a forced Duffing oscillator (2 states), t in [0, 40], "
            "PID rtol = atol = 1e-6, float64; memento at its default settings "
            "(CheckpointAdjoint(memory=32)) against RecursiveCheckpointAdjoint(checkpoints=32); "
            "temp_size_in_bytes of the compiled jit(grad)",
            "speed": f"median of {args.repeats} round-robin runs, one XLA thread, float64",
        },
        "memory": [] if args.cases else saveat_memory(),
        "speed": speed_cases(args.repeats, args.fixed_steps, args.cases),
    }
    print(_common.write_json(args.out, data))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("neural", "saveat"), default="neural")
    parser.add_argument("--max-exp", type=int, default=5)
    parser.add_argument("--max-run-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fixed-steps", type=int, default=2000)
    parser.add_argument(
        "--cases",
        default="",
        help="--part saveat: only the speed cases whose names contain "
        "one of these comma-separated words (and no memory table)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results_dir = Path(__file__).parent / "results"
    if args.part == "saveat":
        args.out = args.out or str(results_dir / "diffrax_saveat.json")
        return main_saveat(args)
    args.out = args.out or str(results_dir / "diffrax.json")
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
