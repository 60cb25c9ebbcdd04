"""memento.while_loop is lax.while_loop, reverse-differentiable: values, types, first and
second derivatives against the unrolled loop, in float64.

The catalogue follows JAX's while-loop tests (weak-typed init) and Equinox's
``tests/test_while_loop.py`` for checkpointed while loops (perturbation through several
steps, gradients of closed-over values, trivial VJPs, unperturbed outputs, vmap with a
batched or unbatched predicate, vmap of the cotangent), rewritten for memento.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from jax import lax

import memento

from . import _trees
from ._variants import assert_close

MEMORIES = [1, 3, 8, None]  # None: every carry kept (needs max_steps)
N = 7  # steps the loops below take

rng = np.random.default_rng(1)
W = rng.normal(size=(3, 3)) * 0.6
H0 = rng.normal(size=3)


def while_fn(memory, max_steps=16):
    return functools.partial(memento.while_loop, memory=memory, max_steps=max_steps)


def unrolled(cond, body, init, max_steps=16):
    for _ in range(max_steps):
        if not bool(cond(init)):
            break
        init = body(init)
    return init


def rnn_loop(loop, w, h0):
    def body(s):
        i, h, acc = s
        h = jnp.tanh(w @ h + 0.1 * i)
        return i + 1, h, acc + jnp.sum(h**2)

    i, h, acc = loop(lambda s: s[0] < N, body, (0, h0, 0.0))
    return jnp.sum(jnp.sin(h)) + acc, i


def derivatives(f):
    """The gradient, the hessian in h0, a hessian-vector product and jacfwd of jacrev: one
    jitted program."""

    @jax.jit
    def run(w, h0):
        hvp = jax.jvp(lambda w: jax.grad(f)(w, h0), (w,), (jnp.ones((3, 3)),))
        return (
            jax.grad(f, (0, 1))(w, h0),
            jax.hessian(f, 1)(w, h0),
            hvp,
            jax.jacfwd(jax.jacrev(f))(w, h0),
        )

    return run(W, H0)


@functools.cache
def unrolled_results():
    """The unrolled loop's value and derivatives, once for every budget."""
    return rnn_loop(unrolled, W, H0), derivatives(lambda w, h0: rnn_loop(unrolled, w, h0)[0])


@pytest.mark.parametrize("memory", MEMORIES)
def test_values_gradients_and_second_order(memory):
    loop = while_fn(memory)
    f = lambda w, h0: rnn_loop(loop, w, h0)[0]
    want_value, want = unrolled_results()
    assert_close(rnn_loop(loop, W, H0), want_value)  # eager
    grad, hessian, hvp, jacfwd_jacrev = derivatives(f)
    assert_close(grad, want[0])
    assert_close(hessian, want[1])
    assert_close(hvp, want[2])
    assert_close(jacfwd_jacrev, want[3])


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint8])
def test_weakly_typed_init(dtype):
    increment = jnp.array(1, dtype)
    out = memento.while_loop(lambda v: v < 2, lambda v: v + increment, 0, memory=2)
    ref = lax.while_loop(lambda v: v < 2, lambda v: v + increment, 0)
    assert_close(out, ref, weak=True)
    out = memento.while_loop(lambda v: v < 2.0, lambda v: v + 1.0, 0.0, memory=2)
    assert_close(out, lax.while_loop(lambda v: v < 2.0, lambda v: v + 1.0, 0.0), weak=True)


def test_keys_ints_bools_and_none_in_the_carry():
    def body(s):
        key, i, flag, h, none = s
        key, sub = jax.random.split(key)
        return key, i + 1, ~flag, jnp.tanh(h + jax.random.normal(sub, h.shape)), none

    cond = lambda s: s[1] < N
    init = (jax.random.key(1), jnp.int32(0), jnp.bool_(False), H0, None)
    assert_close(
        memento.while_loop(cond, body, init, memory=3), lax.while_loop(cond, body, init), weak=True
    )
    loss = lambda loop, h: jnp.sum(loop(cond, body, (*init[:3], h, None))[3])
    assert_close(
        jax.grad(functools.partial(loss, while_fn(3)))(H0),
        jax.grad(functools.partial(loss, unrolled))(H0),
    )


