"""``memento demo``: the gradient of a long LSTM, with ``lax.scan`` and with `memento.scan`.

What a new user sees first. One LSTM (input = hidden = H, batch B) with a loss on every
step's output; its gradient is compiled and timed with ``lax.scan`` (stores every step),
with ``jax.checkpoint`` on the step (stores every carry, recomputes each step once), and
with `memento.scan` at ``memory="1%"`` and ``"5%"`` (of what storing every step takes).
For each: the slots kept, XLA's temporary memory, the median time, the number of forward
step evaluations, and how far the gradient is from ``lax.scan``'s; then what each term
means, the schedule of the smallest budget drawn, and the line to try on one's own loop.

The LSTM and the helpers here are reused by ``benchmarks/rnn.py``.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..loops import scan, scan_schedule
from ..planning import Schedule
from ..planning.internals import Percent, parse_memory

# (steps, hidden, batch). The default takes about a minute on two busy CPU cores.
DEMO_SIZE = (4096, 32, 16)
QUICK_SIZE = (64, 8, 2)
# memento.scan's budgets: shares of what storing every step takes (T x alpha slots).
DEMO_BUDGETS = ("1%", "5%")


# ----------------------------------------------------------------------------------------
# The model


def lstm_params(key, hidden: int) -> dict[str, jax.Array]:
    """LSTM weights for input size = hidden size = ``hidden``."""
    k_w, k_out = jax.random.split(key)
    return {
        "w": jax.random.normal(k_w, (2 * hidden, 4 * hidden)) / math.sqrt(2 * hidden),
        "b": jnp.zeros(4 * hidden),
        "out": jax.random.normal(k_out, (hidden, hidden)) / math.sqrt(hidden),
    }


def lstm_data(key, num_steps: int, hidden: int, batch: int):
    """Inputs ``(T, B, H)`` and the initial carry ``(h, c)``, both ``(B, H)``."""
    xs = jax.random.normal(key, (num_steps, batch, hidden))
    init = (jnp.zeros((batch, hidden)), jnp.zeros((batch, hidden)))
    return xs, init


def lstm_step(params, carry, x):
    """One LSTM step; its output is the step's loss (predict the input from the state)."""
    h, c = carry
    z = jnp.concatenate([x, h], axis=-1) @ params["w"] + params["b"]
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    loss = jnp.mean(jnp.square(h @ params["out"] - x))
    return (h, c), loss


def scan_loss(loop: Callable, step: Callable = lstm_step) -> Callable:
    """``loss(params, xs, init)``: the summed per-step losses, with ``loop`` as the scan.

    ``loop(f, init, xs)`` is ``lax.scan`` or any drop-in (e.g. ``memento.scan`` with a
    budget bound by ``functools.partial``).
    """

    def loss(params, xs, init):
        _, ys = loop(lambda carry, x: step(params, carry, x), init, xs)
        return jnp.sum(ys)

    return loss


def checkpointed_step(step: Callable = lstm_step) -> Callable:
    """The step under ``jax.checkpoint``: the gradient stores carries only."""
    return jax.checkpoint(step)


def memory_slots(fraction: float, num_steps: int) -> int:
    """A budget as a fraction of storing every carry: ``max(1, round(fraction * T))``."""
    return max(1, round(fraction * num_steps))


def measured_alpha(step: Callable, params, xs, init) -> int:
    """Alpha of ``lambda c, x: step(params, c, x)`` as `memento.scan` measures it for a
    gradient in ``params``: an internal state (the residuals of the step differentiated in
    the closed-over parameters only, and the output carry) in carry-sized slots. Read from
    the ISM schedule `memento.loops.scan_schedule` plans, which needs the measurement."""
    f = lambda c, x: step(params, c, x)  # noqa: E731
    memory = 64 * len(xs)  # any budget that fits one internal state
    return scan_schedule(f, init, xs, memory=memory, policy="ism", wrt=("closure",)).alpha


