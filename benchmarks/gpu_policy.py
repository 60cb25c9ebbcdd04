"""One gradient under each policy and executor: what a GPU makes of ``auto``'s pick.

GitHub issue 20 asks what ``policy="auto"`` picks for an LSTM step and for a 4-float body
on a GPU, and whether that is the fastest. This times ``memento.scan``'s gradient, as
``auto`` plans it and with the policy and executor forced, in one process: the first call
and the median of ``--repeats`` steady calls, timed round-robin.

- ``--problem lstm`` (default): the ``gpu_rnn.py`` LSTM (hidden 1024, batch 128, input 64,
  T=1000) at 250 and 50 slots.
- ``--problem cell``: the 4x4 cell ``tanh(W @ h + x)`` of ``small_loops.py``, ``W``
  closed over and differentiated, T=10^4, at 100 slots.

Since auto charges the rows per step on a GPU (``memento.planning.Charges``, measured
from this script's first LSTM run), it should plan HSM, on the recursion, in every case
here; the forced rows show what that avoids.

``--command-buffers``: each case also jitted with XLA:GPU's CUDA graphs on, per function
(``jax.jit(..., compiler_options=COMMAND_BUFFERS)``, the README's ``XLA_FLAGS`` without
the environment), timed in the same round-robin.

Run:  PYTHONPATH=src python benchmarks/gpu_policy.py OUT.json [--problem lstm|cell]
      [--repeats 5] [--small] [--command-buffers]
      (--small: tiny sizes, to check that it runs on a CPU)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common

CASES = {
    "lstm": [(250, "auto", "auto"), (250, "hsm", "auto"), (250, "msm", "rows"),
             (50, "auto", "auto"), (50, "hsm", "rows")],
    "cell": [(100, "auto", "auto"), (100, "hsm", "auto"), (100, "hsm", "rows"),
             (100, "msm", "rows")],
}  # fmt: skip

# XLA:GPU's command buffers (CUDA graphs) for loops and conditionals too, as compiler
# options of one jitted function.
COMMAND_BUFFERS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": 1,
}


def _problem(name: str, small: bool):
    """``(step(p, c, x), p, xs, init, T)`` of ``--problem name``."""
    import jax
    import jax.numpy as jnp

    import gpu_rnn
    from _common import lstm_step

    if name == "lstm":
        T = 100 if small else 1000
        p, xs, init = (
            gpu_rnn.make_problem(16, 2, 4, T) if small else gpu_rnn.make_problem(1024, 128, 64, T)
        )
        return lstm_step, p, xs, init, T
    T = 1000 if small else 10**4
    W = jax.random.normal(jax.random.PRNGKey(0), (4, 4), jnp.float32) * 0.25
    xs, init = jnp.full((T, 4), 1e-3, jnp.float32), jnp.ones(4, jnp.float32)

    def cell(W, h, x):
        h = jnp.tanh(W @ h + x)
        return h, h

    return cell, W, xs, init, T


def main(argv: list[str]) -> int:
    import argparse

    import jax
    import jax.numpy as jnp

    import memento

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--problem", choices=sorted(CASES), default="lstm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--command-buffers", action="store_true")
    args = ap.parse_args(argv)
    variants = [None, COMMAND_BUFFERS] if args.command_buffers else [None]
    step_of, p, xs, init, T = _problem(args.problem, args.small)
    rows, calls = [], {}
    for slots, policy, executor in CASES[args.problem]:

        def loss(p, xs, init, slots=slots, policy=policy, executor=executor):
            def step(c, x):
                return step_of(p, c, x)

            ys = memento.scan(step, init, xs, memory=slots, policy=policy, executor=executor)[1]
            return jnp.sum(ys)

        def step(c, x):
            return step_of(p, c, x)

        s = memento.loops.scan_schedule(
            step, init, xs, memory=slots, policy=policy, executor=executor
        )
        for options in variants:
            g = jax.jit(jax.grad(loss), compiler_options=options)
            t0 = time.perf_counter()
            jax.block_until_ready(g(p, xs, init))
            first = time.perf_counter() - t0
            name = f"{slots}/{policy}/{executor}" + ("/command-buffers" if options else "")
            calls[name] = lambda g=g: jax.block_until_ready(g(p, xs, init))
            rows.append(dict(problem=args.problem, T=T, slots=slots, policy=policy,
                             executor=executor, planned=s.policy, alpha=s.alpha,
                             cost_per_step=s.cost / T, first_s=first,
                             command_buffers=options is not None,
                             backend=jax.default_backend()))  # fmt: skip
    # Steady times round-robin (one run of each case, again): load drifts hit all alike.
    times = _common.time_round_robin(calls, repeats=args.repeats)
    for row, name in zip(rows, calls):
        row["steady_s"] = _common.median(times[name])
        print(json.dumps(row), flush=True)
    out = rows
    _common.write_json(args.out, {"machine": _common.machine(), "rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
