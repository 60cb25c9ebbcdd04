"""Nested tuples, lists, dicts (and namedtuples) of tensors, flattened to lists of leaves.

A small pytree of our own, so that `memento.torch` depends on no private torch module.
``None`` is an empty subtree (a step may return ``(h, None)``).
"""

from __future__ import annotations

from typing import Any

import torch

# A treedef: ("leaf",), ("none",), ("tuple", children), ("list", children),
# ("namedtuple", type, children) or ("dict", keys, children).
TreeDef = tuple


def flatten(tree: Any, *, name: str, what: str) -> tuple[list[torch.Tensor], TreeDef]:
    """The tensor leaves of ``tree`` in order, and its structure.

    Raises:
        TypeError: a leaf that is not a tensor (``name``: the public function, ``what``:
            the argument, for the message).
    """
    leaves: list[torch.Tensor] = []

    def walk(t: Any, path: str) -> TreeDef:
        if isinstance(t, torch.Tensor):
            leaves.append(t)
            return ("leaf",)
        if t is None:
            return ("none",)
        if isinstance(t, tuple) and hasattr(t, "_fields"):
            return (
                "namedtuple",
                type(t),
                tuple(walk(v, f"{path}.{f}") for f, v in zip(t._fields, t)),
            )
        if isinstance(t, (tuple, list)):
            kind = "tuple" if isinstance(t, tuple) else "list"
            return (kind, tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(t)))
        if isinstance(t, dict):
            keys = tuple(t)
            return ("dict", keys, tuple(walk(t[k], f"{path}[{k!r}]") for k in keys))
        raise TypeError(
            f"{name}: {what}{path} is a {type(t).__name__}, not a tensor; {what} must be a "
            "tensor or nested tuples, lists and dicts of tensors (wrap numbers with "
            "torch.tensor)"
        )

    return leaves, walk(tree, "")


def unflatten(treedef: TreeDef, leaves: list) -> Any:
    """The inverse of `flatten`."""
    it = iter(leaves)

    def build(d: TreeDef) -> Any:
        kind = d[0]
        if kind == "leaf":
            return next(it)
        if kind == "none":
            return None
        if kind == "tuple":
            return tuple(build(c) for c in d[1])
        if kind == "list":
            return [build(c) for c in d[1]]
        if kind == "namedtuple":
            return d[1](*(build(c) for c in d[2]))
        return {k: build(c) for k, c in zip(d[1], d[2])}

    return build(treedef)


def describe(leaves: list[torch.Tensor]) -> list[tuple]:
    """(shape, dtype) of each leaf, for structure checks and messages."""
    return [(tuple(t.shape), t.dtype) for t in leaves]
