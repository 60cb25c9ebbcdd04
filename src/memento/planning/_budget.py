"""Memory budgets, NumPy only: parsing ``memory=``, slot sizes, and the schedule to run.

Shared by every executor (`memento.scan`, `memento.while_loop`, `memento.chain`, and
`memento.torch`): ``memory`` is an int of carry-sized slots, a size string such as
``"256MiB"``, or `bytes_budget`; bytes become slots from the measured carry size, and the
paper's alpha from the measured size of a step's internal state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from ._auto import Charges, Policy, auto_policy
from ._dp import plan
from ._schedule import Schedule

__all__ = [
    "Bytes",
    "bytes_budget",
    "choose_policy",
    "choose_schedule",
    "internal_slots",
    "parse_memory",
    "to_slots",
]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "pb": 10**15, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Bytes:
    """A memory budget in bytes; see `bytes_budget`."""

    num_bytes: int


def as_int(value):
    """``value`` as a Python int if it is an integer scalar (int, NumPy or JAX integer,
    a 0-d integer array), else None; bools are not integers here."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if (
        dtype is not None
        and getattr(value, "shape", None) == ()
        and np.issubdtype(np.dtype(dtype), np.integer)
    ):
        try:
            return int(value)  # a concrete JAX or NumPy 0-d array
        except Exception:  # a tracer: not a static budget
            return None
    return None


def bytes_budget(num_bytes: int) -> Bytes:
    """A byte budget for ``memory=``, from an integer number of bytes.

    A plain ``int`` passed as ``memory`` counts carry-sized slots; wrap a byte count with
    this function (or pass a string such as ``"256MiB"``) to mean bytes instead.

    Example:
        >>> memento.scan(f, init, xs, memory=memento.bytes_budget(2**28))  # doctest: +SKIP
    """
    n = as_int(num_bytes)
    if n is None:
        raise TypeError(
            f"memento.bytes_budget: expected an int number of bytes, got {num_bytes!r}."
        )
    num_bytes = n
    if num_bytes < 1:
        raise ValueError(
            f"memento.bytes_budget: expected a positive number of bytes, got {num_bytes}."
        )
    return Bytes(num_bytes)


def parse_memory(memory, *, name: str, arg: str = "memory") -> int | Bytes:
    """``memory=`` as given by the user: an int of slots, or `Bytes`. ``arg`` is the
    argument's name in messages (``"host_memory"`` for a host level's size string)."""
    if isinstance(memory, Bytes):
        return memory
    if isinstance(memory, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", memory)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{name}: cannot read {arg}={memory!r}; pass a size such as '256MiB', "
                "'1.5GB' or '4096B', an int number of slots, or memento.bytes_budget(n)."
            )
        num_bytes = int(float(m.group(1)) * _UNITS[unit])
        if num_bytes < 1:
            fix = (
                "the smallest budget is one carry (memory=1 slot)"
                if arg == "memory"
                else f"pass a size that holds a carry, or an int number of slots ({arg}=0: none)"
            )
            raise ValueError(
                f"{name}: {arg}={memory!r} is {num_bytes} bytes, which holds nothing; {fix}."
            )
        return bytes_budget(num_bytes)
    n = as_int(memory)
    if n is None:
        raise TypeError(
            f"{name}: memory must be None, an int number of carry-sized slots (Python, "
            f"NumPy or a concrete JAX integer), a size string such as '256MiB', or "
            f"memento.bytes_budget(n); got {memory!r}."
        )
    memory = n
    if memory < 1:
        raise ValueError(
            f"{name}: memory={memory} slots is too small; the smallest budget is 1 slot "
            "(the initial carry only, recomputing everything else)."
        )
    return memory


def to_slots(memory: int | Bytes, carry_bytes: int, *, name: str) -> int:
    """Converts a budget into carry-sized slots; a budget below one carry is an error."""
    if isinstance(memory, int):
        return memory
    slots = memory.num_bytes // max(carry_bytes, 1)
    if slots < 1:
        raise ValueError(
            f"{name}: a budget of {memory.num_bytes} bytes cannot hold even one carry of "
            f"{carry_bytes} bytes; the minimum is {carry_bytes} bytes (one slot)."
        )
    return slots


def internal_slots(residual_bytes: int, carry_bytes: int) -> int:
    """The paper's alpha: an internal state (residuals and output carry) in carry slots."""
    return max(1, math.ceil((residual_bytes + carry_bytes) / max(carry_bytes, 1)))


@functools.lru_cache(maxsize=256)
def _plan(num_steps: int, memory: int, policy: Policy, alpha: int | None) -> Schedule:
    return plan(num_steps, memory, policy=policy, alpha=alpha)


def choose_policy(
    num_steps: int,
    slots: int,
    alpha: int,
    policy: Policy,
    *,
    name: str,
    charges: Charges | None = None,
) -> Policy:
    """The policy `choose_schedule` plans: ``policy``, or what ``"auto"`` picks under
    the executor's ``charges`` (default: JAX's, `Charges()`; for HSM without planning it,
    see `memento.planning.auto_policy`)."""
    if policy == "ism" and slots < alpha:
        raise ValueError(
            f"{name}: policy='ism' needs room for one internal state, {alpha} slots "
            f"(measured from the body's residuals); got {slots}. Raise memory or use "
            "policy='hsm' or 'auto'."
        )
    if policy != "auto":
        return policy
    return auto_policy(
        num_steps, slots, alpha, lambda p, a: _plan(num_steps, slots, p, a), charges or Charges()
    )


def choose_schedule(
    num_steps: int,
    slots: int,
    alpha: int,
    policy: Policy,
    *,
    name: str,
    charges: Charges | None = None,
) -> Schedule:
    """The schedule to run for ``num_steps`` steps in ``slots`` carry-sized slots.

    `memento.plan` with the measured alpha (``policy`` validated by the caller), cached.
    """
    policy = choose_policy(num_steps, slots, alpha, policy, name=name, charges=charges)
    return _plan(num_steps, slots, policy, None if policy == "hsm" else alpha)
