"""The NumPy glue that both executors of layer stacks share (`memento.chain` in JAX,
`memento.torch.checkpoint_sequential`): checking the layers and the budget, and turning
measured costs and sizes into a `ChainPlan`. Each executor measures its own way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ._budget import Bytes, Percent
from ._chain import plan_chain_bytes
from ._request import CHAIN_POLICIES, ChainPolicy, read_request
from ._schedule import Schedule, step_evaluations

__all__ = ["CHAIN_POLICIES", "ChainPlan", "ChainPolicy", "check_layers", "plan_layers"]


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    """What an executor of layer stacks measured of its layers, and the schedule it runs.

    Attributes:
        schedule: the plan (`memento.planning.plan_chain`), sizes in units of
            ``unit_bytes``, costs in quantised flops.
        unit_bytes: bytes per size unit of ``schedule``.
        budget_bytes: the budget, in bytes.
        hidden_bytes: bytes of ``x_0 .. x_n`` (``x_n``, the output, is never stored).
        internal_bytes: bytes of each layer's internal state: its input, its output and
            the other tensors its backward keeps (parameters excluded).
        flops: each layer's measured cost (XLA's flop count for `memento.chain`;
            FlopCounterMode's flops plus the output's elements for
            `memento.torch.checkpoint_sequential`).
    """

    schedule: Schedule
    unit_bytes: int
    budget_bytes: int
    hidden_bytes: tuple[int, ...]
    internal_bytes: tuple[int, ...]
    flops: tuple[float, ...]

    @property
    def num_layers(self) -> int:
        return self.schedule.num_steps

    @property
    def peak_bytes(self) -> int:
        """Most bytes of stored states at once, as planned (an upper bound, sizes rounded
        up to units); the input ``x_0`` included."""
        return self.schedule.peak_memory * self.unit_bytes

    @property
    def planned_flops(self) -> float:
        """Forward flops of the schedule: each evaluation of a layer at its measured cost."""
        return float(np.dot(self.evaluations(), self.flops))

    def evaluations(self) -> np.ndarray:
        """How many times the schedule evaluates each layer (first sweep included)."""
        return step_evaluations(self.schedule)


def check_layers(
    layers, memory, policy, *, name: str, what: str = "fns", kinds: str = "list or tuple"
) -> tuple[list[Callable], int | Bytes | Percent | None]:
    """The layers as a list, and the parsed budget (``None`` for ``memory=None``).

    Args:
        layers: what the user passed; ``what`` names it in messages, ``kinds`` the
            sequences accepted.
        name: the public function, for messages.

    Raises:
        TypeError: not a sequence, a layer that is not callable, a bad ``memory``.
        ValueError: no layers; a policy other than ``CHAIN_POLICIES``; a bad ``memory``.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(
            f"{name}: {what} must be a sequence ({kinds}) of callables, got "
            f"{type(layers).__name__}."
        )
    if len(layers) == 0:
        raise ValueError(f"{name}: {what} is empty; pass at least one layer (a callable).")
    for p, f in enumerate(layers):
        if not callable(f):
            raise TypeError(
                f"{name}: {what}[{p}] is not callable ({type(f).__name__}); every layer must "
                "be a function of one argument, x_p -> x_{p+1}."
            )
    return list(layers), read_request(name, "chain", memory=memory, policy=policy).memory


def plan_layers(
    flops: Sequence[float],
    hidden_bytes: Sequence[int],
    internal_bytes: Sequence[int],
    memory: int | Bytes | Percent,
    policy: ChainPolicy,
    *,
    name: str,
) -> ChainPlan:
    """The `ChainPlan` of measured layers (`plan_chain_bytes`) for a budget in bytes, in
    slots (a slot holds the largest state the plan may store, ``x_0 .. x_{n-1}``), or a
    percentage of the bytes of every layer's internal state (its input, output and
    residuals), summed.

    ``policy="hsm"`` stores layer inputs only; ``"auto"`` and ``"msm"`` choose per layer
    between its input and its whole internal state.

    Raises:
        ValueError: a budget below the size of ``x_0``, or a percentage below one byte.
    """
    hidden = tuple(int(h) for h in hidden_bytes)
    slot = max(1, max(hidden[:-1]))
    if isinstance(memory, Percent):  # a share of every layer's internal state
        need = sum(int(i) for i in internal_bytes)
        total = memory.share(need, name=name, what="every layer's internal state", unit="bytes")
    else:
        total = memory.num_bytes if isinstance(memory, Bytes) else memory * slot
    schedule, unit = plan_chain_bytes(
        flops, hidden, internal_bytes, total, internal=policy != "hsm", name=name
    )
    return ChainPlan(
        schedule,
        unit,
        total,
        hidden,
        tuple(int(i) for i in internal_bytes),
        tuple(float(f) for f in flops),
    )
