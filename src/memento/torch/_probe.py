"""What `memento.torch` measures of a step: the tensors it closes over, and the bytes of
the tensors its backward keeps (the paper's internal state)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

# torch's C module for functorch's wrappers (no public name tells a wrapper apart).
_functorch: Any = getattr(torch._C, "_functorch")  # noqa: B009 (untyped in the stubs)


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def nbytes(leaves: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in leaves)


def refuse_functorch(name: str, leaves: Iterable[torch.Tensor]) -> None:
    """A NotImplementedError under ``torch.func`` transforms (grad, vjp, jvp, vmap).

    The executors call user code with their own grad mode and ``torch.autograd.grad`` in a
    custom ``autograd.Function``, which functorch's transforms cannot see through.
    """
    active = torch._C._are_functorch_transforms_active()
    wrapped = any(_functorch.is_functorch_wrapped_tensor(t) for t in leaves)
    if active or wrapped:
        raise NotImplementedError(
            f"{name} does not run under torch.func transforms (grad, vjp, jvp, vmap, "
            "functional_call inside them): its backward pass is a custom "
            "torch.autograd.Function that calls torch.autograd.grad. Differentiate with "
            "torch.autograd (loss.backward(), torch.autograd.grad) instead, or pass "
            "memory=None for a plain loop."
        )


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``, a tensor or nested lists, tuples and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)


# Functions through which a step differentiates something itself (a force field, a
# Hamiltonian): recomputations of such a step need grad mode and inputs requiring grad.
_GRAD_FUNCS = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


class Closure(TorchFunctionMode):
    """Collects the tensors a function uses without being given them.

    Every torch operation (functions, methods, ``nn.functional``, ``_VF`` calls such as
    ``nn.LSTMCell``'s) passes its arguments through this mode. An argument that is not one
    of ``inputs`` and was not produced by an earlier operation inside the mode comes from
    outside: a module parameter or buffer, a closed-over tensor (leaf or not). Those that
    require grad are ``tensors``; the version of each is noted when first seen, so that
    ``mutated`` lists those the function modified in place (BatchNorm's running
    statistics). Inside ``torch.func`` transforms (a `fwdrev_grad` inside a step),
    functorch's wrappers of the step's own tensors are skipped; the tensors they close
    over are not.

    Attributes:
        calls_grad: whether the function called ``torch.autograd.grad`` or ``backward``.
    """

    def __init__(self, inputs: Iterable[torch.Tensor]):
        super().__init__()
        self._known = {id(t) for t in inputs}
        self._keep: list[torch.Tensor] = list(inputs)  # ids stay unique while we look
        self.found: dict[int, torch.Tensor] = {}
        self.outside: dict[int, tuple[torch.Tensor, int]] = {}
        self.calls_grad = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GRAD_FUNCS:
            self.calls_grad = True
        for t in tensors((args, kwargs)):
            i = id(t)
            if i in self._known or i in self.outside:
                continue
            if _functorch.is_functorch_wrapped_tensor(t) or t.is_inference():
                continue
            self.outside[i] = (t, t._version)
            if t.requires_grad:
                self.found[i] = t
        out = func(*args, **kwargs)
        for t in tensors(out):
            self._known.add(id(t))
            self._keep.append(t)
        return out

    def __exit__(self, *exc):
        # Let go of the step's intermediates at once (a reference cycle through the mode
        # would keep them alive until the garbage collector runs).
        self._keep.clear()
        self._known.clear()
        return super().__exit__(*exc)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self.found.values())

    @property
    def read(self) -> list[torch.Tensor]:
        """Every tensor from outside, requiring grad or not."""
        return [t for t, _ in self.outside.values()]

    @property
    def mutated(self) -> list[torch.Tensor]:
        """The tensors from outside that the function modified in place."""
        return [t for t, v in self.outside.values() if t._version != v]


class Outside:
    """Tells the tensors a step closes over from those it computed out of its inputs by
    operations a `Closure` does not see (a custom ``autograd.Function``'s outputs).

    A tensor requiring grad comes from outside when its autograd graph does not reach the
    step's inputs. Nodes found not to reach them are remembered (and held, so that their
    ids stay theirs): a graph made before a step cannot reach a later step's inputs.
    """

    def __init__(self):
        self._far: dict[int, Any] = {}

    def filter(self, found: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor]):
        found = list(found)
        if all(t.grad_fn is None for t in found):
            return found
        inputs = list(inputs)
        nodes = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
        leaves = {id(t) for t in inputs if t.grad_fn is None}
        return [t for t in found if not self._reaches(t, nodes, leaves)]

    def _reaches(self, t: torch.Tensor, nodes: set[int], leaves: set[int]) -> bool:
        if t.grad_fn is None:
            return False
        seen: dict[int, Any] = {}
        todo = [t.grad_fn]
        while todo:
            node = todo.pop()
            key = id(node)
            if key in seen or key in self._far:
                continue
            if key in nodes or id(getattr(node, "variable", None)) in leaves:
                return True
            seen[key] = node
            todo.extend(n for n, _ in node.next_functions if n is not None)
        self._far.update(seen)
        return False


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class Storages:
    """Storages (each counted once) of what a step's autograd graph keeps for backward.

    Read from the graph itself after the step ran: every node's saved tensors (the
    ``_saved_*`` attributes of built-in nodes, ``saved_tensors`` of custom Functions),
    walking back from the outputs and stopping at the graphs of tensors from outside.
    (``saved_tensors_hooks`` would see the same tensors as they are saved, but
    ``torch.func.grad`` refuses to run under them, and a step may call it: `fwdrev_grad`.)
    """

    def __init__(self):
        self.storages: dict[int, int] = {}

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            ptr, size = _storage(t)
            if size:
                self.storages[ptr] = size

    def add_graph(self, outputs: Iterable[torch.Tensor], stop: Iterable[torch.Tensor]) -> None:
        """Adds the tensors saved by the graph of ``outputs``, not entering the graphs of
        the tensors ``stop`` (closed-over tensors computed outside the step)."""
        stop_nodes = {id(t.grad_fn) for t in stop if t.grad_fn is not None}
        todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if id(node) in seen or id(node) in stop_nodes:
                continue
            seen.add(id(node))
            for name in dir(node):
                if name.startswith("_saved_"):
                    with contextlib.suppress(RuntimeError):  # a value already freed
                        self.add(tensors(getattr(node, name)))
            if hasattr(node, "saved_tensors"):  # a custom autograd.Function's node
                with contextlib.suppress(RuntimeError):
                    self.add(tensors(cast(Any, node).saved_tensors))
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def bytes_except(self, *groups: Iterable[torch.Tensor]) -> int:
        """Bytes counted, less the storages of the tensors in ``groups`` (held anyway)."""
        skip = {_storage(t)[0] for g in groups for t in g}
        return sum(size for ptr, size in self.storages.items() if ptr not in skip)