@pytest.mark.parametrize("memory", [1, 3])
def test_perturbation_propagates_over_steps_and_unperturbed_leaves_may_be_non_differentiable(
    memory,
):
    # x perturbs y only after one step, y perturbs z after two (Equinox's body2). z_ below
    # goes through a lax.while_loop, which has no reverse rule, and is never perturbed.
    def body(s):
        x, y, z, u = s
        u = lax.while_loop(lambda v: v < 5.0, lambda v: v + 1.0, u * 0.0)
        return x * 1.1, x + y, y + z, u

    def run(loop, x, y, z):
        x, y, z, u = loop(lambda s: True, body, (x, y, z, 0.0), max_steps=4)
        return z + lax.stop_gradient(u)

    loop = functools.partial(memento.while_loop, memory=memory)
    grad = lambda loop: jax.grad(functools.partial(run, loop), (0, 1, 2))(1.0, 2.0, 3.0)
    assert_close(grad(loop), grad(lambda c, b, i, max_steps: unrolled(c, b, i, max_steps)))


def test_gradients_of_closed_over_values_and_trivial_vjps():
    # Equinox's body_fun_grads: carry[0] needs a gradient only to reach x, closed over.
    def run(loop, x, y):
        return sum(loop(lambda c: True, lambda c: (c[0] * x, c[1] + 1), (1.0, y), max_steps=3))

    loop = functools.partial(memento.while_loop, memory=2)
    ref = lambda c, b, i, max_steps: unrolled(c, b, i, max_steps)
    assert_close(
        jax.grad(functools.partial(run, loop), (0, 1))(1.3, 1.0),
        jax.grad(functools.partial(run, ref), (0, 1))(1.3, 1.0),
    )
    # The output does not depend on the input: a zero gradient, not an error.
    f = lambda x: memento.while_loop(lambda c: True, lambda c: c, (x, 0.0), max_steps=3, memory=2)[
        1
    ]
    assert jax.grad(f)(1.0) == 0.0


@pytest.mark.parametrize("batched_cond", [False, True])
def test_vmap_primal_and_cotangent(batched_cond):
    ns = jnp.array([3, 5, 7]) if batched_cond else jnp.array(5)

    def run(loop, w, h0, n):
        def body(s):
            i, h = s
            return i + 1, jnp.tanh(w @ h)

        return jnp.sum(loop(lambda s: s[0] < n, body, (0, h0))[1])

    h0s = jnp.stack([H0, -H0, 2 * H0])
    axes = (None, 0, 0 if batched_cond else None)
    for memory in (1, 3):
        loop = while_fn(memory)
        got = jax.vmap(jax.grad(functools.partial(run, loop), (0, 1)), axes)(W, h0s, ns)
        ref = jax.vmap(jax.grad(functools.partial(run, _masked), (0, 1)), axes)(W, h0s, ns)
        assert_close(got, ref)


def _scanned(cond, body, init, length):
    # The reference for n steps known in advance: lax.scan of the body.
    return lax.scan(lambda s, _: (body(s), None), init, None, length=length)[0]


def _masked(cond, body, init, max_steps=16):
    # The reference under vmap: a bounded loop that stops changing once cond fails.
    def step(s, _):
        return jax.tree_util.tree_map(lambda a, b: jnp.where(cond(s), a, b), body(s), s), None

    return lax.scan(step, init, None, length=max_steps)[0]


# -- random carries: mixed dtypes, scalars, zero-size leaves, special values, budgets -----

