"""The ``memento`` command line: plan a schedule, draw the paper's curves, run demos.

Thin by design: it parses arguments, calls the library and prints. Examples::

    memento plan --steps 1000 --memory 50 --policy ism
    memento plan --steps 10000 --memory 1%
    memento plan --steps 4096 --memory 5MiB --carry-bytes 4KiB --alpha 9
    memento plan --steps 1000 --memory 250 --policy msm --alpha 5 --json
    memento plan --steps 1000 --memory 10 --host-memory inf --transfer-cost 2
    memento plan --steps 40 --memory 4 --policy hsm --plot schedule.png
    memento plan-chain --costs 1,2,3 --hidden 1,1,2,2 --internal 3,3,4 --memory 6
    memento plan-chain --json chain.json --rows
    memento curves --steps 1000 --out figures/
    memento demo --quick

Bad values exit with status 2 and the library's message on stderr; a missing optional
dependency exits with status 1 and the ``pip install`` that adds it; a reader that stops
early (``| head``) ends the command quietly, with status 0. Progress of long
commands goes to stderr, so stdout stays the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
import time
import typing

__all__ = ["main"]


# The replay is a Python loop (about 1 s per million rows): by default only this many rows
# are replayed; --replay checks any size.
_REPLAY_ROWS = 1_000_000
_PROGRESS_AFTER_S = 2.0  # plans estimated to take longer show their progress on stderr


def _progress_bar(label: str):
    """A `plan` progress callback for stderr: a percentage redrawn in place on a terminal;
    piped into a file, only the start and the end, one line each (no carriage returns)."""

    shown = [-1]
    live = sys.stderr.isatty()

    def show(fraction: float) -> None:
        percent = int(100 * fraction)
        if percent == shown[0] or (not live and 0 < percent < 100 and shown[0] >= 0):
            return
        shown[0] = percent
        if live:
            end = "\n" if fraction >= 1.0 else ""
            print(f"\r{label}: {percent:3d}%", end=end, file=sys.stderr, flush=True)
        else:
            print(f"{label}: {'done' if percent >= 100 else '...'}", file=sys.stderr, flush=True)

    return show


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _percent(fraction: float) -> str:
    """``fraction`` as a percentage with enough digits never to round to 0% or 100%."""
    for digits in range(1, 8):
        text = f"{100 * fraction:.{digits}f}"
        if (float(text) < 100 or fraction >= 1) and (float(text) > 0 or fraction <= 0):
            return text + "%"
    return f"{100 * fraction:.8g}%"


def _progress(message: str) -> None:
    """One line on stderr, so that stdout stays the result (and ``--json`` stays JSON)."""
    print(message, file=sys.stderr, flush=True)


# Optional dependencies: the top-level module -> the extra that installs it.
_EXTRAS = {"jax": "jax", "jaxlib": "jax", "optax": "jax", "matplotlib": "plot"}


def _missing(error: ModuleNotFoundError) -> str | None:
    """A one-line install hint when ``error`` is an optional dependency, else None."""
    root = (error.name or "").partition(".")[0]
    if root not in _EXTRAS:
        return None
    return f'needs {root}, which is not installed: pip install "memento-jax[{_EXTRAS[root]}]"'


def _size(text: str) -> int:
    """An argparse type: a byte count, bare (``4096``) or with a unit (``4KiB``, ``1.5MB``)."""
    from .planning.internals import parse_size

    num_bytes = parse_size(text)
    if num_bytes is None or num_bytes < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in bytes; write a number of bytes such as 4096, or one "
            "with a unit such as 4KiB or 1.5MB"
        )
    return num_bytes


def _lower(text: str) -> str:
    """An argparse type: choices in any case (``--policy HSM``)."""
    return text.strip().lower()


def _budget(text: str, flag: str, *, carry_bytes: int | None, need: int, what: str) -> int:
    """``text`` (slots, a size with ``--carry-bytes``, or a percentage of ``need``) in slots."""
    from .planning import Bytes
    from .planning.internals import Percent, parse_memory, parse_size, to_slots

    name = flag
    if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text):
        raise ValueError(
            f"{flag} {text} is not a whole number of slots; pass an integer, a percentage "
            "such as 5%, or a size such as 5MiB with --carry-bytes."
        )
    if text.strip().isdigit():
        return int(text)  # the planner reports a budget too small for its policy
    if "%" not in text and parse_size(text) is None:
        raise ValueError(
            f"{flag} {text!r} is not a number of slots, a percentage such as 5%, or a size "
            "such as 5MiB (with --carry-bytes)."
        )
    budget = parse_memory(text, name=name)
    if isinstance(budget, Bytes):
        if carry_bytes is None:
            raise ValueError(
                f"{flag} {text} is a size in bytes; plans count slots of one carry, so give "
                "the carry's size too (--carry-bytes 4KiB, say), or pass a number of slots "
                "or a percentage such as 5%."
            )
        return to_slots(budget, carry_bytes, name=name)
    if isinstance(budget, Percent):
        return budget.share(need, name=name, what=what)
    return budget


def _in_bytes(text: str | None) -> bool:
    from .planning.internals import parse_size

    return text is not None and not text.strip().isdigit() and parse_size(text) is not None


def _kind(text: str) -> str:
    return "a percentage" if "%" in text else "a number of slots"


def _slots(args) -> int:
    """``--memory`` in slots: a number, bytes over ``--carry-bytes``, or a percentage of
    every step's internal state (``--steps`` times ``--alpha``, as `memento.plan`)."""
    alpha = 1 if args.alpha is None else args.alpha
    if args.carry_bytes is not None and not any(
        _in_bytes(text) for text in (args.memory, args.host_memory)
    ):
        raise ValueError(
            f"--carry-bytes turns a size in bytes such as 5MiB into slots; --memory "
            f"{args.memory} is already {_kind(args.memory)}: drop --carry-bytes, or give "
            "--memory in bytes."
        )
    return _budget(
        args.memory,
        "--memory",
        carry_bytes=args.carry_bytes,
        need=max(args.steps, 0) * max(alpha, 1),
        what="every step's internal state, --steps x --alpha",
    )


