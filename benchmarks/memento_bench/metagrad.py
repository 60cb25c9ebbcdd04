"""Meta-gradient benchmarks: memento's mixed mode against JAX's default autodiff.

Dynamic memory is XLA's temp allocation of the compiled meta-gradient
(``memory_analysis().temp_size_in_bytes``: exact, deterministic, CPU-friendly); time is
the median of repeated runs after compilation. Ratios are default / memento, measured
in one process, so higher is better (MixFlow-MG, Eq. 10-11).

``benchmarks/metagrad.py`` runs its three parts.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

MiB = 2**20


def measure(fn: Callable, args: Sequence[Any], repeats: int = 5) -> dict[str, float]:
    """Compiles ``jax.jit(fn)`` and returns its temp bytes, compile and median step time."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    if memory is None:
        raise RuntimeError(
            f"XLA gives no memory analysis on the {jax.default_backend()!r} backend; "
            "run this benchmark on CPU or GPU."
        )
    temp = memory.temp_size_in_bytes
    jax.block_until_ready(compiled(*args))  # Warm-up run, not timed.
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {"temp_bytes": temp, "compile_s": compile_s, "time_s": statistics.median(times)}


def _with_ratios(rows: list[dict], key: Sequence[str]) -> list[dict]:
    """Adds default/impl memory and time ratios to every row, grouped by `key`."""
    base = {tuple(r[k] for k in key): r for r in rows if r["impl"] == "default"}
    for r in rows:
        d = base.get(tuple(r[k] for k in key))
        if d is not None:
            r["mem_ratio"] = d["temp_bytes"] / max(r["temp_bytes"], 1)
            r["time_ratio"] = d["time_s"] / r["time_s"]
    return rows


# ---------------------------------------------------------------------------- part 1
def toy_rows(quick: bool = False, repeats: int = 5, log=print) -> list[dict]:
    """MixFlow-MG's toy task (Eq. 9) over M, scan and unrolled, B=256, D=512, T=2."""
    from .toy import make_toy_task

    rows = []
    for variant, m, impl in toy_grid(quick):
        fn, args = make_toy_task(num_maps=m, variant=variant, implementation=impl)
        row = {"variant": variant, "M": m, "impl": impl, **measure(fn, args, repeats)}
        rows.append(row)
        log(_fmt_row(row, ("variant", "M", "impl")))
    return _with_ratios(rows, ("variant", "M"))


def toy_grid(quick: bool = False) -> list[tuple[str, int, str]]:
    """The ``(variant, M, implementation)`` triples `toy_rows` measures, in order."""
    from .toy import IMPLEMENTATIONS

    maps = (1, 4, 16) if quick else (1, 4, 16, 64)
    # The unrolled default with M=64 takes many minutes and ~10 GB to compile on CPU;
    # the scan variant carries the M=64 comparison.
    return [
        (variant, m, impl)
        for variant in ("scan", "unrolled")
        for m in maps
        if not (variant == "unrolled" and m == 64)
        for impl in IMPLEMENTATIONS
    ]


# ---------------------------------------------------------------------------- part 2
@dataclasses.dataclass(frozen=True)
class TaskSetting:
    task: str
    d_model: int
    num_layers: int
    seq_len: int
    batch: int
    num_steps: int


def task_settings(quick: bool = False) -> list[TaskSetting]:
    """The sweep: the three tasks at a base size, then MAML along each axis."""
    base = dict(d_model=64, num_layers=4, seq_len=128, batch=4, num_steps=2)
    if quick:
        return [TaskSetting(t, **{**base, "num_layers": 2, "seq_len": 64}) for t in _tasks()]
    out = [TaskSetting(t, **base) for t in _tasks()]
    for layers in (2, 8, 16):
        out.append(TaskSetting("maml", **{**base, "num_layers": layers}))
    for steps in (4,):
        out.append(TaskSetting("maml", **{**base, "num_steps": steps}))
    for batch in (8,):
        out.append(TaskSetting("maml", **{**base, "batch": batch}))
    for seq in (64, 256):
        out.append(TaskSetting("maml", **{**base, "seq_len": seq}))
    # The largest size: deepest model, longest sequences, largest batch.
    out.append(TaskSetting("maml", d_model=64, num_layers=16, seq_len=256, batch=8, num_steps=2))
    return out


