"""LSTM gradient under a memory budget: memento.scan against its peers, in one process.

The question (issue 3): for a long LSTM with a loss on every step, how much memory and
time does `memento.scan`'s gradient take at a sweep of budgets, and how does that compare
with the other ways JAX users save memory?

Methods, all on the same LSTM and data:

- ``lax.scan``: stores every step's residuals (the fastest, the largest);
- ``memento None``: ``memento.scan(memory=None)``, which must be ``lax.scan``;
- ``checkpoint/step``: ``lax.scan`` of ``jax.checkpoint(step)`` (stores every carry);
- ``nested sqrt(T)``: an outer scan over ~sqrt(T) segments, each a checkpointed inner
  scan (stores sqrt(T) carries plus one segment's residuals);
- ``memento m``: ``memento.scan(memory=m)`` with ``m = max(1, round(frac * T))`` slots,
  ``frac`` in 1%, 2%, 5%, 10%, 25%, 100% of storing every carry;
- ``equinox C``: ``equinox.internal.while_loop(kind="checkpointed", checkpoints=C)``
  with ``C = m`` (the same number of carry-sized checkpoints);
- ``memento fit``: for each peer, the largest memento budget whose measured memory is no
  larger than the peer's (target 1 asks for such a budget, not for one of the sweep's).

For each: XLA's temporary memory of the jitted gradient, the median time (round-robin
over the methods, see ``_common``), forward step evaluations (memento: the schedule's
cost; Equinox: counted with ``jax.debug.callback``; the others: T or 2T), and the
gradient's max relative error against ``lax.scan``. One step's primal time t_forward and
VJP time t_backward are measured too, for the issue's cost model ``cost * t_forward + T *
t_backward`` that memento's times are checked against. That model prices every forward
evaluation as a full step, but a re-computation that only advances the carry (ADVANCE
rows after the first sweep) skips the step's output and loss, so the carry-only step time
t_advance is measured as well and the plan's model is ``(cost - A) * t_forward + A *
t_advance + T * t_backward``, A being the schedule's re-computed advances.

Run:
    /work/venv/bin/python benchmarks/rnn.py            # default sizes, ~10 min on 2 cores
    /work/venv/bin/python benchmarks/rnn.py --quick    # one small size, ~1 min
    /work/venv/bin/python benchmarks/rnn.py --sizes 1024x128x32 --repeats 7
    /work/venv/bin/python benchmarks/rnn.py --from-json benchmarks/results/rnn.json  # redraw

Writes benchmarks/results/rnn.{json,md,png} (``--out`` to change the folder) and prints
the four targets as PASS/FAIL lines.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import memento
from memento.apps import demo as _demo

DEFAULT_SIZES = ((1024, 128, 32), (4096, 64, 16))
QUICK_SIZES = ((256, 32, 8),)
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.25, 1.0)

# The targets of issue 3.
DOMINANCE_SLACK = 0.03  # a memento budget no larger is at most 3% slower than any peer
MODEL_TOLERANCE = 0.10  # memento's time within 10% of its plan's model
FIVE_PERCENT_LIMIT = 1.4  # 5% budget: at most 1.4x the fastest store-all time
NONE_TOLERANCE = 0.03  # memory=None within 3% of lax.scan

step = _demo.lstm_step
T_FORWARD, T_ADVANCE, T_BACKWARD = "(T primal steps)", "(T carry steps)", "(T step VJPs)"
STEP_LOOPS = (T_FORWARD, T_ADVANCE, T_BACKWARD)


def recomputed_advances(schedule: memento.Schedule) -> int:
    """Steps the schedule advances after its first sweep: carry only, no output or loss."""
    rows = schedule.actions[schedule.simulate().sweep_length :]
    return int(rows[rows[:, 0] == memento.planning.Op.ADVANCE, 1].sum())


def model_time(evaluations, advances, num_steps, t_forward, t_advance, t_backward):
    """``(evals - A) * t_forward + A * t_advance + T * t_backward`` (None without evals)."""
    if evaluations is None:
        return None
    return (evaluations - advances) * t_forward + advances * t_advance + num_steps * t_backward


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------------------
# The methods, each a loss(params, xs, init) whose gradient in params is measured


def nested_scan(f, init, xs, *, segment: int):
    """Nested sqrt(T) rematerialisation: a scan of checkpointed inner scans of ``segment``."""
    num_steps = xs.shape[0]
    segments = xs.reshape(num_steps // segment, segment, *xs.shape[1:])

    @jax.checkpoint
    def inner(carry, xs_segment):
        return lax.scan(f, carry, xs_segment)

    carry, ys = lax.scan(inner, init, segments)
    return carry, jax.tree_util.tree_map(lambda y: y.reshape(num_steps, *y.shape[2:]), ys)


def segment_length(num_steps: int) -> int:
    """The divisor of ``num_steps`` closest to sqrt(num_steps) (nested scans need one)."""
    divisors = [d for d in range(1, num_steps + 1) if num_steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - math.sqrt(num_steps)), d))


def equinox_loss(checkpoints: int, step_fn=step):
    """The same loss with Equinox's online-treeverse checkpointed while loop."""
    import equinox.internal as eqxi

    def loss(params, xs, init):
        num_steps = xs.shape[0]

        def body(state):
            i, carry, total = state
            carry, y = step_fn(params, carry, lax.dynamic_index_in_dim(xs, i, 0, keepdims=False))
            return i + 1, carry, total + y

        _, _, total = eqxi.while_loop(
            lambda state: state[0] < num_steps,
            body,
            (jnp.int32(0), init, jnp.float32(0.0)),
            max_steps=num_steps,
            kind="checkpointed",
            checkpoints=checkpoints,
        )
        return total

    return loss


