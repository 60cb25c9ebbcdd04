"""memento.chain against plain composition: values, gradients, counts, transformations."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento
from memento.loops import chain_plan, scan_layers
from memento.planning import step_evaluations


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def assert_trees_close(a, b, rtol=1e-11, atol=1e-12):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def compose(fns, x):
    return functools.reduce(lambda h, f: f(h), fns, x)


# -- a heterogeneous stack: widths 5 to 108, a reshape, a conv, a dict-valued state, an
# Equinox Linear, closures and functools.partial ----------------------------------------


def dense(w, b, h):
    return jnp.tanh(w @ jnp.sin(h) + b)


def conv(k, h):  # h: (c, 6, 6) -> (c', 6, 6)
    out = lax.conv_general_dilated(jnp.sin(h)[None], k, (1, 1), "SAME")[0]
    return jnp.tanh(out)


def split_layer(w, h):  # vector -> {"a": matrix, "b": vector}: a pytree state
    z = jnp.sin(h)
    return {"a": jnp.outer(z, w), "b": jnp.tanh(z[:3])}


def merge_layer(v, s):  # the pytree back to one vector
    return jnp.tanh(jnp.sin(s["a"]) @ v) + jnp.sum(s["b"])


def make_params(seed=0):
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 12))

    def rnd(*shape, scale=0.5):
        return jax.random.normal(next(k), shape, jnp.float64) * scale

    return {
        "d0": (rnd(16, 5), rnd(16)),
        "d1": (rnd(72, 16), rnd(72)),
        "conv": rnd(3, 2, 3, 3, scale=0.3),
        "d2": (rnd(4, 108), rnd(4)),
        "split": rnd(7),
        "merge": rnd(7),
        "lin": eqx.nn.Linear(4, 9, key=next(k), dtype=jnp.float64),
    }


def layers(params):
    """Dense 5 -> 16 -> 72, reshape to (2, 6, 6), conv to 3 channels, flatten, dense to
    4, a dict-valued layer, its inverse, and an Equinox Linear (via a sin wrapper)."""
    lin = params["lin"]
    return [
        functools.partial(dense, *params["d0"]),
        lambda h: dense(*params["d1"], h),
        lambda h: jnp.sin(h).reshape(2, 6, 6),
        functools.partial(conv, params["conv"]),
        lambda h: jnp.sin(h).reshape(-1),
        functools.partial(dense, *params["d2"]),
        functools.partial(split_layer, params["split"]),
        functools.partial(merge_layer, params["merge"]),
        lambda h: lin(jnp.sin(h)),
    ]


X0 = np.linspace(-1.0, 1.0, 5)  # float64; jax arrays are made under x64


def loss(params, x, memory, policy="auto"):
    fns = layers(params)
    y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory, policy=policy)
    return jnp.sum(jnp.cos(y) * jnp.arange(1.0, y.shape[0] + 1))


VALUE_AND_GRAD = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))


def GRAD(*args):  # the same compiled programs as VALUE_AND_GRAD's
    return VALUE_AND_GRAD(*args)[1]


def budgets():
    p = chain_plan(layers(make_params()), X0, memory=1)
    everything = sum(p.hidden_bytes) + sum(p.internal_bytes)
    return [p.hidden_bytes[0], 2 * p.hidden_bytes[0], 3000, 8000, 20000, everything]


def schedule_key(plan):
    actions = np.asarray(plan.schedule.actions)
    return actions.shape, actions.tobytes()


def test_value_and_gradient_equal_composition():
    # Every budget's plan under both policies; a gradient compiled once per distinct
    # schedule (auto and HSM plan the same at the two smallest budgets, and store-all
    # twice: the last two budgets).
    params = make_params()
    ref_v, ref_g = VALUE_AND_GRAD(params, X0, None, None)
    checked = set()
    for policy in ("auto", "hsm"):
        costs = []
        for b in budgets():
            memory = memento.bytes_budget(b)
            plan = chain_plan(layers(params), X0, memory=memory, policy=policy)
            assert plan.peak_bytes <= max(b, plan.hidden_bytes[0] + plan.unit_bytes)
            costs.append(plan.schedule.cost)
            if schedule_key(plan) in checked:
                continue
            checked.add(schedule_key(plan))
            value, grad = VALUE_AND_GRAD(params, X0, memory, policy)
            np.testing.assert_allclose(value, ref_v, rtol=1e-13)
            assert_trees_close(grad, ref_g)
        # The budgets span the trade-off: recompute-from-x_0 down to one evaluation each.
        assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1], policy
        if policy == "auto":
            assert (chain_plan(layers(params), X0, memory=budgets()[-1]).evaluations() == 1).all()
    assert len(checked) >= 6


@pytest.mark.parametrize("memory", [1, 2, 4, "4KiB"])
def test_slots_and_strings(memory):
    params = make_params(1)
    assert_trees_close(GRAD(params, X0, memory, "auto"), GRAD(params, X0, None, None))


def test_slot_is_largest_stored_state():
    p = chain_plan(layers(make_params()), X0, memory=3)
    assert p.budget_bytes == 3 * max(p.hidden_bytes[:-1]) == 3 * 108 * 8  # the conv output
    assert p.hidden_bytes[:3] == (5 * 8, 16 * 8, 72 * 8)
    assert all(i > h for i, h in zip(p.internal_bytes, p.hidden_bytes))


def counted(params, counts):
    """`layers` with a runtime counter in each layer."""

    def tick(p):
        def bump():
            counts[p] += 1

        return bump

    def wrap(p, f):
        def g(h):
            jax.debug.callback(tick(p))
            return f(h)

        return g

    return [wrap(p, f) for p, f in enumerate(layers(params))]


@pytest.mark.parametrize("policy", ["auto", "hsm"])
def test_evaluations_follow_the_plan(policy):
    params = make_params()
    for b in budgets()[:4]:
        memory = memento.bytes_budget(b)
        counts = [0] * 9
        plan = chain_plan(counted(params, counts), X0, memory=memory, policy=policy)
        if policy == "hsm" and b < 100:  # the two smallest: auto's schedule, run above
            assert schedule_key(plan) == schedule_key(
                chain_plan(layers(params), X0, memory=memory, policy="auto")
            )
            continue

        def f(params, x, memory=memory, counts=counts):
            y = memento.chain(counted(params, counts), x, memory=memory, policy=policy)
            return jnp.sum(y**2)

        g = jax.jit(jax.grad(f, argnums=(0, 1)))
        jax.block_until_ready(g(params, X0))
        assert counts == plan.evaluations().tolist(), b
        assert sum(counts) > 9  # these budgets recompute


def sorting_stack():
    # Each layer sorts its input once, and nothing else sorts: XLA neither duplicates
    # sorts into several fusions (as it does elementwise ops) nor removes them, so the
    # compiled program's `sort` instructions count evaluations of layers.
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    dims = [5, 16, 40, 8, 24, 3, 6]
    ws = [jax.random.normal(k[i], (dims[i + 1], dims[i]), jnp.float64) * 0.4 for i in range(6)]

    def layer(w, h):
        return jnp.tanh(w @ jnp.sort(h))

    return [functools.partial(layer, w) for w in ws], ws


def test_compiled_program_recomputes_as_planned():
    # XLA's CSE must not merge recomputations from the same state (nor with the forward
    # pass): the compiled gradient holds one sort per planned evaluation of a layer.
    fns, ws = sorting_stack()

    def loss(ws, x, memory):
        fns = [functools.partial(f.func, w) for f, w in zip(sorting_stack()[0], ws)]
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(jnp.cos(y))

    def sorts(memory) -> int:
        # Both arguments differentiated, as `chain_plan` plans (it perturbs every input).
        grad = jax.grad(loss, argnums=(0, 1))
        c = jax.jit(grad, static_argnums=2).lower(ws, X0, memory).compile()
        return len(re.findall(r"\bsort\(", c.as_text()))

    assert sorts(None) == 6
    seen = set()
    for b in (40, 200, 800, 1500, 2000):
        memory = memento.bytes_budget(b)
        planned = int(chain_plan(fns, X0, memory=memory).evaluations().sum())
        assert sorts(memory) == planned, b
        seen.add(planned)
    assert seen == {21, 14, 11, 8, 6}  # from recompute-from-x_0 to store-all


def test_evaluations_helper_matches_simulator():
    plan = chain_plan(layers(make_params()), X0, memory=memento.bytes_budget(3000))
    weighted = int(np.dot(step_evaluations(plan.schedule), plan.schedule.forward_costs))
    assert weighted == plan.schedule.simulate().forward_evaluations == plan.schedule.cost


def test_vmap():
    params = make_params()
    xs = jax.random.normal(jax.random.PRNGKey(3), (3, 5), jnp.float64)
    memory = memento.bytes_budget(2000)

    def per_example(x, memory):
        return loss(params, x, memory)

    per_grad = jax.jit(jax.vmap(jax.grad(per_example), (0, None)), static_argnums=1)
    assert_trees_close(per_grad(xs, memory), per_grad(xs, None))
    # vmap of the chain, then grad of the batch loss (params shared)
    batch = lambda p, xs, m: jnp.sum(jax.vmap(lambda x: loss(p, x, m))(xs))
    batch_grad = jax.jit(jax.grad(batch), static_argnums=2)
    assert_trees_close(batch_grad(params, xs, memory), batch_grad(params, xs, None))


def test_equinox_module_gradient():
    # Layers that are Equinox modules: their fields are the parameters.
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    mlp = [
        eqx.nn.Linear(5, 12, key=k[0], dtype=jnp.float64),
        eqx.nn.Lambda(jnp.sin),
        eqx.nn.Linear(12, 3, key=k[1], dtype=jnp.float64),
        eqx.nn.Lambda(jnp.tanh),
        eqx.nn.Linear(3, 2, key=k[2], dtype=jnp.float64),
    ]

    def f(model, x, memory):
        fns = list(model)
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(jnp.sin(y))

    ref = eqx.filter_grad(f)(mlp, X0, None)
    for memory in (1, 2, 100):
        got = eqx.filter_jit(eqx.filter_grad(f))(mlp, X0, memory)
        assert_trees_close(got, ref)


def test_second_order():
    params = make_params()
    v = jax.tree_util.tree_map(jnp.ones_like, params["d1"])

    def hvp(memory):
        def g(d1):
            p = {**params, "d1": d1}
            return jax.grad(loss)(p, X0, memory)["d1"]

        return jax.jit(lambda d1, v: jax.jvp(g, (d1,), (v,))[1])(params["d1"], v)

    assert_trees_close(hvp(memento.bytes_budget(2000)), hvp(None))

    def gg(memory):  # reverse over reverse: the chain of the layers' JVPs, budgeted
        inner = lambda x: jnp.sum(jax.grad(loss, argnums=1)(params, x, memory) ** 2)
        return jax.jit(jax.grad(inner))(X0)

    assert_trees_close(gg(memento.bytes_budget(2000)), gg(None))


def test_forward_mode_and_reverse_over_forward():
    params = make_params()
    v = jnp.cos(X0)

    def derivatives(memory):
        f = lambda x: loss(params, x, memory)
        return jax.jit(
            lambda x: [
                jax.jvp(f, (x,), (v,)),
                jax.jacfwd(f)(x),
                jax.grad(lambda x: jax.jvp(f, (x,), (v,))[1])(x),
            ]
        )(X0)

    assert_trees_close(derivatives(2), derivatives(None))


def test_mixed_dtypes_and_integer_leaves():
    # An integer leaf rides along; only float leaves get cotangents.
    w = jnp.arange(6.0).reshape(2, 3) / 7

    def fns(w):
        return [
            lambda s: {"x": jnp.tanh(w @ s["x"]), "n": s["n"] + 1},
            lambda s: {"x": jnp.sin(s["x"]) * s["n"], "n": s["n"] * 2},
            lambda s: jnp.concatenate([s["x"], s["n"][None].astype(jnp.float64)]),
        ]

    x = {"x": jnp.ones(3), "n": jnp.asarray(2, jnp.int32)}

    def f(w, xf, memory):
        xx = {**x, "x": xf}
        fs = fns(w)
        y = compose(fs, xx) if memory is None else memento.chain(fs, xx, memory=memory)
        return jnp.sum(y**2)

    ref = jax.grad(f, (0, 1))(w, x["x"], None)
    for memory in (1, 2, "1KiB"):
        assert_trees_close(jax.grad(f, (0, 1))(w, x["x"], memory), ref)
    y = memento.chain(fns(w), x, memory=1)
    assert y.dtype == jnp.float64 and y.shape == (3,)


def test_memory_none_is_composition():
    params = make_params()
    fns = layers(params)
    assert_trees_close(memento.chain(fns, X0, memory=None), compose(fns, X0))


@pytest.mark.parametrize(
    "fns, kw, exc, match",
    [
        ([], {}, ValueError, r"memento\.chain: fns is empty"),
        ([jnp.sin, 3], {}, TypeError, r"memento\.chain: fns\[1\] is not callable \(int\)"),
        (jnp.sin, {}, TypeError, r"memento\.chain: fns must be a sequence.*PjitFunction"),
        (
            [jnp.sin],
            {"memory": "3B"},
            ValueError,
            r"3 bytes cannot hold the input x_0 \(40 bytes\); the minimum is 40 bytes",
        ),
        ([jnp.sin], {"memory": 0}, ValueError, r"memento\.chain: memory=0 slots is too small"),
        ([jnp.sin], {"memory": 1.5}, TypeError, r"memento\.chain: memory must be None"),
        ([jnp.sin], {"memory": 2, "policy": "ism"}, ValueError, r"policy must be one of"),
        ([lambda h: h @ jnp.ones((3, 3))], {}, TypeError, r"memento\.chain: fns\[0\] failed"),
    ],
)
def test_errors(fns, kw, exc, match):
    kw = {"memory": 2, **kw}
    with pytest.raises(exc, match=match):
        jax.grad(lambda x: jnp.sum(memento.chain(fns, x, **kw)))(X0)


def test_memory_grows_with_the_budget():
    # Wide layers whose residuals dominate: XLA's temporary memory follows the budget.
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    ws = [jax.random.normal(k[i], (256, 256), jnp.float64) / 16 for i in range(8)]

    def f(ws, x, memory):
        fns = [functools.partial(dense, w, 0.0) for w in ws]
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(y)

    x = jnp.ones((256, 64))

    def temp(memory):
        c = jax.jit(jax.grad(f), static_argnums=2).lower(ws, x, memory).compile()
        return c.memory_analysis().temp_size_in_bytes

    small, mid, full = temp(1), temp(3), temp(None)
    assert small < mid < full
    state = 256 * 64 * 8
    assert small < 4 * state  # one stored state and the working layers, not 8 layers


def test_scan_layers_gradient():
    k = jax.random.split(jax.random.PRNGKey(2), 2)
    stacked = {
        "w": jax.random.normal(k[0], (12, 6, 6), jnp.float64) * 0.4,
        "b": jax.random.normal(k[1], (12, 6), jnp.float64),
    }

    def layer(p, h):
        return jnp.tanh(p["w"] @ h + p["b"])

    def f(stacked, x, memory):
        if memory is None:
            for i in range(12):
                x = layer(jax.tree_util.tree_map(lambda a, i=i: a[i], stacked), x)
            return jnp.sum(x**2)
        return jnp.sum(scan_layers(layer, stacked, x, memory=memory) ** 2)

    x = jnp.linspace(0.0, 1.0, 6)
    ref = jax.grad(f, (0, 1))(stacked, x, None)
    for memory in (1, 3, "1KiB"):
        assert_trees_close(jax.jit(jax.grad(f, (0, 1)), static_argnums=2)(stacked, x, memory), ref)
    with pytest.raises(TypeError, match=r"scan_layers: layer must be callable"):
        scan_layers(3, stacked, x, memory=2)


def test_uniform_stack_stays_unrolled_not_stacked():
    # Why chain does not scan a uniform stack itself: stacking the per-layer parameters
    # inside the gradient costs more memory than chain's unrolled plan (docstring).
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    ws = [jax.random.normal(k[i], (64, 64), jnp.float64) / 8 for i in range(8)]
    x = jnp.ones((64, 16))

    def via_chain(ws, x):
        return jnp.sum(memento.chain([functools.partial(dense, w, 0.0) for w in ws], x, memory=1))

    def via_scan(ws, x):
        layer = lambda w, h: dense(w, 0.0, h)
        return jnp.sum(scan_layers(layer, jnp.stack(ws), x, memory=1))

    # each program compiled once: its gradient and its temporary memory
    chain, scan = (jax.jit(jax.grad(f)).lower(ws, x).compile() for f in (via_chain, via_scan))
    np.testing.assert_allclose(chain(ws, x), scan(ws, x), rtol=1e-9)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(chain) < temp(scan)


# -- the tie that keeps recomputations apart changes no value ------------------------------


def bits_equal(a, b):
    """Bit-for-bit equality of two arrays: -0.0 against 0.0 and NaN payloads count."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return a.tobytes() == b.tobytes()


