"""JAX executors of checkpointing schedules: `scan` (and `while_loop`).

`scan_schedule` is the schedule `scan` follows, for given arguments, without running it.
"""

from ._budget import bytes_budget as bytes_budget
from ._scan import scan as scan, scan_schedule as scan_schedule
from ._while import while_loop as while_loop
