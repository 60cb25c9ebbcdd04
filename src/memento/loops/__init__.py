"""JAX executors of checkpointing schedules: `scan` (and `while_loop`)."""

from ._budget import bytes_budget as bytes_budget
from ._scan import scan as scan
from ._while import while_loop as while_loop
