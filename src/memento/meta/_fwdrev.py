"""`fwdrev_grad`: `jax.grad` whose own VJP runs in a chosen differentiation mode.

A bilevel update differentiates through an inner gradient ``g = dL/dtheta``. The
cotangent ``v`` that reaches ``g`` from the outer loss must be pulled back through it:
``v @ d2L/dtheta2`` (a vector-Hessian product, VHP) for the parameters and
``v @ d2L/(dtheta d eta)`` (a vector-mixed-derivative product, VMP) for anything else
``L`` depends on (MixFlow-MG, Eq. 6). ``jax.grad`` of ``jax.grad`` computes both
reverse-over-reverse: it keeps the activations of the inner backward pass alive until
the outer backward pass, which dominates the dynamic memory of a meta-gradient.

Both matrices are symmetric blocks of one Hessian (Schwarz, MixFlow-MG Eq. 7-8), so the
VJP equals a Jacobian-vector product of the gradient map itself:
``u^T H[A, P] = (H[P, A] u)^T`` where ``A`` are the differentiated arguments and ``P``
every input that needs a cotangent. Forward-over-reverse evaluates it as
``jvp(grad_P L, (x_A,), (u,))``; no activation of the inner backward outlives the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from ..planning.internals import check_argnums

Mode = Literal["fwdrev", "revfwd", "revrev"]
MODES = ("fwdrev", "revfwd", "revrev")


def check_mode(mode: Any, where: str) -> None:
    """Raises a ValueError naming `where` unless `mode` is one of `MODES`."""
    if mode not in MODES:
        raise ValueError(
            f"{where}: mode must be one of {MODES!r}, got {mode!r}. Use 'fwdrev' "
            "(forward-over-reverse, the memory-efficient default), 'revfwd' "
            "(reverse-over-forward) or 'revrev' (what jax.grad of jax.grad does)."
        )


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def fwdrev_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    mode: Mode = "fwdrev",
) -> Callable[..., Any]:
    """Gradient of `loss_fn` whose VJP runs forward-over-reverse (MixFlow-MG).

    The returned function computes exactly ``jax.grad(loss_fn, argnums,
    has_aux=has_aux)``. What changes is how it is differentiated again, as in a
    meta-gradient through an inner training step: its VJP, with respect to every
    differentiable input of `loss_fn` (the differentiated arguments, the other
    arguments, and arrays `loss_fn` closes over), is computed in `mode`:

    - ``"fwdrev"``: forward-over-reverse, ``jvp(grad L, u)``. The activations of the
      inner backward pass never outlive the step, and under a per-block
      ``jax.checkpoint`` only one block's activations are alive at a time. This is the
      paper's choice and usually the fastest and leanest.
    - ``"revfwd"``: reverse-over-forward, ``grad(x -> jvp(L, u))``.
    - ``"revrev"``: reverse-over-reverse; the function is plain ``jax.grad`` and JAX
      differentiates it as it does by default (the baseline).

    The first two rest on the symmetry of the Hessian (MixFlow-MG, Eq. 7-8), so `loss_fn`
    must be twice continuously differentiable (as neural network losses are almost
    everywhere). Cotangents are only computed for inputs that are actually
    differentiated by the caller: an inner batch costs nothing.

    Transformations: ``jit``, ``vmap``, ``grad``/``vjp`` (of any order through
    ``"revrev"``, first order through the custom rule) are supported. Forward-mode
    (``jvp``) of the result is not supported in modes ``"fwdrev"`` and ``"revfwd"``
    (JAX raises a TypeError, as for any ``jax.custom_vjp``); use ``"revrev"``.

    Args:
        loss_fn: Scalar-valued function; with `has_aux`, returns ``(loss, aux)``.
            Arguments may be pytrees; integer, boolean and PRNG-key leaves get no
            cotangent.
        argnums: Which positional argument(s) to take the gradient with respect to,
            as in `jax.grad`.
        has_aux: As in `jax.grad`.
        mode: ``"fwdrev"``, ``"revfwd"`` or ``"revrev"``.

    Returns:
        A function with `loss_fn`'s signature returning what
        ``jax.grad(loss_fn, argnums, has_aux=has_aux)`` returns.

    Raises:
        ValueError: For an unknown `mode`, or `argnums` out of range when called.
        TypeError: For a non-callable `loss_fn`, a malformed `argnums`, or
            differentiating an argument with a non-float leaf (when called).

    Examples:
        >>> import jax.numpy as jnp
        >>> import memento
        >>> loss = lambda w, eta, x: eta * jnp.sum((x @ w) ** 2)
        >>> g = memento.fwdrev_grad(loss)
        >>> w, x = jnp.ones(3), jnp.ones((2, 3))
        >>> g(w, 0.5, x)  # == jax.grad(loss)(w, 0.5, x)
        Array([6., 6., 6.], dtype=float32)

    References:
        Kemaev et al. 2025, "Scalable Meta-Learning via Mixed-Mode Differentiation"
        (MixFlow-MG), section 3 and Listing 1.
    """
    if not callable(loss_fn):
        raise TypeError(f"memento.fwdrev_grad: loss_fn must be callable, got {loss_fn!r}.")
    check_mode(mode, "memento.fwdrev_grad")
    nums, single = check_argnums("memento.fwdrev_grad", argnums)
    if mode == "revrev":
        return jax.grad(loss_fn, argnums, has_aux=has_aux)

    @functools.wraps(loss_fn)
    def grad_fn(*args):
        n = len(args)
        if any(a >= n or a < -n for a in nums):
            raise ValueError(
                f"memento.fwdrev_grad: argnums={argnums!r} is out of range for a call with "
                f"{n} positional arguments."
            )
        pos = tuple(a % n for a in nums)
        leaves, treedef = jax.tree.flatten(args)
        # Leaf ranges of each positional argument, to find the differentiated leaves.
        sizes = [len(jax.tree.leaves(a)) for a in args]
        starts = [sum(sizes[:i]) for i in range(n)]
        arg_leaves = [list(range(starts[a], starts[a] + sizes[a])) for a in pos]
        diff_idx = [i for group in arg_leaves for i in group]
        for a, group in zip(pos, arg_leaves, strict=True):
            bad = [leaves[i] for i in group if not _is_float(leaves[i])]
            if bad:
                raise TypeError(
                    f"memento.fwdrev_grad: argument {a} is differentiated (argnums={argnums!r}) "
                    f"but has a leaf of dtype {jnp.result_type(bad[0])}; gradients need "
                    "float leaves. Pass it as a non-differentiated argument instead."
                )

        def loss_of_leaves(*flat):
            return loss_fn(*jax.tree.unflatten(treedef, flat))

        # Arrays closed over by loss_fn (e.g. meta-parameters being differentiated by an
        # enclosing grad) become explicit inputs: a custom_vjp cannot see through a
        # closure, and they need their mixed-derivative cotangent too.
        converted, consts = jax.closure_convert(loss_of_leaves, *leaves)
        # closure_convert's function takes the hoisted constants after the arguments.
        all_leaves = list(leaves) + list(consts)
        a_idx = tuple(diff_idx)
        grads, aux = _grad_call(converted, a_idx, has_aux, mode, all_leaves)
        # Back from flat leaves to the structure jax.grad returns.
        out, k = [], 0
        for a, group in zip(pos, arg_leaves, strict=True):
            struct = jax.tree.structure(args[a])
            out.append(jax.tree.unflatten(struct, grads[k : k + len(group)]))
            k += len(group)
        result = out[0] if single else tuple(out)
        return (result, aux) if has_aux else result

    return grad_fn


def _replace(base, idx, new):
    """A copy of the leaf list `base` with the leaves at positions `idx` set to `new`."""
    full = list(base)
    for i, v in zip(idx, new, strict=True):
        full[i] = v
    return full


def _grad_call(loss, a_idx, has_aux, mode, leaves):
    """Gradient of ``loss(*leaves)`` w.r.t. the leaves `a_idx`, with a custom VJP."""

    def value(flat):
        out = loss(*flat)
        return out if has_aux else (out, None)

    def plain_grad(flat):
        def of_a(a):
            return value(_replace(flat, a_idx, a))

        g, aux = jax.grad(of_a, has_aux=True)(tuple(flat[i] for i in a_idx))
        return tuple(g), aux

    @jax.custom_vjp
    def call(*flat):
        return plain_grad(flat)

    # JAX's new custom_vjp (JAX_CUSTOM_VJP3=1, off by default in JAX 0.10) has no JVP of
    # a symbolic-zeros rule, which a memento loop around this call needs: there every
    # float input counts as perturbed.
    symbolic = not getattr(jax.config, "jax_custom_vjp3", False)

    def fwd(*primals):
        if symbolic:
            flat = [p.value for p in primals]
            # Only inputs someone differentiates need a cotangent (P in the module doc);
            # the inner batch, for example, is skipped entirely.
            perturbed = [p.perturbed for p in primals]
        else:
            flat, perturbed = list(primals), [True] * len(primals)
        perturbed = tuple(i for i, v in enumerate(flat) if perturbed[i] and _is_float(v))
        return plain_grad(flat), (flat, perturbed)

    def bwd(res, cts):
        flat, p_idx = res
        ct_grads, ct_aux = cts
        total = None
        if p_idx and not all(isinstance(c, SymbolicZero) for c in ct_grads):
            u = tuple(
                jnp.zeros_like(flat[i]) if isinstance(c, SymbolicZero) else c
                for i, c in zip(a_idx, ct_grads, strict=True)
            )
            total = _second_order(value, flat, a_idx, p_idx, u, mode)
        aux_leaves = jax.tree.leaves(ct_aux, is_leaf=lambda c: isinstance(c, SymbolicZero))
        if p_idx and has_aux and not all(isinstance(c, SymbolicZero) for c in aux_leaves):
            aux_ct = _aux_vjp(value, flat, p_idx, ct_aux)
            total = aux_ct if total is None else tuple(map(jnp.add, total, aux_ct))
        out = [None] * len(flat)
        if total is not None:
            out = _replace(out, p_idx, total)
        return tuple(out)

    call.defvjp(fwd, bwd, symbolic_zeros=symbolic)
    return call(*leaves)


def _second_order(value, flat, a_idx, p_idx, u, mode):
    """``H[P, A] u``: the VJP of ``grad_A L`` with cotangent `u`, for the leaves P."""

    a0 = tuple(flat[i] for i in a_idx)
    p0 = tuple(flat[j] for j in p_idx)
    if mode == "fwdrev":
        # MixFlow-MG Eq. 7-8: JVP(VJP(e, L), u). Tangent u enters at the A leaves.
        def grad_p(a):
            base = _replace(flat, a_idx, a)

            def loss_p(p):
                return value(_replace(base, p_idx, p))[0]

            return jax.grad(loss_p)(tuple(base[j] for j in p_idx))

        return jax.jvp(grad_p, (a0,), (u,))[1]

    # "revfwd": VJP(e, JVP(L, u)) -- the gradient over P of the directional derivative.
    def directional(p):
        base = _replace(flat, p_idx, p)

        def loss_a(a):
            return value(_replace(base, a_idx, a))[0]

        return jax.jvp(loss_a, (tuple(base[i] for i in a_idx),), (u,))[1]

    try:
        return jax.grad(directional)(p0)
    except NotImplementedError as e:
        if "custom_lin" not in str(e):
            raise
        raise TypeError(
            "memento.fwdrev_grad: mode='revfwd' differentiates the loss forward, then in "
            "reverse, and the loss contains a custom_vjp (memento.meta.inner_loop in "
            "mode 'fwdrev' or 'revfwd', or a jax.custom_vjp of your own, say) that "
            "forward mode cannot enter. Use mode='fwdrev' (forward over reverse) or "
            "mode='revrev'."
        ) from e


def _aux_vjp(value, flat, p_idx, ct_aux):
    """Cotangent of the auxiliary output, pulled back to the leaves P in reverse mode."""

    def aux_of_p(p):
        return value(_replace(flat, p_idx, p))[1]

    aux, pullback = jax.vjp(aux_of_p, tuple(flat[j] for j in p_idx))
    ct = jax.tree.map(
        lambda c, a: _zero_cotangent(a) if isinstance(c, SymbolicZero) else c,
        ct_aux,
        aux,
        is_leaf=lambda c: isinstance(c, SymbolicZero),
    )
    return pullback(ct)[0]


def _zero_cotangent(x):
    if _is_float(x):
        return jnp.zeros_like(x)
    return jnp.zeros(jnp.shape(x), jax.dtypes.float0)
