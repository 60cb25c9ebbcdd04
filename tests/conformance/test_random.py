"""A randomised differential test: memento.scan against lax.scan.

Hypothesis draws the length (0 to 10), the carry (one to five leaves of mixed dtypes:
float64, float32, complex128, int32, int8, uint8, bool; scalars, vectors and zero-size
leaves in any position), the inputs ``xs`` and outputs ``ys`` (zero-size ones too), NaN,
inf and -0.0 in values and cotangents, the budget (log-uniform from one slot to 2^40
bytes, as slots, a size string or `memento.bytes_budget`), the policy, the executor
(rows, the recursion where it runs the policy, auto), a host level (none, 1 or 3 host
slots, unbounded; HSM/MSM/auto on the rows), ``reverse``, ``unroll``, ``jit``,
``vmap`` and forward-over-reverse second order. Each example compares the values, the
vector-Jacobian product for random cotangents and (if drawn) its forward derivative with
lax.scan's: NaN and inf positions and the signs of zeros exactly, other values to 1e-9
(float32: 1e-4); in the forward derivative, which elements are finite (see
`_trees.assert_same`). The one refusal accepted is ISM's below one internal state.

``MEMENTO_EXAMPLES`` sets the number of examples (the multi-device runs take fewer).
"""

import functools
import math
import os

import jax
import numpy as np
from hypothesis import HealthCheck, example, given, settings, strategies as st
from jax import lax

import memento

from . import _trees
from ._trees import Leaf

EXAMPLES = int(os.environ.get("MEMENTO_EXAMPLES", "12"))


@st.composite
def cases(draw):
    policy = draw(st.sampled_from(["hsm", "ism", "msm", "auto"]))
    carry = draw(st.lists(_trees.leaf(), min_size=1, max_size=5))
    return {
        "length": draw(st.integers(0, 10)),
        "carry": carry,
        "drive": draw(st.lists(_trees.leaf(("smooth", "count")), max_size=2)),
        "zero_y": draw(st.booleans()),
        "policy": policy,
        "executor": draw(
            st.sampled_from(
                ["rows", "recursion", "auto"] if policy in ("hsm", "auto") else ["rows", "auto"]
            )
        ),
        "memory": draw(_trees.budgets(sum(c.nbytes for c in carry))),
        "reverse": draw(st.booleans()),
        "unroll": draw(st.sampled_from([1, 2])),
        "jit": draw(st.booleans()),
        "vmap": draw(st.booleans()),
        "second_order": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "host": draw(st.sampled_from([None, None, 1, 3, math.inf])),
    }


def problem(case):
    """``(run, args, cts, tangents)``: ``run(scan, *args)`` returns the differentiable
    outputs and, as aux, the others; ``cts`` and ``tangents`` match outputs and args."""
    rng = np.random.default_rng(case["seed"])
    carry, T = case["carry"], case["length"]
    x_leaves = [c for c in carry if c.kind == "special"] + case["drive"]
    f = _trees.step(carry, x_leaves, case["zero_y"])
    ys = _trees.y_leaves(carry, case["zero_y"])
    init = [_trees.values(c, rng) for c in carry]
    xs = [_trees.values(x, rng, lead=(T,)) for x in x_leaves]
    consts = {
        i: (0.4 * rng.uniform(-1, 1, c.shape)).astype(np.real(np.zeros((), c.dtype)).dtype)
        for i, c in enumerate(carry)
        if c.kind == "smooth"
    }
    dc = [i for i, c in enumerate(carry) if c.differentiable]
    dx = [i for i, x in enumerate(x_leaves) if x.differentiable]
    dy = [i for i, y in enumerate(ys) if y.differentiable]

    def run(scan, consts, init_d, xs_d):
        c0, x0 = list(init), list(xs)
        for i, v in zip(dc, init_d):
            c0[i] = v
        for i, v in zip(dx, xs_d):
            x0[i] = v
        c, y = scan(
            lambda c, x: f(consts, c, x), c0, x0 or None, length=T,
            reverse=case["reverse"], unroll=case["unroll"],
        )  # fmt: skip
        split = lambda leaves, d: (
            [v for i, v in enumerate(leaves) if i in d],
            [v for i, v in enumerate(leaves) if i not in d],
        )
        (cd, cn), (yd, yn) = split(c, dc), split(y, dy)
        return (cd, yd), (cn, yn)

    args = (consts, [init[i] for i in dc], [xs[i] for i in dx])
    cts = (
        [_trees.cotangent(carry[i], rng, carry[i].shape) for i in dc],
        [_trees.cotangent(ys[i], rng, (T, *ys[i].shape)) for i in dy],
    )
    tangents = jax.tree_util.tree_map(lambda a: np.ones_like(a), args)
    return run, args, cts, tangents


