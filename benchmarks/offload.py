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

Device peaks (GPU): ``peak_bytes_in_use`` is a process-wide high-water mark, so
``--isolate`` runs each workload in its own process, and within one the budgets run from
the smallest up with ``lax.scan``'s reference last (see `run_case`). ``--time-budget``
stops starting new budgets (and workloads) once spent; the JSON is rewritten after each.

Run:
    /work/venv/bin/python benchmarks/offload.py --quick   # CPU, reduced sizes, ~1 min
    python benchmarks/offload.py --isolate --time-budget 60   # a GPU, bounded

Writes benchmarks/results/offload.json, or benchmarks/results/gpu/offload.json on a GPU
(``--out``). Never part of pytest.
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

    return _common.lstm_step, params, init, xs


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


def device_peak() -> int | None:
    """The device's high-water mark of allocated bytes (process-wide, never reset), where
    the backend reports one (GPUs; not the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def run_case(name, step, params, init, xs, fracs, cost_arg, repeats, log, deadline=math.inf):
    """One workload at each device budget; ``deadline`` (perf_counter) stops new budgets.

    Device peaks: ``peak_bytes_in_use`` is a high-water mark for the whole process, so
    the budgets run from the smallest up, ``recompute`` before ``offload`` at each, and
    ``lax.scan``'s reference gradient last; each reading is the mark after that method's
    compile, first call and timed runs (an upper bound on its own peak, equal to it where
    it rose above the earlier ones: ``device_peak_rose``).
    """
    steps = xs.shape[0]
    carry_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(init))
    t_step = step_seconds(step, params, init, xs)
    t_copy = transfer_seconds(carry_bytes) if jax.default_backend() != "cpu" else None
    cost = cost_arg if cost_arg is not None else (t_copy / 2 / t_step if t_copy else 0.5)
    rows, grads, last_peak = [], [], device_peak()
    for k, frac in enumerate(sorted(fracs)):
        if k and time.perf_counter() > deadline:  # the smallest budget always runs
            log(f"{name}: time budget spent, fraction {frac} and above not run")
            break
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
            info[method] = {
                "temp_bytes": compiled.temp_bytes,
                "host_pool_bytes": sim.peak_host_memory * carry_bytes,
                "policy": schedule.policy,
                "forward_evaluations": sim.forward_evaluations,
                "host_stores": sim.host_stores,
                "host_loads": sim.host_loads,
                "compile_s": compiled.compile_s,
            }
            grads.append((info[method], compiled.first_output))
            calls[method] = compiled.call
        times = _common.time_round_robin(calls, repeats=repeats)
        for method in methods:  # the marks after both were timed: the same for both
            info[method]["median_s"] = _common.median(times[method])
        peak = device_peak()
        for method in methods:
            info[method]["device_peak_bytes"] = peak
            info[method]["device_peak_rose"] = peak is not None and peak != last_peak
        last_peak = peak
        rows.append({"case": name, "steps": steps, "memory": m, "transfer_cost": cost, **info})
    # lax.scan's gradient last (it stores every step: the largest device memory)
    compiled = _common.compile_fn(gradient(step, params, init, xs), params, init, xs)
    reference = compiled.first_output
    ref_time = _common.median([_common.time_once(compiled.call) for _ in range(repeats)])
    for i, g in grads:
        i["canary_max_rel_vs_lax_scan"] = max_rel(g, reference)
    for row in rows:
        for method in ("recompute", "offload"):
            row[method]["time_vs_lax_scan"] = row[method]["median_s"] / ref_time
        log(
            f"{name} T={steps} m={row['memory']} c={cost:.3g}: recompute "
            f"{row['recompute']['median_s']:.4f}s ({row['recompute']['forward_evaluations']} "
            f"evals), offload {row['offload']['median_s']:.4f}s "
            f"({row['offload']['forward_evaluations']} evals, {row['offload']['host_stores']} "
            f"stores, host {row['offload']['host_pool_bytes'] / 2**20:.1f} MiB); device peak "
            f"{_mib(row['offload']['device_peak_bytes'])}; canary (max rel. vs lax.scan) "
            f"recompute {row['recompute']['canary_max_rel_vs_lax_scan']:.2e}, offload "
            f"{row['offload']['canary_max_rel_vs_lax_scan']:.2e}"
        )
    meta = {
        "case": name,
        "carry_bytes": carry_bytes,
        "step_s": t_step,
        "copy_s": t_copy,
        "lax_scan": {
            "median_s": ref_time,
            "temp_bytes": compiled.temp_bytes,
            "device_peak_bytes": device_peak(),
        },
    }
    log(
        f"{name} lax.scan: {ref_time:.4f}s, temp {compiled.temp_bytes / 2**20:.1f} MiB, device "
        f"peak {_mib(meta['lax_scan']['device_peak_bytes'])}"
    )
    return meta, rows


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def cases(quick: bool, key):
    if quick:
        return {
            "lstm": lambda: lstm(8, 32, 120, key),
            "transformer": lambda: transformer(16, 32, 60, key),
        }, (0.05, 0.2)
    return {
        "lstm": lambda: lstm(64, 1024, 1000, key),
        "transformer": lambda: transformer(512, 1024, 200, key),
    }, (0.02, 0.05, 0.2)


def isolated(a, argv) -> None:
    """Each workload in its own process (device peaks of one workload only); merged."""
    import json
    import os
    import subprocess
    import tempfile

    start = time.perf_counter()
    out = {"isolated": True, "cases": [], "rows": [], "failed": []}
    names = a.cases.split(",") if a.cases else list(cases(a.quick, None)[0])
    rest = [x for x in argv if x != "--isolate"]
    rest = [x for i, x in enumerate(rest) if not (x == "--out" or (i and rest[i - 1] == "--out"))]
    rest = [x for x in rest if not x.startswith("--out=")]
    for name in names:
        left = (a.time_budget or math.inf) - (time.perf_counter() - start)
        if left <= 0:
            out["failed"].append({"case": name, "error": "time budget spent before it"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "case.json"
            cmd = [sys.executable, __file__, *rest, "--cases", name, "--out", str(path)]
            if a.time_budget is not None:
                # no new budget in the last 12 s: lax.scan's reference and the JSON follow
                cmd += ["--time-budget", str(max(min(left, a.case_timeout) - 12, 1))]
            try:
                proc = subprocess.run(cmd, timeout=min(left + 3, a.case_timeout), env=os.environ)
                error = None if path.exists() else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                error = "timeout"
            if error:
                print(f"{name}: FAILED ({error})", flush=True)
                out["failed"].append({"case": name, "error": error})
                continue
            got = json.loads(path.read_text())
        out["machine"] = got["machine"]
        out["cases"] += got["cases"]
        out["rows"] += got["rows"]
        _common.write_json(a.out, out)
    print("wrote", _common.write_json(a.out, out))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU-sized run (about a minute)")
    p.add_argument("--transfer-cost", type=float, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", default=None, help="comma-separated: lstm, transformer")
    p.add_argument("--fracs", default=None, help="device budgets, fractions of T")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; no new budget after")
    p.add_argument("--isolate", action="store_true", help="each workload in its own process")
    p.add_argument("--case-timeout", type=float, default=300.0, help="with --isolate")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.out is None:
        a.out = str(Path(__file__).parent / "results" / "offload.json")
        if not a.quick and (a.isolate or jax.default_backend() == "gpu"):
            a.out = str(Path(__file__).parent / "results" / "gpu" / "offload.json")
    if a.isolate:  # the parent never starts a backend (it would hold the GPU's memory)
        return isolated(a, argv)
    deadline = time.perf_counter() + (a.time_budget or math.inf)
    builders, fracs = cases(a.quick, jax.random.key(0))
    if a.fracs:
        fracs = tuple(float(f) for f in a.fracs.split(","))
    names = a.cases.split(",") if a.cases else list(builders)
    out = {"machine": _common.machine(), "cases": [], "rows": []}
    print(f"devices: {jax.devices()}", flush=True)
    for name in names:
        if time.perf_counter() > deadline:
            print(f"{name}: time budget spent, not run", flush=True)
            continue
        meta, rows = run_case(
            name, *builders[name](), fracs, a.transfer_cost, a.repeats, print, deadline
        )
        out["cases"].append(meta)
        out["rows"].extend(rows)
        _common.write_json(a.out, out)
    print("wrote", _common.write_json(a.out, out))


if __name__ == "__main__":
    main()
