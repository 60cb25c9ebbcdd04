"""`memento.torch.fwdrev_grad`: MixFlow-MG's mixed-mode meta-gradients in PyTorch.

Listing 2 of Kemaev et al. (2025) gives ``fwdrev_grad`` as a ``torch.autograd.Function``
whose forward is ``torch.func.grad(inner_loss)`` and whose backward computes the
vector-Hessian and vector-mixed-derivative products forward-over-reverse,
``jvp(grad L, (params,), (ct,))`` (Eq. 7-8: the Hessian's blocks are symmetric). As
printed, its backward differentiates an undefined ``loss`` (it means ``inner_loss``),
returns a cotangent for every input (integer batches and tensors nobody differentiates
included, which ``torch.func.grad`` cannot), and takes ``params`` as one tensor. Here:
``inner_loss`` is used, cotangents are computed only for the inputs that need them
(``ctx.needs_input_grad``), a missing (zero) output cotangent is a zero tangent, and
``params`` may be a tensor or nested tuples, lists and dicts of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _tree
from ._probe import is_float

_NAME = "memento.torch.fwdrev_grad"


class _FwdRev(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, p_tree, n_p, *args):
        ctx.loss, ctx.p_tree, ctx.n_p = loss, p_tree, n_p
        tensors = [a if isinstance(a, torch.Tensor) else None for a in args]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*tensors)
        p, inputs = args[:n_p], args[n_p:]

        def of_params(*pl):
            return loss(_tree.unflatten(p_tree, list(pl)), *inputs)

        grads = torch.func.grad(of_params, argnums=tuple(range(n_p)))(*p)
        return tuple(grads)

    @staticmethod
    def backward(ctx, *cts):
        loss, p_tree, n_p = ctx.loss, ctx.p_tree, ctx.n_p
        args = [t if o is None else o for t, o in zip(ctx.saved_tensors, ctx.others)]
        needs = ctx.needs_input_grad[3:]
        # P: every input someone differentiates (the paper's P); the tangent u enters at
        # the parameters (A), whose gradient this function returns.
        P = [
            j
            for j, a in enumerate(args)
            if needs[j] and isinstance(a, torch.Tensor) and is_float(a)
        ]
        out: list = [None] * len(args)
        if not P or all(c is None for c in cts):
            return (None, None, None, *out)
        p = tuple(args[:n_p])
        u = tuple(torch.zeros_like(x) if c is None else c for x, c in zip(p, cts))

        def grad_p(*pl):  # grad over P of the loss, the parameters set to pl
            base = list(pl) + list(args[n_p:])

            def loss_p(*pv):
                full = list(base)
                for j, v in zip(P, pv):
                    full[j] = v
                return loss(_tree.unflatten(p_tree, full[:n_p]), *full[n_p:])

            return torch.func.grad(loss_p, argnums=tuple(range(len(P))))(*(base[j] for j in P))

        hvp = torch.func.jvp(grad_p, p, u)[1]  # forward over reverse: Eq. 7-8
        for j, g in zip(P, hvp):
            out[j] = g
        return (None, None, None, *out)


def fwdrev_grad(inner_loss: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``torch.func.grad(inner_loss)`` whose own backward pass runs forward-over-reverse.

    The returned function computes the gradient of ``inner_loss`` with respect to its
    first argument, exactly as ``torch.func.grad(inner_loss)(params, *inputs)``. What
    changes is how that gradient is differentiated again, as in a meta-gradient through
    an inner training step: the cotangent ``v`` reaching the gradient is pulled back to
    ``params`` and to every input that requires grad as ``jvp(grad L, (params,), (v,))``
    (MixFlow-MG, Kemaev et al. 2025, Eq. 7-8 and Listing 2), so no activation of the
    inner backward pass outlives the step. ``inner_loss`` must be twice continuously
    differentiable (the Hessian's symmetry is used).

    Args:
        inner_loss: ``(params, *inputs) -> scalar tensor``. ``params``: a tensor or
            nested tuples, lists, dicts of tensors. ``inputs``: tensors (differentiated
            when they require grad, e.g. a meta-parameter) or any other objects
            (passed through). Tensors ``inner_loss`` closes over are constants, as in
            ``torch.func.grad``: pass what the meta-gradient must reach as an input.

    Returns:
        ``grad(params, *inputs)``, with ``params``' structure.

    Transformations: ``torch.autograd`` (``backward``, ``autograd.grad``), first order
    through the custom rule; inside `memento.torch.scan`'s steps. Not under
    ``torch.func`` transforms of the result (a custom ``autograd.Function`` without a
    ``vmap``/``jvp`` rule; they raise).

    Example:
        >>> inner = memento.torch.fwdrev_grad(lambda w, x: ((x @ w) ** 2).sum())  # doctest: +SKIP
        >>> w = w - lr * inner(w, x)   # differentiate w.r.t. lr: forward-over-reverse

    References:
        Kemaev et al. 2025, "Scalable Meta-Learning via Mixed-Mode Differentiation",
        section 3 and Listing 2.
    """
    if not callable(inner_loss):
        raise TypeError(f"{_NAME}: inner_loss must be callable, got {type(inner_loss).__name__}")

    def grad_fn(params: Any, *inputs: Any) -> Any:
        p_leaves, p_tree = _tree.flatten(params, name=_NAME, what="params")
        if not p_leaves or not all(is_float(p) for p in p_leaves):
            raise TypeError(
                f"{_NAME}: params must hold floating-point tensors (got "
                f"{[p.dtype for p in p_leaves]}); gradients are taken with respect to them"
            )
        grads = _FwdRev.apply(inner_loss, p_tree, len(p_leaves), *p_leaves, *inputs)
        return _tree.unflatten(p_tree, list(grads))

    return grad_fn