class Counter:
    """Counts evaluations of the step at run time with ``jax.debug.callback``."""

    def __init__(self):
        self.count = 0

    def _tick(self):
        self.count += 1

    def step(self, params, carry, x):
        jax.debug.callback(self._tick)
        return step(params, carry, x)


def count_evaluations(make_loss, args) -> int:
    """Step evaluations of one gradient of ``make_loss(step_fn)`` (compiled separately)."""
    counter = Counter()
    grad = jax.jit(jax.grad(make_loss(counter.step)))
    jax.block_until_ready(grad(*args))
    jax.effects_barrier()
    return counter.count


# The issue's counts: Equinox spent 7.42 evaluations per step for 4096 steps and 8
# checkpoints (optimum 6.78), 4.30 for 1024 steps and 32 (optimum 3.42).
ISSUE_COUNTS = ((4096, 8), (1024, 32))


def equinox_issue_counts() -> list[dict]:
    """Equinox's evaluations per step against memento's optimum (HSM, m = C) at the
    issue's sizes. Counts do not depend on the step's width, so a tiny LSTM is used."""
    out = []
    for num_steps, checkpoints in ISSUE_COUNTS:
        params = _demo.lstm_params(jax.random.PRNGKey(0), 2)
        xs, init = _demo.lstm_data(jax.random.PRNGKey(1), num_steps, 2, 1)
        counted = count_evaluations(lambda s, c=checkpoints: equinox_loss(c, s), (params, xs, init))
        optimum = memento.plan(num_steps, checkpoints, policy="hsm").cost
        out.append(
            {
                "num_steps": num_steps,
                "checkpoints": checkpoints,
                "equinox_per_step": counted / num_steps,
                "optimum_per_step": optimum / num_steps,
            }
        )
        log(
            f"equinox T={num_steps} C={checkpoints}: {counted / num_steps:.2f} evaluations per "
            f"step, optimum {optimum / num_steps:.2f}"
        )
    return out


# ----------------------------------------------------------------------------------------
# t_forward, t_advance and t_backward: one step, measured on its own


