"""A loop of known trip count against one whose bound XLA cannot see, by length.

GitHub issue 20 (compile time of the rows on a GPU). XLA:GPU treats a while loop whose
trip count it can prove (``lax.fori_loop`` with static bounds, ``lax.scan``) apart from
one bounded by a run-time value: it runs the known loop without reading its predicate
back to the host, and its ``dynamic-slice-annotator`` pass analyses the loop's slices
at compile time. This times both kinds on the same 4-float ``tanh`` body reading
``xs[i]``: lowering and compiling at each T, and the run's time per iteration up to
10^5 steps. The second loop's bound goes through ``lax.optimization_barrier``, the way a
bound read from data would.

Run:  python benchmarks/trip_count.py [--out FILE] [--steps 1e4,1e5,1e6]
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
from jax import lax


def known(xs, c):
    return lax.fori_loop(0, xs.shape[0], lambda i, c: jnp.tanh(c * 1.01 + xs[i]), c)


def hidden(xs, c):
    n = lax.optimization_barrier(jnp.int32(xs.shape[0]))

    def body(s):
        i, c, n = s
        return i + 1, jnp.tanh(c * 1.01 + xs[i]), n

    return lax.while_loop(lambda s: s[0] < s[2], body, (jnp.int32(0), c, n))[1]


def measure(T: int, name: str, f, timed: bool) -> dict:
    xs, c = jnp.full((T, 4), 1e-3, jnp.float32), jnp.ones(4, jnp.float32)
    start = time.perf_counter()
    lowered = jax.jit(f).lower(xs, c)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    row = {"T": T, "loop": name, "lower_s": lower_s, "compile_s": time.perf_counter() - start,
           "known_trip_count": "known_trip_count" in compiled.as_text()}  # fmt: skip
    if timed:
        jax.block_until_ready(compiled(xs, c))
        best = min(_common.time_once(lambda: compiled(xs, c)) for _ in range(3))
        row["us_per_iteration"] = best / T * 1e6
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "trip_count.json"))
    parser.add_argument("--steps", default="1e4,1e5,1e6")
    args = parser.parse_args(argv)
    rows = []
    for T in (int(float(s)) for s in args.steps.split(",")):
        for name, f in (("known", known), ("hidden", hidden)):
            rows.append(measure(T, name, f, timed=T <= 10**5))
            print(rows[-1], flush=True)
    _common.write_json(args.out, {"machine": _common.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
