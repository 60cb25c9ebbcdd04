"""`memento.torch.fwdrev_grad`: MixFlow-MG's mixed-mode meta-gradients in PyTorch.

Listing 2 of Kemaev et al. (2025) gives ``fwdrev_grad`` as a ``torch.autograd.Function``
whose forward is ``torch.func.grad(inner_loss)`` and whose backward computes the
vector-Hessian and vector-mixed-derivative products forward-over-reverse,
``jvp(grad L, (params,), (ct,))`` (Eq. 7-8: the Hessian's blocks are symmetric). As
printed, its backward differentiates an undefined ``loss`` (it means ``inner_loss``),
returns a cotangent for every input (integer batches and tensors nobody differentiates
included, which ``torch.func.grad`` cannot), and takes ``params`` as one tensor. Here:
the loss is used, cotangents are computed only for the inputs that need them
(``ctx.needs_input_grad``), a missing (zero) output cotangent is a zero tangent, the
differentiated arguments may be tensors or nested tuples, lists and dicts of tensors,
and tensors the loss closes over that require grad are inputs of the function too (found
while the gradient is computed), their cotangents computed reverse-over-reverse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

from ..planning.internals import check_argnums
from . import _tree
from ._probe import _functorch, is_float, tensors

_NAME = "memento.torch.fwdrev_grad"
Mode = Literal["fwdrev", "revfwd", "revrev"]
_MODES = ("fwdrev", "revfwd", "revrev")


class _Captured(TorchFunctionMode):
    """Finds the tensors requiring grad that a loss uses without being given them."""

    def __init__(self, inputs):
        super().__init__()
        self._ids = {id(t) for t in inputs}
        self.found: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tensors((args, kwargs)):
            if (
                t.requires_grad
                and id(t) not in self._ids
                and id(t) not in self.found
                and not _functorch.is_functorch_wrapped_tensor(t)
            ):
                self.found[id(t)] = t
        return func(*args, **kwargs)


class _Call:
    """One call's layout: the loss, where the differentiated leaves go, the others."""

    def __init__(self, loss, args, pos, has_aux):
        self.loss, self.pos, self.has_aux = loss, pos, has_aux
        self.args = list(args)
        self.trees, self.leaves = [], []
        for i in pos:
            leaves, tree = _tree.flatten(args[i], name=_NAME, what=f"argument {i}")
            if not leaves or not all(is_float(p) for p in leaves):
                raise TypeError(
                    f"{_NAME}: argument {i} must hold floating-point tensors (got "
                    f"{[p.dtype for p in leaves]}); gradients are taken with respect to them"
                )
            self.trees.append((tree, len(leaves)))
            self.leaves += leaves
        self.others = [j for j in range(len(args)) if j not in pos]

    def full(self, p_leaves, others) -> list:
        """The arguments with the differentiated leaves ``p_leaves`` and ``others``."""
        args = list(self.args)
        at = 0
        for i, (tree, n) in zip(self.pos, self.trees):
            args[i] = _tree.unflatten(tree, list(p_leaves[at : at + n]))
            at += n
        for j, v in zip(self.others, others):
            args[j] = v
        return args

    def value(self, p_leaves, others):
        out = self.loss(*self.full(p_leaves, others))
        return out[0] if self.has_aux else out

    def grad(self, p_leaves, others):
        """(gradient leaves, aux) of the loss at ``p_leaves``."""
        aux: list = [None]

        def of_params(*pl):
            out = self.loss(*self.full(pl, others))
            if self.has_aux:
                aux[0] = out[1]
                return out[0]
            return out

        g = torch.func.grad(of_params, argnums=tuple(range(len(p_leaves))))(*p_leaves)
        return list(g), aux[0]

    def result(self, grads: list, aux, single: bool):
        out, at = [], 0
        for tree, n in self.trees:
            out.append(_tree.unflatten(tree, grads[at : at + n]))
            at += n
        g = out[0] if single else tuple(out)
        return (g, aux) if self.has_aux else g


