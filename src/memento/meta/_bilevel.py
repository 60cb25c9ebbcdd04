"""`inner_loop`: T steps of an optax optimiser, differentiable w.r.t. meta-parameters.

The inner loop of MixFlow-MG's Eq. 3 with its reparameterisation (Eq. 4, Algorithm 2):
the update ``Upsilon(grad L_i, theta_i, upsilon_i, eta, x_i)`` receives the inner gradient
as an argument, and that gradient comes from `fwdrev_grad`, so the meta-gradient's
Hessian and mixed-derivative products run forward-over-reverse.

Memory, in the paper's terms (section 4):

- dynamic memory, the activations of one inner step's meta-backward: mixed mode plus
  per-block rematerialisation inside the user's model keep one block's worth;
- the inner gradient saved with the step's checkpoint (section 4, "saving inner
  gradients") spares one inner backward pass per step in the outer backward pass;
- static memory, the per-step checkpoints ``(theta_i, upsilon_i, grad L_i)``: linear in T
  with per-step rematerialisation; under a `memento.scan` budget (``memory=``) it is
  bounded by the budget whatever T, at the price of recomputing inner steps (appendix
  A.2's suggestion of dynamic-programming checkpointing).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard

import jax
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

from ._fwdrev import Mode, check_mode, fwdrev_grad

if TYPE_CHECKING:
    from ..planning import Policy

_NAME = "memento.meta.inner_loop"
# The checkpoint name of the inner gradient (MixFlow-MG, Listing 3).
INNER_GRADS = "memento_inner_grads"


def inner_loop(
    inner_loss: Callable[[Any, Any, Any], Any],
    optimizer: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    params: Any,
    eta: Any,
    batches: Any,
    *,
    mode: Mode = "fwdrev",
    remat: bool = True,
    save_inner_grads: bool = True,
    memory: int | str | None = None,
    policy: Policy = "auto",
) -> Any:
    """Runs T inner optimiser steps; the result is differentiable w.r.t. `eta`.

    Equivalent to::

        opt = optimizer(eta) if callable(optimizer) else optimizer
        state = opt.init(params)
        for t in range(T):
            g = jax.grad(inner_loss)(params, eta, batches[t])
            updates, state = opt.update(g, state, params)
            params = optax.apply_updates(params, updates)
        return params

    with the same value and the same meta-gradient (any ``jax.grad`` of a function of
    the result, w.r.t. `eta` or anything else it depends on), computed the MixFlow-MG
    way: the inner gradient's VJP in `mode`, each inner step rematerialised from its
    input with its inner gradient saved, and optionally a memory budget across steps.

    `eta` reaches the inner loop three ways, all differentiated: through `inner_loss`
    (loss weighting), through a callable `optimizer` (learned learning rates), and
    through `params` when the caller builds them from `eta` (MAML: ``params=eta``).

    Transformations: ``jit``, ``grad``/``vjp`` and ``vmap`` (e.g. over tasks); forward
    mode in mode ``"revrev"``, with or without `memory`. Not forward mode in modes
    ``"fwdrev"``/``"revfwd"`` (custom VJPs).

    Args:
        inner_loss: ``L(params, eta, batch) -> scalar``, twice differentiable.
        optimizer: An optax transformation, or a function ``eta -> transformation`` when
            its hyperparameters depend on `eta` (e.g. per-parameter learning rates).
            Adam-like optimisers need ``eps_root > 0`` (see Raises).
        params: Initial parameters ``theta_0`` (a pytree).
        eta: Meta-parameters (any pytree, possibly ``None``).
        batches: Pytree whose leaves have a leading axis of length T, one slice per step.
        mode: How the inner gradient is differentiated: ``"fwdrev"`` (default),
            ``"revfwd"`` or ``"revrev"`` (plain ``jax.grad``); see `fwdrev_grad`.
        remat: Rematerialise each inner step in the outer backward pass, storing only
            its inputs (and the inner gradient, see below): the static memory is the
            per-step checkpoints instead of every activation.
        save_inner_grads: With `remat`, also store each step's inner gradient (MixFlow-MG,
            section 4), so the outer backward pass does not redo the inner backward.
        memory: A `memento.scan` budget across the inner steps: an ``int`` number of
            slots the size of the loop state ``(params, optimiser state)``, or bytes such
            as ``"64MiB"``. ``None`` stores every step's checkpoint (linear in T).
        policy: `memento.scan`'s policy when `memory` is set.

    Returns:
        The final parameters ``theta_T``, with the structure of `params`.

    Raises:
        ValueError: An unknown `mode`; an optimiser with ``eps_root == 0`` (optax's Adam
            default), whose meta-gradient is NaN wherever an inner gradient coordinate
            is exactly zero; batches without a common leading axis.
        TypeError: A non-callable `inner_loss` or an `optimizer` that is not an optax
            transformation.

    References:
        Kemaev et al. 2025, "Scalable Meta-Learning via Mixed-Mode Differentiation": Algorithm 2, section 4, appendix A.2.
    """
    check_mode(mode, _NAME)
    if not callable(inner_loss):
        raise TypeError(f"{_NAME}: inner_loss must be callable, got {inner_loss!r}.")
    opt = optimizer(eta) if _is_factory(optimizer) else optimizer
    if not isinstance(opt, optax.GradientTransformation):
        raise TypeError(
            f"{_NAME}: optimizer must be an optax.GradientTransformation or a function "
            f"eta -> optax.GradientTransformation, got {type(opt).__name__}."
        )
    _check_eps_root(opt)
    num_steps = _num_steps(batches)
    del num_steps  # Validated; the scan reads it from `batches`.

    grad_fn = fwdrev_grad(inner_loss, mode=mode)

    def step(carry, batch):
        theta, state = carry
        g = grad_fn(theta, eta, batch)
        if save_inner_grads:
            g = jax.tree.map(lambda x: checkpoint_name(x, INNER_GRADS), g)
        # The rest is Upsilon of Eq. 4: it sees the gradient only as an input.
        updates, state = opt.update(g, state, theta)
        return (optax.apply_updates(theta, updates), state), None

    if remat:
        saved = (INNER_GRADS,) if save_inner_grads else ()
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.save_only_these_names(*saved))
    carry = (params, opt.init(params))
    if memory is None:
        (theta, _), _ = jax.lax.scan(step, carry, batches)
    else:
        from ..loops import scan

        (theta, _), _ = scan(step, carry, batches, memory=memory, policy=policy)
    return theta


def _is_factory(optimizer) -> TypeGuard[Callable[[Any], optax.GradientTransformation]]:
    return callable(optimizer) and not isinstance(optimizer, optax.GradientTransformation)


def _num_steps(batches) -> int:
    leaves = jax.tree.leaves(batches)
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if not leaves or -1 in lengths or len(lengths) != 1:
        sizes = sorted("None" if n < 0 else str(n) for n in lengths)
        raise ValueError(
            f"{_NAME}: batches must be a pytree whose leaves share a leading axis of length "
            f"T (one slice per inner step); got leading sizes {sizes}."
        )
    (length,) = lengths
    return length


def _check_eps_root(opt: optax.GradientTransformation) -> None:
    """Refuses Adam-like transformations built with ``eps_root == 0``.

    optax's scale_by_adam divides by ``sqrt(nu + eps_root)``. With ``eps_root = 0`` the
    derivative of the square root is infinite where ``nu = 0``, i.e. wherever a gradient
    coordinate has been exactly zero so far (embedding rows of absent tokens, masked
    weights), and ``inf * 0`` makes the meta-gradient NaN in every mode. The value lives
    in the update function's closure; we look for it there.
    """
    for value in _closure_values(opt.update, "eps_root"):
        if isinstance(value, numbers.Number) and value == 0:
            raise ValueError(
                f"{_NAME}: the optimiser was built with eps_root={value!r} (optax's Adam "
                "default). Its meta-gradient is NaN wherever an inner gradient coordinate "
                "is exactly zero, because d sqrt(nu)/d nu is infinite at nu = 0. Build it "
                "with eps_root > 0, e.g. optax.adam(learning_rate, eps_root=1e-8)."
            )


def _closure_values(obj, name: str, depth: int = 6, seen=None) -> list:
    """Values of closure variables called `name`, found recursively from `obj`."""
    seen = set() if seen is None else seen
    if depth < 0 or id(obj) in seen:
        return []
    seen.add(id(obj))
    found = []
    if isinstance(obj, (tuple, list)):
        for item in obj:
            found += _closure_values(item, name, depth - 1, seen)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # An empty cell.
                continue
            if var == name:
                found.append(value)
            else:
                found += _closure_values(value, name, depth - 1, seen)
    return found