def schedule_for(step: Callable, params, xs, init, memory) -> Schedule:
    """The schedule `memento.scan` runs for the gradient in ``params`` of `scan_loss`'s
    ``scan(lambda c, x: step(params, c, x), init, xs, memory=memory)``
    (`memento.loops.scan_schedule`)."""
    return scan_schedule(lambda c, x: step(params, c, x), init, xs, memory=memory, wrt=("closure",))


def max_relative_error(grad, reference) -> float:
    """``max |g - g_ref| / max |g_ref|`` over the leaves (each leaf scaled by its own)."""
    errors = jax.tree_util.tree_map(
        lambda g, r: float(jnp.max(jnp.abs(g - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)),
        grad,
        reference,
    )
    return max(jax.tree_util.tree_leaves(errors))


# ----------------------------------------------------------------------------------------
# The demo


def _measure(loss: Callable, args: Sequence, repeats: int) -> dict[str, Any]:
    grad = jax.jit(jax.grad(loss))
    compiled = grad.lower(*args).compile()
    value = jax.block_until_ready(compiled(*args))  # warm-up; also the value compared
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    analysis = compiled.memory_analysis()  # None only on backends without it
    return {
        "grad": value,
        "temp_bytes": analysis.temp_size_in_bytes if analysis is not None else 0,
        "time_s": statistics.median(times),
    }


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    """Three significant figures at most, never rounded to zero (``--quick`` runs in us)."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-2:
        return f"{seconds * 1e3:.0f} ms"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def _progress(message: str) -> None:
    """Progress on stderr, so that stdout is the report alone."""
    print(message, file=sys.stderr, flush=True)


def main(args) -> int:
    """Runs the demo; ``args`` has ``steps`` (int or None), ``out`` (folder or None), ``quick``.

    Returns:
        0 (the CLI's exit status).

    Raises:
        ValueError: ``steps`` below 2.
    """
    num_steps, hidden, batch = QUICK_SIZE if args.quick else DEMO_SIZE
    if args.steps is not None:
        if args.steps < 2:
            raise ValueError(f"memento demo: --steps must be at least 2, got {args.steps}.")
        num_steps = args.steps
    repeats = 3 if args.quick else 5
    out_dir = Path(args.out if args.out is not None else "memento-demo")

    k_params, k_data = jax.random.split(jax.random.PRNGKey(0))
    params = lstm_params(k_params, hidden)
    xs, init = lstm_data(k_data, num_steps, hidden, batch)
    data = (params, xs, init)
    carry_bytes = 2 * batch * hidden * 4

    print(
        f"memento demo: gradient of an LSTM over T={num_steps} steps "
        f"(hidden {hidden}, batch {batch}, one carry = {_size(carry_bytes)}), on "
        f"{jax.default_backend().upper()}; median of {repeats} runs."
    )
    # (label, loss, forward evaluations)
    methods: list[tuple[str, Callable, int]] = [
        ("lax.scan (stores every step)", scan_loss(lax.scan), num_steps),
        (
            "lax.scan + jax.checkpoint per step",
            scan_loss(lax.scan, checkpointed_step()),
            2 * num_steps,
        ),
    ]
    alpha = measured_alpha(lstm_step, *data)
    schedules = {}
    for budget in DEMO_BUDGETS:
        percent = parse_memory(budget, name="memento demo")
        assert isinstance(percent, Percent)
        least = math.ceil(100 / (percent.percent * alpha))
        if num_steps < least:
            raise ValueError(
                f"memento demo: --steps {num_steps} is too short for memory={budget!r} to "
                f"hold one slot ({budget} of T x alpha = {num_steps} x {alpha} slots); use "
                f"--steps {least} or more."
            )
        schedule = schedule_for(lstm_step, *data, budget)
        schedules[budget] = schedule

        def loop(f, init, xs, budget=budget):
            return scan(f, init, xs, memory=budget)

        label = f'memento.scan, memory="{budget}": {schedule.policy.upper()}'
        methods.append((label, scan_loss(loop), int(schedule.cost)))

    rows = []
    for n, (label, loss, evaluations) in enumerate(methods, 1):
        _progress(f"[{n}/{len(methods)}] compiling and timing {label} ...")
        rows.append((label, _measure(loss, data, repeats), evaluations))
    reference = rows[0][1]

    header = ("method", "slots", "memory", "time", "fwd evals/step", "grad error")
    table: list[tuple[str, ...]] = [header]
    slots = [str(num_steps * alpha), str(num_steps)] + [
        str(schedules[b].memory) for b in DEMO_BUDGETS
    ]
    for (label, m, evaluations), used in zip(rows, slots):
        table.append(
            (
                label,
                used,
                f"{_size(m['temp_bytes'])}",
                _duration(m["time_s"]),
                f"{evaluations / num_steps:.2f}",
                f"{max_relative_error(m['grad'], reference['grad']):.1e}",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print()
    for n, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        print("  ".join(cells))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print(_explain(num_steps, alpha, carry_bytes, schedules))

    small = DEMO_BUDGETS[0]
    if importlib.util.find_spec("matplotlib") is None:  # the [plot] extra is optional
        print(
            '\n(no schedule picture: matplotlib is not installed; pip install "memento-jax[plot]")'
        )
    else:
        from .plotting import plot_schedule

        out_dir.mkdir(parents=True, exist_ok=True)
        picture = out_dir / "schedule.png"
        schedule = schedules[small]
        title = (
            f'memento.scan, memory="{small}": {schedule.policy.upper()}, T={num_steps}, '
            f"{schedule.memory} slots, {schedule.cost_per_step:.2f} forward evaluations per step"
        )
        plot_schedule(schedule, picture, title=title)
        print(
            f'\nschedule of memento.scan at memory="{small}" ({schedule.memory} slots): {picture}'
        )

    _, m_small, _ = rows[len(rows) - len(DEMO_BUDGETS)]
    less = reference["temp_bytes"] / max(m_small["temp_bytes"], 1)
    slower = m_small["time_s"] / reference["time_s"]
    error = max_relative_error(m_small["grad"], reference["grad"])
    # float32: a different evaluation order may move the last bits, nothing more.
    agreement = "same gradient" if error < 1e-4 else f"gradient within {error:.0e}"
    print(
        f'\nmemento.scan at memory="{small}": {less:.0f}x less memory than lax.scan, '
        f"{slower:.1f}x its time, {agreement}."
    )
    print(
        '\nOn your own loop: carry, ys = memento.scan(step, h0, xs, memory="5%")'
        "  # lax.scan's arguments; memory=None is lax.scan"
    )
    return 0


def _explain(num_steps: int, alpha: int, carry_bytes: int, schedules: dict) -> str:
    """Every term of the table, once (the docs' Concepts page says more)."""
    chosen = ", ".join(f'{s.policy.upper()} at "{b}"' for b, s in schedules.items())
    replanned = [
        f'"{b}" asks for {Percent(float(b[:-1])).share(num_steps * alpha, name="")} slots and '
        f"plans {s.memory}"
        for b, s in schedules.items()
        if s.memory != Percent(float(b[:-1])).share(num_steps * alpha, name="")
    ]
    lines = [
        "What the words mean (the docs' Concepts page says more):",
        f"  slot        room for one carry (here h and c, {_size(carry_bytes)})",
        "  alpha       slots a step's internal state takes (what its backward pass needs:",
        f"              residuals and output carry); measured: alpha={alpha}",
        "  lax.scan    plain backpropagation through time (BPTT): keeps every internal",
        f"              state, T x alpha = {num_steps * alpha} slots",
        '  memory="5%" 5% of those slots, the budget memento.scan plans within',
        "  HSM/ISM/MSM the plan stores carries only / internal states only / a mix;",
        f"              policy='auto' (the default) picked {chosen}",
        "  memory      XLA's temporary bytes of the compiled gradient",
        "  fwd evals   forward evaluations of the step per step (1.00: nothing recomputed)",
        "  grad error  max relative difference from lax.scan's gradient",
    ]
    if replanned:
        lines.append(
            "  slots       what each schedule uses: "
            + "; ".join(replanned)
            + ",\n              fewer, so that its storage (grouped by dtype and shape) fits"
        )
    return "\n".join(lines)
