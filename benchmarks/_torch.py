"""Measuring PyTorch on CPU for the torch benchmarks: peak live tensor bytes, and time.

Memory: `LiveBytes`, a ``TorchDispatchMode`` that sees every operation (forward and the
autograd engine's backward ops alike) and counts each new storage its outputs hold until
the storage is freed (a ``weakref.finalize`` on the storage). The peak over a forward and
backward pass, above what was live before (parameters and inputs are excluded by
passing them as ``existing``), is the number reported: the live tensor bytes the
gradient needs, stored activations and the backward's working memory included. A
storage allocated and freed inside one operation (its scratch space) is not seen.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created while the mode is active and still alive."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = self.peak = 0
        self.tracked: dict[int, int] = {}
        self.skip = {t.untyped_storage().data_ptr() for t in existing}

    def _free(self, key: int) -> None:
        self.live -= self.tracked.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key and key not in self.tracked and key not in self.skip:
                self.tracked[key] = st.nbytes()
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, key)
        return out


def peak_bytes(run: Callable[[], object], existing: Iterable[torch.Tensor]) -> int:
    """Peak live tensor bytes of ``run()`` (a forward and backward pass), see `LiveBytes`."""
    with LiveBytes(existing) as mode:
        run()
    return mode.peak


def time_round_robin(calls: Mapping[str, Callable[[], object]], repeats: int = 5) -> dict:
    """Median seconds of each call, timed in interleaved rounds (one warm-up each)."""
    for c in calls.values():
        c()
    times: dict[str, list[float]] = {n: [] for n in calls}
    names = list(calls)
    for r in range(repeats):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            start = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(v) for n, v in times.items()}


def torch_info() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads()}
