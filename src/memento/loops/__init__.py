"""JAX executors of checkpointing schedules: `scan`, `while_loop`, `chain`.

`scan_schedule` is the schedule `scan` follows, for given arguments, without running it;
`chain_plan`, the plan `chain` follows.
"""

from ._budget import bytes_budget as bytes_budget
from ._chain import (
    ChainPlan as ChainPlan,
    chain as chain,
    chain_plan as chain_plan,
    scan_layers as scan_layers,
)
from ._scan import scan as scan, scan_schedule as scan_schedule
from ._while import while_loop as while_loop