def step_loops(params, xs, init) -> dict[str, _common.Compiled]:
    """Loops of T primal steps, T carry-only steps and T step VJPs.

    They give t_forward, t_advance and t_backward. Each is divided by T when timed, so
    that dispatch overhead does not count and the loop's own overhead counts as it does
    in the executors. The VJP loop applies one step's pullback (its residuals computed
    beforehand, as a backward pass reads them from storage) T times, threading the carry
    cotangent and summing the others. They are timed in the same round-robin as the
    methods, so they see the same machine load.
    """
    num_steps = xs.shape[0]

    def forward(params, xs, init):
        carry, ys = lax.scan(lambda c, x: step(params, c, x), init, xs)
        return carry, jnp.sum(ys)

    def advance(params, xs, init):
        carry, _ = lax.scan(lambda c, x: (step(params, c, x)[0], None), init, xs)
        return carry

    _, pullback = jax.vjp(step, params, init, xs[0])

    def backward(pullback, ct_carry):
        zeros = (jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros_like(xs[0]))

        def one(i, state):
            ct_carry, (ct_params, ct_x) = state
            d_params, d_carry, d_x = pullback((ct_carry, jnp.float32(1.0)))
            ct_params = jax.tree_util.tree_map(jnp.add, ct_params, d_params)
            return d_carry, (ct_params, ct_x + d_x)

        return lax.fori_loop(0, num_steps, one, (ct_carry, zeros))

    ct = jax.tree_util.tree_map(jnp.ones_like, init)
    return {
        T_FORWARD: _common.compile_fn(forward, params, xs, init),
        T_ADVANCE: _common.compile_fn(advance, params, xs, init),
        T_BACKWARD: _common.compile_fn(backward, pullback, ct),
    }


# ----------------------------------------------------------------------------------------
# One size


def fit_budgets(methods, compiled, add_memento, compile_new, tries=4) -> None:
    """Adds, for each peer, the largest memento budget no larger than the peer in memory.

    memento's memory is close to affine in the budget, so the slots for a peer's memory
    are interpolated between the measured budgets that bracket it, compiled, and the
    bracket narrowed (regula falsi) until it closes or ``tries`` run out. Budgets that turn
    out larger than the peer are dropped. Peers smaller than every budget get none
    (target 1 then reports that no memento configuration is that small).
    """
    known = {m["slots"]: compiled[n].temp_bytes for n, m in methods.items() if "slots" in m}
    peers = [n for n, m in methods.items() if not m["family"].startswith("memento")]
    for peer in peers:
        limit = compiled[peer].temp_bytes
        for _ in range(tries):
            below = max((m for m, b in known.items() if b <= limit), default=None)
            above = min(
                (m for m, b in known.items() if b > limit and m > (below or 0)), default=None
            )
            if below is None or above is None:
                break
            slope = (known[above] - known[below]) / (above - below)
            guess = min(above - 1, below + int((limit - known[below]) / slope))
            if guess <= below:
                break
            name = f"memento fit {peer} (m={guess})"
            add_memento(name, "memento fit", guess, fits=peer)
            compile_new()
            known[guess] = compiled[name].temp_bytes
            if known[guess] > limit:
                del methods[name], compiled[name]


