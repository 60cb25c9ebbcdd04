"""What the executors share (JAX's `memento.loops`, `memento.torch`, the command line).

Not user API: names here may change between versions. NumPy only, like the rest of
`memento.planning`.

- Reading ``memory=``: `parse_memory` (slots, `Bytes` or `Percent`), `parse_size`,
  `to_slots`, `as_int`; the paper's alpha from measured sizes: `internal_slots`.
- Reading a request (every entry point's arguments, validated once): `read_request`
  (a `Request`), `check_executor`, `parse_host_memory`, `host_slots`, `EXECUTORS`; the
  backend's part in choosing: `recursion_min_steps`, `auto_charges`.
- Choosing what to run: `check_policy`, `auto_policy`, `choose_policy`,
  `choose_schedule`, `INTERNAL_STATE_CHARGE`.
- Walking a schedule: `Walk`, `INITIAL`, `first_backward` (where the first sweep ends),
  `backward_runs` (backward steps an eager executor may run as one reverse pass),
  `stack_depths` and `two_level_depths` (the slot stacks a schedule needs).
- Layer stacks: `check_layers`, `plan_layers` (a `ChainPlan`), `plan_chain_bytes`,
  `CHAIN_POLICIES`, `ChainPolicy`.
- Closed forms' splits and tables: `hsm_split`, `ism_split`, `ism_column`,
  `checkpoints_at`, `msm_estimate_s`.
- Static plans (nested segments of static lengths, the static executor's):
  `StaticPlan`, `plan_static`, `static_plan`, `nest_schedule`; what a plan's loops cost:
  `LoopCosts`, `loop_costs`, `loop_seconds`, `step_seconds`, `dataflow_loops`.
"""

from ._args import check_argnums as check_argnums
from ._auto import (
    INTERNAL_STATE_CHARGE as INTERNAL_STATE_CHARGE,
    auto_policy as auto_policy,
    check_policy as check_policy,
)
from ._budget import (
    Percent as Percent,
    as_int as as_int,
    internal_slots as internal_slots,
    parse_memory as parse_memory,
    parse_size as parse_size,
    to_slots as to_slots,
)
from ._chain import plan_chain_bytes as plan_chain_bytes
from ._choose import choose_policy as choose_policy, choose_schedule as choose_schedule
from ._closed import hsm_split as hsm_split, ism_column as ism_column, ism_split as ism_split
from ._layers import (
    CHAIN_POLICIES as CHAIN_POLICIES,
    ChainPlan as ChainPlan,
    ChainPolicy as ChainPolicy,
    check_layers as check_layers,
    plan_layers as plan_layers,
)
from ._msm import msm_estimate_s as msm_estimate_s
from ._nest import (
    StaticPlan as StaticPlan,
    nest_schedule as nest_schedule,
    plan_static as plan_static,
    static_plan as static_plan,
)
from ._online import checkpoints_at as checkpoints_at
from ._request import (
    EXECUTORS as EXECUTORS,
    Executor as Executor,
    Request as Request,
    auto_charges as auto_charges,
    check_executor as check_executor,
    host_slots as host_slots,
    parse_host_memory as parse_host_memory,
    read_request as read_request,
    recursion_min_steps as recursion_min_steps,
)
from ._schedule import (
    INITIAL as INITIAL,
    Walk as Walk,
    backward_runs as backward_runs,
    first_backward as first_backward,
    stack_depths as stack_depths,
    two_level_depths as two_level_depths,
)
from ._time import (
    LoopCosts as LoopCosts,
    dataflow_loops as dataflow_loops,
    loop_costs as loop_costs,
    loop_seconds as loop_seconds,
    step_seconds as step_seconds,
)
