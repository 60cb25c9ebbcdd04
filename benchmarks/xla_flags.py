"""One gradient under the XLA_FLAGS of this process: lax.scan against memento.scan.

For comparing XLA options (on a GPU, command buffers) on the long-loop body of
``benchmarks/long.py``: a 4-float tanh carry, 100 slots. Prints lowering + compile time,
the first run and the best of three further runs, for ``lax.scan``, ``memento.scan``
with ``policy="hsm"`` and with ``"auto"``.

Run:  XLA_FLAGS="..." PYTHONPATH=src python benchmarks/xla_flags.py [steps]
(benchmarks/results/gpu/README.md has an H100's numbers.)
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp
from jax import lax

import memento


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    steps = int(float(argv[0])) if argv else 10**4

    def step(c, x):
        return jnp.tanh(c * 1.01 + x), None

    xs = jnp.full((steps,), 1e-3, jnp.float32)
    c0 = jnp.ones(4, jnp.float32)
    losses = {
        "lax": lambda c: lax.scan(step, c, xs)[0].sum(),
        "hsm": lambda c: memento.scan(step, c, xs, memory=100, policy="hsm")[0].sum(),
        "auto": lambda c: memento.scan(step, c, xs, memory=100)[0].sum(),
    }
    print("XLA_FLAGS", repr(os.environ.get("XLA_FLAGS", "")), jax.devices())
    for name, loss in losses.items():
        compiled, first = _common.first_call(jax.grad(loss), c0)
        steady = min(_common.time_once(functools.partial(compiled, c0)) for _ in range(3))
        print(
            f"{name:5s} T={steps:.0e} lower+compile {first['lower_s'] + first['compile_s']:.3f}s "
            f"first run {first['first_run_s']:.3f}s steady {steady:.4f}s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
