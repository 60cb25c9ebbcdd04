"""`memento.torch.checkpoint_sequential`: a stack of layers whose gradient follows the
optimal heterogeneous-chain schedule (Gruslys et al. 2016, appendix C, with MSM's choice
per stored state) for a memory budget.

Measuring (once per layers and input signature, cached; see `chain_plan`): each layer
runs once with grad enabled on the output of the previous one, under
``torch.utils.flop_counter.FlopCounterMode`` (its cost: the flops it counts, matrix
products and convolutions, plus the output's elements so that element-wise layers cost
something); the tensors its autograd graph saves are read from the graph, which is then
dropped (the measuring pass keeps one layer's graph at a time). Sizes: ``x_p``'s bytes
(hidden), and a layer's input, output and saved tensors other than parameters
(internal). Planned with `memento.planning.internals.plan_layers`, as `memento.chain` plans.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..planning import Bytes
from ..planning.internals import ChainPlan, ChainPolicy, Percent, check_layers, plan_layers
from . import _tree
from ._machine import Machine, Steps, make_function
from ._probe import Closure, Storages, is_float, nbytes, refuse_functorch

_NAME = "memento.torch.checkpoint_sequential"
_CACHE_SIZE = 32


class _Layers(Steps):
    def __init__(self, layers: list[Callable], trees: tuple):
        self.layers, self.trees = layers, trees
        self.num_steps = len(layers)
        self.params: list[torch.Tensor] = []
        self._ids: dict[int, int] = {}
        self._index: list[list[int]] = [[] for _ in layers]
        self._seen = [False] * len(layers)

    def call(self, p, h, x):
        inp = _tree.unflatten(self.trees[p], h)
        if self._seen[p]:
            out = self.layers[p](inp)
        else:  # the first evaluation of layer p (in the first sweep) finds its parameters
            closure = Closure(h)
            with closure:
                out = self.layers[p](inp)
            for t in closure.tensors:
                if is_float(t):
                    if id(t) not in self._ids:
                        self._ids[id(t)] = len(self.params)
                        self.params.append(t)
                    self._index[p].append(self._ids[id(t)])
            self._seen[p] = True
        leaves, tree = _tree.flatten(out, name=_NAME, what=f"the output of layer {p}")
        if tree != self.trees[p + 1]:
            raise TypeError(
                f"{_NAME}: layer {p} returned a structure other than when it was measured "
                f"({tree} instead of {self.trees[p + 1]}); layers must be deterministic"
            )
        return leaves, []

    def param_index(self, p):
        return self._index[p]


def _check(layers, memory, policy) -> tuple[list[Callable], int | Bytes | Percent | None]:
    if isinstance(layers, torch.nn.Sequential):
        layers = list(layers)
    return check_layers(
        layers, memory, policy, name=_NAME, what="layers", kinds="nn.Sequential, list or tuple"
    )


def _measure(
    layers: list[Callable], x_leaves: list, x_tree, budget, policy
) -> tuple[ChainPlan, tuple]:
    """One pass with grad enabled that stores nothing (see the module docstring)."""
    hidden, internal, flops, trees = [nbytes(x_leaves)], [], [], [x_tree]
    h = x_leaves
    for p, layer in enumerate(layers):
        h_in = [t.detach().requires_grad_() if is_float(t) else t.detach() for t in h]
        closure, counter = Closure(h_in), FlopCounterMode(display=False)
        with torch.enable_grad(), closure, counter:
            out = layer(_tree.unflatten(trees[p], h_in))
        leaves, tree = _tree.flatten(out, name=_NAME, what=f"the output of layer {p}")
        saved = Storages()
        saved.add_graph(leaves, closure.tensors)
        trees.append(tree)
        hidden.append(nbytes(leaves))
        residual = saved.bytes_except(closure.tensors, h_in, leaves)
        internal.append(hidden[p] + hidden[p + 1] + residual)
        flops.append(float(counter.get_total_flops()) + sum(t.numel() for t in leaves))
        h = [t.detach() for t in leaves]
    return plan_layers(flops, hidden, internal, budget, policy, name=_NAME), tuple(trees)


# (ids of the layers, input signature, budget, policy) -> (layers, plan, the structures
# of x_0 .. x_n). The layers are
# held so that their ids cannot be reused by other objects while the entry lives.
_plans: collections.OrderedDict = collections.OrderedDict()


def _plan(layers, x_leaves, x_tree, budget, policy) -> tuple[ChainPlan, tuple]:
    key = (
        tuple(id(l) for l in layers),
        x_tree,
        tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in x_leaves),
        budget,
        policy,
    )
    if key in _plans:
        _plans.move_to_end(key)
        return _plans[key][1:]
    plan, trees = _measure(layers, x_leaves, x_tree, budget, policy)
    _plans[key] = (list(layers), plan, trees)
    if len(_plans) > _CACHE_SIZE:
        _plans.popitem(last=False)
    return plan, trees


def chain_plan(
    layers: Sequence[Callable] | torch.nn.Sequential,
    x: Any,
    *,
    memory: int | str | Bytes,
    policy: ChainPolicy = "auto",
) -> ChainPlan:
    """The plan `checkpoint_sequential` runs for these arguments (measured, or cached).

    Raises:
        ValueError, TypeError: as `checkpoint_sequential`.
    """
    layers, budget = _check(layers, memory, policy)
    if budget is None:
        raise TypeError(f"{_NAME}: chain_plan needs a memory budget, got None")
    x_leaves, x_tree = _tree.flatten(x, name=_NAME, what="x")
    return _plan(layers, x_leaves, x_tree, budget, policy)[0]


_Run = make_function(_NAME)


@torch.compiler.disable  # dynamo cannot trace the walker: a graph break, run eagerly
def checkpoint_sequential(
    layers: Sequence[Callable] | torch.nn.Sequential,
    x: Any,
    *,
    memory: int | str | Bytes | None,
    policy: ChainPolicy = "auto",
) -> Any:
    """Applies ``layers`` in turn to ``x``; the gradient fits ``memory`` with the fewest
    recomputed flops.

    The optimal replacement for ``torch.utils.checkpoint.checkpoint_sequential``, whose
    segments are uniform: here each layer's cost and sizes are measured, and
    `memento.plan_chain` chooses per layer what to keep (its input, its whole internal
    state, i.e. the tensors autograd saves, or nothing) for the least recomputation
    that fits the budget (Gruslys et al. 2016, appendix C, with MSM's choice).

    The value is ``functools.reduce(lambda h, f: f(h), layers, x)``, and so is the
    gradient, to ``x`` and to every tensor the layers use that requires grad
    (parameters, closed-over tensors), as ``torch.utils.checkpoint`` delivers them.

    Args:
        layers: an ``nn.Sequential`` or a non-empty sequence of callables
            ``x_p -> x_{p+1}``; shapes and structures may change from layer to layer.
            Layers must be deterministic (they are recomputed): no dropout in training
            mode; BatchNorm in training mode updates its running statistics once per
            evaluation.
        x: the input, a tensor or nested tuples, lists and dicts of tensors.
        memory: what the backward pass may keep, ``x`` included. An ``int``: slots of
            the largest state the plan may store (1 recomputes every layer from ``x``).
            A string such as ``"16MiB"`` or ``memento.bytes_budget(n)``: bytes, at least
            ``x``'s. ``None``: plain composition, autograd storing everything.
        policy: ``"auto"`` or ``"msm"`` (the same: inputs or internal states, per layer),
            or ``"hsm"`` (layer inputs only, as ``torch.utils.checkpoint`` keeps).

    Returns:
        The last layer's output.

    Raises:
        ValueError: empty ``layers``; a byte budget below ``x``'s size; unknown policy.
        TypeError: layers not callables; a non-tensor leaf; a bad ``memory``.
        NotImplementedError: under ``torch.func`` transforms.

    Measuring: the first call for given layers (the same objects), input shapes, dtypes,
    ``requires_grad`` flags, budget and policy measures every layer in one extra pass
    that stores nothing (see `chain_plan`); later calls reuse the plan, and evaluate the
    layers ``schedule.cost`` times in all (weighted by cost; `ChainPlan.evaluations`
    per layer). Under ``torch.no_grad()`` / ``torch.inference_mode()`` nothing is
    stored and nothing is measured. Transformations: as `memento.torch.scan`.

    Example:
        >>> y = memento.torch.checkpoint_sequential(model, images, memory="256MiB")  # doctest: +SKIP
    """
    layers, budget = _check(layers, memory, policy)
    x_leaves, x_tree = _tree.flatten(x, name=_NAME, what="x")
    refuse_functorch(_NAME, x_leaves)
    if budget is None or not torch.is_grad_enabled():
        return functools.reduce(lambda h, f: f(h), layers, x)
    plan, trees = _plan(layers, x_leaves, x_tree, budget, policy)
    stack = _Layers(layers, trees)
    machine = Machine(stack, x_leaves, plan.schedule)
    machine.sweep()
    if not (any(t.requires_grad for t in x_leaves) or stack.params):
        return _tree.unflatten(trees[-1], machine.cur)  # nothing to differentiate
    n_x = len(x_leaves)

    def outputs(m: Machine):
        return m.cur

    def grads(m: Machine, cts: list, needs: tuple):
        m.backward(cts, list(needs[n_x:]))
        ct_x = [
            None if not need else (g if g is not None else torch.zeros_like(h))
            for g, h, need in zip(m.ct, x_leaves, needs[:n_x])
        ]
        return [*ct_x, *m.ct_params]

    outs = _Run.apply(machine, outputs, grads, *x_leaves, *stack.params)
    return _tree.unflatten(trees[-1], list(outs))
