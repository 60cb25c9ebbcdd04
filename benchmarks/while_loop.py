"""The comparison of Equinox's design note "Bounded while loop" (Kidger), measured.

Time, compile size, memory and evaluation counts of each implementation.

Methods (max_steps m = b**d, b = 16, d = 3 unless told otherwise):

- ``scan_cond``: one ``lax.scan`` of m steps, each ``lax.cond(pred, body, identity)``;
- ``nested_scan_cond``: d nested scans of b, a ``cond`` at every level skips a finished
  block;
- ``sqrt_checkpoint``: a scan of sqrt(m) blocks, each a ``jax.checkpoint`` of a scan-cond
  of sqrt(m) steps;
- ``nested_checkpoint``: as ``nested_scan_cond`` with ``jax.checkpoint`` around each
  nested block (the note's implementation 5);
- ``equinox``: ``equinox.internal.while_loop(kind="checkpointed", checkpoints=c)``;
- ``memento``: ``memento.while_loop(max_steps=m, memory=c)``, with the same c.

Bodies: an explicit RK4 step of a small MLP vector field ("ode") and an LSTM step.
For n << m and n close to m, it measures: the primal ("forward") and gradient
("backward", forward and backward passes) times, the gradient's compile time, HLO lines
and temporary memory, and for equinox and memento the counted body evaluations of one
gradient (forward, recomputation and VJP alike).

Run:  PYTHONPATH=src python benchmarks/while_loop.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common

_common.use_one_thread()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import memento  # noqa: E402
from memento import planning  # noqa: E402

# ----------------------------------------------------------------------------------- bodies


def ode_body(size=32, hidden=64, seed=0):
    """RK4 step of dy/dt = W2 tanh(W1 y + b1) + b2; params closed over by the caller."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "w1": jax.random.normal(k[0], (hidden, size)) / math.sqrt(size),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k[1], (size, hidden)) / math.sqrt(hidden),
        "b2": jnp.zeros(size),
    }
    y0 = jax.random.normal(k[2], (size,))

    def step(params, y):
        def f(y):
            return params["w2"] @ jnp.tanh(params["w1"] @ y + params["b1"]) + params["b2"]

        dt = 0.01
        k1 = f(y)
        k2 = f(y + dt / 2 * k1)
        k3 = f(y + dt / 2 * k2)
        k4 = f(y + dt * k3)
        return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)

    return params, y0, step


