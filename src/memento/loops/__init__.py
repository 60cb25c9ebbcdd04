"""JAX executors of checkpointing schedules: `scan`, `while_loop`, `chain`.

`explain` is what `scan`'s gradient will run, and why, for given arguments, without
running it (`scan_schedule`, its schedule alone); `chain_plan`, the plan `chain` follows.
"""

from .. import _needs_jax  # noqa: F401  (first: without it, an ImportError naming the extra)
from ._budget import (
    Bytes as Bytes,
    bytes_budget as bytes_budget,
    parse_memory as parse_memory,
    to_slots as to_slots,
)
from ._chain import (
    ChainPlan as ChainPlan,
    chain as chain,
    chain_plan as chain_plan,
    scan_layers as scan_layers,
)
from ._scan import explain as explain, scan as scan, scan_schedule as scan_schedule
from ._while import _Buffer as Buffer, while_loop as while_loop

# Shared with memento.diffrax and the command line (one reading of budgets): `Bytes`
# (what `bytes_budget` returns), `parse_memory` (``memory=`` as given: slots or `Bytes`),
# `to_slots` (bytes to carry-sized slots), and `Buffer`, the stand-in `while_loop`'s body
# receives for each ``buffers=`` leaf (it supports ``buf.at[i].set(x)`` only).

__all__ = [
    "Buffer",
    "Bytes",
    "ChainPlan",
    "bytes_budget",
    "chain",
    "chain_plan",
    "explain",
    "parse_memory",
    "scan",
    "scan_layers",
    "scan_schedule",
    "to_slots",
    "while_loop",
]
