"""memento for PyTorch: optimal checkpointing of loops and layer stacks, and MixFlow-MG.

An optional extra (``pip install "memento-jax[torch]"``); the only part of memento that
imports torch (``import memento`` stays NumPy only). The schedules are
`memento.planning`'s, walked row by row as the JAX executors walk them:

- `scan`: a recurrent loop ``h, y = step(h, x)`` whose gradient follows `memento.plan`'s
  optimal HSM / ISM / MSM schedule for a budget in slots or bytes;
- `chain` (as `memento.chain`) and `checkpoint_sequential`: the optimal replacement for
  ``torch.utils.checkpoint.checkpoint_sequential``, planned with `memento.plan_chain` from
  each layer's measured cost and sizes;
- `peak_bytes` and `LiveBytes`: the peak of live tensor bytes while a function runs, on
  any device (on CPU, PyTorch counts none);
- `fwdrev_grad`: ``torch.func.grad`` whose backward pass runs forward-over-reverse
  (MixFlow-MG, Listing 2 of Kemaev et al. 2025, made correct).
"""

from .. import _needs_torch  # noqa: F401  (first: without it, an ImportError naming the extra)
from ._chain import (
    ChainPlan as ChainPlan,
    chain as chain,
    chain_plan as chain_plan,
    checkpoint_sequential as checkpoint_sequential,
)
from ._fwdrev import fwdrev_grad as fwdrev_grad
from ._memory import LiveBytes as LiveBytes, peak_bytes as peak_bytes
from ._scan import scan as scan, scan_schedule as scan_schedule