def _schedule(args, slots: int):
    from .planning import plan, plan_estimate

    kwargs: dict = dict(policy=args.policy, alpha=args.alpha, beta=args.beta)
    try:
        seconds, _ = plan_estimate(args.steps, slots, **kwargs)
    except (ValueError, TypeError):  # plan reports bad values itself
        seconds = 0.0
    if seconds > _PROGRESS_AFTER_S:
        kwargs["progress"] = _progress_bar(f"planning (about {seconds:.0f} s)")
    return plan(args.steps, slots, **kwargs)


def _describe(schedule) -> str:
    """What a slot is under the schedule's memory model, for the first line."""
    from .planning import Op

    a, b = schedule.alpha, schedule.beta
    h0 = "h_0 takes one" if schedule.counts_initial else "h_0 is given, not counted"
    if not (schedule.actions[:, 0] == Op.SAVE_INTERNAL).any():  # HSM, revolve
        policy = schedule.policy.upper()
        return f"a slot holds one hidden state; {policy} stores hidden states only; {h0}"
    internal = f"an internal state takes alpha={_plural(a, 'slot')}"
    if schedule.policy == "msm" and b != a:
        internal += f" ({b} when its input hidden state is stored)"
    return f"a slot holds one hidden state; {internal}; {h0}"


