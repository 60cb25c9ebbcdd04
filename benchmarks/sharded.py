"""Budgeted gradients over 8 devices: memento against its peers, data and model parallel.

The question (issue: multi-device): when a long scan runs on a sharded batch (data
parallel) or a sharded hidden dimension (model parallel), does memento keep its memory
advantage per device, without adding collectives to the loops?

Workloads, each under ``jax.jit`` with ``NamedSharding`` inputs on 8 simulated CPU
devices (``--xla_force_host_platform_device_count=8``, set below before JAX starts):

- ``lstm``: an LSTM over T steps, a loss on every step;
- ``block``: a transformer-style residual block (attention over S tokens and an MLP)
  applied T times with shared weights (a scan over "layers").

Shardings: ``dp`` shards the batch over 8 devices; ``mp`` shards the hidden dimension
(the LSTM's gates and state, the block's MLP) over 8 devices, Megatron style.

Methods: ``lax.scan`` (stores everything), ``checkpoint/step`` (``lax.scan`` of
``jax.checkpoint(step)``), ``memento`` at a budget of T/8 carries (policy ``auto``) and
Equinox's checkpointed while loop with as many checkpoints. For each: per-device temp
memory (``memory_analysis``), collectives inside loops (from the compiled HLO, by kind),
and the median time of 5 round-robin runs, as ratios to ``lax.scan`` in one process.

Run:
    python benchmarks/sharded.py          # ~2-4 min on 2 cores
Writes benchmarks/results/sharded.json and sharded.md.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import memento
from memento_bench.hlo import loop_collectives

# -- workloads: (params, init, xs, step, shardings) ------------------------------------


def lstm(mode: str, T=128, B=256, H=128):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "wx": jax.random.normal(k[0], (H, 4 * H)) / H**0.5,
        "wh": jax.random.normal(k[1], (H, 4 * H)) / H**0.5,
        "b": jnp.zeros(4 * H),
    }
    xs = jax.random.normal(k[2], (T, B, H))
    init = (jnp.zeros((B, H)), jnp.zeros((B, H)))

    def step(p, carry, x):
        h, c = carry
        gates = (x @ p["wx"] + h @ p["wh"] + p["b"]).reshape(x.shape[0], 4, -1)
        i, f, g, o = (gates[:, j] for j in range(4))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), jnp.mean(h**2)

    if mode == "dp":
        spec = {"params": P(), "init": P("x"), "xs": P(None, "x")}
    else:  # hidden sharded: gate columns (per gate) and the state
        spec = {"params": {"wx": P(None, "x"), "wh": P(None, "x"), "b": P("x")},
                "init": P(None, "x"), "xs": P()}  # fmt: skip
    return params, init, xs, step, spec


def block(mode: str, T=32, B=32, S=16, D=64, F=256):
    k = jax.random.split(jax.random.PRNGKey(1), 5)
    params = {
        "qkv": jax.random.normal(k[0], (D, 3 * D)) / D**0.5,
        "w1": jax.random.normal(k[1], (D, F)) / D**0.5,
        "w2": jax.random.normal(k[2], (F, D)) / F**0.5,
    }
    xs = jax.random.normal(k[3], (T, B, 1, D)) * 0.1  # a per-layer input added to x
    init = jax.random.normal(k[4], (B, S, D))

    def step(p, x, u):
        q, kk, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        a = jax.nn.softmax(q @ jnp.swapaxes(kk, -1, -2) / D**0.5, axis=-1) @ v
        x = x + a + u
        x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
        x = x / (1 + jnp.mean(x**2, axis=-1, keepdims=True)) ** 0.5
        return x, jnp.mean(x**2)

    if mode == "dp":
        spec = {"params": P(), "init": P("x"), "xs": P(None, "x")}
    else:  # the MLP's hidden dimension sharded
        spec = {"params": {"qkv": P(), "w1": P(None, "x"), "w2": P("x", None)},
                "init": P(), "xs": P()}  # fmt: skip
    return params, init, xs, step, spec


# -- methods ------------------------------------------------------------------------


def scan_loss(scan):
    def loss(params, init, xs, step):
        _, ys = scan(functools.partial(step, params), init, xs)
        return jnp.sum(ys)

    return loss


def equinox_loss(checkpoints):
    import equinox.internal as eqxi

    def loss(params, init, xs, step):
        num_steps = xs.shape[0]

        def body(state):
            i, carry, total = state
            carry, y = step(params, carry, lax.dynamic_index_in_dim(xs, i, 0, keepdims=False))
            return i + 1, carry, total + y

        state = (jnp.int32(0), init, jnp.float32(0.0))
        return eqxi.while_loop(
            lambda s: s[0] < num_steps, body, state, max_steps=num_steps,
            kind="checkpointed", checkpoints=checkpoints,
        )[2]  # fmt: skip

    return loss


def methods(num_steps: int) -> dict:
    slots = max(2, num_steps // 8)
    return {
        "lax.scan": scan_loss(lax.scan),
        "checkpoint/step": scan_loss(lambda f, i, x: lax.scan(jax.checkpoint(f), i, x)),
        f"memento m={slots}": scan_loss(functools.partial(memento.scan, memory=slots)),
        f"equinox C={slots}": equinox_loss(slots),
    }


def put(tree, spec, mesh):
    return jax.tree_util.tree_map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
        tree,
        spec if isinstance(spec, dict) else jax.tree_util.tree_map(lambda _: spec, tree),
        is_leaf=lambda s: isinstance(s, P),
    )


def run(workload: str, mode: str, repeats: int) -> list[dict]:
    params, init, xs, step, spec = {"lstm": lstm, "block": block}[workload](mode)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    args = (
        put(params, spec["params"], mesh),
        put(init, spec["init"], mesh),
        put(xs, spec["xs"], mesh),
    )
    compiled = {}
    for name, loss in methods(xs.shape[0]).items():
        grad = jax.grad(lambda p, i, x, loss=loss: loss(p, i, x, step))
        compiled[name] = _common.compile_fn(grad, *args)
        print(f"  compiled {workload}/{mode} {name}", file=sys.stderr, flush=True)
    times = _common.time_round_robin({n: c.call for n, c in compiled.items()}, repeats=repeats)
    reference = compiled["lax.scan"]
    ref_types = {(k, t) for k, ts in loop_collectives(reference.hlo_body).items() for t in ts}
    rows = []
    for name, c in compiled.items():
        coll = loop_collectives(c.hlo_body)
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(
                jax.tree_util.tree_leaves(c.first_output),
                jax.tree_util.tree_leaves(reference.first_output),
            )
        )
        rows.append({
            "workload": workload, "mode": mode, "method": name,
            "temp_bytes_per_device": c.temp_bytes,
            "loop_collectives": {k: len(v) for k, v in coll.items()},
            # collectives in loops on values lax.scan's loops never exchange: what
            # storing states would add (recomputing a step repeats the body's own)
            "new_loop_collectives": sorted(
                {f"{k} {t}" for k, ts in coll.items() for t in ts} - {f"{k} {t}" for k, t in ref_types}
            ),
            "time_s": _common.median(times[name]), "times_s": times[name],
            "grad_error": err,
        })  # fmt: skip
    base = next(r for r in rows if r["method"] == "lax.scan")
    for r in rows:
        r["time_ratio"] = r["time_s"] / base["time_s"]
        r["memory_ratio"] = r["temp_bytes_per_device"] / max(base["temp_bytes_per_device"], 1)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| workload | sharding | method | temp / device | vs lax.scan | time | vs lax.scan "
        "| all-gather in loops | all-reduce in loops | not in lax.scan's loops | grad error |\n"
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n"
    )
    body = "".join(
        f"| {r['workload']} | {r['mode']} | {r['method']} | "
        f"{_common.mib(r['temp_bytes_per_device']):.2f} MiB | {r['memory_ratio']:.2f}x | "
        f"{r['time_s'] * 1e3:.0f} ms | {r['time_ratio']:.2f}x | "
        f"{r['loop_collectives']['all-gather']} | {r['loop_collectives']['all-reduce']} | "
        f"{', '.join(r['new_loop_collectives']) or 'none'} | {r['grad_error']:.1e} |\n"
        for r in rows
    )
    return head + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    assert jax.device_count() == 8, jax.devices()
    rows = []
    for workload in ("lstm", "block"):
        for mode in ("dp", "mp"):
            rows += run(workload, mode, args.repeats)
    md = table(rows)
    print(md)
    out = Path(args.out)
    _common.write_json(
        out / "sharded.json", {"benchmark": "sharded", "machine": _common.machine(), "rows": rows}
    )
    (out / "sharded.md").write_text("# benchmarks/sharded.py: 8 simulated CPU devices\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
