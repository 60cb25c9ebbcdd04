"""Argument checks that the JAX and the PyTorch entry points share (no framework)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_argnums(name: str, argnums: Any) -> tuple[tuple[int, ...], bool]:
    """``(argnums as a tuple, whether a single int was passed)``, as ``jax.grad`` reads
    ``argnums``; a TypeError naming the function ``name`` otherwise."""
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        return (argnums,), True
    if (
        isinstance(argnums, Sequence)
        and argnums
        and all(isinstance(a, int) and not isinstance(a, bool) for a in argnums)
    ):
        return tuple(argnums), False
    raise TypeError(
        f"{name}: argnums must be an int or a non-empty tuple of ints, got {argnums!r}."
    )