def run_size(num_steps: int, hidden: int, batch: int, *, repeats: int, count: bool) -> dict:
    """All methods at one size; returns the JSON record of that size."""
    log(f"size T={num_steps} H={hidden} B={batch}")
    k_params, k_data = jax.random.split(jax.random.PRNGKey(0))
    params = _demo.lstm_params(k_params, hidden)
    xs, init = _demo.lstm_data(k_data, num_steps, hidden, batch)
    args = (params, xs, init)
    carry_bytes = 2 * batch * hidden * 4
    segment = segment_length(num_steps)

    # name -> description; "make" builds the loss from a step function (for counting).
    methods: dict[str, dict[str, Any]] = {}

    def add(name, family, make, evaluations, **extra):
        methods[name] = {"family": family, "make": make, "evaluations": evaluations, **extra}

    add("lax.scan", "lax.scan", lambda s: _demo.scan_loss(lax.scan, s), num_steps)
    add(
        "memento None",
        "memento None",
        lambda s: _demo.scan_loss(functools.partial(memento.scan, memory=None), s),
        num_steps,
    )
    add(
        "checkpoint/step",
        "checkpoint/step",
        lambda s: _demo.scan_loss(lax.scan, jax.checkpoint(s)),
        2 * num_steps,
    )
    add(
        f"nested sqrt(T) ({num_steps // segment}x{segment})",
        "nested sqrt(T)",
        lambda s: _demo.scan_loss(functools.partial(nested_scan, segment=segment), s),
        2 * num_steps,
    )

    def add_memento(name, family, slots, **extra):
        schedule = _demo.schedule_for(step, *args, slots)
        add(
            name,
            family,
            lambda s: _demo.scan_loss(functools.partial(memento.scan, memory=slots), s),
            schedule.cost,
            slots=slots,
            policy=schedule.policy,
            advances=recomputed_advances(schedule),
            **extra,
        )

    for fraction in FRACTIONS:
        slots = _demo.memory_slots(fraction, num_steps)
        add_memento(f"memento {fraction:.0%} (m={slots})", "memento", slots, fraction=fraction)
    for fraction in FRACTIONS:
        slots = _demo.memory_slots(fraction, num_steps)
        add(
            f"equinox {fraction:.0%} (C={slots})",
            "equinox",
            lambda s, slots=slots: equinox_loss(slots, s),
            None,
            fraction=fraction,
            checkpoints=slots,
        )

    compiled = {}

    def compile_new():
        for name, m in methods.items():
            if name not in compiled:
                c = _common.compile_fn(jax.grad(m["make"](step)), *args)
                compiled[name] = c
                log(
                    f"  compiled {name}: {c.compile_s:.1f} s, "
                    f"temp {_common.mib(c.temp_bytes):.2f} MiB"
                )

    compile_new()
    fit_budgets(methods, compiled, add_memento, compile_new)
    reference = compiled["lax.scan"].first_output
    for name, m in methods.items():
        m["grad_error"] = _demo.max_relative_error(compiled[name].first_output, reference)
        if m["evaluations"] is None and count:
            m["evaluations"] = count_evaluations(m["make"], args)
            log(f"  counted {name}: {m['evaluations'] / num_steps:.2f} evaluations per step")

    calls = {name: c.call for name, c in compiled.items()}
    calls.update({name: c.call for name, c in step_loops(*args).items()})
    times = _common.time_round_robin(calls, repeats=repeats, log=lambda s: log("  " + s))
    t_forward, t_advance, t_backward = (_common.median(times[k]) / num_steps for k in STEP_LOOPS)
    log(
        f"  t_forward {t_forward * 1e6:.1f} us, t_advance {t_advance * 1e6:.1f} us, "
        f"t_backward {t_backward * 1e6:.1f} us"
    )

    lax_time = _common.median(times["lax.scan"])
    lax_temp = compiled["lax.scan"].temp_bytes
    rows = []
    for name, m in methods.items():
        c = compiled[name]
        t = _common.median(times[name])
        evaluations = m["evaluations"]
        predicted = model_time(
            evaluations, m.get("advances", 0), num_steps, t_forward, t_advance, t_backward
        )
        row = {
            "name": name,
            "family": m["family"],
            **{
                k: m[k]
                for k in ("fraction", "slots", "checkpoints", "policy", "advances", "fits")
                if k in m
            },
            "temp_bytes": c.temp_bytes,
            "memory_vs_lax": c.temp_bytes / lax_temp,
            "time_s": t,
            "min_time_s": min(times[name]),
            "times_s": times[name],
            "time_vs_lax": t / lax_time,
            "evaluations": evaluations,
            "evaluations_per_step": evaluations / num_steps if evaluations is not None else None,
            "predicted_s": predicted,
            "time_vs_predicted": t / predicted if predicted else None,
            "grad_error": m["grad_error"],
            "hlo_lines": c.hlo_lines,
            "compile_s": c.compile_s,
        }
        rows.append(row)
    return {
        "num_steps": num_steps,
        # memory=None returns lax.scan itself: the same program, whatever the timings say.
        "none_same_program": compiled["memento None"].hlo_body == compiled["lax.scan"].hlo_body,
        "hidden": hidden,
        "batch": batch,
        "carry_bytes": carry_bytes,
        "nested_segment": segment,
        "t_forward_s": t_forward,
        "t_advance_s": t_advance,
        "t_backward_s": t_backward,
        "t_forward_times_s": [x / num_steps for x in times[T_FORWARD]],
        "t_advance_times_s": [x / num_steps for x in times[T_ADVANCE]],
        "t_backward_times_s": [x / num_steps for x in times[T_BACKWARD]],
        "repeats": repeats,
        "methods": rows,
    }


