"""Operations per loop iteration on CPU: why checkpointing every step can be slower than
nested sqrt(T) at the same number of evaluations.

XLA:CPU runs the operations (thunks) of a loop body one after another in the calling
thread when the body has at most 8 of them after fusion, when every buffer they touch
has at most 512 bytes, or when each needs the one before; otherwise it runs them as a
dataflow graph over its thread pool, which costs more per iteration. A loop whose
iteration costs under 1 KiB of memory traffic is instead compiled whole into one kernel
(``xla_cpu_small_while_loop_byte_threshold``).

``lax.scan(jax.checkpoint(cell))`` recomputes a step and back-propagates it in the same
iteration of its backward loop; nested sqrt(T) recomputes a segment in one loop and
back-propagates it in another. Both evaluate each step twice, but the first's backward
body has about as many operations as the second's two bodies together, and passes 8
sooner. memento's one-step segments (plans ``(T, 1)``) are the first kind.

For each body this benchmark compiles the gradient of ``lax.scan``, checkpoint per step
and nested sqrt(T), counts the operations of each while loop's body in the optimized
program (and the loops compiled whole), and times them round robin in one process, with
memento ``auto`` at checkpoint per step's bytes beside them.

Run:  PYTHONPATH=src python benchmarks/loop_ops.py [--steps 3001]
      [--bodies matvec4,matvec8,matvec16,matvec64,counter16,velocity64,rk4mlp,elem256]
      [--rounds 5] [--threads one|all] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import re
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common
import pareto

DEFAULT_OUT = Path(__file__).parent / "results" / "loop_ops.json"
IDIOMS = ("lax.scan", "checkpoint per step", "nested sqrt(T)")
# Instructions that are no thunk of their own.
_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast"})


def _matvec_inputs(width: int):
    def make(num_steps):
        import jax
        import jax.numpy as jnp

        k = jax.random.split(jax.random.PRNGKey(7), 2)
        w = jax.random.normal(k[0], (width, width)) / width**0.5
        return w, jnp.zeros(width), jax.random.normal(k[1], (num_steps, width))

    return make


def _matvec(w, h, x):
    import jax.numpy as jnp

    return jnp.tanh(w @ h + x), h[0]


BODIES = {
    **pareto.BODIES,
    **{
        f"matvec{n}": pareto.Body(f"matvec{n}", f"`tanh(W @ h + x)`, {n} floats", _matvec,
                                  _matvec_inputs(n))
        for n in (4, 8, 16, 32, 64)
    },
}  # fmt: skip


def loop_operations(hlo: str) -> dict:
    """Of an optimized HLO module's text: the operations of each while loop's body
    (sorted), and how many loops XLA:CPU compiled whole (small calls)."""
    computations, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = computations.setdefault(head.group(1), [])
            continue
        op = re.search(r"= \S+ ([\w\-]+)\(", line) if current is not None else None
        if op and line.startswith("  ") and op.group(1) not in _FREE:
            current.append(op.group(1))
    bodies = re.findall(r"body=%?([\w.\-]+)", hlo)
    return {
        "loop_bodies": sorted(len(computations.get(b, [])) for b in bodies),
        "compiled_whole": hlo.count("xla_cpu_small_call"),
    }


def measure(body: pareto.Body, num_steps: int, rounds: int) -> dict:
    import jax

    args = body.make(num_steps)
    runs = {name: pareto.peer_runs(num_steps)[name] for name in IDIOMS}
    compiled, out = {}, {"body": body.name, "label": body.label, "T": num_steps}
    for name, run in runs.items():
        c = _common.compile_fn(jax.grad(pareto.loss_of(body.cell, run)), *args)
        compiled[name] = c
        out[name] = {"temp_bytes": c.temp_bytes, **loop_operations(c.hlo_body)}
    budget = out["checkpoint per step"]["temp_bytes"]
    name = "memento auto @ checkpoint per step's bytes"
    c = _common.compile_fn(
        jax.grad(pareto.loss_of(body.cell, pareto.memento_run(budget, "auto"))), *args
    )
    compiled[name] = c
    out[name] = {"temp_bytes": c.temp_bytes, **loop_operations(c.hlo_body)}
    calls = {n: (lambda c=c: jax.block_until_ready(c.call())) for n, c in compiled.items()}
    times = _common.time_round_robin(calls, repeats=rounds, min_round_s=0.05)
    nested = _common.median(times["nested sqrt(T)"])
    for n, ts in times.items():
        out[n]["time_s"] = _common.median(ts)
        out[n]["vs_nested"] = out[n]["time_s"] / nested
    return out


def _operations(result: dict, name: str) -> str:
    whole = result[name]["compiled_whole"]
    counts = ", ".join(map(str, result[name]["loop_bodies"]))
    return counts + (f" ({whole} compiled whole)" if whole else "")


def markdown(data: dict) -> str:
    per, nest, auto = (
        "checkpoint per step",
        "nested sqrt(T)",
        "memento auto @ checkpoint per step's bytes",
    )
    lines = [
        "| body | operations per loop body: checkpoint per step | nested sqrt(T) | "
        "time / nested sqrt(T): lax.scan | checkpoint per step | memento at checkpoint "
        "per step's bytes |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in data["results"]:
        ops = functools.partial(_operations, r)
        lines.append(
            f"| {r['label']} | {ops(per)} | {ops(nest)} | {r['lax.scan']['vs_nested']:.2f}x | "
            f"{r[per]['vs_nested']:.2f}x | {r[auto]['vs_nested']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3001)
    parser.add_argument(
        "--bodies", default="matvec4,matvec8,matvec16,matvec64,counter16,velocity64,rk4mlp,elem256"
    )
    parser.add_argument("--rounds", type=int, default=5)
    _common.add_threads_option(parser)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--markdown", metavar="JSON", help="print an existing JSON's table")
    args = parser.parse_args(argv)
    if args.markdown:
        return _common.print_markdown(args.markdown, markdown)
    if args.threads == "one":
        _common.use_one_thread()
    results = [measure(BODIES[n], args.steps, args.rounds) for n in args.bodies.split(",")]
    data = {
        "benchmark": "loop_ops",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _common.machine(),
        "settings": {
            "steps": args.steps,
            "bodies": args.bodies,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "results": results,
    }
    _common.write_json(args.out, data)
    print(markdown(data), end="")
    return data


if __name__ == "__main__":
    main()
