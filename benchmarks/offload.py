"""Host memory against recomputation: `memento.scan(host_memory=)` at equal device memory.

The question (issue 24): at a fixed device budget of m carry-sized slots, how does the
two-level plan (device slots, host slots, transfers overlapped with compute) compare in
time with the recompute-only plan of the same device budget?

Workloads: an LSTM cell (batch x hidden) and a transformer block (pre-norm attention and
MLP on a (tokens, width) carry), T steps each, a loss on every output. For each, at each
device budget m (a fraction of T):

- ``recompute``: `memento.scan(memory=m)`, the one-level optimal plan;
- ``offload``: `memento.scan(memory=m, host_memory=math.inf, transfer_cost=c)`, the
  two-level plan; ``c`` is ``--transfer-cost`` (forward-step units per carry slot), or on
  a GPU measured: carry bytes / measured host-to-device bandwidth / measured step time.

Reported: XLA's temporary bytes of the jitted gradient (``memory_analysis``: on the CPU,
host memory is the same RAM and XLA:CPU counts the host pools there too), the host pools'
bytes (the schedule's peak host slots x carry bytes), the device's peak bytes where the
backend reports them (``memory_stats``, GPU), forward evaluations and host copies of the
schedule, the median time (round-robin, `_common`), and a canary for openxla/xla#46231
(wrong gradients with offloaded scan residuals on GPU, fixed in July 2026): each
gradient's largest relative difference from ``lax.scan``'s.

Run:
    /work/venv/bin/python benchmarks/offload.py --quick   # CPU, reduced sizes, ~1 min
    /work/venv/bin/python benchmarks/offload.py           # GPU sizes

Writes benchmarks/results/offload.json (``--out``). Never part of pytest.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
import _common
import memento


def lstm(batch: int, hidden: int, steps: int, key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "W": jax.random.normal(k1, (hidden, 4 * hidden)) / math.sqrt(hidden),
        "U": jax.random.normal(k2, (hidden, 4 * hidden)) / math.sqrt(hidden),
        "b": jnp.zeros(4 * hidden),
    }
    xs = jax.random.normal(k3, (steps, batch, hidden))
    init = (jnp.zeros((batch, hidden)), jnp.zeros((batch, hidden)))

    def step(params, carry, x):
        h, c = carry
        z = x @ params["W"] + h @ params["U"] + params["b"]
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), jnp.mean(h**2)

    return step, params, init, xs


def transformer(tokens: int, width: int, steps: int, key):
    ks = jax.random.split(key, 5)
    s = 1 / math.sqrt(width)
    params = {
        "qkv": jax.random.normal(ks[0], (width, 3 * width)) * s,
        "out": jax.random.normal(ks[1], (width, width)) * s,
        "up": jax.random.normal(ks[2], (width, 4 * width)) * s,
        "down": jax.random.normal(ks[3], (4 * width, width)) * s / 2,
    }
    xs = jax.random.normal(ks[4], (steps, tokens, width)) * 0.1
    init = jnp.zeros((tokens, width))

    def norm(x):
        return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)

    def step(params, h, x):
        h = h + x
        q, k, v = jnp.split(norm(h) @ params["qkv"], 3, axis=-1)
        a = jax.nn.softmax(q @ k.T / math.sqrt(width), axis=-1)
        h = h + (a @ v) @ params["out"]
        h = h + jax.nn.gelu(norm(h) @ params["up"]) @ params["down"]
        return h, jnp.mean(h**2)

    return step, params, init, xs


def gradient(step, params, init, xs, **kw):
    def loss(params, init, xs):
        scan = memento.scan if kw else lax.scan
        _, ys = scan(lambda c, x: step(params, c, x), init, xs, **kw)
        return jnp.sum(ys)

    return jax.grad(loss, argnums=(0, 1))


def step_seconds(step, params, init, xs) -> float:
    f = jax.jit(lambda c, x: step(params, c, x))
    x0 = xs[0]
    jax.block_until_ready(f(init, x0))
    return _common.median([_common.time_once(lambda: f(init, x0)) for _ in range(20)])


def transfer_seconds(nbytes: int) -> float | None:
    """Seconds to copy ``nbytes`` to pinned host memory and back, where there is one."""
    try:
        host = jax.devices()[0].memory("pinned_host")
    except Exception:
        return None
    x = jnp.ones(max(nbytes // 4, 1), jnp.float32)
    dev = jax.devices()[0]
    to_host = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind=host.kind))
    jax.block_until_ready(to_host)
    start = time.perf_counter()
    for _ in range(5):
        y = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind=host.kind))
        jax.block_until_ready(y)
    return (time.perf_counter() - start) / 5


def max_rel(a, b) -> float:
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
    return out


def run_case(name, step, params, init, xs, fracs, cost_arg, repeats, log):
    steps = xs.shape[0]
    carry_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(init))
    t_step = step_seconds(step, params, init, xs)
    t_copy = transfer_seconds(carry_bytes) if jax.default_backend() != "cpu" else None
    cost = cost_arg if cost_arg is not None else (t_copy / 2 / t_step if t_copy else 0.5)
    reference = jax.jit(gradient(step, params, init, xs))(params, init, xs)
    rows = []
    for frac in fracs:
        m = max(2, round(frac * steps))
        methods = {
            "recompute": dict(memory=m),
            "offload": dict(memory=m, host_memory=math.inf, transfer_cost=cost),
        }
        calls, info = {}, {}
        for method, kw in methods.items():
            g = gradient(step, params, init, xs, **kw)
            compiled = _common.compile_fn(g, params, init, xs)
            schedule = memento.loops.scan_schedule(lambda c, x: step(params, c, x), init, xs, **kw)
            sim = schedule.simulate()
            peak = None
            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                peak = stats["peak_bytes_in_use"]
            info[method] = {
                "temp_bytes": compiled.temp_bytes,
                "host_pool_bytes": sim.peak_host_memory * carry_bytes,
                "device_peak_bytes": peak,
                "policy": schedule.policy,
                "forward_evaluations": sim.forward_evaluations,
                "host_stores": sim.host_stores,
                "host_loads": sim.host_loads,
                "compile_s": compiled.compile_s,
                "canary_max_rel_vs_lax_scan": max_rel(compiled.first_output, reference),
            }
            calls[method] = compiled.call
        times = _common.time_round_robin(calls, repeats=repeats)
        for method in methods:
            info[method]["median_s"] = _common.median(times[method])
        row = {"case": name, "steps": steps, "memory": m, "transfer_cost": cost, **info}
        rows.append(row)
        log(
            f"{name} T={steps} m={m} c={cost:.3g}: recompute {info['recompute']['median_s']:.4f}s"
            f" ({info['recompute']['forward_evaluations']} evals), offload "
            f"{info['offload']['median_s']:.4f}s ({info['offload']['forward_evaluations']} "
            f"evals, {info['offload']['host_stores']} stores); canary "
            f"{info['offload']['canary_max_rel_vs_lax_scan']:.2e}"
        )
    return {"case": name, "carry_bytes": carry_bytes, "step_s": t_step, "copy_s": t_copy}, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU-sized run (about a minute)")
    p.add_argument("--transfer-cost", type=float, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "offload.json"))
    a = p.parse_args(argv)
    key = jax.random.key(0)
    if a.quick:
        cases = [
            ("lstm", *lstm(8, 32, 120, key)),
            ("transformer", *transformer(16, 32, 60, key)),
        ]
        fracs = (0.05, 0.2)
    else:
        cases = [
            ("lstm", *lstm(64, 1024, 1000, key)),
            ("transformer", *transformer(512, 1024, 200, key)),
        ]
        fracs = (0.02, 0.05, 0.2)
    out = {"machine": _common.machine(), "cases": [], "rows": []}
    for name, step, params, init, xs in cases:
        meta, rows = run_case(
            name, step, params, init, xs, fracs, a.transfer_cost, a.repeats, print
        )
        out["cases"].append(meta)
        out["rows"].extend(rows)
    print("wrote", _common.write_json(a.out, out))


if __name__ == "__main__":
    main()
