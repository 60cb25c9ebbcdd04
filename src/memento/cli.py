"""The ``memento`` command line: plan a schedule, draw the paper's curves, run demos.

Thin by design: it parses arguments, calls the library and prints. Examples::

    memento plan --steps 1000 --memory 50 --policy ism
    memento plan --steps 1000 --memory 250 --policy msm --alpha 5 --json
    memento plan --steps 40 --memory 4 --policy hsm --plot schedule.png
    memento curves --steps 1000 --out figures/
    memento demo --quick
    memento bench metagrad --quick --json metagrad.json

Bad values exit with status 2 and the library's message on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time

__all__ = ["main"]


# The replay is a Python loop (about 1 s per million rows): by default only this many rows
# are replayed; --replay checks any size.
_REPLAY_ROWS = 1_000_000
_PROGRESS_AFTER_S = 2.0  # plans estimated to take longer show their progress on stderr


def _progress(label: str):
    """A `plan` progress callback that redraws one line on stderr."""

    shown = [-1]

    def show(fraction: float) -> None:
        percent = int(100 * fraction)
        if percent == shown[0]:
            return
        shown[0] = percent
        end = "\n" if fraction >= 1.0 else ""
        print(f"\r{label}: {percent:3d}%", end=end, file=sys.stderr, flush=True)

    return show


def _plan(args) -> int:
    from .planning import compare_to_bptt, plan, plan_estimate

    kwargs: dict = dict(policy=args.policy, alpha=args.alpha, beta=args.beta)
    try:
        seconds, _ = plan_estimate(args.steps, args.memory, **kwargs)
    except (ValueError, TypeError):  # plan reports bad values itself, below
        seconds = 0.0
    if seconds > _PROGRESS_AFTER_S:
        kwargs["progress"] = _progress(f"planning (about {seconds:.0f} s)")
    schedule = plan(args.steps, args.memory, **kwargs)
    replay = None
    if args.replay or len(schedule.actions) <= _REPLAY_ROWS:
        replay = schedule.simulate()
    summary = compare_to_bptt(schedule, backward_cost=args.backward_cost)
    if args.plot:
        from ._plotting import plot_schedule

        plot_schedule(schedule, args.plot)
    if args.json:
        record = {
            "policy": schedule.policy,
            "alpha": schedule.alpha,
            "beta": schedule.beta,
            **dataclasses.asdict(summary),
            "budget": schedule.memory,
            "actions": len(schedule.actions),
            "replay": None if replay is None else dataclasses.asdict(replay),
        }
        if args.plot:
            record["plot"] = str(args.plot)
        print(json.dumps(record))
        return 0
    t, b = summary.num_steps, summary.backward_cost
    print(
        f"{schedule.policy.upper()} schedule: {t} steps, {schedule.memory} slots"
        f" (a slot holds a hidden state, an internal state takes alpha={schedule.alpha})"
    )
    print(
        f"  cost            {summary.cost} forward steps, {summary.cost_per_step:.3f} per step"
        " (plain BPTT: 1.000)"
    )
    print(
        f"  memory          {summary.memory} slots at peak: {100 * summary.memory_saved:.1f}%"
        f" less than plain BPTT ({summary.bptt_memory} slots, every internal state)"
    )
    print(
        f"  predicted time  {summary.time_ratio:.3f}x plain BPTT"
        f" (forward = 1, backward = {b:g}: {summary.cost + t * b:.10g} vs {t * (1 + b):.10g})"
    )
    if replay is None:
        print(
            f"  replay          skipped: {len(schedule.actions)} actions (pass --replay to"
            f" check them, about {len(schedule.actions) / 1e6:.0f} s)"
        )
    else:
        print(
            f"  replay          {len(schedule.actions)} actions checked:"
            f" {replay.forward_evaluations} forward evaluations, peak {replay.peak_memory} slots"
        )
    if args.plot:
        print(f"  plot            {args.plot}")
    return 0


def _curves(args) -> int:
    from ._plotting import write_curves

    start = time.perf_counter()
    written = write_curves(args.steps, args.out)
    seconds = time.perf_counter() - start
    print(f"Figures 2a, 5a, 5b, 6, 7 of Gruslys et al. for t = 1..{args.steps} ({seconds:.1f} s):")
    for path in written:
        print(f"  {path}")
    return 0


def _delegate(module: str, command: str):
    """A handler that imports ``module`` only when the subcommand runs, then calls its main."""

    def handler(args) -> int:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            print(f"memento {command}: not available ({module}: {e})", file=sys.stderr)
            return 1
        return int(mod.main(args) or 0)

    return handler


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memento",
        description="Optimal gradient checkpointing through long loops (Gruslys et al. 2016).",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"memento {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plan",
        help="plan a schedule and report its cost, memory and predicted time",
        description="Plan the optimal schedule for STEPS steps in MEMORY slots and compare it"
        " with plain BPTT (time model: forward = 1, backward = --backward-cost).",
    )
    p.add_argument("--steps", type=int, required=True, help="sequence length t")
    p.add_argument("--memory", type=int, required=True, help="budget m, in slots")
    p.add_argument(
        "--policy",
        required=True,
        help="hsm (hidden states only), ism (internal states only) or msm (mixed)",
    )
    p.add_argument("--alpha", type=int, help="slots per internal state")
    p.add_argument("--beta", type=int, help="slots per internal state whose input is held")
    p.add_argument(
        "--backward-cost",
        type=float,
        default=2.0,
        help="time of a backward step in forward steps (default 2)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw the schedule (Figure 3 style)")
    p.add_argument(
        "--replay",
        action="store_true",
        help=f"replay (check) the schedule even above {_REPLAY_ROWS:,} actions (slow)",
    )
    p.set_defaults(handler=_plan)

    p = sub.add_parser(
        "curves",
        help="reproduce Figures 2a, 5a, 5b, 6 and 7 of the paper (PNG and CSV)",
    )
    p.add_argument("--steps", type=int, default=1000, help="longest sequence (default 1000)")
    p.add_argument("--out", default="memento-curves", help="output folder")
    p.set_defaults(handler=_curves)

    p = sub.add_parser("demo", help="run the JAX demo (memento.loops)")
    p.add_argument("--steps", type=int, default=None, help="sequence length")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder")
    p.add_argument("--quick", action="store_true", help="small sizes")
    p.set_defaults(handler=_delegate("memento.loops._demo", "demo"))

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    p = bench.add_parser("metagrad", help="meta-gradient benchmark (memento.meta)")
    p.add_argument("--quick", action="store_true", help="small sizes")
    p.add_argument("--json", default=None, metavar="FILE", help="write results as JSON")
    p.set_defaults(handler=_delegate("memento.meta._bench", "bench metagrad"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the ``memento`` command line; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success; 2 for bad arguments, values the library rejects or files that cannot
        be written (the message is printed on stderr, without a traceback); 1 when an
        optional subcommand is not available.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage errors
        return e.code if isinstance(e.code, int) else 0
    try:
        return args.handler(args)
    except (ValueError, TypeError, NotImplementedError, OSError) as e:
        print(f"memento {args.command}: error: {e}", file=sys.stderr)
        return 2