def _tasks():
    from .tasks import TASKS

    return TASKS


def task_rows(quick: bool = False, repeats: int = 5, log=print) -> list[dict]:
    """The three tasks on the transformer: default vs memento, across sizes."""
    from .tasks import IMPLEMENTATIONS, make_task
    from .transformer import TransformerConfig

    rows = []
    for s in task_settings(quick):
        config = TransformerConfig(
            vocab_size=128,
            seq_len=s.seq_len,
            d_model=s.d_model,
            num_heads=4,
            num_layers=s.num_layers,
            d_ff=4 * s.d_model,
        )
        for impl, options in IMPLEMENTATIONS.items():
            meta_loss, eta, data = make_task(
                s.task, config, num_steps=s.num_steps, batch_size=s.batch, **options
            )
            row = {
                **dataclasses.asdict(s),
                "params": config.num_params,
                "impl": impl,
                **measure(jax.grad(meta_loss), (eta, data), repeats),
            }
            rows.append(row)
            log(_fmt_row(row, ("task", "num_layers", "seq_len", "batch", "num_steps", "impl")))
    return _with_ratios(rows, tuple(f.name for f in dataclasses.fields(TaskSetting)))


# ---------------------------------------------------------------------------- part 3
def memory_rows(quick: bool = False, repeats: int = 3, slots: int = 8, log=print) -> list[dict]:
    """Static memory against T: per-step remat alone vs a `memento.scan` budget.

    The inner model is the toy map (M=4) with D x D parameters and plain SGD, so the loop
    state is exactly one parameter-sized copy and ``memory=slots`` means `slots`
    parameter copies.
    """
    from memento.meta import inner_loop

    from .toy import toy_apply

    # Parameters (D x D) dominate activations (B x D), as in large models.
    dim, batch, num_maps = (128, 8, 4) if quick else (512, 16, 4)
    horizons = (1, 8, 16, 32) if quick else (1, 8, 16, 32, 64)
    param_bytes = dim * dim * 4

    def loss(theta, _eta, data):
        x, y = data
        return jnp.mean((toy_apply(theta, x, num_maps, "scan") - y) ** 2)

    rows = []
    for steps in horizons:
        k1, k2 = jax.random.split(jax.random.PRNGKey(steps))
        eta = jax.random.normal(k1, (dim, dim)) / dim**0.5
        xs, ys = jax.random.normal(k2, (2, steps, batch, dim))
        budgets = (("remat", None), (f"memory={slots}", slots)) if steps > 1 else (("remat", None),)
        for name, memory in budgets:

            def meta_loss(eta, xs, ys, memory=memory):
                theta = inner_loop(
                    loss, optax.sgd(1e-3), eta, None, (xs, ys), mode="fwdrev", memory=memory
                )
                return loss(theta, None, (xs[0], ys[0]))

            row = {
                "T": steps,
                "impl": name,
                "param_bytes": param_bytes,
                **measure(jax.grad(meta_loss), (eta, xs, ys), repeats),
            }
            row["param_copies"] = round(row["temp_bytes"] / param_bytes, 1)
            rows.append(row)
            log(_fmt_row(row, ("T", "impl")))
    return rows


# ---------------------------------------------------------------------------- output
def _fmt_row(row: dict, keys: Sequence[str]) -> str:
    head = " ".join(f"{k}={row[k]}" for k in keys)
    return (
        f"{head}: temp {row['temp_bytes'] / MiB:.1f} MiB, {row['time_s'] * 1e3:.0f} ms "
        f"(compile {row['compile_s']:.1f} s)"
    )


def markdown(rows: list[dict], keys: Sequence[str]) -> str:
    """A Markdown table: the `keys` columns, memory, time and the ratios to default."""
    cols = [*keys, "temp MiB", "time ms", "mem ratio", "time ratio"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r[k]) for k in keys]
        cells += [f"{r['temp_bytes'] / MiB:.1f}", f"{r['time_s'] * 1e3:.0f}"]
        cells += [f"{r[k]:.2f}x" if k in r else "" for k in ("mem_ratio", "time_ratio")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, results: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend()}
    path.write_text(json.dumps({"environment": meta, **results}, indent=2, default=float))
