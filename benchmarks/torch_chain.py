"""`memento.torch.checkpoint_sequential` against ``torch.utils.checkpoint.checkpoint_sequential``.

The question (issue 22): for layer stacks whose layers differ in cost and size, how fast
is the gradient with memento's optimal chain schedule at the memory that PyTorch's
uniform segments take? Stacks (float32, CPU, small enough for a shared machine):

- ``resnet``: a stem, residual blocks in three stages (32x32x16, 16x16x32, 8x8x64, strided
  projections between), a pooled linear head; 10 layers;
- ``transformer``: ``nn.TransformerEncoderLayer`` blocks (width 64, 4 heads, feed-forward
  256, sequence 128) in two groups with a width change (64 -> 96) between; 10 layers.

For each number of segments ``s`` of PyTorch's ``checkpoint_sequential`` (use_reentrant
False), its peak live tensor bytes ``P_s`` are measured (``memento.torch.LiveBytes``); memento's
budget is then the largest of a grid of byte budgets whose *measured* peak is at most
``P_s`` ("equal memory"), and both are timed round-robin in one process (one thread).
Rotor and Rockmate (other optimal checkpointing libraries for PyTorch) are not installed
here and not compared.

With ``--device cuda`` the stacks and inputs are on the GPU, memory is
``torch.cuda.max_memory_allocated()`` after ``torch.cuda.reset_peak_memory_stats()`` (less
what was allocated before the run; issue 22) and every timed run is bracketed by
``torch.cuda.synchronize()``.

    python benchmarks/torch_chain.py [--repeats 5] [--device cuda]

Writes benchmarks/results/torch_chain.json, or benchmarks/results/gpu/torch_chain.json on
a GPU (``--out``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # _common imports jax: keep it off the GPU

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import memento.torch
from _common import (
    machine,
    torch_device_info,
    torch_peak_bytes,
    torch_synced,
    warm_round_robin,
    write_json,
)

RESULTS = Path(__file__).parent / "results" / "torch_chain.json"
RESULTS_GPU = Path(__file__).parent / "results" / "gpu" / "torch_chain.json"


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1, stride) if (cin != cout or stride != 1) else None

    def forward(self, x):
        y = self.c2(torch.relu(self.c1(x)))
        return torch.relu(y + (x if self.skip is None else self.skip(x)))


def resnet():
    layers = [nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU())]
    layers += [Block(16, 16, 1), Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1)]
    layers += [Block(32, 64, 2), Block(64, 64, 1), Block(64, 64, 1)]
    layers += [nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(64, 10)]
    return nn.Sequential(*layers), torch.randn(8, 3, 32, 32)


def transformer():
    def enc(d):
        return nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)

    layers = [enc(64) for _ in range(4)] + [nn.Linear(64, 96)] + [enc(96) for _ in range(4)]
    layers += [nn.Linear(96, 8)]
    return nn.Sequential(*layers), torch.randn(4, 128, 64)


def bench(name, net, x, segments, repeats, device="cpu"):
    params = list(net.parameters())
    xg = x.clone().requires_grad_()
    existing = [x, xg, *params]

    def zero():
        for p in params:
            p.grad = None
        xg.grad = None

    def plain():
        net(xg).sum().backward()

    def torch_seg(s):
        return lambda: checkpoint_sequential(net, s, xg, use_reentrant=False).sum().backward()

    def ours(memory):
        return lambda: memento.torch.checkpoint_sequential(net, xg, memory=memory).sum().backward()

    zero()
    peaks = {"plain": torch_peak_bytes(plain, existing, device)}
    calls = {"plain": plain}
    for s in segments:
        zero()
        peaks[f"torch {s} segments"] = torch_peak_bytes(torch_seg(s), existing, device)
        calls[f"torch {s} segments"] = torch_seg(s)
    # memento's measured peak on a grid of byte budgets (each planned once, cached).
    grid = {}
    for f in (0.02, 0.04, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0):
        memory = f"{int(f * peaks['plain'])}B"
        try:
            ours(memory)()  # measure and plan outside the peak
        except ValueError:
            continue
        zero()
        grid[memory] = torch_peak_bytes(ours(memory), existing, device)
    matched = {}
    for s in segments:
        target = peaks[f"torch {s} segments"]
        fits = [m for m, p in grid.items() if p <= target]
        if fits:
            best = max(fits, key=lambda m: int(m[:-1]))
            matched[s] = best
            calls[f"memento = torch {s}"] = ours(best)
            peaks[f"memento = torch {s}"] = grid[best]
    times = warm_round_robin(
        {n: torch_synced(lambda c=c: (zero(), c()), device) for n, c in calls.items()}, repeats
    )
    rows = {}
    for n in calls:
        rows[n] = {
            "peak_bytes": peaks[n],
            "time_s": times[n],
            "memory_ratio": peaks[n] / peaks["plain"],
            "time_ratio": times[n] / times["plain"],
        }
    for s, memory in matched.items():
        plan = memento.torch.chain_plan(net, xg, memory=memory)
        rows[f"memento = torch {s}"].update(
            budget=memory,
            evaluations=plan.evaluations().tolist(),
            vs_torch_time=times[f"memento = torch {s}"] / times[f"torch {s} segments"],
            vs_torch_memory=peaks[f"memento = torch {s}"] / peaks[f"torch {s} segments"],
        )
    for n, r in rows.items():
        print(
            f"{name:11s} {n:22s} peak {r['peak_bytes'] / 2**20:7.2f} MiB ({r['memory_ratio']:6.1%})"
            f"  time {r['time_s']:.3f} s ({r['time_ratio']:.2f}x)"
            + (
                f"  vs torch: time {r['vs_torch_time']:.2f}x, memory {r['vs_torch_memory']:.2f}x"
                if "vs_torch_time" in r
                else ""
            ),
            flush=True,
        )
    return {"stack": name, "layers": len(net), "grid": grid, "methods": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name(torch.device(args.device))}", flush=True)
    else:
        torch.set_num_threads(1)
    out = Path(args.out) if args.out else (RESULTS_GPU if gpu else RESULTS)
    torch.manual_seed(0)
    runs = []
    for name, build in (("resnet", resnet), ("transformer", transformer)):
        net, x = build()
        net, x = net.to(args.device), x.to(args.device)
        runs.append(bench(name, net, x, (2, 3, 5), args.repeats, args.device))
    write_json(
        out,
        {
            "machine": machine(),
            "torch": torch_device_info(args.device),
            "memory": "torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), "
            "above the bytes allocated before the run"
            if gpu
            else "peak live tensor bytes (memento.torch.peak_bytes)",
            "not_compared": "Rotor and Rockmate: not installed on this machine",
            "runs": runs,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
