"""Optimal checkpointing policies (Gruslys et al. 2016) as explicit schedules. NumPy only.

Planners: `plan` (``policy="auto"`` is `memento.scan`'s choice, by `predicted_work`),
`cost_table`, `plan_chain`; `plan_estimate` and `msm_estimate_s` predict how long `plan`
takes. Closed forms: `hsm_cost`, `ism_cost` and their splits. Online checkpointing (for
`memento.while_loop`, whose length is unknown): `online_events`, `online_evaluations`.
Baselines, flat in this namespace and in ``memento``, each a replayed `Schedule` under
the same memory model: `store_all` (plain BPTT), `store_none`, `chen_sqrt`,
`chen_recursive`, `revolve` (with `revolve_cost`); `compare_to_bptt` reports any
schedule's memory saved and predicted time. Executing a schedule: `walk` yields its rows
checked and annotated, one row walk shared by `simulate`, `step_evaluations` and the
executors that run rows one by one (`memento.chain`, `memento.torch`).

Shared by the executors (JAX's and `memento.torch`): reading ``memory=`` (`parse_memory`,
`bytes_budget`, `to_slots`), the paper's alpha from measured sizes (`internal_slots`),
the schedule to run (`choose_schedule`), where the first sweep ends
(`first_backward`), which backward steps an eager executor may run as one reverse pass
(`backward_runs`); for layer stacks, checking the layers (`check_layers`) and planning
measured layers (`plan_layers`, a `ChainPlan`).
"""

from ._auto import (
    INTERNAL_STATE_CHARGE as INTERNAL_STATE_CHARGE,
    Charges as Charges,
    Policy as Policy,
    auto_policy as auto_policy,
    check_policy as check_policy,
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
from ._budget import (
    Bytes as Bytes,
    bytes_budget as bytes_budget,
    choose_policy as choose_policy,
    choose_schedule as choose_schedule,
    internal_slots as internal_slots,
    parse_memory as parse_memory,
    to_slots as to_slots,
)
from ._chain import plan_chain as plan_chain, plan_chain_bytes as plan_chain_bytes
from ._closed import (
    hsm_cost as hsm_cost,
    hsm_split as hsm_split,
    ism_column as ism_column,
    ism_cost as ism_cost,
    ism_split as ism_split,
)
from ._dp import (
    cost_table as cost_table,
    plan as plan,
    plan_estimate as plan_estimate,
)
from ._layers import (
    CHAIN_POLICIES as CHAIN_POLICIES,
    ChainPlan as ChainPlan,
    ChainPolicy as ChainPolicy,
    check_layers as check_layers,
    plan_layers as plan_layers,
)
from ._msm import msm_estimate_s as msm_estimate_s
from ._time import (
    LoopCosts as LoopCosts,
    loop_costs as loop_costs,
    loop_seconds as loop_seconds,
    step_seconds as step_seconds,
)
from ._nest import (
    StaticPlan as StaticPlan,
    nest_schedule as nest_schedule,
    plan_static as plan_static,
    static_plan as static_plan,
)
from ._online import (
    OnlineEvents as OnlineEvents,
    checkpoints_at as checkpoints_at,
    online_evaluations as online_evaluations,
    online_events as online_events,
)
from ._schedule import (
    INITIAL as INITIAL,
    Op as Op,
    Row as Row,
    Schedule as Schedule,
    ScheduleError as ScheduleError,
    SimulationResult as SimulationResult,
    Walk as Walk,
    backward_runs as backward_runs,
    first_backward as first_backward,
    simulate as simulate,
    stack_depths as stack_depths,
    step_evaluations as step_evaluations,
    two_level_depths as two_level_depths,
    walk as walk,
)
