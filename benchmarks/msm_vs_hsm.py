"""MSM against HSM on the rows, by body: does MSM's saving in evaluations show in time?

``policy="auto"`` picks MSM over HSM when it makes fewer forward evaluations, plus a
charge per internal state stored (`memento.planning.Charges`). This benchmark checks that
choice on CPU across bodies: the gradient of ``memento.scan`` with ``policy="hsm"`` and
``policy="msm"``, both on the rows executor (which runs HSM below 2^16 steps on CPU),
timed round-robin in one process (median of ``--repeats``), one XLA thread, at 20 and
100 slots:

- ``matvec{w}``: ``tanh(W @ h + x)``, ``W`` (w x w) closed over and differentiated;
- ``lstm{H}x{B}``: the ``gpu_rnn.py`` LSTM step with hidden H, batch B, input 16.

Each row records both plans' evaluations a step, ``auto``'s pick and the time ratio
MSM / HSM (below 1: MSM is faster, as its evaluations predict).

Run:  PYTHONPATH=src python benchmarks/msm_vs_hsm.py [--repeats 9] [--out PATH]
Writes benchmarks/results/msm_vs_hsm.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common

SLOTS = (20, 100)


def _problems():
    """``(name, step(p, c, x), p, xs, init, T)`` for each body."""
    import jax
    import jax.numpy as jnp

    import gpu_rnn

    for w in (4, 16, 64, 256):
        T = 10**4 if w <= 64 else 2000
        W = jax.random.normal(jax.random.PRNGKey(0), (w, w)) * 0.5 / w**0.5
        xs, h = jnp.full((T, w), 1e-3), jnp.ones(w)
        yield f"matvec{w}", (lambda W, c, x: (jnp.tanh(W @ c + x), c.sum())), W, xs, h, T
    for H, B in ((32, 8), (64, 16), (256, 32)):
        T = 2000
        p, xs, init = gpu_rnn.make_problem(H, B, 16, T)
        yield f"lstm{H}x{B}", _common.lstm_step, p, xs, init, T


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "msm_vs_hsm.json"))
    args = ap.parse_args(argv)
    _common.use_one_thread()
    import jax
    import jax.numpy as jnp

    import memento

    rows = []
    for name, f, p, xs, init, T in _problems():
        for slots in SLOTS:
            calls, plans = {}, {}
            for policy in ("hsm", "msm", "auto"):

                def step(c, x, f=f, p=p):
                    return f(p, c, x)

                plans[policy] = memento.loops.scan_schedule(
                    step, init, xs, memory=slots, policy=policy, executor="rows"
                )
                if policy == "auto":
                    continue

                def loss(p, xs, init, policy=policy, slots=slots, f=f):
                    ys = memento.scan(
                        lambda c, x: f(p, c, x), init, xs, memory=slots, policy=policy,
                        executor="rows",
                    )[1]  # fmt: skip
                    return jnp.sum(ys)

                g = jax.jit(jax.grad(loss))
                jax.block_until_ready(g(p, xs, init))
                calls[policy] = lambda g=g, p=p, xs=xs, init=init: jax.block_until_ready(
                    g(p, xs, init)
                )
            times = {
                k: _common.median(v)
                for k, v in _common.time_round_robin(calls, repeats=args.repeats).items()
            }
            row = dict(
                body=name, T=T, slots=slots, alpha=plans["msm"].alpha,
                auto=plans["auto"].policy,
                hsm_per_step=plans["hsm"].cost / T, msm_per_step=plans["msm"].cost / T,
                hsm_s=times["hsm"], msm_s=times["msm"], msm_vs_hsm=times["msm"] / times["hsm"],
            )  # fmt: skip
            print(
                f"{name:11s} T={T:5d} slots={slots:3d} alpha={row['alpha']} auto={row['auto']}"
                f" HSM {row['hsm_per_step']:.2f}/step {times['hsm'] * 1e3:8.2f} ms"
                f"  MSM {row['msm_per_step']:.2f}/step {times['msm'] * 1e3:8.2f} ms"
                f"  MSM/HSM {row['msm_vs_hsm']:.2f}",
                flush=True,
            )
            rows.append(row)
    _common.write_json(args.out, {"machine": _common.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
