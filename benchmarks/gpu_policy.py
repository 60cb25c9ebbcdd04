"""One LSTM gradient under each policy and executor: what a GPU makes of ``auto``'s pick.

GitHub issue 20 asks what ``policy="auto"`` picks for an LSTM step on a GPU and whether
that is the fastest. This times ``memento.scan``'s gradient of the ``gpu_rnn.py`` LSTM
(hidden 1024, batch 128, input 64, T=1000) at 250 and 50 slots, as ``auto`` plans it and
with the policy and executor forced, in one process: the first call and the median of
five steady calls.

Run:  PYTHONPATH=src python benchmarks/gpu_policy.py OUT.json [--small]
      (--small: hidden 16, batch 2, T=100, to check that it runs on a CPU)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CASES = [(250, "auto", "auto"), (250, "hsm", "auto"), (250, "msm", "rows"),
         (50, "auto", "auto"), (50, "hsm", "rows")]  # fmt: skip


def main(argv: list[str]) -> int:
    import jax
    import jax.numpy as jnp

    import gpu_rnn
    import memento
    from _common import lstm_step

    small = "--small" in argv
    T = 100 if small else 1000
    p, xs, init = (
        gpu_rnn.make_problem(16, 2, 4, T) if small else gpu_rnn.make_problem(1024, 128, 64, T)
    )
    out = []
    for slots, policy, executor in CASES:

        def loss(p, xs, init, slots=slots, policy=policy, executor=executor):
            def step(c, x):
                return lstm_step(p, c, x)

            ys = memento.scan(step, init, xs, memory=slots, policy=policy, executor=executor)[1]
            return jnp.sum(ys)

        def step(c, x):
            return lstm_step(p, c, x)

        s = memento.loops.scan_schedule(step, init, xs, memory=slots, policy=policy)
        g = jax.jit(jax.grad(loss))
        t0 = time.perf_counter()
        jax.block_until_ready(g(p, xs, init))
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(g(p, xs, init))
            times.append(time.perf_counter() - t0)
        row = dict(slots=slots, policy=policy, executor=executor, planned=s.policy,
                   alpha=s.alpha, cost_per_step=s.cost / T, first_s=first,
                   steady_s=sorted(times)[2], backend=jax.default_backend())  # fmt: skip
        print(json.dumps(row), flush=True)
        out.append(row)
    Path(argv[0]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
