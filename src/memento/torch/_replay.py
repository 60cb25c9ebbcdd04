"""What a recomputation restores so that it computes what the forward pass computed.

`torch.utils.checkpoint` replays the random number generators' states and the autocast
state; `memento.torch` replays those and the tensors a step modifies in place (module
buffers such as BatchNorm's running statistics), and checks before the backward pass
that nothing it recomputes from was modified since the forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._probe import tensors

# (device type, enabled, dtype) per device type, and whether autocast caches casts.
AutocastState = tuple


def _devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def autocast_state() -> AutocastState:
    """The autocast settings in force now, for the devices memento replays."""
    per_device = tuple(
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _devices()
    )
    return per_device, torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def autocast(state: AutocastState) -> Iterator[None]:
    """Enters the autocast settings ``state`` (from `autocast_state`)."""
    per_device, cache = state
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in per_device:
            stack.enter_context(
                torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state and, once CUDA is initialised, every GPU's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def rng_moved(a, b) -> bool:
    """Whether random numbers were drawn between the states ``a`` and ``b``."""
    if not torch.equal(a[0], b[0]):
        return True
    if b[1] is None:
        return False
    if a[1] is None:  # CUDA was initialised in between: it may have drawn
        return True
    return any(not torch.equal(x, y) for x, y in zip(a[1], b[1]))


class Snapshots(TorchDispatchMode):
    """Keeps the value of every tensor from outside that an operation is about to modify.

    For passes that only measure (a layer's cost, a step's sizes): `restore` puts back
    what they modified in place (BatchNorm's running statistics, counters), and
    ``mutated`` lists those tensors. An operation modifies an argument when its schema
    marks it written (``Tensor(a!)``); tensors the pass creates are not kept.
    """

    def __init__(self):
        super().__init__()
        self._inside: set[int] = set()
        self._keep: list[torch.Tensor] = []  # ids stay unique while we look
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        # The batch norm kernels write their running statistics though their schemas
        # do not say so.
        stats = "batch_norm" in schema.name and _training(schema, args, kwargs)
        for i, arg in enumerate(schema.arguments):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if not (written or (stats and arg.name in ("running_mean", "running_var"))):
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tensors(value):
                key = t.untyped_storage().data_ptr()
                if key not in self._inside and id(t) not in self.saved:
                    self.saved[id(t)] = (t, t.clone())
        out = func(*args, **kwargs)
        if all(r.alias_info is None for r in schema.returns):  # new tensors, not views
            for t in tensors(out):
                self._inside.add(t.untyped_storage().data_ptr())
                self._keep.append(t)
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for t, old in self.saved.values():
                t.data.copy_(old)  # no version bump: as if the pass had not run
        self._keep.clear()

    @property
    def mutated(self) -> list[torch.Tensor]:
        return [t for t, _ in self.saved.values()]


def _training(schema, args, kwargs) -> bool:
    for i, arg in enumerate(schema.arguments):
        if arg.name == "training":
            return bool(args[i] if i < len(args) else kwargs.get("training"))
    return False


Snapshot = tuple  # (RNG state or None, clones of the state tensors)


class Context:
    """What one call's recomputations replay.

    Attributes:
        autocast: the autocast settings of the forward pass.
        rng: whether the steps draw random numbers (their states are then kept).
        state: tensors from outside that the steps modify in place (module buffers).
        start: the `Snapshot` before the first step.
        watch: (tensor, version) of every tensor the recomputations read from outside
            the steps, as the forward pass left them.
    """

    def __init__(self, *, rng: bool, state: Iterable[torch.Tensor], start: Snapshot):
        self.autocast = autocast_state()
        self.rng = rng
        self.state = list(state)
        self.start = start
        self.watch: list[tuple[torch.Tensor, int]] = []

    @property
    def active(self) -> bool:
        return self.rng or bool(self.state)

    def save(self) -> Snapshot:
        rng = rng_state() if self.rng else None
        with torch.no_grad():
            return rng, [t.clone() for t in self.state]

    def load(self, snap: Snapshot) -> None:
        rng, values = snap
        if rng is not None:
            set_rng_state(rng)
        # Without a version bump: graphs that saved these tensors (batch norm saves its
        # running statistics) saw these values, and the kernels that write them bump none.
        with torch.no_grad():
            for t, v in zip(self.state, values):
                t.data.copy_(v)

    def watch_versions(self, groups: Iterable[Iterable[torch.Tensor]]) -> None:
        """Remembers the versions of the tensors in ``groups`` (not those in ``state``)."""
        skip = {id(t) for t in self.state}
        seen: set[int] = set()
        self.watch = []
        for group in groups:
            for t in group:
                if id(t) not in skip and id(t) not in seen:
                    seen.add(id(t))
                    self.watch.append((t, t._version))

    def check_versions(self, name: str) -> None:
        """Raises if a watched tensor was modified in place since `watch_versions`."""
        for t, version in self.watch:
            if t._version != version:
                raise RuntimeError(
                    f"{name}: one of the tensors its backward pass recomputes from (a "
                    f"{t.dtype} tensor of shape {tuple(t.shape)}) was modified by an inplace "
                    f"operation after the forward pass: it is at version {t._version}; "
                    f"expected version {version} instead. Plain autograd raises the same "
                    "error when it saved that tensor. Call backward() before modifying "
                    "parameters or inputs in place (an optimizer step, a weight update)."
                )

    @contextlib.contextmanager
    def replaying(self) -> Iterator[Any]:
        """Around a backward pass: the caller's RNG states and the state tensors' values
        are put back afterwards, as if the recomputations had not run."""
        if not self.active:
            yield
            return
        before = self.save()
        try:
            yield
        finally:
            self.load(before)