def _host_args(args) -> dict[str, typing.Any]:
    """``--host-memory``, ``--transfer-cost``, ``--overlap`` as `plan`'s keywords."""
    if args.host_memory is None:
        if args.transfer_cost is not None or args.overlap != "step":
            raise ValueError("--transfer-cost and --overlap apply with --host-memory H")
        return {}
    text = args.host_memory.strip().lower()
    if text in ("inf", "unbounded"):
        host = float("inf")
    elif text.isdigit():
        host = int(text)
    else:
        host = _budget(
            args.host_memory,
            "--host-memory",
            carry_bytes=args.carry_bytes,
            need=max(args.steps, 0) * max(args.alpha or 1, 1),
            what="every step's internal state, --steps x --alpha",
        )
    cost = None
    if args.transfer_cost is not None:
        try:
            parts = [float(v) for v in args.transfer_cost.split(",")]
        except ValueError:
            raise ValueError(
                f"--transfer-cost must be a number or WRITE,READ, got {args.transfer_cost!r}"
            ) from None
        cost = parts[0] if len(parts) == 1 else tuple(parts)
    return dict(host_memory=host, transfer_cost=cost, overlap=args.overlap)


def _plan_two_level(args, host: dict) -> int:
    """``memento plan --host-memory``: a two-level plan, replayed, against the device alone."""
    from .planning import plan

    slots = _slots(args)
    policy = args.policy
    if policy == "auto":  # two levels plan HSM or MSM: MSM where internal states are sized
        policy = "hsm" if args.alpha is None else "msm"
    kwargs: dict = dict(policy=policy, alpha=args.alpha, beta=args.beta)
    start = time.perf_counter()
    schedule = plan(args.steps, slots, **kwargs, **host)
    seconds = time.perf_counter() - start
    replay = schedule.simulate()
    device = plan(args.steps, slots, **kwargs)
    write, read = schedule.transfer_cost
    if args.json:
        record = {
            "policy": schedule.policy,
            "num_steps": schedule.num_steps,
            "alpha": schedule.alpha,
            "beta": schedule.beta,
            "memory": schedule.memory,
            "host_memory": None if schedule.host_memory == float("inf") else schedule.host_memory,
            "transfer_cost": [write, read],
            "overlap": schedule.overlap,
            "cost": schedule.cost,
            "device_only_cost": device.cost,
            "plan_seconds": seconds,
            "actions": len(schedule.actions),
            "replay": {**dataclasses.asdict(replay), "cost": replay.cost},
        }
        print(json.dumps(record))
        return 0
    t = schedule.num_steps
    hm = (
        "unbounded"
        if schedule.host_memory == float("inf")
        else _plural(host["host_memory"], "slot")
    )
    print(
        f"two-level {schedule.policy.upper()} schedule: {_plural(t, 'step')},"
        f" device {_plural(schedule.memory, 'slot')} (h_0 takes one), host {hm}"
    )
    how = (
        "each copy hides behind one step of compute"
        if schedule.overlap == "step"
        else "copies add in full"
    )
    print(f"  transfers       {write:g} to the host, {read:g} back per slot ({how})")
    print(
        f"  cost            {schedule.cost:.10g} step units, {schedule.cost / t:.3f} per step:"
        f" {_plural(replay.forward_evaluations, 'forward evaluation')}"
        f" + {replay.transfer_time:.10g} transfer stall"
    )
    print(
        f"  device only     {_plural(int(device.cost), 'forward step')} in the same device slots"
        f" ({device.cost / schedule.cost:.3f}x the two-level cost)"
    )
    print(f"  device peak     {_plural(replay.peak_memory, 'slot')}")
    print(f"  host peak       {_plural(replay.peak_host_memory, 'slot')}")
    print(f"  transfers       {replay.host_stores} to the host, {replay.host_loads} back")
    print(
        f"  replay          {_plural(len(schedule.actions), 'action')} checked"
        f" (planned in {seconds:.2f} s)"
    )
    print("  note            memento.scan does not run host schedules yet (planner only)")
    return 0


