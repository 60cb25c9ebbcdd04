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
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..planning import Bytes
from ..planning.internals import ChainPlan, ChainPolicy, Percent, check_layers, plan_layers
from . import _tree
from ._machine import Machine, Steps, make_function
from ._probe import Closure, Outside, Storages, is_float, nbytes, refuse_functorch
from ._replay import Context, Snapshots, autocast_state, rng_moved, rng_state, set_rng_state

_NAME = "memento.torch.checkpoint_sequential"
_CACHE_SIZE = 32


class _Measured(NamedTuple):
    """What the measuring pass found (cached with the plan).

    Attributes:
        plan: the plan.
        trees: the structures of x_0 .. x_n.
        copies: per layer, whether it modifies its input in place.
        grad: per layer, whether it calls ``torch.autograd.grad`` itself.
        rng: whether a layer draws random numbers.
        state: tensors from outside that the layers modify in place (module buffers).
    """

    plan: ChainPlan
    trees: tuple
    copies: tuple[bool, ...]
    grad: tuple[bool, ...]
    rng: bool
    state: tuple[torch.Tensor, ...]


class _Layers(Steps):
    def __init__(self, layers: list[Callable], measured: _Measured, name: str):
        self.layers, self.measured, self.name = layers, measured, name
        self.trees = measured.trees
        self.num_steps = len(layers)
        self.params: list[torch.Tensor] = []
        self.read: dict[int, torch.Tensor] = {}
        self.mutated: dict[int, torch.Tensor] = {}
        self._ids: dict[int, int] = {}
        self._index: list[list[int]] = [[] for _ in layers]
        self._seen = [False] * len(layers)
        self._outside = Outside()

    def call(self, p, h, x):
        inp = _tree.unflatten(self.trees[p], h)
        if self._seen[p]:
            out = self.layers[p](inp)
        else:  # the first evaluation of layer p (in the first sweep) finds its parameters
            closure = Closure(h)
            with closure:
                out = self.layers[p](inp)
            for t in self._outside.filter(closure.tensors, h):
                if is_float(t):
                    if id(t) not in self._ids:
                        self._ids[id(t)] = len(self.params)
                        self.params.append(t)
                    self._index[p].append(self._ids[id(t)])
            self.read.update((id(t), t) for t in closure.read)
            self.mutated.update((id(t), t) for t in closure.mutated)
            self._seen[p] = True
        leaves, tree = _tree.flatten(out, name=self.name, what=f"the output of layer {p}")
        if tree != self.trees[p + 1]:
            raise TypeError(
                f"{self.name}: layer {p} returned a structure other than when it was "
                f"measured ({tree} instead of {self.trees[p + 1]}); layers must return the "
                "same structure at every call"
            )
        return leaves, []

    def copies(self, p):
        return self.measured.copies[p]

    def grad_mode(self, p):
        return self.measured.grad[p]

    def param_index(self, p):
        return self._index[p]


def _check(
    layers, memory, policy, name=_NAME, what="layers"
) -> tuple[list[Callable], int | Bytes | Percent | None]:
    if isinstance(layers, torch.nn.Sequential):
        layers = list(layers)
    return check_layers(
        layers, memory, policy, name=name, what=what, kinds="nn.Sequential, list or tuple"
    )


