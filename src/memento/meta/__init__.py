"""Mixed-mode meta-gradients (MixFlow-MG) and bilevel helpers.

MixFlow-MG: Kemaev et al. 2025, "Scalable Meta-Learning via Mixed-Mode Differentiation".

- `fwdrev_grad`: ``jax.grad`` whose VJP (Hessian- and mixed-derivative-vector products)
  runs forward-over-reverse, reverse-over-forward or reverse-over-reverse.
- `inner_loop`: T optax steps on an inner loss, differentiable w.r.t. meta-parameters,
  with per-step rematerialisation that saves inner gradients and an optional
  `memento.scan` memory budget across steps.
"""

from .. import _needs_jax  # noqa: F401  (first: without it, an ImportError naming the extra)
from ._bilevel import inner_loop as inner_loop
from ._fwdrev import fwdrev_grad as fwdrev_grad

__all__ = ["fwdrev_grad", "inner_loop"]