EXAMPLES = max(3, int(os.environ.get("MEMENTO_EXAMPLES", "12")) // 2)


@st.composite
def while_cases(draw):
    carry = draw(st.lists(_trees.leaf(), min_size=1, max_size=5))
    max_steps = draw(st.integers(0, 8))
    bytes_ = sum(c.nbytes for c in carry) + 4  # and the step counter, an int32
    return {
        "carry": carry,
        "steps": draw(st.integers(0, max_steps)),
        "max_steps": max_steps,
        "memory": draw(st.one_of(st.none(), _trees.budgets(bytes_))),
        "vmap": draw(st.booleans()),
        "second_order": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _while_case(carry, memory, **kw):
    base = {"steps": 5, "max_steps": 6, "vmap": False, "second_order": False, "seed": 0}
    return {"carry": carry, "memory": memory, **base, **kw}


_MIXED = [
    _trees.Leaf("special", np.float32, (0,)),
    _trees.Leaf("smooth", np.float64, ()),
    _trees.Leaf("count", np.uint8, (3,)),
    _trees.Leaf("smooth", np.complex128, (3,)),
    _trees.Leaf("special", np.float64, (3,)),
    _trees.Leaf("smooth", np.float32, (2, 0)),
]


@example(_while_case(_MIXED, 1))
@example(_while_case(_MIXED, "1TiB", vmap=True, second_order=True))
@example(_while_case(_MIXED, 2**40, steps=0))
@example(_while_case(_MIXED[::-1], memento.bytes_budget(2**40), steps=6, second_order=True))
@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(while_cases())
def test_random_carries_against_lax(case):
    # The body of test_random's scans, its inputs indexed by the step counter; n steps of
    # at most max_steps. Values against lax.while_loop; vector-Jacobian products (random
    # cotangents with NaN, inf and -0.0) and their forward derivative against lax.scan
    # over the n steps, NaN positions and signs of zeros exactly. (Not against the
    # unrolled loop: there a cotangent's tangent is a symbolic zero, so 0 * inf never
    # happens, where a loop's backward pass, lax.scan's as memento's, carries a real 0.)
    rng = np.random.default_rng(case["seed"])
    carry, n, max_steps = case["carry"], case["steps"], case["max_steps"]
    x_leaves = [c for c in carry if c.kind == "special"]
    f = _trees.step(carry, x_leaves, zero_y=False)
    init = [_trees.values(c, rng) for c in carry]
    table = [_trees.values(x, rng, lead=(max(max_steps, 1),)) for x in x_leaves]
    consts = {
        i: (0.4 * rng.uniform(-1, 1, c.shape)).astype(np.real(np.zeros((), c.dtype)).dtype)
        for i, c in enumerate(carry)
        if c.kind == "smooth"
    }
    dc = [i for i, c in enumerate(carry) if c.differentiable]

    def run(loop, consts, table, init_d):
        c0 = list(init)
        for i, v in zip(dc, init_d):
            c0[i] = v

        def body(s):
            c, i = s
            return f(consts, c, [jnp.asarray(t)[i] for t in table])[0], i + 1

        c, _ = loop(lambda s: s[1] < n, body, (c0, jnp.int32(0)))
        return [v for i, v in enumerate(c) if i in dc], [v for i, v in enumerate(c) if i not in dc]

    args = (consts, table, [init[i] for i in dc])
    cts = [_trees.cotangent(carry[i], rng, carry[i].shape) for i in dc]
    tangents = jax.tree_util.tree_map(lambda a: np.ones_like(a), args)
    if case["vmap"]:
        args, cts, tangents = jax.tree_util.tree_map(
            lambda a: np.stack([a, -0.5 * a]), (args, cts, tangents)
        )

    def results(loop):
        def go(args, cts, tangents):
            def vjp(args):
                out, pullback, aux = jax.vjp(functools.partial(run, loop), *args, has_aux=True)
                return out, aux, pullback(cts)

            return jax.jvp(vjp, (args,), (tangents,)) if case["second_order"] else vjp(args)

        return (jax.vmap(go, axis_size=2) if case["vmap"] else go)(args, cts, tangents)

    ours = functools.partial(memento.while_loop, memory=case["memory"], max_steps=max_steps)
    try:
        got = results(ours)
    except ValueError as e:  # the loop of the step's JVP keeps a carry and its tangent
        assert case["second_order"] and "cannot hold even one carry" in str(e), e
        return
    want = results(functools.partial(_scanned, length=n))
    if case["second_order"]:
        _trees.assert_same(got[1], want[1], "forward derivative", exact=False)
        got, want = got[0], want[0]
    _trees.assert_same(got, want)
    values = lambda loop: (
        jax.vmap(lambda a: run(loop, *a))(args) if case["vmap"] else run(loop, *args)
    )
    _trees.assert_same(values(ours), values(lax.while_loop))
