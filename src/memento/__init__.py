"""memento: reverse-mode gradients through long loops, under a memory budget.

``import memento`` loads only the NumPy planner. The JAX parts (`scan`, `while_loop`,
`chain`, `explain`, `bytes_budget`, `fwdrev_grad`, `meta`, `loops`, and `diffrax` with Diffrax
installed) load on first use, through the module ``__getattr__`` below; type checkers
read their real signatures from the ``TYPE_CHECKING`` imports.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

from .planning import (
    BpttComparison as BpttComparison,
    Op as Op,
    Plan as Plan,
    Schedule as Schedule,
    ScheduleError as ScheduleError,
    SimulationResult as SimulationResult,
    chen_recursive as chen_recursive,
    chen_sqrt as chen_sqrt,
    compare_to_bptt as compare_to_bptt,
    cost_table as cost_table,
    plan as plan,
    plan_chain as plan_chain,
    revolve as revolve,
    revolve_cost as revolve_cost,
    simulate as simulate,
    store_all as store_all,
    store_none as store_none,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers only (no jax at runtime)
    from . import diffrax as diffrax, loops as loops, meta as meta
    from .loops import (
        bytes_budget as bytes_budget,
        chain as chain,
        explain as explain,
        scan as scan,
        while_loop as while_loop,
    )
    from .meta import fwdrev_grad as fwdrev_grad

# name -> (module, attribute); attribute None means the module itself.
_LAZY = {
    "scan": ("memento.loops", "scan"),
    "while_loop": ("memento.loops", "while_loop"),
    "chain": ("memento.loops", "chain"),
    "explain": ("memento.loops", "explain"),
    "bytes_budget": ("memento.loops", "bytes_budget"),
    "fwdrev_grad": ("memento.meta", "fwdrev_grad"),
    "meta": ("memento.meta", None),
    "loops": ("memento.loops", None),
    # needs Diffrax (pip install "memento-jax[diffrax]"); the ImportError says so
    "diffrax": ("memento.diffrax", None),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = _importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memento' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
