"""Predicted time of a plan: evaluations of the step, plus the executor's loop iterations.

Counting forward evaluations alone (the paper's cost) ignores what running a schedule
costs per loop iteration: the static executor's loops are ``lax.scan``s that XLA compiles
as tight loops, the rows executor reads a schedule row and dispatches on it, the recursion
keeps its own stack. For small steps that overhead dominates; `loop_seconds` charges it.

The constants are per backend and coarse: what separates the executors is orders of
magnitude (a ``lax.scan`` iteration costs tens of nanoseconds on CPU, a row of the rows
executor or a node of the recursion about a microsecond), not the digits.
``benchmarks/pareto.py`` times ``"auto"``'s pick against every forced executor.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LoopCosts", "loop_costs", "loop_seconds", "step_seconds"]


@dataclasses.dataclass(frozen=True)
class LoopCosts:
    """A backend's costs, in seconds.

    Attributes:
        flop: per floating-point operation of the step.
        byte: per byte a step reads or writes (its arrays' sizes).
        op: per operation of the step (a kernel launch or a dispatch).
        iteration: per loop iteration, by executor (``"static"``, ``"rows"``,
            ``"recursion"``), beyond the step it runs.
        start: per loop the static executor starts (a segment's ``lax.scan``: its
            buffers set up, its first and last iterations), beyond its iterations.
        cache: bytes of stored internal states that stay in cache between the run that
            stores them and the backward pass that reads them (a segment's).
        spill: per byte of internal state stored past ``cache`` (written to memory and
            read back).
    """

    flop: float
    byte: float
    op: float
    iteration: dict
    start: float
    cache: float
    spill: float


# CPU: a 4-float cell's gradient per evaluation on each executor (benchmarks/pareto.py).
# The static executor's loop start: on CPU, the time a nest of 10^4 steps of that cell
# adds per outer segment, over the three loops a segment starts.
# GPU: a loop iteration is a launch and a predicate read back, several microseconds.
_COSTS = {
    "cpu": LoopCosts(
        flop=2.5e-10,
        byte=1.0e-10,
        op=2.0e-8,
        iteration={"static": 2.0e-8, "rows": 1.5e-6, "recursion": 1.0e-6},
        start=5.0e-7,
        cache=2**20,
        spill=1.0e-10,
    ),
    "gpu": LoopCosts(
        flop=1.0e-13,
        byte=3.0e-12,
        op=3.0e-6,
        iteration={"static": 5.0e-6, "rows": 5.0e-5, "recursion": 4.0e-5},
        start=1.0e-5,
        cache=0,
        spill=0.0,
    ),
}


def loop_costs(backend: str) -> LoopCosts:
    """The `LoopCosts` of ``backend`` (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"``,
    ``"tpu"``); backends not measured take the GPU's."""
    return _COSTS.get(backend, _COSTS["gpu"])


def step_seconds(flops: float, bytes_accessed: float, ops: int, backend: str) -> float:
    """Predicted seconds of one step of ``flops`` floating-point operations touching
    ``bytes_accessed`` bytes in ``ops`` operations."""
    c = loop_costs(backend)
    return flops * c.flop + bytes_accessed * c.byte + ops * c.op


def loop_seconds(
    evaluations: float,
    iterations: float,
    executor: str,
    *,
    step: float,
    backend: str,
    starts: float = 0,
    spilled: float = 0,
) -> float:
    """Predicted seconds of a plan: ``evaluations`` forward evaluations of a step of
    ``step`` seconds (its backward counted as two more, for every plan alike),
    ``iterations`` loop iterations of ``executor`` and, for the static executor, the
    ``starts`` of its loops and the bytes of internal states it stores past the cache
    (``spilled``, see `LoopCosts.spill`)."""
    c = loop_costs(backend)
    loops = iterations * c.iteration[executor] + starts * c.start
    return evaluations * step + loops + 2 * spilled * c.spill