def derivatives(scan, run, second_order, args, cts, tangents):
    def vjp(args):
        out, pullback, aux = jax.vjp(functools.partial(run, scan), *args, has_aux=True)
        return out, aux, pullback(cts)

    if not second_order:
        return vjp(args)
    return jax.jvp(vjp, (args,), (tangents,))


def _case(carry, memory, policy="hsm", executor="rows", **kw):
    return {
        "length": 7, "carry": carry, "drive": [], "zero_y": False, "policy": policy,
        "executor": executor, "memory": memory, "reverse": False, "unroll": 1, "jit": False,
        "vmap": False, "second_order": False, "seed": 0, "host": None, **kw,
    }  # fmt: skip


# The extremes, whatever hypothesis draws: one slot and 2^40 bytes, a zero-size leaf
# first and last, scalars beside vectors, every dtype kind, through every executor.
_MIXED = [
    Leaf("special", np.float32, (0,), "self"),
    Leaf("smooth", np.float64, (), "sum"),
    Leaf("count", np.uint8, (3,), "self"),
    Leaf("smooth", np.complex128, (3,), "sum"),
    Leaf("special", np.float64, (3,), "sum"),
]
_SCALARS = [
    Leaf("smooth", np.float32, (), "self"),
    Leaf("special", np.float64, (), "self"),
    Leaf("count", np.bool_, ()),
    Leaf("smooth", np.float64, (2, 0), "self"),
]


@example(  # NaN in lax.scan's forward-over-reverse derivative where the unrolled loop's is inf
    _case(
        [
            Leaf("smooth", np.float64, (0,)),
            Leaf("smooth", np.float64, ()),
            Leaf("special", np.float64, (2, 2)),
        ],
        "0.115KB",
        length=2,
        drive=[Leaf("count", np.int32, ()), Leaf("smooth", np.float64, ())],
        unroll=2,
        jit=True,
        second_order=True,
        seed=598,
    )
)
@example(_case(_MIXED, 1, executor="recursion", drive=[Leaf("smooth", np.float32, (0,))]))
@example(_case(_MIXED, memento.bytes_budget(2**40), "auto", "recursion", zero_y=True))
@example(_case(_MIXED, "1TiB", "ism", "auto", reverse=True, jit=True))
@example(_case(_SCALARS, 1, "msm", unroll=2, vmap=True, second_order=True))
@example(
    _case(
        _MIXED, 2, "auto", host=1, reverse=True, jit=True, drive=[Leaf("smooth", np.float32, (0,))]
    )
)
@example(_case(_SCALARS, 1, "msm", host=math.inf, vmap=True, second_order=True, length=10))
@example(_case(_SCALARS, 2**40, "auto", "recursion", length=10, vmap=True, second_order=True))
@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(cases())
def test_memento_scan_equals_lax_scan(case):
    run, args, cts, tangents = problem(case)
    if case["vmap"]:  # two members: these inputs and cotangents, and a scaled copy
        args, cts, tangents = jax.tree_util.tree_map(
            lambda a: np.stack([a, -0.5 * a]), (args, cts, tangents)
        )

    policy, executor, host = case["policy"], case["executor"], {}
    if case["host"] is not None:  # a two-level plan: HSM or MSM, on the rows
        policy = "msm" if policy == "ism" else policy
        executor = "rows" if executor == "recursion" else executor
        host = {"host_memory": case["host"], "transfer_cost": 0.5}

    def budgeted(f, init, xs, **kw):
        return memento.scan(
            f, init, xs, **kw, memory=case["memory"], policy=policy, executor=executor, **host
        )  # fmt: skip

    def results(scan):
        go = functools.partial(derivatives, scan, run, case["second_order"])
        if case["jit"]:
            go = jax.jit(go)
        if case["vmap"]:
            go = jax.vmap(go, axis_size=2)  # (axis_size: nothing may be differentiable)
        return go(args, cts, tangents)

    want = results(lax.scan)
    try:
        got = results(budgeted)
    except ValueError as e:  # the refusals accepted, each naming what it needs
        if executor == "rows" and "executor='rows' cannot run" in str(e):
            assert "its smallest takes" in str(e), e  # a byte budget below its rows
            return
        if case["second_order"] and "cannot hold even one carry" in str(e):
            return  # the loop of the step's JVP keeps a carry and its tangent per slot
        assert policy == "ism", e  # ISM below one internal state
        assert "needs room for one internal state" in str(e), e
        return
    if not case["second_order"]:
        return _trees.assert_same(got, want)
    _trees.assert_same(got[0], want[0])  # values and the vector-Jacobian product
    _trees.assert_same(got[1], want[1], "forward derivative", exact=False)