# ----------------------------------------------------------------------------------------
# Targets, table, plot


def evaluate_targets(size: dict, statistic: str = "median") -> list[dict]:
    """The four targets of issue 3 at one size, each ``{"target", "pass", "detail"}``.

    Args:
        size: one size's record from `run_size`.
        statistic: ``"median"`` (the issue's rule) or ``"min"`` of the runs, for every
            time, the one-step times included. Interference from other jobs only
            adds time, so the minimum shows what the code costs when the machine is quiet.
    """
    key = {"median": "time_s", "min": "min_time_s"}[statistic]
    pick = _common.median if statistic == "median" else min
    t_forward = pick(size["t_forward_times_s"])
    t_advance = pick(size["t_advance_times_s"])
    t_backward = pick(size["t_backward_times_s"])
    num_steps = size["num_steps"]

    def model(evaluations, advances):
        return model_time(evaluations, advances, num_steps, t_forward, t_advance, t_backward)

    rows = [
        {
            **r,
            "time_s": r[key],
            "time_vs_predicted": r[key] / model(r["evaluations"], r.get("advances", 0)),
            # The issue's model: every evaluation at t_forward.
            "time_vs_plain": r[key] / model(r["evaluations"], 0),
        }
        if r["evaluations"] is not None
        else {**r, "time_s": r[key]}
        for r in size["methods"]
    ]
    label = f"T={size['num_steps']} H={size['hidden']} B={size['batch']}"
    ours = [r for r in rows if r["family"].startswith("memento")]
    budgets = [r for r in rows if r["family"] == "memento"]
    peers = [r for r in rows if not r["family"].startswith("memento")]
    by_name = {r["name"]: r for r in rows}
    out = []

    # 1. No peer both faster and smaller. memory=None compiles to lax.scan's own program
    # (checked, as in target 4), so it matches lax.scan whatever the noise says.
    beaten = []
    for p in peers:
        if p["name"] == "lax.scan" and size["none_same_program"]:
            continue
        fits = [r for r in ours if r["temp_bytes"] <= p["temp_bytes"]]
        best = min(fits, key=lambda r: r["time_s"], default=None)
        if best is None or best["time_s"] > (1 + DOMINANCE_SLACK) * p["time_s"]:
            beaten.append(
                f"{p['name']} ({_common.mib(p['temp_bytes']):.2f} MiB, {p['time_s']:.3f} s): "
                + (
                    f"best memento no larger is {best['name']} at {best['time_s'] / p['time_s']:.2f}x"
                    if best
                    else "no memento configuration is that small"
                )
            )
    out.append(
        {
            "target": f"1. no peer both faster and smaller [{label}]",
            "pass": not beaten,
            "detail": "; ".join(beaten) or f"all {len(peers)} peer configurations matched",
        }
    )

    # 2. Cost model: the plan's, with the issue's plain one beside it.
    ratios = [(r["name"], r["time_vs_predicted"]) for r in budgets]
    worst = max(ratios, key=lambda nr: abs(nr[1] - 1))
    out.append(
        {
            "target": f"2. memento time within {MODEL_TOLERANCE:.0%} of the plan's model "
            f"`(cost-A)*t_f + A*t_a + T*t_b` [{label}]",
            "pass": all(abs(r - 1) <= MODEL_TOLERANCE for _, r in ratios),
            "detail": "measured/model: "
            + ", ".join(f"{n.split(' (')[0]} {r:.2f}" for n, r in ratios)
            + f" (worst {worst[0]}: {worst[1]:.2f}); against the plain `cost*t_f + T*t_b`: "
            + ", ".join(f"{r['time_vs_plain']:.2f}" for r in budgets),
        }
    )

    # 3. 5% budget against the fastest store-all.
    five = next(r for r in budgets if math.isclose(r["fraction"], 0.05))
    store_all = min(by_name["lax.scan"]["time_s"], by_name["memento None"]["time_s"])
    ratio = five["time_s"] / store_all
    out.append(
        {
            "target": f"3. 5% budget at most {FIVE_PERCENT_LIMIT}x the fastest store-all [{label}]",
            "pass": ratio <= FIVE_PERCENT_LIMIT,
            "detail": f"{five['name']}: {ratio:.2f}x ({five['time_s']:.3f} s vs {store_all:.3f} s)",
        }
    )

    # 4. memory=None is lax.scan. When both compile to the same program, a difference in
    # time is the machine's noise (it is our noise floor), so the program decides.
    ratio = by_name["memento None"]["time_s"] / by_name["lax.scan"]["time_s"]
    within = abs(ratio - 1) <= NONE_TOLERANCE
    same = size["none_same_program"]
    out.append(
        {
            "target": f"4. memory=None within {NONE_TOLERANCE:.0%} of lax.scan [{label}]",
            "pass": within or same,
            "detail": f"measured {ratio:.3f}x; "
            + (
                "the same optimised HLO as lax.scan, so the difference is noise"
                if same
                else "a different program from lax.scan's"
            ),
        }
    )
    return out