def _measure(layers: list[Callable], x_leaves: list, x_tree, budget, policy, name) -> _Measured:
    """One pass with grad enabled that stores nothing (see the module docstring).

    Each layer runs on a copy of its input, so that one modifying its input in place is
    seen doing so. The random number generators and every tensor the layers modify in
    place are put back afterwards: the pass leaves no trace.
    """
    hidden, internal, flops, trees = [nbytes(x_leaves)], [], [], [x_tree]
    copies, grad = [], []
    rng_before, snapshots = rng_state(), Snapshots()
    try:
        with snapshots:
            h = x_leaves
            for p, layer in enumerate(layers):
                h_in = [t.detach().requires_grad_() if is_float(t) else t.detach() for t in h]
                with torch.enable_grad():
                    inp = [t.clone() for t in h_in]
                versions = [t._version for t in inp]
                closure, counter = Closure([*h_in, *inp]), FlopCounterMode(display=False)
                with torch.enable_grad(), closure, counter:
                    out = layer(_tree.unflatten(trees[p], inp))
                leaves, tree = _tree.flatten(out, name=name, what=f"the output of layer {p}")
                copies.append(any(t._version != v for t, v in zip(inp, versions)))
                grad.append(closure.calls_grad)
                saved = Storages()
                saved.add_graph(leaves, closure.tensors)
                trees.append(tree)
                hidden.append(nbytes(leaves))
                # The copies stand for the input unless the layer modifies them.
                stand_in = [] if copies[-1] else inp
                residual = saved.bytes_except(closure.tensors, h_in, stand_in, leaves)
                internal.append(hidden[p] + hidden[p + 1] + residual)
                flops.append(float(counter.get_total_flops()) + sum(t.numel() for t in leaves))
                h = [t.detach() for t in leaves]
    finally:
        snapshots.restore()
        rng = rng_moved(rng_before, rng_state())
        set_rng_state(rng_before)
    plan = plan_layers(flops, hidden, internal, budget, policy, name=name)
    return _Measured(plan, tuple(trees), tuple(copies), tuple(grad), rng, tuple(snapshots.mutated))


# (ids of the layers, input signature, budget, policy, autocast) -> (layers, what was
# measured). The layers are held so that their ids cannot be reused by other objects
# while the entry lives.
_plans: collections.OrderedDict = collections.OrderedDict()


def _plan(layers, x_leaves, x_tree, budget, policy, name=_NAME) -> _Measured:
    key = (
        tuple(id(l) for l in layers),
        x_tree,
        tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in x_leaves),
        budget,
        policy,
        autocast_state(),
    )
    if key in _plans:
        _plans.move_to_end(key)
        return _plans[key][1]
    measured = _measure(layers, x_leaves, x_tree, budget, policy, name)
    _plans[key] = (list(layers), measured)
    if len(_plans) > _CACHE_SIZE:
        _plans.popitem(last=False)
    return measured


def chain_plan(
    layers: Sequence[Callable] | torch.nn.Sequential,
    x: Any,
    *,
    memory: int | str | Bytes,
    policy: ChainPolicy = "auto",
) -> ChainPlan:
    """The plan `chain` and `checkpoint_sequential` run for these arguments (measured, or
    cached).

    Raises:
        ValueError, TypeError: as `checkpoint_sequential`.
    """
    layers, budget = _check(layers, memory, policy)
    if budget is None:
        raise TypeError(f"{_NAME}: chain_plan needs a memory budget, got None")
    x_leaves, x_tree = _tree.flatten(x, name=_NAME, what="x")
    return _plan(layers, x_leaves, x_tree, budget, policy).plan


