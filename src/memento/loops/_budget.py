"""Memory budgets: the NumPy-only helpers of `memento.planning`, under the names the JAX
executors import."""

from ..planning import Bytes as Bytes, Charges as Charges, bytes_budget as bytes_budget
from ..planning.internals import (
    Percent as Percent,
    choose_policy as choose_policy,
    choose_schedule as choose_schedule,
    internal_slots as internal_slots,
    parse_memory as parse_memory,
    to_slots as to_slots,
)
