"""Mixed-mode meta-gradients (MixFlow-MG, seed 004) and bilevel helpers."""

from ._bilevel import inner_loop as inner_loop
from ._fwdrev import fwdrev_grad as fwdrev_grad

__all__ = ["fwdrev_grad", "inner_loop"]
