"""The device budget of a two-level plan, on the backend at hand (GitHub issue 24).

On one H200 (jax 0.11.2) a gradient with host slots took more device temporary memory
than the one-level plan at the same device slots: 1.9x in `tests/loops/test_scan_host.py`'s
case, +53% and +27% in two of `benchmarks/offload.py`'s workloads, where the one-level
plan was HSM and the two-level one MSM. This separates the candidate causes in one run:
the same case (a 64-float ``tanh(W @ c + x)`` cell with outputs, 200 steps, float64,
4 device slots) compiled one-level under ``hsm``, ``msm`` and ``auto``, and two-level
with 5, 20 and unbounded host slots. For each: XLA's device and host temporary bytes
(``memory_analysis()``), the plan's policy, its simulated peaks and evaluations, and the
number of host placements in the optimised HLO. On CPU the host pools are counted with
the device's (the same RAM); on a GPU they should not be.

Run:  PYTHONPATH=src python benchmarks/device_budget.py [--out PATH] [--hlo DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp

import memento

CASES = {
    "one-level hsm": dict(memory=4, policy="hsm", executor="rows"),
    "one-level hsm recursion": dict(memory=4, policy="hsm", executor="recursion"),
    "one-level msm": dict(memory=4, policy="msm"),
    "one-level auto": dict(memory=4),
    "one-level auto rows": dict(memory=4, executor="rows"),
    "host 5": dict(memory=4, host_memory=5, transfer_cost=0.5),
    "host 20": dict(memory=4, host_memory=20, transfer_cost=0.5),
    "host unbounded": dict(memory=4, host_memory=math.inf, transfer_cost=0.5),
}


def measure(hlo_dir: Path | None) -> list[dict]:
    W = jnp.eye(64) * 0.5
    f = lambda c, x: (jnp.tanh(W @ c + x), jnp.sum(c))  # noqa: E731
    h0, xs = jnp.ones(64), jnp.ones((200, 64)) * 0.01
    rows = []
    for name, kw in CASES.items():
        g = jax.jit(jax.grad(lambda h, x, kw=kw: jnp.sum(memento.scan(f, h, x, **kw)[1])))
        compiled = g.lower(h0, xs).compile()
        mem = compiled.memory_analysis()
        text = compiled.as_text()
        schedule = memento.loops.scan_schedule(f, h0, xs, **kw)
        replay = schedule.simulate()
        row = {
            "case": name,
            "policy": schedule.policy,
            "temp_bytes": int(mem.temp_size_in_bytes),
            "host_temp_bytes": int(getattr(mem, "host_temp_size_in_bytes", 0) or 0),
            "carry_bytes": 64 * 8,
            "peak_slots": replay.peak_memory,
            "peak_host_slots": replay.peak_host_memory,
            "evaluations": replay.forward_evaluations,
            "hlo_host_placements": text.count("pinned_host") + text.count("S(5)"),
        }
        rows.append(row)
        print(row, flush=True)
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            (hlo_dir / f"{name.replace(' ', '_')}.txt").write_text(text)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON (default: results/device_budget.json)")
    parser.add_argument("--hlo", default=None, help="a folder for each case's optimised HLO")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    backend = jax.default_backend()
    default = Path(__file__).parent / "results" / ("gpu" if backend == "gpu" else "")
    out = Path(args.out) if args.out else default / "device_budget.json"
    rows = measure(Path(args.hlo) if args.hlo else None)
    _common.write_json(
        out, {"machine": _common.machine(), "git": _common.git_state(), "rows": rows}
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