def markdown(results: dict) -> str:
    lines = ["# LSTM gradient: memento.scan against its peers", ""]
    lines.append(
        "memory: XLA temp bytes of the jitted gradient; time: median of "
        f"{results['sizes'][0]['repeats']} round-robin runs; evals: forward step evaluations "
        "per step; model: `(cost - A)*t_forward + A*t_advance + T*t_backward` (`cost = evals*T`; A: "
        "re-computed carry-only steps, memento only); error: max relative error of "
        "the gradient against lax.scan."
    )
    m = results.get("machine", {})
    git = m.get("git")
    lines += [
        "",
        f"Measured on {m.get('processor', '?')} ({m.get('cpu_count', '?')} CPUs, shared with "
        f"other jobs), devices {', '.join(m.get('devices', ['?']))}, jax {m.get('jax', '?')}, "
        f"XLA_FLAGS={m.get('xla_flags', '')!r}"
        + (f", commit {git['commit'][:7]}" if git else "")
        + (
            f" with uncommitted {', '.join(git['uncommitted_src'])}"
            if git and git["uncommitted_src"]
            else ""
        )
        + f"; the whole run took {results.get('wall_s', 0):.0f} s.",
    ]
    for size in results["sizes"]:
        lines += [
            "",
            f"## T={size['num_steps']}, H={size['hidden']}, B={size['batch']} "
            f"(carry {size['carry_bytes'] / 1024:.0f} KiB; t_forward "
            f"{size['t_forward_s'] * 1e6:.1f} us, t_advance {size['t_advance_s'] * 1e6:.1f} us, "
            f"t_backward {size['t_backward_s'] * 1e6:.1f} us)",
            "",
            "| method | memory MiB | x lax | time s | x lax | min s | evals | model s | time/model | error |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in size["methods"]:
            ev = r["evaluations_per_step"]
            pred = r["predicted_s"]
            vs = r["time_vs_predicted"]
            lines.append(
                f"| {r['name']}{' ' + r['policy'] if 'policy' in r else ''} "
                f"| {_common.mib(r['temp_bytes']):.2f} | {r['memory_vs_lax']:.3f} "
                f"| {r['time_s']:.3f} | {r['time_vs_lax']:.2f} | {r['min_time_s']:.3f} "
                f"| {'-' if ev is None else f'{ev:.2f}'} "
                f"| {'-' if pred is None else f'{pred:.3f}'} "
                f"| {'-' if vs is None else f'{vs:.2f}'} "
                f"| {r['grad_error']:.1e} |"
            )
    if "equinox_issue_counts" in results:
        lines += [
            "",
            "## Equinox's evaluations per step at the issue's sizes (counted) and the optimum",
            "",
            "| T | checkpoints | Equinox | optimum (memento HSM, m = C) |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for c in results["equinox_issue_counts"]:
            lines.append(
                f"| {c['num_steps']} | {c['checkpoints']} | {c['equinox_per_step']:.2f} "
                f"| {c['optimum_per_step']:.2f} |"
            )
    lines += ["", "## Targets", ""]
    lines.append("Medians (the issue's rule), then the same with each method's fastest run.")
    lines.append("")
    for t in results["targets"]:
        lines.append(f"- **{'PASS' if t['pass'] else 'FAIL'}** {t['target']}: {t['detail']}")
        lines.append(
            f"  - with min times: **{'PASS' if t['pass_min'] else 'FAIL'}**: {t['detail_min']}"
        )
    return "\n".join(lines) + "\n"


_STYLE = {
    "lax.scan": ("*", "black"),
    "memento None": ("x", "tab:gray"),
    "checkpoint/step": ("s", "tab:green"),
    "nested sqrt(T)": ("D", "tab:purple"),
    "memento": ("o", "tab:blue"),
    "memento fit": ("P", "tab:cyan"),
    "equinox": ("^", "tab:orange"),
}


def plot(results: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    sizes = results["sizes"]
    fig = Figure(figsize=(6.5 * len(sizes), 5), layout="constrained")
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    for ax, size in zip(axes, sizes):
        for family, (marker, colour) in _STYLE.items():
            rows = [r for r in size["methods"] if r["family"] == family]
            if not rows:
                continue
            x = [_common.mib(r["temp_bytes"]) for r in rows]
            y = [r["time_s"] for r in rows]
            line = "-" if family in ("memento", "equinox") else ""
            ax.plot(x, y, line + marker, color=colour, label=family, markersize=8, alpha=0.85)
            if family in ("memento", "equinox"):
                for r, xi, yi in zip(rows, x, y):
                    ax.annotate(
                        f"{r['fraction']:.0%}",
                        (xi, yi),
                        textcoords="offset points",
                        xytext=(4, 4 if family == "memento" else -10),
                        fontsize=7,
                        color=colour,
                    )
        ax.set_xscale("log")
        ax.set_xlabel("XLA temp memory of the gradient (MiB, log)")
        ax.set_ylabel("gradient time (s, median)")
        ax.set_title(f"LSTM T={size['num_steps']}, H={size['hidden']}, B={size['batch']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle("time against memory: lower left is better (labels: budget, % of T carries)")
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------


def parse_size(text: str) -> tuple[int, int, int]:
    try:
        t, h, b = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"size must be TxHxB, e.g. 1024x128x32; got {text!r}"
        ) from None
    return t, h, b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size, 5 repeats")
    parser.add_argument(
        "--sizes", type=parse_size, nargs="+", help="sizes TxHxB (default 1024x128x32 4096x64x16)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="round-robin runs (>= 5)")
    parser.add_argument(
        "--multithread",
        action="store_true",
        help="keep XLA's CPU thread pool (default: one thread, steadier on a shared machine)",
    )
    parser.add_argument(
        "--no-count", action="store_true", help="skip counting Equinox's evaluations"
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder"
    )
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="re-evaluate the targets and redraw the table and plot from an earlier run",
    )
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error(f"--repeats must be at least 5, got {args.repeats}")
    if not args.multithread:
        _common.use_one_thread()
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    out = Path(args.out)
    start = time.perf_counter()

    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = {
            "benchmark": "rnn",
            "machine": _common.machine(),
            "fractions": list(FRACTIONS),
            "sizes": [
                run_size(t, h, b, repeats=args.repeats, count=not args.no_count)
                for t, h, b in sizes
            ],
        }
        if not args.no_count:
            results["equinox_issue_counts"] = equinox_issue_counts()
        results["wall_s"] = time.perf_counter() - start
    results["targets"] = []
    for size in results["sizes"]:
        for median, minimum in zip(evaluate_targets(size), evaluate_targets(size, "min")):
            results["targets"].append(
                {**median, "pass_min": minimum["pass"], "detail_min": minimum["detail"]}
            )

    json_path = _common.write_json(out / "rnn.json", results)
    md = markdown(results)
    (out / "rnn.md").write_text(md)
    plot(results, out / "rnn.png")
    print()
    print(md)
    log(f"wrote {json_path}, rnn.md, rnn.png in {results['wall_s']:.0f} s")
    print("\nTargets (medians, the issue's rule; then the same with the fastest run of each):")
    for t in results["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'} {t['target']}: {t['detail']}")
        print(f"    with min times: {'PASS' if t['pass_min'] else 'FAIL'}: {t['detail_min']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