def assert_same(a, b, rtol=1e-13):
    """Close, with NaN in the same places and the same signs (-0.0 is not 0.0)."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=0, equal_nan=True)


def signbit_layer(h):
    return h * jnp.where(jnp.signbit(h), 2.0, 3.0)


@pytest.mark.parametrize("memory", [1, 2, "1KiB", None])
def test_negative_zero_survives_recomputation(memory):
    # memory=1 recomputes every layer from x_0: a tie that turned the loaded -0.0 into
    # +0.0 made signbit_layer's gradient 3.0 where it is 2.0.
    w = jnp.linspace(0.5, 1.5, 4)
    x = jnp.asarray([-0.0, 0.0, -1.5, 2.0])

    def f(w, x, memory):
        fns = [signbit_layer, lambda h: jnp.sin(h) * w, jnp.tanh, lambda h: h * w]
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(y)

    gw, gx = jax.jit(jax.grad(f, (0, 1)), static_argnums=2)(w, x, memory)
    rw, rx = jax.grad(f, (0, 1))(w, x, None)
    assert float(gx[0]) == 2.0 * float(w[0]) ** 2 and float(gx[1]) == 3.0 * float(w[1]) ** 2
    assert_same(gx, rx)
    assert_same(gw, rw)


def test_nan_cotangent_cleaned_by_double_where():
    # The cotangent of the state before `sqrt` is NaN at element 0 (0 * sqrt'(0)); the
    # double-where layer before it zeroes that element, so the gradient is finite. A tie
    # that turned the NaN into +1.0 on the recomputed states made it 20-26% wrong.
    w = jnp.linspace(0.5, 1.5, 4)
    x = jnp.asarray([-1.0, 0.5, 1.0, 2.0])
    mask = jnp.asarray([0.0, 1.0, 1.0, 1.0])

    def clean(h):  # the double-where pattern: sqrt-safe where h <= 0
        return jnp.where(h > 0, jnp.where(h > 0, h, 1.0), 0.0)

    def f(w, x, memory):
        fns = [lambda h: h * w, jnp.sin, clean, jnp.sqrt, lambda h: jnp.cos(h) * w]
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(y * mask)

    ref = jax.grad(f, (0, 1))(w, x, None)
    assert np.isfinite(np.asarray(ref[1])).all()  # the reference is clean
    for memory in (1, 2, 3, "1KiB"):
        got = jax.jit(jax.grad(f, (0, 1)), static_argnums=2)(w, x, memory)
        for a, b in zip(got, ref):
            assert_same(a, b)


def test_nan_cotangent_stays_where_it_is():
    # A NaN that reaches the gradient does so at the same places as without memento.
    w = jnp.linspace(0.5, 1.5, 4)
    x = jnp.asarray([0.0, 0.5, 1.0, 2.0])

    def f(w, x, memory):
        fns = [lambda h: h * w, jnp.sqrt, jnp.sin, lambda h: h * w, jnp.tanh]
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(y * jnp.asarray([0.0, 1.0, 1.0, 1.0]))

    ref = jax.grad(f, (0, 1))(w, x, None)
    assert np.isnan(np.asarray(ref[1][0])) and np.isfinite(np.asarray(ref[1][1:])).all()
    for memory in (1, 2, "1KiB"):
        got = jax.grad(f, (0, 1))(w, x, memory)
        for a, b in zip(got, ref):
            assert_same(a, b)


def test_special_values_flow_through_bit_for_bit():
    # -0.0, +-inf, NaN and subnormals in the states that are stored, loaded and
    # recomputed: layers that only scale, negate and select give the same bits.
    tiny = np.finfo(np.float64).smallest_subnormal
    x = jnp.asarray([-0.0, 0.0, np.inf, -np.inf, np.nan, tiny, -3 * tiny, 1.0])
    a = jnp.asarray([2.0, -1.0, 0.5, 4.0, 1.0, 2.0, -0.5, 3.0])

    def f(a, x, memory):
        fns = [lambda h: h * a, lambda h: -h, signbit_layer, lambda h: h * a, lambda h: h * 0.5]
        y = compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)
        return jnp.sum(y * a), y

    ref_g, ref_y = jax.grad(f, (0, 1), has_aux=True)(a, x, None)
    for memory in (1, 2, "1KiB"):
        got_g, got_y = jax.grad(f, (0, 1), has_aux=True)(a, x, memory)
        assert bits_equal(got_y, ref_y)
        for g, r in zip(got_g, ref_g):
            assert bits_equal(g, r), (memory, g, r)


def test_integer_bool_complex_and_empty_leaves():
    # Leaves of every kind ride in the recomputed states unchanged; only the inexact
    # ones get cotangents, and an empty leaf is carried and differentiated as empty.
    w = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    x = {
        "x": jnp.asarray([1.0, -0.0, 2.0]),
        "n": jnp.asarray([3, -7], jnp.int32),
        "flag": jnp.asarray([True, False]),
        "z": jnp.asarray([1.0 + 2.0j, -0.0 - 1.0j]),
        "e": jnp.zeros((0, 3)),
    }

    def step(s):
        return {
            "x": jnp.tanh(w.T @ (w @ s["x"])) * jnp.where(s["flag"][0], 2.0, 1.0),
            "n": s["n"] * 3 + 1,
            "flag": ~s["flag"],
            "z": s["z"] * (1.0 - 0.5j) + jnp.sum(s["x"]),
            "e": jnp.sin(s["e"]) * 2.0,
        }

    def head(s):
        z = s["z"]
        return (
            jnp.sum(s["x"] * s["n"][0])
            + jnp.sum(z.real * z.imag)
            + jnp.sum(s["e"])
            + jnp.sum(s["flag"])
        )

    def f(w_, x, memory):
        del w_
        fns = [step, step, step, step, head]
        return compose(fns, x) if memory is None else memento.chain(fns, x, memory=memory)

    ref = jax.grad(f, 1, allow_int=True)(w, x, None)
    for memory in (1, 2, "1KiB"):
        assert bits_equal(f(w, x, memory), f(w, x, None))
        got = jax.grad(f, 1, allow_int=True)(w, x, memory)
        for k in ("x", "z"):
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-13, atol=0)
        assert got["e"].shape == (0, 3) and got["n"].dtype == jax.dtypes.float0


def test_compiled_program_recomputes_from_integer_states():
    # x_0 holds only integers (token ids): its loads are tied too, so XLA does not merge
    # the recomputations of the embedding layer from it.
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    emb = jax.random.normal(k[0], (10, 6), jnp.float64)
    ws = [jax.random.normal(k[i], (6, 6), jnp.float64) * 0.4 for i in (1, 2, 3)]
    ids = jnp.asarray([3, 1, 4, 1, 5], jnp.int32)

    def fns(emb, ws):
        first = lambda i: jnp.tanh(emb[jnp.sort(i)])
        return [first] + [
            functools.partial(lambda w, h: jnp.tanh(jnp.sort(h, 0) @ w), w) for w in ws
        ]

    def loss(params, ids, memory):  # ids an argument: XLA would fold a constant's sort
        return jnp.sum(jnp.cos(memento.chain(fns(*params), ids, memory=memory)))

    memory = 1  # x_0 only: every layer is recomputed from the integer input
    c = jax.jit(jax.grad(loss), static_argnums=2).lower((emb, ws), ids, memory).compile()
    planned = int(chain_plan(fns(emb, ws), ids, memory=memory).evaluations().sum())
    assert planned == 10
    assert len(re.findall(r"\bsort\(", c.as_text())) == planned
    ref = jax.grad(lambda p: jnp.sum(jnp.cos(compose(fns(*p), ids))))((emb, ws))
    assert_trees_close(jax.grad(loss)((emb, ws), ids, memory), ref)


# -- extremes: one layer, empty states, budgets far above need --------------------------


def test_one_layer():
    x = jnp.asarray([-0.0, 0.5, 2.0])
    for memory in (1, 2, "1KiB"):
        g = jax.grad(lambda x, m=memory: jnp.sum(memento.chain([signbit_layer], x, memory=m)))(x)
        assert_same(g, jax.grad(lambda x: jnp.sum(signbit_layer(x)))(x))
        plan = chain_plan([signbit_layer], x, memory=memory)
        assert plan.evaluations().tolist() == [1] and plan.num_layers == 1


@pytest.mark.parametrize(
    "x",
    [jnp.zeros((0,)), {"a": jnp.zeros((0, 3)), "b": jnp.linspace(-1.0, 1.0, 4)}],
    ids=["empty", "empty-leaf"],
)
def test_zero_size_states(x):
    fns = [
        lambda h: jax.tree_util.tree_map(jnp.sin, h),
        lambda h: jax.tree_util.tree_map(lambda a: a * 2.0, h),
        lambda h: sum(jnp.sum(jnp.cos(a)) for a in jax.tree_util.tree_leaves(h)),
    ]
    ref = jax.grad(lambda x: compose(fns, x))(x)
    for memory in (1, 3, "1KiB"):
        got = jax.grad(lambda x, m=memory: memento.chain(fns, x, memory=m))(x)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-13)


def test_budgets_far_above_need_run_store_all():
    # Slots and bytes far above what storing everything takes (2^62 slots of 48 bytes is
    # 2^67.6 bytes: Python ints, no wrapping), NumPy integers among them: the plan is
    # capped at store-all, and the program does not grow with the number: it is the very
    # program of memory=100 (the same lowered text, so the same compiled memory and
    # gradient; compiled and run once, and one huge budget run eagerly too).
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    ws = [jax.random.normal(k[i], (6, 6), jnp.float64) * 0.5 for i in range(4)]
    x = jnp.linspace(-1.0, 1.0, 6)

    def fns(ws):
        return [functools.partial(dense, w, 0.0) for w in ws]

    def f(ws, x, memory):
        y = compose(fns(ws), x) if memory is None else memento.chain(fns(ws), x, memory=memory)
        return jnp.sum(y**2)

    def lowered(memory):  # a closure: NumPy integers are budgets too, not static arguments
        return jax.jit(jax.grad(lambda ws, x: f(ws, x, memory), (0, 1))).lower(ws, x)

    ref = jax.grad(f, (0, 1))(ws, x, None)
    everything = chain_plan(fns(ws), x, memory=100)
    assert (everything.evaluations() == 1).all()
    store_all = lowered(100)
    assert_trees_close(store_all.compile()(ws, x), ref)
    assert_trees_close(jax.grad(f, (0, 1))(ws, x, 2**62), ref)
    huge = [
        10**6,
        2**40,
        2**62,
        np.int64(2**40),
        np.int32(2**30),
        "1TiB",
        "1PiB",
        memento.bytes_budget(2**40),
        memento.bytes_budget(np.int64(2**50)),
        memento.bytes_budget(10**30),
    ]
    for memory in huge:
        plan = chain_plan(fns(ws), x, memory=memory)
        assert (plan.evaluations() == 1).all(), memory
        assert plan.schedule.cost == everything.schedule.cost
        assert plan.peak_bytes == everything.peak_bytes
        if isinstance(memory, (int, np.integer)):  # exact, in Python ints
            assert plan.budget_bytes == int(memory) * 48
        assert plan.budget_bytes > everything.peak_bytes
        assert lowered(memory).as_text() == store_all.as_text(), memory
    np.testing.assert_array_equal(
        chain_plan(fns(ws), x, memory=np.int64(2)).schedule.actions,
        chain_plan(fns(ws), x, memory=2).schedule.actions,
    )


def test_internal_state_counts_what_the_step_stores_besides_its_output():
    # One count of a layer's residuals, the scan's (`ResidualSpec`): tanh's value is the
    # layer's output (held once), 1 - tanh^2 is computed again from it, a weight's
    # transpose is the same in every call (computed again, never stored); sin keeps cos.
    w = jnp.arange(12.0).reshape(3, 4) / 10
    x = jnp.ones(4)
    layers = [
        lambda x: jnp.tanh(w @ x),
        lambda x: jnp.sin(x),
        lambda x: x * jnp.exp(x),
    ]
    p = chain_plan(layers, x, memory="1MiB")
    f32 = x.dtype.itemsize
    assert p.hidden_bytes == (4 * f32, 3 * f32, 3 * f32, 3 * f32)
    inside = [i - a - b for i, a, b in zip(p.internal_bytes, p.hidden_bytes, p.hidden_bytes[1:])]
    assert inside[0] == 0  # tanh(W @ x): its output; W and W.T are not stored per call
    assert inside[1] == 3 * f32  # sin: cos(x)
    assert inside[2] == 3 * f32  # x * exp(x): exp(x) (x is the input)
