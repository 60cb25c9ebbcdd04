"""`memento.torch.scan` against PyTorch's own checkpointing, on an ``nn.LSTMCell`` loop.

The question (issue 22): at 5% and 25% of plain autograd's memory, how fast is the
gradient through a long LSTM loop with memento's optimal schedule, next to what PyTorch
offers: plain autograd (store everything), ``torch.utils.checkpoint`` on every step
(stores the carry of every step, recomputes each step once), and ``sqrt(T)`` segments
(``torch.utils.checkpoint`` on segments of ~sqrt(T) steps). All in one process, float32
on CPU, forward and backward of ``loss = h_T.sum()``.

Memory: peak live tensor bytes during the forward and backward pass, above the inputs
and parameters (``memento.torch.LiveBytes``: a dispatch mode that counts every storage an
operation creates until it is freed); with ``--device cuda``,
``torch.cuda.max_memory_allocated()`` after ``torch.cuda.reset_peak_memory_stats()``, less
what was allocated before the run (issue 22). memento's budget is that fraction of plain
autograd's measured peak, in bytes (``memory="...B"``). Time: median of round-robin runs,
one thread on CPU; on a GPU each run is bracketed by ``torch.cuda.synchronize()``.
Also the paper's headline (Gruslys et al. 2016): t = 1000 at 5% memory, about 1.33x the
time of plain BPTT. ``floor``: plain autograd followed by as many extra ``no_grad``
steps as memento's plan recomputes (``cost - T``), the time of the plan's recomputation
with no executor around it (its memory is plain autograd's; ignore that column).

    python benchmarks/torch_rnn.py [--steps 4096] [--batch 16] [--hidden 64] [--repeats 5]
    python benchmarks/torch_rnn.py --device cuda --steps 1000 --batch 128 --hidden 1024 --no-headline

Writes benchmarks/results/torch_rnn.json, or benchmarks/results/gpu/torch_rnn.json on a
GPU (``--out``).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # _common imports jax: keep it off the GPU

import torch
from torch.utils.checkpoint import checkpoint

import memento.planning
import memento.torch
from _common import (
    machine,
    torch_device_info,
    torch_peak_bytes,
    torch_synced,
    warm_round_robin,
    write_json,
)

RESULTS = Path(__file__).parent / "results" / "torch_rnn.json"
RESULTS_GPU = Path(__file__).parent / "results" / "gpu" / "torch_rnn.json"


def methods(cell, xs, h0, fractions, plain_peak):
    def plain():
        h = h0
        for x in xs:
            h = cell(x, h)
        h[0].sum().backward()

    def every_step():
        h = h0
        for x in xs:
            h = checkpoint(cell, x, h, use_reentrant=False)
        h[0].sum().backward()

    seg = max(1, round(math.sqrt(len(xs))))

    def segment(h, c, xs_seg):
        hc = (h, c)
        for x in xs_seg:
            hc = cell(x, hc)
        return hc

    def sqrt_segments():
        h = h0
        for s in range(0, len(xs), seg):
            h = checkpoint(segment, *h, xs[s : s + seg], use_reentrant=False)
        h[0].sum().backward()

    def step(hc, x):
        return cell(x, hc), None

    out = {
        "plain": plain,
        "checkpoint every step": every_step,
        f"sqrt(T) segments ({seg})": sqrt_segments,
    }
    budgets = {}
    for f in fractions:
        memory = f"{int(f * plain_peak)}B"
        budgets[f"memento {f:.0%}"] = memory

        def run(memory=memory):
            (h, _), _ = memento.torch.scan(step, h0, xs, memory=memory)
            h.sum().backward()

        out[f"memento {f:.0%}"] = run
        if plain_peak > 1:  # the plan's floor: plain autograd plus its extra evaluations
            extra = memento.torch.scan_schedule(step, h0, xs, memory=memory).cost - len(xs)

            def floor(extra=extra):
                plain()
                with torch.no_grad():
                    h = h0
                    for x in xs[:extra]:
                        h = cell(x, h)

            out[f"floor {f:.0%}"] = floor
    return out, budgets, step


def bench(steps, batch, hidden, fractions, repeats, device="cpu"):
    torch.manual_seed(0)
    cell = torch.nn.LSTMCell(hidden, hidden, device=device)
    xs = torch.randn(steps, batch, hidden, device=device)
    h0 = (torch.zeros(batch, hidden, device=device), torch.zeros(batch, hidden, device=device))
    existing = [xs, *h0, *cell.parameters()]

    def zero():
        for p in cell.parameters():
            p.grad = None

    calls, budgets, step = methods(cell, xs, h0, fractions, 1)  # plain first, to size budgets
    zero()
    plain_peak = torch_peak_bytes(calls["plain"], existing, device)
    calls, budgets, step = methods(cell, xs, h0, fractions, plain_peak)
    rows = {}
    for name, call in calls.items():
        zero()
        rows[name] = {
            "peak_bytes": plain_peak
            if name == "plain"
            else torch_peak_bytes(call, existing, device)
        }
        if name in budgets:
            s = memento.torch.scan_schedule(step, h0, xs, memory=budgets[name])
            rows[name].update(
                budget=budgets[name],
                policy=s.policy,
                alpha=s.alpha,
                slots=s.memory,
                cost_per_step=s.cost / steps,
                # one torch.autograd.grad per run of backward steps
                grad_calls=int(steps - memento.planning.internals.backward_runs(s).sum()),
            )
    times = warm_round_robin(
        {n: torch_synced(lambda c=c: (zero(), c()), device) for n, c in calls.items()}, repeats
    )
    for name, row in rows.items():
        row["time_s"] = times[name]
        row["memory_ratio"] = row["peak_bytes"] / plain_peak
        row["time_ratio"] = times[name] / times["plain"]
        print(
            f"T={steps:5d} {name:26s} peak {row['peak_bytes'] / 2**20:8.2f} MiB "
            f"({row['memory_ratio']:6.1%})  time {times[name]:7.3f} s ({row['time_ratio']:.2f}x)",
            flush=True,
        )
    return {"steps": steps, "batch": batch, "hidden": hidden, "device": device, "methods": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    parser.add_argument("--no-headline", action="store_true", help="skip the T=1000 run")
    parser.add_argument(
        "--fractions", default="0.05,0.25", help="memento's budgets, fractions of plain's peak"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name(torch.device(args.device))}", flush=True)
    else:
        torch.set_num_threads(1)  # a shared machine: one thread each, steadier times
    out = Path(args.out) if args.out else (RESULTS_GPU if gpu else RESULTS)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    runs = [bench(args.steps, args.batch, args.hidden, fractions, args.repeats, args.device)]
    if not args.no_headline:  # the paper's headline
        runs.append(bench(1000, args.batch, args.hidden, (0.05,), args.repeats, args.device))
    write_json(
        out,
        {
            "machine": machine(),
            "torch": torch_device_info(args.device),
            "memory": "torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), "
            "above the bytes allocated before the run"
            if gpu
            else "peak live tensor bytes (memento.torch.peak_bytes)",
            "runs": runs,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
