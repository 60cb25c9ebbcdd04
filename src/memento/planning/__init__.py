"""Optimal checkpointing policies (Gruslys et al. 2016) as explicit schedules. NumPy only."""

from ._schedule import (
    Op as Op,
    Schedule as Schedule,
    ScheduleError as ScheduleError,
    SimulationResult as SimulationResult,
)
from ._schedule import simulate as simulate
