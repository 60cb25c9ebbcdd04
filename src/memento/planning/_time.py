"""Predicted time of a plan: evaluations of the step, plus the executor's loop iterations.

Counting forward evaluations alone (the paper's cost) ignores what running a schedule
costs per loop iteration: the static executor's loops are ``lax.scan``s that XLA compiles
as tight loops, the rows executor reads a schedule row and dispatches on it, the recursion
keeps its own stack. For small steps that overhead dominates; `loop_seconds` charges it.

The constants are per backend and coarse: what separates the executors is orders of
magnitude (a ``lax.scan`` iteration costs nanoseconds on CPU, a row of the rows
executor or a node of the recursion about a microsecond), not the digits.
``benchmarks/pareto.py`` times ``"auto"``'s pick against every forced executor.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LoopCosts", "dataflow_loops", "loop_costs", "loop_seconds", "step_seconds"]


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
        rewrite: per byte copied by a store into a stack that the backend copies whole
            at each store (XLA's CPU backend does so for bfloat16 arrays, as in
            ``lax.scan``'s own gradient), see `StaticPlan.rewritten_bytes`.
        dataflow: per iteration of a loop whose body the backend runs as a dataflow
            graph rather than in order (see `dataflow_loops`), beyond ``iteration``.
    """

    flop: float
    byte: float
    op: float
    iteration: dict
    start: float
    cache: float
    spill: float
    rewrite: float = 0.0
    dataflow: float = 0.0


# CPU: fitted to the gradients' times of eight bodies (a scalar to an LSTM, 4 to 4096
# floats) under eight static plans each at 10^4 steps, one core, a step's backward
# counted as two evaluations; the rows' and the recursion's iterations measured on a
# 4-float cell. ``cache``: a stack of internal states up to 8 MB costs no more per byte
# than shorter ones; from 48 MB on it does (half the last-level cache of the machine
# measured, 32 MiB). ``rewrite``: a loop storing 256 bfloat16 per step into a stack.
# ``dataflow``: added to that fit (its other constants kept), between the fitted 1.7e-7
# and the 2.3e-7 to 3.1e-7 per step by which checkpointing every step of a
# ``tanh(W @ h + x)`` cell of 8 to 64 floats is slower than nested sqrt(T)
# (``benchmarks/loop_ops.py``).
# GPU: a loop iteration is a launch and a predicate read back, several microseconds.
_COSTS = {
    "cpu": LoopCosts(
        flop=1.6e-11,
        byte=2.8e-12,
        op=4.8e-10,
        iteration={"static": 6.3e-9, "rows": 1.5e-6, "recursion": 1.0e-6},
        start=5.0e-8,
        cache=16 * 2**20,
        spill=1.0e-10,
        rewrite=1.45e-10,
        dataflow=2.0e-7,
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
    rewritten: float = 0,
    dataflow: float = 0,
) -> float:
    """Predicted seconds of a plan: ``evaluations`` forward evaluations of a step of
    ``step`` seconds (its backward counted as two more, for every plan alike),
    ``iterations`` loop iterations of ``executor`` and, for the static executor, the
    ``starts`` of its loops and the bytes of internal states it stores past the cache
    (``spilled``, see `LoopCosts.spill`), the bytes its stores copy (``rewritten``,
    see `LoopCosts.rewrite`) and its iterations run as dataflow graphs (``dataflow``,
    see `dataflow_loops`)."""
    c = loop_costs(backend)
    loops = iterations * c.iteration[executor] + starts * c.start + dataflow * c.dataflow
    return evaluations * step + loops + 2 * spilled * c.spill + rewritten * c.rewrite


# XLA:CPU runs the operations of a computation in order in the calling thread when there
# are at most 8 of them, when no buffer they touch exceeds 512 bytes, or when each needs
# the one before; otherwise as a dataflow graph over its thread pool. A loop whose
# iteration touches under 1 KiB (its cost analysis's bytes) is compiled whole instead.
_SEQUENTIAL_OPS = 8
_WHOLE_LOOP_BYTES = 1024


def dataflow_loops(matmuls: int, carry_leaves: int, step_bytes: float, backend: str):
    """Whether ``backend`` runs the static executor's loop bodies as dataflow graphs
    (`LoopCosts.dataflow`): ``(separate, fused)``, for loops that run or back-propagate
    one step per iteration, and for those that run a step again and back-propagate it in
    the same iteration (a one-step segment's; see `StaticPlan.step_iterations`).

    Estimated from a step of ``matmuls`` matrix products or convolutions, ``carry_leaves``
    differentiated carry leaves and ``step_bytes`` bytes read and written. Operations
    after XLA's fusion, counted on the executor's loops for bodies of 0 to 8 products and
    1 or 2 leaves: a separate loop's body about ``5 + matmuls + 2 * leaves`` (its step or
    VJP, a copy and an update per carried leaf, the counter), a fused one's about
    ``4 + 4 * matmuls + 2 * leaves`` (the VJP of a product is two more). A separate loop
    touches about twice a step's bytes, a fused one three times. Only XLA:CPU is known
    to do this; other backends answer ``(False, False)``.
    """
    if backend != "cpu":
        return False, False
    separate = 5 + matmuls + 2 * carry_leaves > _SEQUENTIAL_OPS
    fused = 4 + 4 * matmuls + 2 * carry_leaves > _SEQUENTIAL_OPS
    return (
        separate and 2 * step_bytes >= _WHOLE_LOOP_BYTES,
        fused and 3 * step_bytes >= _WHOLE_LOOP_BYTES,
    )
