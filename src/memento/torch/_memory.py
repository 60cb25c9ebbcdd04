"""Measured memory on any device: the peak of live tensor bytes while a function runs.

On a GPU, ``torch.cuda.max_memory_allocated`` answers; on CPU PyTorch keeps no such
count. `LiveBytes` keeps one: a ``TorchDispatchMode`` sees every operation (the forward
and the autograd engine's backward operations alike) and counts each new storage its
outputs hold until the storage is freed (a ``weakref.finalize`` on the storage).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._probe import tensors


class LiveBytes(TorchDispatchMode):
    """A context manager: the peak bytes of the storages created inside it and alive.

    Counts every storage an operation returns, once, from its creation until it is
    freed; ``peak`` is the most alive at once. A storage allocated and freed inside one
    operation (its scratch space) is not seen, nor are storages created before the mode
    (pass those that the block may return views of as ``existing``, so that they are
    never counted).

    Attributes:
        live: bytes counted and alive now.
        peak: the most bytes alive at once so far.

    Example:
        >>> with memento.torch.LiveBytes(existing=[x, *model.parameters()]) as mem:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> mem.peak
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = self.peak = 0
        self._tracked: dict[int, int] = {}
        self._skip = {t.untyped_storage().data_ptr() for t in existing}

    def _free(self, key: int) -> None:
        self.live -= self._tracked.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors(out):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._tracked and key not in self._skip:
                self._tracked[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key)
        return out


def peak_bytes(run: Callable[[], object], existing: Iterable[torch.Tensor] = ()) -> int:
    """The peak live tensor bytes of ``run()`` (say, a forward and backward pass), above
    the tensors ``existing`` (parameters, inputs); see `LiveBytes`.

    What the benchmarks of `memento.torch` report as memory on CPU: stored activations
    and the backward pass's working memory, every storage counted while it lives.
    """
    with LiveBytes(existing) as mode:
        run()
    return mode.peak