def _plan(args) -> int:
    from .planning import compare_to_bptt

    host = _host_args(args)
    if host:
        if args.plot:
            raise ValueError("--plot draws one-level schedules; drop --plot or --host-memory")
        return _plan_two_level(args, host)
    if args.steps > 20_000:
        _progress(f"memento plan: planning {args.steps} steps ...")
    schedule = _schedule(args, _slots(args))
    replay = None
    if args.replay or len(schedule.actions) <= _REPLAY_ROWS:
        if len(schedule.actions) > 200_000:
            _progress(f"memento plan: replaying {len(schedule.actions)} actions ...")
        replay = schedule.simulate()
    summary = compare_to_bptt(schedule, backward_cost=args.backward_cost)
    if args.plot:
        from .apps.plotting import plot_schedule

        plot_schedule(schedule, args.plot)
    if args.json:
        record = {
            "policy": schedule.policy,
            "requested_policy": args.policy,
            "alpha": schedule.alpha,
            "beta": schedule.beta,
            "counts_initial": schedule.counts_initial,
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
    chosen = ""
    if args.policy == "auto":
        chosen = f" (policy auto, as memento.scan with alpha={schedule.alpha})"
    budget = _plural(schedule.memory, "slot")
    if args.carry_bytes is not None:
        budget += f" = {args.memory} in {args.carry_bytes}-byte carries"
    print(
        f"{schedule.policy.upper()} schedule{chosen}: {_plural(t, 'step')}, {budget}"
        f" ({_describe(schedule)})"
    )
    print(
        f"  cost            {_plural(summary.cost, 'forward step')},"
        f" {summary.cost_per_step:.3f} per step (plain BPTT: 1.000)"
    )
    # Plain BPTT keeps every internal state (beta slots each: its input is held by the
    # previous one) and, where the policy counts it, h_0.
    internal = _plural(t, "internal state")
    contents = f"h_0 and {internal}" if schedule.counts_initial else internal
    if schedule.beta != 1:
        contents += f" of {schedule.beta} slots"
    print(
        f"  memory          {_plural(summary.memory, 'slot')} at peak:"
        f" {_percent(summary.memory_saved)} less than plain BPTT"
        f" ({_plural(summary.bptt_memory, 'slot')}: {contents})"
    )
    print(
        f"  predicted time  {summary.time_ratio:.3f}x plain BPTT"
        f" (forward = 1, backward = {b:g}: {summary.cost + t * b:.10g} vs {t * (1 + b):.10g})"
    )
    if replay is None:
        print(
            f"  replay          skipped: {_plural(len(schedule.actions), 'action')} (pass"
            f" --replay to check them, about {len(schedule.actions) / 1e6:.0f} s)"
        )
    else:
        print(
            f"  replay          {_plural(len(schedule.actions), 'action')} checked:"
            f" {_plural(replay.forward_evaluations, 'forward evaluation')},"
            f" peak {_plural(replay.peak_memory, 'slot')}"
        )
    if args.plot:
        print(f"  plot            {args.plot}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _chain_problem(args) -> dict:
    """The chain to plan: from --json FILE, or from --costs/--hidden/--internal/--memory."""
    flags = ("costs", "hidden", "internal", "memory")
    if args.json is not None:
        given = [f"--{f}" for f in flags if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--json FILE gives the whole chain; drop {', '.join(given)}")
        with open(args.json) as f:
            data = json.load(f)
        missing = [k for k in flags if k not in data] if isinstance(data, dict) else flags
        if missing:
            raise ValueError(
                f"{args.json}: expected a JSON object with keys {', '.join(flags)}; "
                f"missing {', '.join(missing)}"
            )
        return {k: data[k] for k in flags}
    missing = [f"--{f}" for f in flags if getattr(args, f) is None]
    if missing:
        raise ValueError(f"give {', '.join(missing)} (or --json FILE)")
    internal = _ints(args.internal, "--internal")
    memory = args.memory.strip()
    if memory.endswith("%"):  # a share of every internal state, in the same unit
        from .planning.internals import Percent, parse_memory

        budget = parse_memory(memory, name="memento plan-chain --memory")
        assert isinstance(budget, Percent)
        units = budget.share(
            sum(internal),
            name="memento plan-chain --memory",
            what="every layer's internal state, the sum of --internal",
            unit="units",
        )
    elif memory.isdigit():
        units = int(memory)
    else:
        raise ValueError(
            f"--memory must be an integer in the unit of --hidden and --internal, or a "
            f"percentage of their sum such as 50%; got {args.memory!r}"
        )
    return {
        "costs": _ints(args.costs, "--costs"),
        "hidden": _ints(args.hidden, "--hidden"),
        "internal": internal,
        "memory": units,
    }


def _plan_chain(args) -> int:
    from .planning import Op, plan_chain

    problem = _chain_problem(args)
    try:
        schedule = plan_chain(
            problem["costs"],
            problem["hidden"],
            problem["internal"],
            problem["memory"],
            internal=args.policy != "hsm",
        )
    except ValueError as e:  # the library's argument names, as the flags that gave them
        flags = {"internal_sizes": "--internal", "hidden_sizes": "--hidden"}
        text = re.sub(r"\b(internal_sizes|hidden_sizes)\b", lambda m: flags[m[1]], str(e))
        raise ValueError(text) from None
    replay = schedule.simulate()
    n = schedule.num_steps
    print(
        f"chain schedule ({args.policy}): {_plural(n, 'layer')}, memory {problem['memory']}"
        f" units (h_0 counted, the working state not)"
    )
    print(
        f"  cost            {schedule.cost} (weighted forward cost; each layer once:"
        f" {sum(problem['costs'])})"
    )
    print(f"  peak memory     {replay.peak_memory} units")
    print(
        f"  actions         {len(schedule.actions)} rows, {replay.sweep_length} in the first sweep"
    )
    if args.rows:
        for op, arg, pos in schedule.actions.tolist():
            print(f"    {Op(op).name:<18} arg={arg:<3} pos={pos}")
    return 0


def _curves(args) -> int:
    from .apps.plotting import write_curves

    start = time.perf_counter()
    log = (lambda line: _progress(f"memento curves: {line}")) if args.steps > 300 else None
    written = write_curves(args.steps, args.out, log=log)
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
            hint = _missing(e) or f"not available ({module}: {e})"
            print(f"memento {command}: {hint}", file=sys.stderr)
            return 1
        return int(mod.main(args) or 0)

    return handler


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memento",
        description="Optimal gradient checkpointing through long loops (Gruslys et al. 2016).",
    )
    from . import __version__
    from .planning import Policy

    parser.add_argument("--version", action="version", version=f"memento {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plan",
        help="plan a schedule and report its cost, memory and predicted time",
        description="Plan the optimal schedule for STEPS steps in MEMORY slots and compare it"
        " with plain BPTT (time model: forward = 1, backward = --backward-cost).",
    )
    p.add_argument("--steps", type=int, required=True, help="sequence length t")
    p.add_argument(
        "--memory",
        required=True,
        help="budget m: a number of slots (one slot holds one carry), a percentage such as"
        " 5%% of storing every step's internal state (steps x alpha slots), or bytes such"
        " as 5MiB together with --carry-bytes",
    )
    p.add_argument(
        "--carry-bytes",
        type=_size,
        metavar="SIZE",
        help="bytes of one carry (one slot), such as 4096 or 4KiB, to read --memory in bytes",
    )
    p.add_argument(
        "--policy",
        default="auto",
        type=_lower,
        choices=typing.get_args(Policy),
        help="auto (default, as memento.scan: the least predicted work of the three),"
        " hsm (hidden states only), ism (internal states only) or msm (mixed)",
    )
    p.add_argument(
        "--alpha",
        type=int,
        help="slots per internal state (memento.scan measures it; default 1)",
    )
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
    p.add_argument(
        "--host-memory",
        metavar="H",
        help="a second level: host slots ('inf': unbounded; a percentage or a size as"
        " --memory); plans hsm or msm on both levels",
    )
    p.add_argument(
        "--transfer-cost",
        metavar="C or W,R",
        help="with --host-memory: time to copy one slot to the host (and back), in forward steps",
    )
    p.add_argument(
        "--overlap",
        choices=("step", "none"),
        type=_lower,
        default="step",
        help="with --host-memory: a copy hides behind one step of compute (step, default) or"
        " adds in full (none)",
    )
    p.set_defaults(handler=_plan)

    p = sub.add_parser(
        "plan-chain",
        help="plan a heterogeneous chain (per-layer costs and sizes) and print the schedule",
        description="Plan the optimal schedule for a chain of layers with different costs"
        " and sizes (Gruslys et al. appendix C, as memento.chain runs it). Sizes are"
        " integers in one unit; internal sizes include the layer's input and output.",
    )
    p.add_argument("--costs", metavar="U0,U1,...", help="forward cost of each of the n layers")
    p.add_argument("--hidden", metavar="S0,...,Sn", help="sizes of the n + 1 hidden states")
    p.add_argument("--internal", metavar="I0,I1,...", help="sizes of the n internal states")
    p.add_argument(
        "--memory",
        metavar="M",
        help="the budget, in the same unit, or a percentage of the sum of --internal (50%%)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help='the chain as a JSON object {"costs": [...], "hidden": [...], "internal": [...],'
        ' "memory": M} instead of the four flags',
    )
    p.add_argument(
        "--policy",
        default="auto",
        type=_lower,
        choices=("auto", "hsm", "msm"),
        help="auto or msm (hidden or internal states, the same), hsm (hidden states only)",
    )
    p.add_argument("--rows", action="store_true", help="print every row of the schedule")
    p.set_defaults(handler=_plan_chain)

    p = sub.add_parser(
        "curves",
        help="reproduce Figures 2a, 5a, 5b, 6 and 7 of the paper (PNG and CSV)",
        description="Redraw Figures 2a, 5a, 5b, 6 and 7 of Gruslys et al. (2016): forward"
        " evaluations per step of HSM, ISM and MSM against the sequence length, at budgets"
        " of 10 to 1000 slots, and against Chen's sqrt(t) checkpointing. Writes a PNG and"
        " the CSV of its data per figure. NumPy plans; drawing needs matplotlib.",
    )
    p.add_argument(
        "--steps", type=int, default=1000, help="longest sequence t (default 1000, about 3 s)"
    )
    p.add_argument(
        "--out",
        default="memento-curves",
        metavar="DIR",
        help="output folder, created if missing (default: memento-curves)",
    )
    p.set_defaults(handler=_curves)

    p = sub.add_parser(
        "demo",
        help="the gradient of an LSTM under a memory budget (needs jax)",
        description="Compile the gradient of an LSTM over many steps with lax.scan, with"
        " jax.checkpoint per step and with memento.scan at memory=1%% and 5%% of what"
        " storing every step takes; print each one's slots, memory, time, forward"
        " evaluations per step and gradient error, explain the terms, and draw the"
        " schedule memento ran (with matplotlib).",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="sequence length T (default 4096; 64 with --quick)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the schedule picture goes (default: memento-demo)",
    )
    p.add_argument("--quick", action="store_true", help="toy sizes, a few seconds")
    p.set_defaults(handler=_delegate("memento.apps.demo", "demo"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the ``memento`` command line; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success; 2 for bad arguments, values the library rejects or files that cannot
        be written (the message is printed on stderr, without a traceback); 1 when an
        optional dependency is missing (with the ``pip install`` that adds it) or an
        optional subcommand is not available.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage errors
        return e.code if isinstance(e.code, int) else 0
    try:
        return args.handler(args)
    except BrokenPipeError:
        # The reader stopped early (``memento plan ... | head``): that is not an error.
        # Point stdout at /dev/null so that the interpreter's final flush fails quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as e:
        hint = _missing(e)
        if hint is None:
            raise
        print(f"memento {args.command}: {hint}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, NotImplementedError, OSError) as e:
        print(f"memento {args.command}: error: {e}", file=sys.stderr)
        return 2
