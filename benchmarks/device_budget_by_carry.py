"""Device temporary bytes of one- and two-level plans, in carries, by carry size.

GitHub issue 24. `benchmarks/device_budget.py` measures a 512-byte carry, where an
executor's control state (the schedule's int32 rows, counters) is worth many carries. This
measures the gradient of a 200-step elementwise ``tanh`` scan and ``while_loop`` at 4
device slots, one-level (what ``auto`` runs, and the rows forced for the scan) and with 5
and 20 host slots, at carries of 64, 4096 and 65536 floats: ``temp`` is the device's
temporary bytes (on the CPU they include the host pools, which are the same RAM),
``host_temp`` the host's where the backend reports them apart (a GPU).

Run:  python benchmarks/device_budget_by_carry.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp

import memento

CASES = {
    "one": dict(memory=4),
    "one_rows": dict(memory=4, executor="rows"),  # scan only
    "host5": dict(memory=4, host_memory=5),
    "host20": dict(memory=4, host_memory=20),
}


def loss_of(loop: str, n: int, kw: dict):
    W = jnp.full((n,), 0.5)
    if loop == "scan":
        xs = jnp.full((200, 1), 0.01)
        kw = {**kw, "transfer_cost": 0.5} if "host_memory" in kw else kw

        def cell(c, x):
            return jnp.tanh(W * c + x), None

        return lambda h: jnp.sum(memento.scan(cell, h, xs, **kw)[0])

    def body(s):
        return s[0] + 1, jnp.tanh(W * s[1] + 0.01)

    def loss(h):
        return jnp.sum(
            memento.while_loop(lambda s: s[0] < 200, body, (0, h), max_steps=200, **kw)[1]
        )

    return loss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).parent / "results" / "device_budget_by_carry.json"
    parser.add_argument("--out", default=str(default))
    args = parser.parse_args(argv)
    rows = []
    for n in (64, 4096, 65536):
        carry = n * jnp.ones(()).dtype.itemsize
        for loop in ("scan", "while"):
            for case, kw in CASES.items():
                if loop == "while" and "executor" in kw:
                    continue
                h0 = jnp.ones(n)
                mem = jax.jit(jax.grad(loss_of(loop, n, kw))).lower(h0).compile().memory_analysis()
                temp = int(mem.temp_size_in_bytes)
                host = int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)
                rows.append({"n": n, "carry_bytes": int(carry), "loop": loop, "case": case,
                             "temp": temp, "host_temp": host, "temp_in_carries": temp / carry})  # fmt: skip
                print(rows[-1], flush=True)
    _common.write_json(args.out, {"machine": _common.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
