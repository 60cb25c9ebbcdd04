"""Storing a step's residuals: the typed pools of `memento.scan` against other storage.

The question: what does it cost, per step, to write one step's internal state (the
residual leaves of an LSTM step's VJP, as `memento.scan` stores them) into slot storage
and read it back, for

- ``typed``: one buffer per leaf with a leading slot axis (what `memento.while_loop` uses
  for carries);
- ``typed pools``: `memento.loops._pool.Pools`, one pool per dtype and shape (a stored
  leaf is one entry) shared by hidden and internal states, what `memento.scan` and
  `memento.while_loop` use now;
- ``flat pools (before)``: one flat pool per dtype, each leaf raveled at an element
  offset, the single-device layout before (its int32 offsets wrapped past 2^31
  elements, and it forked the layout on the device count);
- ``pool uint32`` / ``pool uint8``: every leaf bitcast into one flat pool of words, the
  design `memento.scan` used before the typed pools (it lost tangents, complex numbers
  and keys); kept here, written out below, to compare the two in one process.

Each variant is a loop writing T states, then a loop reading them back in reverse and
summing them; ``no storage`` makes and sums the same states without storing them, and
its time is subtracted. Same process, round-robin timing (see ``_common``).

Run:
    /work/venv/bin/python benchmarks/pool.py            # ~1 min
Writes benchmarks/results/pool.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from memento.apps import demo as _demo
from memento.loops import _body, _pool


def residual_leaves(hidden: int, batch: int) -> list:
    """The stored residual leaves of one LSTM step, as `memento.scan` finds them."""
    params = _demo.lstm_params(jax.random.PRNGKey(0), hidden)
    xs, init = _demo.lstm_data(jax.random.PRNGKey(1), 1, hidden, batch)
    x = jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype)
    body = _body.make_body(lambda c, x: _demo.lstm_step(params, c, x), init, x, name="pool")
    return [jnp.ones(a.shape, a.dtype) for a in body.residual_spec().stored]


def variants(leaves: list, num_steps: int) -> dict:
    """name -> function of the leaves returning a scalar (jitted by the caller)."""

    def state(leaves, i):
        return [leaf * (1 + i.astype(leaf.dtype)) for leaf in leaves]

    def total(values):
        return sum(jnp.sum(v) for v in values)

    def none(leaves):
        return lax.fori_loop(0, num_steps, lambda i, acc: acc + total(state(leaves, i)), 0.0)

    def typed(leaves):
        buffers = [jnp.zeros((num_steps, *leaf.shape), leaf.dtype) for leaf in leaves]

        def put(i, bufs):
            return [
                lax.dynamic_update_index_in_dim(b, v, i, 0) for b, v in zip(bufs, state(leaves, i))
            ]

        def get(j, acc):
            i = num_steps - 1 - j
            return acc + total(lax.dynamic_index_in_dim(b, i, 0, keepdims=False) for b in bufs)

        bufs = lax.fori_loop(0, num_steps, put, buffers)
        return lax.fori_loop(0, num_steps, get, 0.0)

    def typed_pools(leaves):
        avals = [jax.typeof(leaf) for leaf in leaves]
        # internal states only: a state's place is (nh, ni) = (0, number below it)
        pools = _pool.Pools.of([], avals, np.array([[0, num_steps]]))

        def put(i, p):
            return pools.write(p, 0, i, state(leaves, i), "i")

        def get(j, acc):
            return acc + total(pools.read(p, 0, num_steps - 1 - j, "i"))

        p = lax.fori_loop(0, num_steps, put, pools.allocate())
        return lax.fori_loop(0, num_steps, get, 0.0)

    def flat_pools(leaves):
        # The layout memento used on one device before: one flat pool per dtype, a
        # leaf stored raveled at an element offset (int32, which wrapped past 2^31).
        dtypes = list(dict.fromkeys(leaf.dtype for leaf in leaves))
        unit = {d: sum(leaf.size for leaf in leaves if leaf.dtype == d) for d in dtypes}
        pools0 = [jnp.zeros(num_steps * unit[d], d) for d in dtypes]

        def put(i, pools):
            pools, starts = list(pools), [i * unit[d] for d in dtypes]
            for v in state(leaves, i):
                j = dtypes.index(v.dtype)
                pools[j] = lax.dynamic_update_slice_in_dim(pools[j], v.ravel(), starts[j], 0)
                starts[j] = starts[j] + v.size
            return pools

        def get(k, acc):
            i = num_steps - 1 - k
            starts = [i * unit[d] for d in dtypes]
            out = []
            for leaf in leaves:
                j = dtypes.index(leaf.dtype)
                x = lax.dynamic_slice_in_dim(pools[j], starts[j], leaf.size)
                out.append(x.reshape(leaf.shape))
                starts[j] = starts[j] + leaf.size
            return acc + total(out)

        pools = lax.fori_loop(0, num_steps, put, pools0)
        return lax.fori_loop(0, num_steps, get, 0.0)

    def word_pool(word):
        words = {1: jnp.uint8, 4: jnp.uint32}[word]

        def run(leaves):
            sizes = [leaf.size * leaf.dtype.itemsize // word for leaf in leaves]
            unit = sum(sizes)

            def put(i, pool):
                start = i * unit
                for v, n in zip(state(leaves, i), sizes):
                    w = lax.bitcast_convert_type(v, words).reshape(-1)
                    pool = lax.dynamic_update_slice_in_dim(pool, w, start, 0)
                    start = start + n
                return pool

            def get(j, acc):
                start, out = (num_steps - 1 - j) * unit, []
                for leaf, n in zip(leaves, sizes):
                    w = lax.dynamic_slice_in_dim(pool, start, n)
                    shape = leaf.shape + ((leaf.dtype.itemsize // word,) if word == 1 else ())
                    out.append(lax.bitcast_convert_type(w.reshape(shape), leaf.dtype))
                    start = start + n
                return acc + total(out)

            pool = lax.fori_loop(0, num_steps, put, jnp.zeros(num_steps * unit, words))
            return lax.fori_loop(0, num_steps, get, 0.0)

        return run

    return {
        "no storage": none,
        "typed": typed,
        "typed pools": typed_pools,
        "flat pools (before)": flat_pools,
        "pool uint32": word_pool(4),
        "pool uint8": word_pool(1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    _common.use_one_thread()

    leaves = residual_leaves(args.hidden, args.batch)
    state_bytes = _body.nbytes([jax.typeof(leaf) for leaf in leaves])
    compiled = {
        name: _common.compile_fn(f, leaves) for name, f in variants(leaves, args.steps).items()
    }
    reference = float(compiled["no storage"].first_output)
    for name, c in compiled.items():  # every variant sums the same states
        got = float(c.first_output)
        if abs(got - reference) > 1e-4 * abs(reference):
            raise SystemExit(f"{name}: sum {got} differs from {reference}")
    times = _common.time_round_robin(
        {name: c.call for name, c in compiled.items()}, repeats=args.repeats
    )
    base = _common.median(times["no storage"])
    rows = []
    print(
        f"{len(leaves)} residual leaves, {state_bytes / 1024:.1f} KiB a step "
        f"(LSTM H={args.hidden}, B={args.batch}), T={args.steps}"
    )
    for name in compiled:
        per_step = (_common.median(times[name]) - base) / args.steps
        rows.append({"name": name, "times_s": times[name], "store_and_load_us": per_step * 1e6})
        print(f"  {name:12s} write + read: {per_step * 1e6:6.2f} us a step")
    _common.write_json(
        Path(args.out) / "pool.json",
        {
            "benchmark": "pool",
            "machine": _common.machine(),
            "leaves": len(leaves),
            "state_bytes": state_bytes,
            "steps": args.steps,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