class _FwdRev(torch.autograd.Function):
    """Inputs: the differentiated leaves, the other arguments, the closed-over tensors;
    outputs: the gradient leaves (computed beforehand, passed in ``grads``)."""

    @staticmethod
    def forward(ctx, call, mode, grads, n_o, *inputs):
        ctx.call, ctx.mode, ctx.n_o = call, mode, n_o
        ctx.objects = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.save_for_backward(*(a if isinstance(a, torch.Tensor) else None for a in inputs))
        return tuple(grads)

    @staticmethod
    def backward(ctx, *cts):
        call, mode, n_o = ctx.call, ctx.mode, ctx.n_o
        inputs = [t if o is None else o for t, o in zip(ctx.saved_tensors, ctx.objects)]
        needs = ctx.needs_input_grad[4:]
        n_p = len(call.leaves)
        out: list = [None] * len(inputs)
        if all(c is None for c in cts):
            return (None, None, None, None, *out)
        p, others, closed = inputs[:n_p], inputs[n_p : n_p + n_o], inputs[n_p + n_o :]
        u = tuple(torch.zeros_like(x) if c is None else c for x, c in zip(p, cts))
        # P: the inputs someone differentiates (the paper's P), the closed-over excluded.
        P = [j for j, a in enumerate(inputs[: n_p + n_o]) if needs[j] and _diff(a)]

        def sub(pv):  # the differentiated leaves and other arguments, P set to pv
            full = list(inputs[: n_p + n_o])
            for j, v in zip(P, pv):
                full[j] = v
            return full[:n_p], full[n_p:]

        if P and mode == "fwdrev":
            # forward over reverse: Eq. 7-8. The jvp moves the parameters; P's own
            # parameter entries are read from pv, which the jvp's tangent reaches too.
            hvp = torch.func.jvp(lambda *pl: _grad_at(call, P, inputs, n_p, pl), tuple(p), u)[1]
            for j, g in zip(P, hvp):
                out[j] = g
        elif P:  # revfwd: the gradient over P of the directional derivative

            def tangent(*pv):
                pl, o = sub(pv)
                return torch.func.jvp(lambda *q: call.value(list(q), o), tuple(pl), u)[1]

            g = torch.func.grad(tangent, argnums=tuple(range(len(P))))(*(inputs[j] for j in P))
            for j, gj in zip(P, g):
                out[j] = gj
        want = [k for k, c in enumerate(closed) if needs[n_p + n_o + k]]
        if want:  # closed-over tensors: reverse over reverse, through autograd
            with torch.enable_grad():
                gp, _ = call.grad([t.detach() for t in p], [_detach(o) for o in others])
                g = torch.autograd.grad(gp, [closed[k] for k in want], u, allow_unused=True)
            for k, gk in zip(want, g):
                out[n_p + n_o + k] = gk
        return (None, None, None, None, *out)


def _grad_at(call: _Call, P: list[int], inputs: list, n_p: int, pl) -> tuple:
    """grad over P of the loss, with the differentiated leaves at ``pl``: P's entries
    among those leaves follow ``pl`` (so a jvp in ``pl`` moves them too)."""
    base = list(pl) + list(inputs[n_p:])

    def loss_P(*pv):
        full = list(base)
        for j, v in zip(P, pv):
            full[j] = v
        return call.value(full[:n_p], full[n_p : len(inputs)])

    return torch.func.grad(loss_P, argnums=tuple(range(len(P))))(*(base[j] for j in P))


def _diff(a) -> bool:
    return isinstance(a, torch.Tensor) and is_float(a)


def _detach(a):
    return a.detach() if isinstance(a, torch.Tensor) else a


