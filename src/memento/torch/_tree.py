"""Nested tuples, lists, dicts (and namedtuples) of tensors, flattened to lists of leaves.

A small pytree of our own, so that `memento.torch` depends on no private torch module.
``None`` is an empty subtree (a step may return ``(h, None)``).
"""

from __future__ import annotations

from typing import Any, cast

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
    try:
        return leaves, _walk(tree, leaves)
    except _NotATensor:
        _walk_named(tree, "", name, what)  # raises, naming the path
        raise


class _NotATensor(Exception):
    pass


_LEAF: TreeDef = ("leaf",)
_NONE: TreeDef = ("none",)


# Module-level recursion: a nested recursive function would be a reference cycle holding
# the leaves (activations) until the garbage collector runs. The executors flatten every
# step's output: no strings are built here (`_walk_named` finds the path of an error).
def _walk(t: Any, leaves: list) -> TreeDef:
    if isinstance(t, torch.Tensor):
        leaves.append(t)
        return _LEAF
    if t is None:
        return _NONE
    if isinstance(t, tuple):
        if hasattr(t, "_fields"):
            return ("namedtuple", type(t), tuple(_walk(v, leaves) for v in t))
        return ("tuple", tuple(_walk(v, leaves) for v in t))
    if isinstance(t, list):
        return ("list", tuple(_walk(v, leaves) for v in t))
    if isinstance(t, dict):
        keys = tuple(t)
        return ("dict", keys, tuple(_walk(t[k], leaves) for k in keys))
    raise _NotATensor


def _walk_named(t: Any, path: str, name: str, what: str) -> None:
    if isinstance(t, torch.Tensor) or t is None:
        return
    if isinstance(t, tuple) and hasattr(t, "_fields"):
        for f, v in zip(cast(Any, t)._fields, t):
            _walk_named(v, f"{path}.{f}", name, what)
    elif isinstance(t, (tuple, list)):
        for i, v in enumerate(t):
            _walk_named(v, f"{path}[{i}]", name, what)
    elif isinstance(t, dict):
        for k, v in t.items():
            _walk_named(v, f"{path}[{k!r}]", name, what)
    else:
        raise TypeError(
            f"{name}: {what}{path} is a {type(t).__name__}, not a tensor; {what} must be a "
            "tensor or nested tuples, lists and dicts of tensors (wrap numbers with "
            "torch.tensor)"
        )


def leaves(tree: Any, *, name: str, what: str) -> list[torch.Tensor]:
    """`flatten`'s leaves only; a tensor, or a tuple or list of tensors, without a walk
    (the executors read every step's output)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if type(tree) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in tree):
        return list(tree)
    return flatten(tree, name=name, what=what)[0]


def unflatten(treedef: TreeDef, leaves: list) -> Any:
    """The inverse of `flatten`."""
    kind = treedef[0]
    if kind == "leaf":
        return leaves[0]
    if kind == "tuple" and len(leaves) == len(treedef[1]) and all(c is _LEAF for c in treedef[1]):
        return tuple(leaves)  # a flat tuple, as an LSTM's (h, c)
    return _build(treedef, iter(leaves))


def _build(d: TreeDef, it) -> Any:
    kind = d[0]
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    if kind == "tuple":
        return tuple(_build(c, it) for c in d[1])
    if kind == "list":
        return [_build(c, it) for c in d[1]]
    if kind == "namedtuple":
        return d[1](*(_build(c, it) for c in d[2]))
    return {k: _build(c, it) for k, c in zip(d[1], d[2])}


def describe(leaves: list[torch.Tensor]) -> list[tuple]:
    """(shape, dtype) of each leaf, for structure checks and messages."""
    return [(tuple(t.shape), t.dtype) for t in leaves]
