"""An LSTM's gradient through T steps on a GPU: device memory and time, method by method.

The question (issue 20): on an accelerator, what does each way of differentiating a long
loop cost in device memory and in time? An LSTM cell in plain ``jax.numpy`` (hidden
1024, batch 128, float32; inputs of width ``--input``), ``loss = sum_t mean(h_t**2)``,
gradient in the cell's parameters, T steps, for:

- ``lax.scan``: every step's residuals stored;
- ``lax.scan+ckpt``: ``jax.checkpoint`` on the step (one carry stored per step, each step
  recomputed once);
- ``nested sqrt(T)``: an outer scan of checkpointed inner scans of ~sqrt(T) steps;
- ``equinox F``: ``equinox.internal.while_loop(kind="checkpointed", checkpoints=F*T)``;
- ``memento F``: ``memento.scan(memory=round(F*T))`` (F*T carry-sized slots, the paper's
  m; ``policy="auto"``), F = 1%, 5%, 25% by default.

Measured for each (method, T), each in its own subprocess (``jax``'s
``peak_bytes_in_use`` is a process-wide high-water mark that cannot be reset), with a
per-case timeout so that one slow case cannot take the whole budget:

- ``peak_bytes``: ``jax.devices()[0].memory_stats()["peak_bytes_in_use"]`` after the
  first call and the timed runs (the inputs, parameters and gradients included; ``None``
  where the backend reports no stats, e.g. the CPU);
- ``temp_bytes``: ``memory_analysis().temp_size_in_bytes`` of the compiled gradient;
- ``first_s``: the first call (trace + plan + lower, compile, run), with ``lower_s`` and
  ``compile_s`` apart;
- ``steady_s``: the median of ``--repeats`` (>= 5) further calls, each ended by
  ``block_until_ready``;
- ``grad_max_rel``: the largest relative difference of the gradient from ``lax.scan``'s
  (max |a - b| / max |b| per leaf), where ``lax.scan`` ran at that T; where it did not,
  from ``lax.scan+ckpt``'s (``grad_ref`` names the reference; the table marks it "*").

``lax.scan`` (and ``lax.scan+ckpt``) is skipped at a T where its predicted memory, from
the per-step bytes measured by a probe (the compiled gradient's temporary bytes at two
small T), would exceed ``--device-bytes`` (80 GB by default, less 10% headroom); the
default list of T runs from 10^3 up to the first T past that point. Ratios are against
``lax.scan`` at the same T, measured in the same run-set on the same device.

    python benchmarks/gpu_rnn.py                          # a GPU; T = 1e3, 3e3, 1e4, 3e4
    python benchmarks/gpu_rnn.py --steps 1000,10000 --time-budget 150
    python benchmarks/gpu_rnn.py --quick                  # CPU, tiny sizes, < 1 min

Writes ``benchmarks/results/gpu/gpu_rnn.json`` (``--out``), rewritten after every case,
and prints a markdown table. Never part of pytest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gpu" / "gpu_rnn.json"
RESULT_TAG = "GPU_RNN_RESULT "
STORES_EVERY_STEP = ("lax.scan", "lax.scan+ckpt")


# --- the workload (imported by the children only: the parent never starts a backend) ---


def make_problem(hidden: int, batch: int, inputs: int, steps: int):
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "W": jax.random.normal(k1, (inputs, 4 * hidden), jnp.float32) / math.sqrt(inputs),
        "U": jax.random.normal(k2, (hidden, 4 * hidden), jnp.float32) / math.sqrt(hidden),
        "b": jnp.zeros(4 * hidden, jnp.float32),
    }
    xs = jax.random.normal(k3, (steps, batch, inputs), jnp.float32)
    init = (jnp.zeros((batch, hidden), jnp.float32), jnp.zeros((batch, hidden), jnp.float32))
    return params, xs, init


def segment_length(steps: int) -> int:
    """The divisor of ``steps`` closest to sqrt(steps) (the nested scans need one)."""
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - math.sqrt(steps)), d))


def make_loss(method: str, steps: int):
    """``loss(params, xs, init)`` for ``method``, and what the method keeps (a note)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from _common import lstm_step

    def body(params):
        return lambda carry, x: lstm_step(params, carry, x)

    if method == "lax.scan":
        return lambda p, xs, init: jnp.sum(lax.scan(body(p), init, xs)[1]), {}
    if method == "lax.scan+ckpt":
        return lambda p, xs, init: jnp.sum(lax.scan(jax.checkpoint(body(p)), init, xs)[1]), {}
    if method == "nested sqrt(T)":
        seg = segment_length(steps)

        def nested(p, xs, init):
            @jax.checkpoint
            def inner(carry, xs_seg):
                return lax.scan(body(p), carry, xs_seg)

            segments = xs.reshape(steps // seg, seg, *xs.shape[1:])
            return jnp.sum(lax.scan(inner, init, segments)[1])

        return nested, {"segment": seg}
    kind, frac = method.split(" ")
    slots = max(2, round(float(frac.rstrip("%")) / 100 * steps))
    if kind == "memento":
        import memento

        def mem(p, xs, init):
            return jnp.sum(memento.scan(body(p), init, xs, memory=slots)[1])

        return mem, {"slots": slots}
    if kind == "equinox":
        import equinox.internal as eqxi

        def eqx(p, xs, init):
            def step(state):
                i, carry, total = state
                x = lax.dynamic_index_in_dim(xs, i, 0, keepdims=False)
                carry, y = lstm_step(p, carry, x)
                return i + 1, carry, total + y

            _, _, total = eqxi.while_loop(
                lambda state: state[0] < steps,
                step,
                (jnp.int32(0), init, jnp.float32(0.0)),
                max_steps=steps,
                kind="checkpointed",
                checkpoints=slots,
            )
            return total

        return eqx, {"checkpoints": slots}
    raise ValueError(f"unknown method {method!r}")


def peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def run_case(method: str, steps: int, a) -> dict:
    """One (method, T) in this process: compile, first call, steady time, peak memory."""
    import jax

    sys.path.insert(0, str(HERE))
    import _common

    params, xs, init = make_problem(a.hidden, a.batch, a.input, steps)
    loss, extra = make_loss(method, steps)
    grad = jax.grad(loss)
    compiled, first = _common.first_call(grad, params, xs, init)
    mem = compiled.memory_analysis()
    times = [_common.time_once(lambda: compiled(params, xs, init)) for _ in range(a.repeats)]
    g = jax.block_until_ready(compiled(params, xs, init))
    peak, limit = peak_bytes()
    if a.grad_dir:
        np.savez(
            Path(a.grad_dir) / f"{safe(method)}_{steps}.npz",
            **{k: np.asarray(v) for k, v in g.items()},
        )
    return {
        "method": method,
        "steps": steps,
        **extra,
        "peak_bytes": peak,
        "bytes_limit": limit,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        **first,
        "steady_s": float(np.median(times)),
        "times_s": times,
    }


def probe(a) -> dict:
    """Temporary bytes of the stored-every-step gradients at two small T: bytes per step."""
    import jax

    out = {}
    for method in STORES_EVERY_STEP:
        temps = []
        for steps in (16, 32):
            params, xs, init = make_problem(a.hidden, a.batch, a.input, steps)
            loss, _ = make_loss(method, steps)
            c = jax.jit(jax.grad(loss)).lower(params, xs, init).compile()
            temps.append(int(c.memory_analysis().temp_size_in_bytes))
        per_step = (temps[1] - temps[0]) / 16
        out[method] = {"per_step_bytes": per_step, "fixed_bytes": temps[0] - 16 * per_step}
    out["input_bytes_per_step"] = a.batch * a.input * 4
    out["param_bytes"] = 4 * (a.input + a.hidden + 1) * 4 * a.hidden
    out["backend"] = jax.default_backend()
    out["devices"] = [f"{d} ({d.device_kind})" for d in jax.devices()]
    out["jax"] = jax.__version__
    return out


def predicted_bytes(info: dict, method: str, steps: int) -> float:
    """The memory of a stored-every-step method at ``steps``: temporaries, inputs, params,
    gradients."""
    p = info[method]
    return (
        p["fixed_bytes"]
        + p["per_step_bytes"] * steps
        + info["input_bytes_per_step"] * steps
        + 2 * info["param_bytes"]
    )


# --- the parent: cases as subprocesses -------------------------------------------------


def safe(method: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in method)


def child(args: list[str], timeout: float) -> tuple[dict | None, str]:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :]), ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return None, f"exit {proc.returncode}: " + " | ".join(tail)[-400:]