def fwdrev_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    mode: Mode = "fwdrev",
) -> Callable[..., Any]:
    """Gradient of ``loss_fn`` whose own backward pass runs forward-over-reverse.

    The PyTorch counterpart of `memento.fwdrev_grad`, with its arguments. The returned
    function computes ``torch.func.grad(loss_fn, argnums, has_aux=has_aux)``. What
    changes is how that gradient is differentiated again, as in a meta-gradient through
    an inner training step: the cotangent ``v`` reaching the gradient is pulled back to
    every input that requires grad (the differentiated arguments, the other tensor
    arguments, and tensors ``loss_fn`` closes over), in ``mode``:

    - ``"fwdrev"``: forward-over-reverse, ``jvp(grad L, (params,), (v,))`` (MixFlow-MG,
      Kemaev et al. 2025, Eq. 7-8 and Listing 2): no activation of the inner backward
      pass outlives the step;
    - ``"revfwd"``: reverse-over-forward, ``grad(x -> jvp(L, v))``;
    - ``"revrev"``: reverse-over-reverse; the function is plain ``torch.func.grad``,
      differentiated by autograd (the baseline).

    The first two rest on the symmetry of the Hessian, so ``loss_fn`` must be twice
    continuously differentiable. Tensors ``loss_fn`` closes over that require grad get
    their cotangent reverse-over-reverse (pass them as arguments to get the mode's).

    Args:
        loss_fn: ``(*args) -> scalar tensor``; with ``has_aux``, ``(loss, aux)``.
            Differentiated arguments: tensors or nested tuples, lists, dicts of
            floating-point tensors. Other arguments: tensors (differentiated when they
            require grad, e.g. a meta-parameter) or any other objects (passed through).
        argnums: which positional argument(s) to differentiate, as in ``torch.func.grad``.
        has_aux: as in ``torch.func.grad``; ``aux`` carries no gradient.
        mode: ``"fwdrev"``, ``"revfwd"`` or ``"revrev"``.

    Returns:
        A function with ``loss_fn``'s signature returning what
        ``torch.func.grad(loss_fn, argnums, has_aux=has_aux)`` returns.

    Raises:
        ValueError: an unknown ``mode``; ``argnums`` out of range (when called).
        TypeError: a non-callable ``loss_fn``, a malformed ``argnums``, a differentiated
            argument with a non-float leaf (when called).

    Transformations: ``torch.autograd`` (``backward``, ``autograd.grad``), first order
    through the custom rule (any order with ``"revrev"``); inside `memento.torch.scan`'s
    steps. Not under ``torch.func`` transforms of the result (a custom
    ``autograd.Function`` without a ``vmap``/``jvp`` rule; they raise).

    Example:
        >>> inner = memento.torch.fwdrev_grad(lambda w, x: ((x @ w) ** 2).sum())  # doctest: +SKIP
        >>> w = w - lr * inner(w, x)   # differentiate w.r.t. lr: forward-over-reverse

    References:
        Kemaev et al. 2025, "Scalable Meta-Learning via Mixed-Mode Differentiation",
        section 3 and Listing 2.
    """
    if not callable(loss_fn):
        raise TypeError(f"{_NAME}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if mode not in _MODES:
        raise ValueError(f"{_NAME}: mode must be one of {_MODES}, got {mode!r}")
    nums, single = check_argnums(_NAME, argnums)
    if mode == "revrev":
        return torch.func.grad(loss_fn, nums[0] if single else nums, has_aux=has_aux)

    @functools.wraps(loss_fn)
    def grad_fn(*args: Any) -> Any:
        n = len(args)
        if any(a >= n or a < -n for a in nums):
            raise ValueError(
                f"{_NAME}: argnums={argnums!r} is out of range for a call with {n} "
                "positional arguments"
            )
        call = _Call(loss_fn, args, tuple(a % n for a in nums), has_aux)
        others = [args[j] for j in call.others]
        captured = _Captured([*call.leaves, *tensors(others)])
        with torch.no_grad(), captured:
            grads, aux = call.grad(call.leaves, others)
        closed = list(captured.found.values()) if torch.is_grad_enabled() else []
        inputs = [*call.leaves, *others, *closed]
        out = _FwdRev.apply(call, mode, grads, len(others), *inputs)
        return call.result(list(out), aux, single)

    return grad_fn
