"""Memory budgets, NumPy only: reading ``memory=`` and turning it into slots.

Shared by every executor (`memento.scan`, `memento.while_loop`, `memento.chain`, and
`memento.torch`) and the command line: ``memory`` is an int of carry-sized slots, a size
string such as ``"256MiB"`` or `bytes_budget` (`Bytes`), or a percentage such as ``"5%"``
(`Percent`) of what storing every step takes. Bytes become slots from the measured carry
size, a percentage from the measured need, and the paper's alpha from the measured size of
a step's internal state.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import re

import numpy as np

__all__ = [
    "Bytes",
    "Percent",
    "bytes_budget",
    "internal_slots",
    "parse_memory",
    "parse_size",
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


@dataclasses.dataclass(frozen=True)
class Percent:
    """A memory budget as a percentage of what storing every step takes (``"5%"``).

    Resolved by `share` where that need is known: ``floor(percent / 100 * need)`` slots,
    computed exactly from the decimal written (``"0.1%"`` is 1/1000). See `parse_memory`
    for what each entry point counts as the need.

    Attributes:
        percent: the percentage, ``0 < percent <= 100``.
    """

    percent: float

    def share(
        self, need: int, *, name: str, what: str = "storing every step", unit: str = "slots"
    ) -> int:
        """``floor(percent / 100 * need)``: the budget, in the unit ``need`` is counted in.

        Raises:
            ValueError: a share of ``need`` below one unit (the message names the smallest
                percentage that holds one).
        """
        share = math.floor(fractions.Fraction(repr(self.percent)) * need / 100)
        if share < 1:
            least = 100 / max(need, 1)
            raise ValueError(
                f"{name}: memory='{self.percent:g}%' of {need} {unit} ({what}) is less than "
                f"one; pass at least '{least:.3g}%', or memory=1 (one slot)."
            )
        return share


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


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_PERCENT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*%\s*")


def parse_size(text: str) -> int | None:
    """A size string (``"4096"``, ``"4KiB"``, ``"1.5GB"``) in bytes, or None if ``text``
    is not one. A bare number is bytes."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[unit])


def _parse_percent(text: str, *, name: str) -> Percent:
    m = _PERCENT.fullmatch(text)
    if m is None:
        raise ValueError(
            f"{name}: cannot read memory={text!r} as a percentage; write a number in "
            "(0, 100] followed by '%', such as '5%' or '0.5%'."
        )
    percent = float(m.group(1))
    if not 0 < percent <= 100:
        raise ValueError(
            f"{name}: memory={text!r} is outside (0%, 100%]; 100% stores every step "
            "(as lax.scan), so a budget is a percentage above 0 and at most 100, such as '5%'."
        )
    return Percent(percent)


def parse_memory(memory, *, name: str, arg: str = "memory") -> int | Bytes | Percent:
    """``memory=`` as given by the user: an int of slots, `Bytes`, or `Percent`. ``arg``
    is the argument's name in messages (``"host_memory"`` for a host level's size).

    Accepted forms:

    - an int (Python, NumPy or a concrete 0-d JAX integer): carry-sized slots;
    - a size string, ``"256MiB"``, ``"1.5GB"``, ``"4096B"`` (SI and binary units), or
      `bytes_budget`: bytes, turned into slots by `to_slots` from the carry's size;
    - a percentage string, ``"5%"``: that share of what storing every step takes,
      ``floor(percent / 100 * need)`` slots (`Percent.share`, at least one), where the
      need is counted in carry-sized slots as the entry point stores every step:
      `memento.scan` and `memento.torch.scan`: every step's internal state, ``num_steps
      * alpha`` (``lax.scan``'s memory; alpha is measured from the residuals actually
      differentiated); `memento.while_loop`: every carry, ``max_steps + 1`` (what
      ``memory=None`` keeps; a percentage needs ``max_steps``); `memento.chain` and
      `memento.torch.checkpoint_sequential`: every layer's internal state, in bytes;
      `memento.plan`: ``num_steps * alpha`` (``num_steps`` for HSM).

    Raises:
        TypeError: anything else (a float, a bool).
        ValueError: a string that is neither a size nor a percentage; a size of 0 bytes;
            fewer than 1 slot; a percentage outside (0, 100].
    """
    if isinstance(memory, Bytes | Percent):
        return memory
    if isinstance(memory, str):
        if "%" in memory:
            return _parse_percent(memory, name=name)
        num_bytes = parse_size(memory)
        if num_bytes is None:
            raise ValueError(
                f"{name}: cannot read {arg}={memory!r}; pass a size such as '256MiB', "
                "'1.5GB' or '4096B', a percentage such as '5%' of storing every step, an "
                "int number of slots, or memento.bytes_budget(n)."
            )
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
            f"NumPy or a concrete JAX integer), a size string such as '256MiB', a "
            f"percentage such as '5%', or memento.bytes_budget(n); got {memory!r}."
        )
    memory = n
    if memory < 1:
        raise ValueError(
            f"{name}: memory={memory} slots is too small; the smallest budget is 1 slot "
            "(the initial carry only, recomputing everything else)."
        )
    return memory


def to_slots(
    memory: int | Bytes | Percent, carry_bytes: int, *, name: str, need: int | None = None
) -> int:
    """Converts a budget into carry-sized slots; a budget below one carry is an error.

    Args:
        memory: from `parse_memory`.
        carry_bytes: the size of one slot.
        name: the public function, for messages.
        need: the slots storing every step takes, which a `Percent` is a share of.

    Raises:
        ValueError: bytes below one carry, or a percentage below one slot.
        TypeError: a `Percent` without ``need`` (an entry point that cannot count it).
    """
    if isinstance(memory, int):
        return memory
    if isinstance(memory, Percent):
        if need is None:
            raise TypeError(f"{name}: memory='{memory.percent:g}%' needs a total to be a share of.")
        return memory.share(need, name=name)
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
