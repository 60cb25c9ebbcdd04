"""Optimal checkpointing policies (Gruslys et al. 2016) as explicit schedules. NumPy only.

Planners: `plan`, `cost_table`, `plan_chain`; `msm_estimate_s` predicts how long `plan`
takes for MSM. Baselines, flat in this namespace and in ``memento``, each a replayed
`Schedule` under the same memory model: `store_all` (plain BPTT), `store_none`,
`chen_sqrt`, `chen_recursive`, `revolve` (with `revolve_cost`); `compare_to_bptt` reports
any schedule's memory saved and predicted time.
"""

from ._baselines import BpttComparison as BpttComparison
from ._baselines import chen_recursive as chen_recursive
from ._baselines import chen_sqrt as chen_sqrt
from ._baselines import compare_to_bptt as compare_to_bptt
from ._baselines import revolve as revolve
from ._baselines import revolve_cost as revolve_cost
from ._baselines import store_all as store_all
from ._baselines import store_none as store_none
from ._chain import plan_chain as plan_chain
from ._closed import hsm_cost as hsm_cost
from ._closed import hsm_split as hsm_split
from ._closed import ism_cost as ism_cost
from ._dp import cost_table as cost_table
from ._dp import plan as plan
from ._dp import plan_estimate as plan_estimate
from ._msm import msm_estimate_s as msm_estimate_s
from ._schedule import (
    Op as Op,
)
from ._schedule import (
    Schedule as Schedule,
)
from ._schedule import (
    ScheduleError as ScheduleError,
)
from ._schedule import (
    SimulationResult as SimulationResult,
)
from ._schedule import simulate as simulate
from ._schedule import stack_depths as stack_depths
