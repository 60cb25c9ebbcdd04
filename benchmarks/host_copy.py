"""Time to copy one slot between the device and pinned host memory, by size.

GitHub issue 24: a two-level plan's executor issues each host copy from the row that
needs it, not ahead of it. What a prefetch could save is at most the copies' time, so
this measures it: ``jax.device_put`` of a float32 array to the device's ``pinned_host``
memory and back, eagerly, each ended by ``jax.block_until_ready``, the best of
``--repeats``. Where the backend has no ``pinned_host`` memory it says so and exits (on
CPU the host memory is the same RAM: the numbers are a copy's, not a transfer's).

Run:  python benchmarks/host_copy.py [--out FILE] [--mib 0.5,2,8,64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_copy.json"))
    parser.add_argument("--mib", default="0.5,2,8,64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    try:
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        jax.block_until_ready(jax.device_put(jnp.ones(4), host))
    except Exception as e:  # any failure means: no pinned host memory here
        print(f"no pinned_host memory on {dev}: {type(e).__name__}: {e}")
        return 0
    rows = []
    for mib in (float(m) for m in args.mib.split(",")):
        x = jax.device_put(jnp.ones(int(mib * 2**20 / 4), jnp.float32), device)
        h = jax.block_until_ready(jax.device_put(x, host))
        out = min(
            _common.time_once(lambda x=x: jax.device_put(x, host)) for _ in range(args.repeats)
        )
        back = min(
            _common.time_once(lambda h=h: jax.device_put(h, device)) for _ in range(args.repeats)
        )
        row = {"MiB": mib, "to_host_us": out * 1e6, "to_device_us": back * 1e6,
               "to_host_GBps": mib * 2**20 / out / 1e9, "to_device_GBps": mib * 2**20 / back / 1e9}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    _common.write_json(args.out, {"machine": _common.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
