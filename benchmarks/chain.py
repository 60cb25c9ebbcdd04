"""Heterogeneous chains: `memento.chain` against JAX's rematerialisation, in one process.

The question (issue 14): for networks whose layers differ in cost and size, how much
memory and time does ``jax.jit(jax.grad(loss))`` take with `memento.chain` at several
budgets, and how does that compare with the usual ways of saving memory?

Stacks (float32, small enough for two CPU cores):

- ``resnet``: a strided CNN, a stem and 12 residual blocks in four stages (32x32x16 down
  to 4x4x128: states 2x smaller per stage, 8x from first to last, cost per block falling);
- ``unet``: a U-Net encoder whose state is a pytree (the feature map and every skip
  connection so far), so the state grows while the feature map shrinks;
- ``transformer``: 24 pre-norm blocks in three groups of widths 64, 128, 64 (a
  projection where the width changes), sequence 64.

Methods: ``none`` (store everything); ``ckpt/layer`` (``jax.checkpoint`` on each layer);
``ckpt dots`` and ``ckpt nothing`` (with the ``dots_saveable`` / ``nothing_saveable``
policies); ``sqrt(L)`` (``jax.checkpoint`` on ~sqrt(L) consecutive segments);
``memento hsm f`` and ``memento auto f`` (budget: a fraction ``f`` of what the plan would
store to keep everything); ``memento fit <peer>`` (the budget set to the peer's measured
memory, for a comparison at matched memory).

For each: XLA's temporary memory of the compiled gradient, the median time (round-robin,
see ``_common``), and for memento the ratios to the plan's model: measured temporary
bytes / planned peak bytes, and measured time / predicted time, where the prediction
scales the ``none`` time by ``(planned forward flops + 2 F) / 3 F`` (F: one forward pass,
a backward pass taken as two).

Measured on XLA:CPU (benchmarks/results/chain.json): every ``jax.checkpoint`` variant
takes the memory of ``none``. XLA:CPU expands optimization barriers before its last CSE
pass, which then merges each rematerialisation with the forward computation it repeats;
memento ties its recomputations to the cotangent instead (see `memento.loops._chain`).
So "matched memory" against those peers means store-everything on this backend.

Run:
    /work/main/.venv/bin/python benchmarks/chain.py            # ~14 min on 2 cores (compiles dominate)
    /work/main/.venv/bin/python benchmarks/chain.py --quick    # smaller, ~4 min

Writes benchmarks/results/chain.json and chain.png (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.use_one_thread()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import memento  # noqa: E402
from memento.loops import chain_plan  # noqa: E402

FRACTIONS = (0.05, 0.2, 0.5, 1.0)


def _keys(seed: int):
    key = jax.random.PRNGKey(seed)
    while True:
        key, sub = jax.random.split(key)
        yield sub


def _conv(w, x, stride=1):
    return lax.conv_general_dilated(
        x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _init_conv(k, cin, cout):
    return jax.random.normal(k, (3, 3, cin, cout), jnp.float32) / math.sqrt(9 * cin)


def resnet(quick: bool):
    batch, size = (2, 16) if quick else (2, 32)
    keys = _keys(0)
    widths = (16, 32, 64, 128)
    params = []
    layers_spec = [("stem", 3, 16, 1)]
    for s, c in enumerate(widths):
        for b in range(3):
            stride = 2 if (b == 0 and s > 0) else 1
            layers_spec.append(("block", widths[s - 1] if b == 0 and s > 0 else c, c, stride))
    for kind, cin, cout, _ in layers_spec:
        if kind == "stem":
            params.append({"w": _init_conv(next(keys), cin, cout)})
        else:
            params.append(
                {"w1": _init_conv(next(keys), cin, cout), "w2": _init_conv(next(keys), cout, cout)}
            )

    def make(params):
        fns = []
        for (kind, cin, cout, stride), p in zip(layers_spec, params):
            if kind == "stem":
                fns.append(lambda x, p=p: jax.nn.relu(_conv(p["w"], x)))
                continue

            def block(x, p=p, stride=stride, cin=cin, cout=cout):
                h = jax.nn.relu(_conv(p["w1"], x, stride))
                h = _conv(p["w2"], h)
                skip = x[:, ::stride, ::stride, :]
                if cout != cin:
                    skip = jnp.concatenate([skip, jnp.zeros_like(skip)], axis=-1)
                return jax.nn.relu(h + skip)

            fns.append(block)
        return fns

    x = jax.random.normal(next(keys), (batch, size, size, 3), jnp.float32)
    return params, x, make, lambda y: jnp.mean(y**2)


def unet(quick: bool):
    batch, size = (2, 32) if quick else (2, 64)
    keys = _keys(1)
    widths = (8, 16, 32, 64)
    spec = [("in", 3, widths[0])]
    for s, c in enumerate(widths):
        if s > 0:
            spec.append(("down", widths[s - 1], c))
        spec.append(("conv", c, c))
        spec.append(("conv", c, c))
    params = [{"w": _init_conv(next(keys), cin, cout)} for _, cin, cout in spec]

    def make(params):
        fns = []
        for (kind, _, _), p in zip(spec, params):
            if kind == "in":
                fns.append(lambda x, p=p: (jax.nn.relu(_conv(p["w"], x)), ()))
            elif kind == "down":  # keep the map as a skip connection, then stride 2
                fns.append(lambda s, p=p: (jax.nn.relu(_conv(p["w"], s[0], 2)), (*s[1], s[0])))
            else:
                fns.append(lambda s, p=p: (jax.nn.relu(_conv(p["w"], s[0])) + s[0], s[1]))
        return fns

    def loss(state):
        x, skips = state
        return jnp.mean(x**2) + sum(jnp.mean(jnp.abs(s)) for s in skips)

    x = jax.random.normal(next(keys), (batch, size, size, 3), jnp.float32)
    return params, x, make, loss


def _layer_norm(x):
    mu = jnp.mean(x, -1, keepdims=True)
    return (x - mu) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


def transformer(quick: bool):
    batch, seq = (1, 32) if quick else (1, 64)
    keys = _keys(2)
    groups = (64, 128, 64)
    per_group = 4 if quick else 8
    spec = []
    prev = groups[0]
    for d in groups:
        for b in range(per_group):
            spec.append((prev if b == 0 else d, d))
        prev = d

    def dense(k, a, b):
        return jax.random.normal(k, (a, b), jnp.float32) / math.sqrt(a)

    params = []
    for din, d in spec:
        p = {
            "qkv": dense(next(keys), d, 3 * d),
            "o": dense(next(keys), d, d),
            "up": dense(next(keys), d, 4 * d),
            "down": dense(next(keys), 4 * d, d),
        }
        if din != d:
            p["proj"] = dense(next(keys), din, d)
        params.append(p)

    def block(p, x):
        if "proj" in p:
            x = x @ p["proj"]
        h = _layer_norm(x)
        q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
        heads = 4
        split = lambda t: t.reshape(*t.shape[:-1], heads, -1)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        a = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        a = jax.nn.softmax(a, axis=-1)
        att = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape)
        x = x + att @ p["o"]
        return x + jax.nn.gelu(_layer_norm(x) @ p["up"]) @ p["down"]

    def make(params):
        return [functools.partial(block, p) for p in params]

    x = jax.random.normal(next(keys), (batch, seq, groups[0]), jnp.float32)
    return params, x, make, lambda y: jnp.mean(y**2)


STACKS = {"resnet": resnet, "unet": unet, "transformer": transformer}


def _compose(fns, x):
    return functools.reduce(lambda h, f: f(h), fns, x)


def methods(make, readout, num_layers: int):
    """name -> loss(params, x) for the peers (memento's are added with their budgets)."""

    def wrap(transform):
        def loss(params, x):
            return readout(_compose([transform(f) for f in make(params)], x))

        return loss

    seg = max(1, round(math.sqrt(num_layers)))

    def sqrt_segments(params, x):
        fns = make(params)
        groups = [fns[i : i + seg] for i in range(0, len(fns), seg)]
        return readout(
            _compose([jax.checkpoint(functools.partial(_compose, g)) for g in groups], x)
        )

    cp = jax.checkpoint_policies
    return {
        "none": wrap(lambda f: f),
        "ckpt/layer": wrap(jax.checkpoint),
        "ckpt dots": wrap(lambda f: jax.checkpoint(f, policy=cp.dots_saveable)),
        "ckpt nothing": wrap(lambda f: jax.checkpoint(f, policy=cp.nothing_saveable)),
        f"sqrt(L) ({seg} per segment)": sqrt_segments,
    }


def memento_loss(make, readout, memory, policy):
    def loss(params, x):
        return readout(memento.chain(make(params), x, memory=memory, policy=policy))

    return loss


def run_stack(name: str, quick: bool, repeats: int) -> dict:
    params, x, make, readout = STACKS[name](quick)
    n = len(make(params))
    everything = chain_plan(make(params), x, memory=1)
    store_all = sum(everything.hidden_bytes[:-1]) + sum(everything.internal_bytes)
    forward_flops = sum(everything.flops)
    losses = methods(make, readout, n)
    compiled = {}
    plans = {}

    def add(label, loss, plan=None):
        print(f"  compiling {label} ...", file=sys.stderr, flush=True)
        compiled[label] = _common.compile_fn(jax.grad(loss), params, x)
        if plan is not None:
            plans[label] = plan

    for label, loss in losses.items():
        add(label, loss)
    for policy in ("hsm", "auto"):
        for frac in FRACTIONS:
            memory = memento.bytes_budget(max(everything.hidden_bytes[0], int(frac * store_all)))
            plan = chain_plan(make(params), x, memory=memory, policy=policy)
            add(f"memento {policy} {frac:g}", memento_loss(make, readout, memory, policy), plan)
    for peer in ("ckpt/layer", next(k for k in losses if k.startswith("sqrt"))):
        memory = memento.bytes_budget(max(everything.hidden_bytes[0], compiled[peer].temp_bytes))
        plan = chain_plan(make(params), x, memory=memory)
        add(f"memento fit {peer}", memento_loss(make, readout, memory, "auto"), plan)

    ref = compiled["none"].first_output
    times = _common.time_round_robin({k: c.call for k, c in compiled.items()}, repeats=repeats)
    t_none = _common.median(times["none"])
    rows = []
    for label, c in compiled.items():
        err = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(
                jax.tree_util.tree_leaves(c.first_output), jax.tree_util.tree_leaves(ref)
            )
        )
        row = {
            "method": label,
            "temp_bytes": c.temp_bytes,
            "time_s": _common.median(times[label]),
            "times_s": times[label],
            "compile_s": c.compile_s,
            "hlo_lines": c.hlo_lines,
            "max_rel_error": err,
        }
        if label in plans:
            p = plans[label]
            predicted = t_none * (p.planned_flops + 2 * forward_flops) / (3 * forward_flops)
            row.update(
                budget_bytes=p.budget_bytes,
                planned_peak_bytes=p.peak_bytes,
                planned_forward_flops=p.planned_flops,
                evaluations=p.evaluations().tolist(),
                memory_ratio=c.temp_bytes / p.peak_bytes,
                predicted_time_s=predicted,
                time_ratio=row["time_s"] / predicted,
            )
        rows.append(row)
    return {
        "stack": name,
        "num_layers": n,
        "hidden_bytes": list(everything.hidden_bytes),
        "internal_bytes": list(everything.internal_bytes),
        "flops": list(everything.flops),
        "store_all_bytes": store_all,
        "rows": rows,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacks = results["stacks"]
    fig, axes = plt.subplots(1, len(stacks), figsize=(5 * len(stacks), 4.2))
    for ax, st in zip(axes if len(stacks) > 1 else [axes], stacks):
        for series, marker in (("memento auto", "o-"), ("memento hsm", "s--")):
            pts = sorted(
                (r["temp_bytes"] / 2**20, r["time_s"] * 1e3)
                for r in st["rows"]
                if r["method"].startswith(series)
            )
            ax.plot(*zip(*pts), marker, label=series)
        for r in st["rows"]:
            if not r["method"].startswith("memento"):
                ax.plot(r["temp_bytes"] / 2**20, r["time_s"] * 1e3, "x", ms=9)
                ax.annotate(r["method"], (r["temp_bytes"] / 2**20, r["time_s"] * 1e3), fontsize=7)
            elif r["method"].startswith("memento fit"):
                ax.plot(r["temp_bytes"] / 2**20, r["time_s"] * 1e3, "k*", ms=9)
                ax.annotate(
                    r["method"][8:], (r["temp_bytes"] / 2**20, r["time_s"] * 1e3), fontsize=7
                )
        ax.set_xlabel("XLA temp memory (MiB)")
        ax.set_ylabel("jit(grad) time (ms)")
        ax.set_title(f"{st['stack']} ({st['num_layers']} layers)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    results = {"machine": _common.machine(), "quick": args.quick, "stacks": []}
    for name in args.stacks.split(","):
        print(f"{name}:", file=sys.stderr, flush=True)
        results["stacks"].append(run_stack(name, args.quick, args.repeats))
    out = Path(args.out)
    _common.write_json(out / "chain.json", results)
    plot(results, out / "chain.png")
    for st in results["stacks"]:
        print(f"\n{st['stack']} ({st['num_layers']} layers)")
        print(f"  {'method':<34}{'temp MiB':>10}{'ms':>9}{'mem/plan':>10}{'time/model':>11}")
        for r in st["rows"]:
            mem = f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else ""
            tim = f"{r['time_ratio']:.2f}" if "time_ratio" in r else ""
            print(
                f"  {r['method']:<34}{_common.mib(r['temp_bytes']):>10.2f}"
                f"{r['time_s'] * 1e3:>9.1f}{mem:>10}{tim:>11}"
            )


if __name__ == "__main__":
    main()