def max_rel(path: Path, reference: Path) -> float:
    a, b = np.load(path), np.load(reference)
    out = 0.0
    for k in b.files:
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
    return out


def fallback_errors(rows: list, steps: int, grad_dir: str) -> None:
    """Where lax.scan did not run at ``steps``: errors against ``lax.scan+ckpt`` (the same
    arithmetic as lax.scan's, each step recomputed once), marked by ``grad_ref``."""
    ref = Path(grad_dir) / f"{safe('lax.scan+ckpt')}_{steps}.npz"
    if (Path(grad_dir) / f"{safe('lax.scan')}_{steps}.npz").exists() or not ref.exists():
        return
    for row in rows:
        mine = Path(grad_dir) / f"{safe(row['method'])}_{steps}.npz"
        if row["steps"] == steps and "error" not in row and mine.exists():
            row["grad_max_rel"], row["grad_ref"] = max_rel(mine, ref), "lax.scan+ckpt"
            print(f"T={steps} {row['method']}: grad err vs lax.scan+ckpt {row['grad_max_rel']:.1e}")


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def ratio(row, ref, key):
    if ref is None or row.get(key) is None or not ref.get(key):
        return None
    return row[key] / ref[key]


def table_order(row: dict) -> tuple:
    kinds = ("lax.scan", "lax.scan+ckpt", "nested", "equinox", "memento")
    method = row["method"]
    kind = next((i for i, k in enumerate(kinds) if method.split(" ")[0] == k), len(kinds))
    frac = float(method.split(" ")[1].rstrip("%")) if kind in (3, 4) else 0.0
    return row["steps"], kind, frac