_RUNS = {n: make_function(n) for n in (_NAME, "memento.torch.chain")}


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
        NotImplementedError: under ``torch.func`` transforms; a layer that draws random
            numbers or modifies a buffer only on some calls.
        RuntimeError: (in backward) a parameter or input modified in place after the
            forward pass, as plain autograd raises.

    Recomputation replays what the forward pass saw, as ``torch.utils.checkpoint``
    does and more: the random number generators' states (dropout draws the same masks),
    the autocast settings, and the buffers layers modify in place (BatchNorm's running
    statistics end as plain autograd leaves them). A layer that modifies its input in
    place (``ReLU(inplace=True)``) is given a copy when recomputed.

    Measuring: the first call for given layers (the same objects), input shapes, dtypes,
    ``requires_grad`` flags, budget and policy measures every layer in one extra pass
    that stores nothing (see `chain_plan`); later calls reuse the plan, and evaluate the
    layers ``schedule.cost`` times in all (weighted by cost; `ChainPlan.evaluations`
    per layer). Under ``torch.no_grad()`` / ``torch.inference_mode()`` nothing is
    stored and nothing is measured. Transformations: as `memento.torch.scan`.

    Example:
        >>> y = memento.torch.checkpoint_sequential(model, images, memory="256MiB")  # doctest: +SKIP
    """
    return _run(layers, x, memory, policy, _NAME)


@torch.compiler.disable  # dynamo cannot trace the walker: a graph break, run eagerly
def chain(
    fns: Sequence[Callable] | torch.nn.Sequential,
    x: Any,
    *,
    memory: int | str | Bytes | None,
    policy: ChainPolicy = "auto",
) -> Any:
    """Applies the layers ``fns`` in turn to ``x``; its gradient fits a memory budget.

    The PyTorch counterpart of `memento.chain`, with its arguments; the same function as
    `checkpoint_sequential` (which keeps ``torch.utils.checkpoint``'s name).

    Args:
        fns: an ``nn.Sequential`` or a non-empty sequence of callables
            ``x_p -> x_{p+1}``.
        x: the input ``x_0``, a tensor or nested tuples, lists and dicts of tensors.
        memory: as `checkpoint_sequential`; ``None``: plain composition.
        policy: ``"auto"``, ``"msm"`` or ``"hsm"``.

    Returns:
        The last layer's output.

    Raises:
        ValueError, TypeError: as `checkpoint_sequential`.

    Example:
        >>> y = memento.torch.chain(list(model.children()), images, memory=4)  # doctest: +SKIP
    """
    return _run(fns, x, memory, policy, "memento.torch.chain", what="fns")


def _run(layers, x, memory, policy, name: str, what: str = "layers") -> Any:
    layers, budget = _check(layers, memory, policy, name, what)
    x_leaves, x_tree = _tree.flatten(x, name=name, what="x")
    refuse_functorch(name, x_leaves)
    if budget is None or not torch.is_grad_enabled():
        return functools.reduce(lambda h, f: f(h), layers, x)
    measured = _plan(layers, x_leaves, x_tree, budget, policy, name)
    trees = measured.trees
    stack = _Layers(layers, measured, name)
    start_rng = rng_state()
    with torch.no_grad():
        start = (start_rng if measured.rng else None, [t.clone() for t in measured.state])
    context = Context(rng=measured.rng, state=measured.state, start=start)
    machine = Machine(stack, x_leaves, measured.plan.schedule, context, name)
    machine.sweep()
    _check_sweep(stack, context, start_rng, name)
    if not (any(t.requires_grad for t in x_leaves) or stack.params):
        return _tree.unflatten(trees[-1], machine.cur)  # nothing to differentiate
    context.watch_versions([stack.params, stack.read.values(), x_leaves])
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

    outs = _RUNS[name].apply(machine, outputs, grads, *x_leaves, *stack.params)
    return _tree.unflatten(trees[-1], list(outs))


def _check_sweep(stack: _Layers, context: Context, start_rng, name: str) -> None:
    """Raises if the layers drew random numbers, or modified a tensor from outside in
    place, when they did not while measured: those are not kept for recomputation."""
    if not context.rng and rng_moved(start_rng, rng_state()):
        raise NotImplementedError(
            f"{name}: a layer drew random numbers that it did not draw when measured; the "
            "random number generator's state is kept for recomputation only for layers "
            "that draw at every call."
        )
    state = {id(t) for t in context.state}
    late = [t for i, t in stack.mutated.items() if i not in state]
    if late:
        raise NotImplementedError(
            f"{name}: a layer modified a tensor from outside in place (a {late[0].dtype} "
            f"tensor of shape {tuple(late[0].shape)}) that it did not modify when measured; "
            "its values are kept for recomputation only for layers that modify it at every "
            "call."
        )
