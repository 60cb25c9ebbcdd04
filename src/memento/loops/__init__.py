"""JAX executors of checkpointing schedules: `scan`, `while_loop`, `chain`."""

from ._budget import bytes_budget as bytes_budget
from ._chain import ChainPlan as ChainPlan
from ._chain import chain as chain
from ._chain import chain_plan as chain_plan
from ._chain import scan_layers as scan_layers
from ._scan import scan as scan
from ._while import while_loop as while_loop
