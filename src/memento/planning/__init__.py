"""Optimal checkpointing policies (Gruslys et al. 2016) as explicit schedules. NumPy only.

Planners: `plan` (``policy="auto"`` is `memento.scan`'s choice, by `predicted_work` under
`Charges`), `cost_table`, `plan_chain`; `plan_estimate` predicts how long `plan` takes.
Closed forms: `hsm_cost`, `ism_cost`. Online checkpointing (for `memento.while_loop`,
whose length is unknown): `online_events`, `online_evaluations`. Baselines, each a
replayed `Schedule` under the same memory model: `store_all` (plain BPTT), `store_none`,
`chen_sqrt`, `chen_recursive`, `revolve` (with `revolve_cost`); `compare_to_bptt`
reports any schedule's memory saved and predicted time. Reading a schedule: `walk`
yields its rows (`Row`) checked and annotated, `simulate` replays it, and
`step_evaluations` counts each step's evaluations. Budgets: `bytes_budget`. What
`memento.explain` returns: `Plan` (what a scan's gradient will run, and why), of a
`Request` (a loop's arguments, validated).

What the executors share beyond this (reading ``memory=``, choosing the schedule to run,
walking it) is in `memento.planning.internals`.
"""

from ._auto import (
    Charges as Charges,
    Policy as Policy,
    predicted_work as predicted_work,
)
from ._baselines import (
    BpttComparison as BpttComparison,
    chen_recursive as chen_recursive,
    chen_sqrt as chen_sqrt,
    compare_to_bptt as compare_to_bptt,
    revolve as revolve,
    revolve_cost as revolve_cost,
    store_all as store_all,
    store_none as store_none,
)
from ._budget import Bytes as Bytes, bytes_budget as bytes_budget
from ._chain import plan_chain as plan_chain
from ._closed import hsm_cost as hsm_cost, ism_cost as ism_cost
from ._dp import cost_table as cost_table, plan as plan, plan_estimate as plan_estimate
from ._online import (
    OnlineEvents as OnlineEvents,
    online_evaluations as online_evaluations,
    online_events as online_events,
)
from ._request import Plan as Plan, Request as Request
from ._schedule import (
    Op as Op,
    Row as Row,
    Schedule as Schedule,
    ScheduleError as ScheduleError,
    SimulationResult as SimulationResult,
    simulate as simulate,
    step_evaluations as step_evaluations,
    walk as walk,
)

__all__ = [
    "BpttComparison",
    "Bytes",
    "Charges",
    "OnlineEvents",
    "Op",
    "Plan",
    "Policy",
    "Request",
    "Row",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "bytes_budget",
    "chen_recursive",
    "chen_sqrt",
    "compare_to_bptt",
    "cost_table",
    "hsm_cost",
    "ism_cost",
    "online_evaluations",
    "online_events",
    "plan",
    "plan_chain",
    "plan_estimate",
    "predicted_work",
    "revolve",
    "revolve_cost",
    "simulate",
    "step_evaluations",
    "store_all",
    "store_none",
    "walk",
]