def lstm_body(size=64, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "w": jax.random.normal(k[0], (4 * size, 2 * size)) / math.sqrt(2 * size),
        "b": jnp.zeros(4 * size),
    }
    x = jax.random.normal(k[1], (size,))
    state0 = (jax.random.normal(k[2], (size,)) * 0.1, jnp.zeros(size))

    def step(params, state):
        h, c = state
        z = params["w"] @ jnp.concatenate([x, h]) + params["b"]
        i, f, g, o = jnp.split(z, 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return h, c

    return params, state0, step


# ---------------------------------------------------------------------------------- methods
# Every method maps (step, params, init, n, m) to the final state of "while i < n: step".


def scan_cond(step, params, init, n, m, **_):
    def one(s, _):
        i, y = s
        y = lax.cond(i < n, lambda y: step(params, y), lambda y: y, y)
        return (i + 1, y), None

    return lax.scan(one, (0, init), None, length=m)[0][1]


def _nested(step, params, init, n, b, d, checkpoint):
    def level(k):
        size = b**k  # steps per block at this level

        def block(s):
            if k == 0:
                i, y = s
                return i + 1, step(params, y)
            inner = level(k - 1)
            if checkpoint:
                inner = jax.checkpoint(inner)

            def one(s, _):
                return lax.cond(s[0] < n, inner, lambda s: s, s), None

            return lax.scan(one, s, None, length=b)[0]

        del size
        return block

    top = level(d)
    return top((0, init))[1]


def nested_scan_cond(step, params, init, n, m, b=16, d=3, **_):
    return _nested(step, params, init, n, b, d, checkpoint=False)


def nested_checkpoint(step, params, init, n, m, b=16, d=3, **_):
    return _nested(step, params, init, n, b, d, checkpoint=True)


def sqrt_checkpoint(step, params, init, n, m, **_):
    r = math.isqrt(m)

    @jax.checkpoint
    def block(s):
        def one(s, _):
            i, y = s
            y = lax.cond(i < n, lambda y: step(params, y), lambda y: y, y)
            return (i + 1, y), None

        return lax.scan(one, s, None, length=r)[0]

    def outer(s, _):
        return lax.cond(s[0] < n, block, lambda s: s, s), None

    return lax.scan(outer, (0, init), None, length=m // r)[0][1]


def equinox(step, params, init, n, m, c, **_):
    import equinox.internal as eqxi

    def body(s):
        i, y = s
        return i + 1, step(params, y)

    out = eqxi.while_loop(
        lambda s: s[0] < n, body, (0, init), max_steps=m, kind="checkpointed", checkpoints=c
    )
    return out[1]


def memento_loop(step, params, init, n, m, c, **_):
    def body(s):
        i, y = s
        return i + 1, step(params, y)

    return memento.while_loop(lambda s: s[0] < n, body, (0, init), max_steps=m, memory=c)[1]


METHODS = {
    "scan_cond": scan_cond,
    "nested_scan_cond": nested_scan_cond,
    "sqrt_checkpoint": sqrt_checkpoint,
    "nested_checkpoint": nested_checkpoint,
    "equinox": equinox,
    "memento": memento_loop,
}


def _loss(method, step, m, c):
    def loss(params, init, n):
        out = METHODS[method](step, params, init, n, m, c=c)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree_util.tree_leaves(out))

    return loss


def count_evaluations(method, step, params, init, ns, m, c) -> dict[int, int]:
    """Body evaluations of one gradient (debug callback in the step)."""
    counts = [0]

    def bump():
        counts[0] += 1

    def counted(params, y):
        jax.debug.callback(bump)
        return step(params, y)

    grad = jax.jit(jax.grad(_loss(method, counted, m, c)))
    out = {}
    for n in ns:
        jax.block_until_ready(grad(params, init, jnp.int32(n)))
        counts[0] = 0
        jax.block_until_ready(grad(params, init, jnp.int32(n)))
        out[n] = counts[0]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m = 8**3 and fewer repeats")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "while_loop.json"))
    ap.add_argument("--memory", type=int, default=48, help="checkpoints c (default d*b)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    args = ap.parse_args(argv)
    b, d = (8, 3) if args.quick else (16, 3)
    m = b**d
    c = args.memory
    ns = {"n<<m": m // 16, "n~m": m - m // 64}
    bodies = {"ode": ode_body(), "lstm": lstm_body()}
    rows = []
    for body_name, (params, init, step) in bodies.items():
        for method in args.methods:
            loss = _loss(method, step, m, c)
            if method in ("nested_scan_cond", "nested_checkpoint"):
                loss = _loss_nested(method, step, m, c, b, d)
            n0 = ns["n<<m"]
            fwd, _ = _compile(loss, params, init, n0)
            grad, stats = _compile(jax.grad(loss), params, init, n0)
            counts = {}
            if method in ("equinox", "memento"):
                counts = count_evaluations(method, step, params, init, list(ns.values()), m, c)
            for label, n in ns.items():
                a = (params, init, jnp.int32(n))
                times = _common.time_round_robin(
                    {"forward": lambda a=a, f=fwd: f(*a), "backward": lambda a=a, g=grad: g(*a)},
                    repeats=args.repeats,
                )
                row = {
                    "body": body_name,
                    "method": method,
                    "case": label,
                    "n": n,
                    "max_steps": m,
                    "checkpoints": c,
                    "forward_s": _common.median(times["forward"]),
                    "backward_s": _common.median(times["backward"]),
                    "compile_s": stats["compile_s"],
                    "hlo_lines": stats["hlo_lines"],
                    "temp_mib": _common.mib(stats["temp_bytes"]),
                    "evaluations": counts.get(n),
                    "model": planning.online_evaluations(c, n, m) if method == "memento" else None,
                }
                rows.append(row)
                print(_fmt(row), flush=True)
    _common.write_json(args.out, {"machine": _common.machine(), "rows": rows})
    print(f"wrote {args.out}")


def _loss_nested(method, step, m, c, b, d):
    fn = METHODS[method]

    def loss(params, init, n):
        out = fn(step, params, init, n, m, b=b, d=d)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree_util.tree_leaves(out))

    return loss


def _compile(f, *args):
    """Compiles ``f`` once (n is a runtime int32); returns it with its static measurements."""
    args = (*args[:-1], jnp.int32(args[-1]))
    start = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    return compiled, {
        "compile_s": compile_s,
        "hlo_lines": len(compiled.as_text().splitlines()),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    }


def _fmt(r) -> str:
    ev = "" if r["evaluations"] is None else f" evals={r['evaluations']}"
    return (
        f"{r['body']:5s} {r['method']:18s} {r['case']:5s} n={r['n']:5d} "
        f"fwd={r['forward_s'] * 1e3:8.1f}ms bwd={r['backward_s'] * 1e3:8.1f}ms "
        f"compile={r['compile_s']:5.1f}s hlo={r['hlo_lines']:6d} "
        f"temp={r['temp_mib']:8.2f}MiB{ev}"
    )


if __name__ == "__main__":
    main()
