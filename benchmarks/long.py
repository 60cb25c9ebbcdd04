"""Very long loops: first-call and steady-state time and memory of a gradient, T = 1e3..1e8.

Issue 12's question: does memento's planning and compiling stay in proportion to the loop
(NumPy-vectorised O(T), no replay on the trace path), and how do its first call, steady
time and memory compare with the peers at the same T?

Methods (a tiny body, a 4-float carry, ``c -> tanh(1.01 c + x)``; loss = sum of the final
carry; gradient with respect to the initial carry):

- ``lax_scan``: ``jax.lax.scan`` (stores every step's residuals);
- ``memento_hsm`` / ``memento_auto``: ``memento.scan(..., memory=100, policy=...)``
  (HSM as schedule rows below ``memento.planning.internals.recursion_min_steps("cpu")``, 2^16 steps on CPU,
  as the recursion on the device from there: no rows, O(slots) planning);
- ``nested_sqrt``: a scan of ~sqrt(T) blocks, each a ``jax.checkpoint`` of a scan;
- ``equinox``: ``equinox.internal.while_loop(kind="checkpointed", checkpoints=100)``
  counting to T.

For each: ``first_s`` (trace + plan + compile + first run, a fresh ``jax.jit``),
``lower_s``, ``compile_s``, ``steady_s`` (median of 3 further runs) and
``temp_kib`` (``memory_analysis().temp_size_in_bytes``), and memento's first call over
``lax.scan``'s at each T (issue 12's target: at most 2 at T = 1e6), and at T = 1e6 for
budgets of 100, 1000 and 10,000 slots (``budgets_at_1e6``, each beside a ``lax.scan``
first call of its own). Sizes a method cannot
handle on this host (memory, time) are skipped and the reason recorded.

Run:  PYTHONPATH=src python benchmarks/long.py [--max-exp 8] [--out PATH]
Writes benchmarks/results/long.json and, with matplotlib, long.png (not committed).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common  # noqa: I001

import jax
import jax.numpy as jnp
from jax import lax

import memento
from memento.loops import _choice
from memento.planning import _choose

MEMORY = 100
CARRY = 4


def step(c, x):
    return jnp.tanh(c * 1.01 + x), None


def make_loss(method: str, T: int, memory: int = MEMORY):
    xs = jnp.full((T,), 1e-3, jnp.float32)
    if method == "lax_scan":
        return lambda c: lax.scan(step, c, xs)[0].sum()
    if method in ("memento_hsm", "memento_auto"):
        policy = method.split("_")[1]
        return lambda c: memento.scan(step, c, xs, memory=memory, policy=policy)[0].sum()
    if method == "nested_sqrt":
        outer = 10 ** (round(math.log10(T)) // 2)
        inner = T // outer
        blocks = xs.reshape(outer, inner)

        @jax.checkpoint
        def block(c, xb):
            return lax.scan(step, c, xb)[0], None

        return lambda c: lax.scan(block, c, blocks)[0].sum()
    if method == "equinox":
        import equinox.internal as eqxi

        def body(s):
            i, c = s
            return i + 1, jnp.tanh(c * 1.01 + 1e-3)

        def loss(c):
            _, c = eqxi.while_loop(
                lambda s: s[0] < T, body, (0, c), max_steps=T, kind="checkpointed",
                checkpoints=MEMORY,
            )  # fmt: skip
            return c.sum()

        return loss
    raise ValueError(method)


# What each method is run up to on a 2-core CPU host in the 15 minutes this script may
# take, and why not beyond.
LIMITS = {
    "lax_scan": (10**7, "stores every step's residuals: GiBs at 1e8"),
    "memento_hsm": (10**8, ""),
    "memento_auto": (10**8, ""),
    "nested_sqrt": (10**7, "stores sqrt(T) carries and one block's residuals: fine, but "
                    "1e8 needs minutes of runs on this host"),
    "equinox": (10**6, "online treeverse at 1e7 takes minutes on this host"),
}  # fmt: skip


def measure(method: str, T: int, memory: int = MEMORY) -> dict:
    # A first call plans and compiles its schedule: memento's caches must not carry a
    # plan over from another method at the same T.
    _choose._plan.cache_clear()
    _choice._compile.cache_clear()
    loss = make_loss(method, T, memory)
    c0 = jnp.ones(CARRY, jnp.float32)
    compiled, first = _common.first_call(jax.grad(loss), c0)
    runs = [_common.time_once(lambda: compiled(c0)) for _ in range(3)]
    mem = compiled.memory_analysis()
    return {
        "method": method,
        "T": T,
        "memory": memory,
        **first,
        "steady_s": statistics.median(runs),
        "temp_kib": mem.temp_size_in_bytes / 1024 if mem is not None else None,
    }


def plan_only(T: int) -> dict:
    """plan(T, 100) alone: seconds, or the up-front refusal."""
    start = time.perf_counter()
    try:
        s = memento.plan(T, MEMORY, policy="hsm")
    except ValueError as e:
        return {"T": T, "refused": str(e), "seconds": time.perf_counter() - start}
    return {"T": T, "seconds": time.perf_counter() - start, "rows": len(s.actions)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-exp", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "long.json"))
    args = parser.parse_args(argv)
    sizes = [10**e for e in range(3, args.max_exp + 1)]
    results, skipped, plans = [], [], []
    for T in sizes:
        plans.append(plan_only(T))
        print("plan", plans[-1], file=sys.stderr, flush=True)
        for method, (limit, why) in LIMITS.items():
            if limit < T:
                skipped.append({"method": method, "T": T, "why": why})
                continue
            r = measure(method, T)
            results.append(r)
            print(
                f"{method:13s} T={T:.0e} first {r['first_s']:.3f}s (lower {r['lower_s']:.3f}, "
                f"compile {r['compile_s']:.3f}, run {r['first_run_s']:.3f}) steady "
                f"{r['steady_s']:.4f}s temp {r['temp_kib']:.1f} KiB",
                file=sys.stderr,
                flush=True,
            )
    # HSM evaluates each step at least twice: the first call at 10^6 steps by budget.
    budgets = []
    if args.max_exp >= 6:
        for memory in (MEMORY, 1000, 10_000):
            for method in ("lax_scan", "memento_hsm"):
                budgets.append(measure(method, 10**6, memory))
            lax_first, hsm_first = budgets[-2]["first_s"], budgets[-1]["first_s"]
            print(f"T=1e6 memory={memory}: memento_hsm first call / lax.scan's "
                  f"{hsm_first / lax_first:.2f}", file=sys.stderr, flush=True)  # fmt: skip
    # The target: memento's first call within 2x lax.scan's, at each T.
    first = {(r["method"], r["T"]): r["first_s"] for r in results}
    ratios = [
        {"method": m, "T": T, "first_call_vs_lax_scan": first[m, T] / first["lax_scan", T]}
        for (m, T) in first
        if m.startswith("memento") and ("lax_scan", T) in first
    ]
    for r in ratios:
        print(f"{r['method']:13s} T={r['T']:.0e} first call / lax.scan's: "
              f"{r['first_call_vs_lax_scan']:.2f}", file=sys.stderr)  # fmt: skip
    data = {
        "machine": _common.machine(),
        "git": _common.git_state(),
        "memory_slots": MEMORY,
        "results": results,
        "skipped": skipped,
        "plan": plans,
        "first_call_ratios": ratios,
        "budgets_at_1e6": budgets,
    }
    path = _common.write_json(args.out, data)
    print(path)
    _plot(results, Path(args.out).with_suffix(".png"))
    return 0


def _plot(results, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, ax in zip(("first_s", "steady_s", "temp_kib"), axes, strict=True):
        for method in LIMITS:
            rows = [r for r in results if r["method"] == method]
            ax.loglog([r["T"] for r in rows], [r[key] for r in rows], "o-", label=method)
        ax.set_xlabel("T (steps)")
        ax.set_title(key)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