def markdown(out: dict) -> str:
    lines = [
        f"LSTM hidden {out['hidden']}, batch {out['batch']}, input {out['input']}, float32; "
        f"device: {', '.join(out['probe'].get('devices', []))}, jax "
        f"{out['probe'].get('jax')}; peak = device "
        "peak_bytes_in_use (each case its own process); ratios against lax.scan at that T.",
        "",
        "| T | method | kept | peak MiB | peak/lax | temp MiB | temp/lax | first s "
        "(lower, compile) | steady s | time/lax | grad rel err |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(out["rows"], key=table_order):
        ref = next(
            (
                x
                for x in out["rows"]
                if x["steps"] == r["steps"] and x["method"] == "lax.scan" and "error" not in x
            ),
            None,
        )
        kept = r.get("slots", r.get("checkpoints", r.get("segment", "")))
        if "error" in r:
            lines.append(f"| {r['steps']} | {r['method']} | {kept} | {r['error']} |||||||| ")
            continue
        mib = 2**-20
        lines.append(
            f"| {r['steps']} | {r['method']} | {kept} "
            f"| {fmt(r['peak_bytes'] and r['peak_bytes'] * mib, '.0f')} "
            f"| {fmt(ratio(r, ref, 'peak_bytes'), '.3f')} "
            f"| {r['temp_bytes'] * mib:.1f} | {fmt(ratio(r, ref, 'temp_bytes'), '.3f')} "
            f"| {r['first_s']:.2f} ({r['lower_s']:.2f}, {r['compile_s']:.2f}) "
            f"| {r['steady_s']:.4f} | {fmt(ratio(r, ref, 'steady_s'), '.2f')} "
            f"| {fmt(r.get('grad_max_rel'), '.1e')}"
            f"{'*' if r.get('grad_ref') == 'lax.scan+ckpt' else ''} |"
        )
    if any(r.get("grad_ref") == "lax.scan+ckpt" for r in out["rows"]):
        lines.append("\n\\* error against lax.scan+ckpt's gradient (lax.scan did not run there)")
    for note in out["notes"]:
        lines.append(f"\n{note}")
    return "\n".join(lines)


def default_steps(info: dict, device_bytes: float) -> list[int]:
    """1e3, 3e3, 1e4, ... up to the first T where lax.scan would not fit."""
    out, k = [], 0
    while True:
        steps = (1000, 3000)[k % 2] * 10 ** (k // 2)
        out.append(steps)
        if predicted_bytes(info, "lax.scan", steps) > 0.9 * device_bytes or steps >= 10**7:
            return out
        k += 1


def parent(a) -> int:
    start = time.perf_counter()
    budget = a.time_budget if a.time_budget is not None else math.inf
    common = [
        f"--hidden={a.hidden}",
        f"--batch={a.batch}",
        f"--input={a.input}",
        f"--repeats={a.repeats}",
    ]
    info, err = child(["--probe", *common], a.case_timeout)
    if info is None:
        print(f"probe failed: {err}", flush=True)
        return 1
    device_bytes = a.device_bytes
    if device_bytes is None:
        device_bytes = info["lax.scan"]["per_step_bytes"] * 200 if a.quick else 80e9
    steps_list = [int(float(s)) for s in a.steps.split(",")] if a.steps else None
    steps_list = steps_list or default_steps(info, device_bytes)
    # Run order: lax.scan first (the reference of the gradient errors), then memento,
    # then the others, so that a spent --time-budget cuts the peers first; the table
    # lists them in `table_order`.
    methods = ["lax.scan", *(f"memento {f:g}%" for f in a.memento)]
    methods += ["lax.scan+ckpt", "nested sqrt(T)", *(f"equinox {f:g}%" for f in a.equinox)]
    if a.methods:  # a follow-up run of some: a name, or its first word ("memento", "equinox")
        keep = a.methods.split(",")
        methods = [m for m in methods if m in keep or m.split()[0] in keep]
    out = {
        "benchmark": "gpu_rnn",
        "hidden": a.hidden,
        "batch": a.batch,
        "input": a.input,
        "repeats": a.repeats,
        "device_bytes": device_bytes,
        "case_timeout_s": a.case_timeout,
        "time_budget_s": a.time_budget,
        "python": sys.version.split()[0],
        "probe": info,
        "notes": [],
        "rows": [],
    }
    notes = out["notes"]
    print(
        f"probe: lax.scan {info['lax.scan']['per_step_bytes'] / 2**20:.2f} MiB/step, "
        f"lax.scan+ckpt {info['lax.scan+ckpt']['per_step_bytes'] / 2**20:.2f} MiB/step "
        f"({info['backend']}: {', '.join(info['devices'])}); T = {steps_list}",
        flush=True,
    )
    grad_dir = tempfile.mkdtemp(prefix="gpu_rnn_")
    for steps in steps_list:
        for method in methods:
            if method in STORES_EVERY_STEP:
                need = predicted_bytes(info, method, steps)
                if need > 0.9 * device_bytes:
                    note = (
                        f"T={steps}: {method} skipped, predicted {need / 1e9:.1f} GB > 90% of "
                        f"a {device_bytes / 1e9:.3g} GB device"
                    )
                    notes.append(note)
                    print(note, flush=True)
                    continue
            if method == "nested sqrt(T)" and segment_length(steps) == 1:
                continue
            elapsed = time.perf_counter() - start
            if elapsed > budget:
                note = f"time budget {budget:.0f} s spent ({elapsed:.0f} s): T={steps} {method} and later cases not run"
                notes.append(note)
                print(note, flush=True)
                break
            timeout = min(a.case_timeout, max(budget - elapsed, 5) + 5)
            t0 = time.perf_counter()
            row, err = child(
                ["--case", method, "--case-steps", str(steps), "--grad-dir", grad_dir, *common],
                timeout,
            )
            if row is None:
                row = {"method": method, "steps": steps, "error": err}
                print(f"T={steps} {method}: FAILED {err}", flush=True)
            else:
                ref = Path(grad_dir) / f"{safe('lax.scan')}_{steps}.npz"
                mine = Path(grad_dir) / f"{safe(method)}_{steps}.npz"
                if ref.exists() and mine.exists():
                    row["grad_max_rel"], row["grad_ref"] = max_rel(mine, ref), "lax.scan"
                peak = row["peak_bytes"]
                print(
                    f"T={steps} {method}: peak {fmt(peak and peak / 2**20, '.0f')} MiB, temp "
                    f"{row['temp_bytes'] / 2**20:.1f} MiB, first {row['first_s']:.2f} s "
                    f"(lower {row['lower_s']:.2f}, compile {row['compile_s']:.2f}), steady "
                    f"{row['steady_s']:.4f} s, grad err {fmt(row.get('grad_max_rel'), '.1e')} "
                    f"[{time.perf_counter() - t0:.1f} s wall]",
                    flush=True,
                )
            out["rows"].append(row)
            out["elapsed_s"] = time.perf_counter() - start
            write(a.out, out)
        else:
            fallback_errors(out["rows"], steps, grad_dir)
            continue
        fallback_errors(out["rows"], steps, grad_dir)
        break
    for p in Path(grad_dir).glob("*.npz"):
        p.unlink()
    os.rmdir(grad_dir)
    out["elapsed_s"] = time.perf_counter() - start
    path = write(a.out, out)
    print()
    print(markdown(out))
    print(f"\nwrote {path} ({out['elapsed_s']:.0f} s)")
    return 0


def write(path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", help="comma-separated T (default: 1e3, 3e3, ... past lax.scan's)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--input", type=int, default=64, help="input width (inputs are T x B x this)")
    p.add_argument("--memento", default="1,5,25", help="memento's memory, %% of T slots")
    p.add_argument("--equinox", default="5", help="equinox's checkpoints, %% of T")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", help="comma-separated methods or first words to run (default: all)")
    p.add_argument("--device-bytes", type=float, default=None, help="default 80e9")
    p.add_argument("--case-timeout", type=float, default=120.0)
    p.add_argument("--time-budget", type=float, default=None, help="seconds; no new case after")
    p.add_argument("--quick", action="store_true", help="tiny sizes, runs on a CPU")
    p.add_argument("--out", default=None)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--case-steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grad-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats < 5:
        p.error("--repeats must be >= 5")
    if a.quick:
        a.hidden, a.batch, a.input = 32, 8, 8
        a.steps = a.steps or "100,400"
    a.memento = [float(x) for x in a.memento.split(",") if x]
    a.equinox = [float(x) for x in a.equinox.split(",") if x]
    if a.out is None:
        a.out = str(HERE / "results" / "gpu_rnn_cpu_quick.json") if a.quick else str(RESULTS)
    if a.probe:
        print(RESULT_TAG + json.dumps(probe(a)), flush=True)
        return 0
    if a.case:
        print(RESULT_TAG + json.dumps(run_case(a.case, a.case_steps, a)), flush=True)
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
