"""The static executor (`memento.scan(..., executor="static")`): nested ``lax.scan``s of
static lengths. Gradients against ``lax.scan`` in float64 for every shape of plan, the
evaluations it makes against its schedule's replay, byte budgets against XLA's own
count, and the sizes at the extremes."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento
from memento.loops import _choice
from memento.planning import Op
from memento.planning.internals import nest_schedule, static_plan


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _force(monkeypatch, levels):
    """Make the static executor run ``static_plan(T, levels)`` whatever the budget."""
    monkeypatch.setattr(
        _choice, "plan_static", lambda num_steps, budget, **kw: static_plan(num_steps, levels, **{
            k: v for k, v in kw.items() if k in ("carry_bytes", "residual_bytes", "stream_bytes")
        })
    )  # fmt: skip


def _loss(scan, w, h0, xs, **kw):
    """A loop with a pytree carry (a float vector and an int counter), a float and an int
    output, and a loss that weighs every output and the final carry."""

    def step(c, x):
        h, t = c
        h = jnp.tanh(w @ h + x * t.astype(x.dtype))
        return (h, t + 1), (h * 2.0, t)

    (h, t), (ys, ts) = scan(step, (h0, jnp.int32(1)), xs, **kw)
    weights = jnp.arange(ys.shape[0], dtype=ys.dtype)[:, None]
    return jnp.sum(jnp.sin(h)) + jnp.sum(ys * weights) + jnp.sum(ts) * 0 + t * 0


def _params(t, h=3, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(k[0], (h, h)) * 0.5,
        jax.random.normal(k[1], (h,)),
        jax.random.normal(k[2], (t, h)) * 0.3,
    )


GRAD = functools.partial(jax.grad, argnums=(1, 2, 3))  # of (scan, w, h0, xs, ...)

SHAPES = [
    (1, (0,)),
    (1, (0, 1)),
    (7, (0,)),
    (5, (0, 1)),
    (10, (0, 5)),
    (37, (0, 5)),
    (12, (0, 2, 3)),
    (37, (0, 3, 4)),
    (64, (0, 4, 4)),
    (37, (0, 2, 2, 2)),
    (100, (0, 3, 4)),
]


@pytest.mark.parametrize("num_steps,levels", SHAPES)
def test_gradients_equal_lax_scan_for_every_shape_of_plan(monkeypatch, num_steps, levels):
    _force(monkeypatch, levels)
    w, h0, xs = _params(num_steps)
    ref = GRAD(_loss)(lax.scan, w, h0, xs)
    scan = functools.partial(memento.scan, memory="1TiB", executor="static")
    got = jax.jit(functools.partial(GRAD(_loss), scan))(w, h0, xs)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_steps,levels", SHAPES)
def test_the_step_runs_as_often_as_the_replayed_schedule_says(monkeypatch, num_steps, levels):
    _force(monkeypatch, levels)
    calls = []
    w, h0, xs = _params(num_steps)

    def loss(w, xs):
        def step(h, x):
            jax.debug.callback(lambda x: calls.append(1), x)
            return jnp.tanh(w @ h + x), h

        h, ys = memento.scan(step, h0, xs, memory="1TiB", executor="static")
        return jnp.sum(ys) + jnp.sum(h)

    jax.grad(loss)(w, xs)
    plan = static_plan(num_steps, levels, carry_bytes=1, residual_bytes=1)
    replay = nest_schedule(plan).simulate()
    assert len(calls) == plan.evaluations == replay.forward_evaluations


def _cell_loss(w, xs=None, h0=None, memory=None, executor="static"):
    h, ys = memento.scan(
        lambda h, x: (jnp.tanh(w @ h + x),) * 2, h0, xs, memory=memory, executor=executor
    )
    return jnp.sum(ys) + jnp.sum(h)


def _temp(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "width,num_steps,share",
    [(1, 1, 1.0), (4, 1000, 1.0), (4, 1000, 0.05), (64, 10**4, 0.3), (64, 10**4, 0.05),
     (4, 10**6, 0.05), (4, 2000, 0.69), (4, 2000, 0.85)],
)  # fmt: skip
@pytest.mark.usefixtures("on_cpu")
def test_a_byte_budget_is_the_compiled_gradients_memory(width, num_steps, share):
    # The budget is a share of what lax.scan's gradient takes; the compiled gradient of
    # memento.scan must take at most the budget, give or take 5% and 4 KiB (XLA's
    # buffer assignment is not the planner's), or the budget is refused naming the least.
    # Between half and all of lax.scan's bytes too, where plans mix a nest and steps
    # stored whole.
    with jax.enable_x64(False):
        w = jnp.eye(width) * 0.5
        h0, xs = jnp.zeros(width), jnp.ones((num_steps, width)) * 0.1
        full = _temp(jax.grad(functools.partial(_cell_loss, h0=h0, memory=None)), w, xs)
        budget = max(int(full * share), 1)
        for executor in ("auto", "static"):
            f = jax.grad(
                functools.partial(_cell_loss, h0=h0, memory=f"{budget}B", executor=executor)
            )
            try:
                temp = _temp(f, w, xs)
            except ValueError as e:
                assert "smallest takes" in str(e) or "cannot hold" in str(e), str(e)
                continue
            assert temp <= budget * 1.05 + 4096, (executor, temp, budget)


def _force_plan(monkeypatch, pieces):
    """Makes the static planner return ``pieces``, sized as it was asked."""
    from memento.planning.internals import StaticPlan

    monkeypatch.setattr(
        _choice, "plan_static", lambda n, b, **kw: StaticPlan(pieces, **{
            k: v for k, v in kw.items() if k.endswith("_bytes")
        })
    )  # fmt: skip


def _assert_counted_closely(compiled: int, count: int):
    """The plan's count is at least what XLA compiled it to, and not far above."""
    assert compiled <= count + 512, (compiled, count)
    assert count <= 1.35 * compiled + 1024, (compiled, count)


@pytest.mark.parametrize("width", [4, 64])
@pytest.mark.parametrize(
    "pieces",
    [((10, 10, 10),), ((10, 5, 4, 5),), ((3, 10, 5, 5), (5, 10, 5)),
     ((3, 10, 5, 5), (2, 10, 10), (5, 10)), ((5, 10, 10), (500,))],
)  # fmt: skip
@pytest.mark.usefixtures("on_cpu")
def test_a_static_plans_count_bounds_its_compiled_bytes_closely(monkeypatch, width, pieces):
    # What the planner counts for a plan (`explain(...).program_bytes`) is at least what
    # XLA compiles it to, and not far above: nests of three to four levels, several
    # nests one after another (each keeps its refilled starts apart), and a nest beside
    # steps stored whole.
    _force_plan(monkeypatch, pieces)
    with jax.enable_x64(False):
        w = jnp.eye(width) * 0.5
        h0, xs = jnp.zeros(width), jnp.ones((1000, width)) * 0.1
        cell = lambda h, x: (jnp.tanh(w @ h + x),) * 2
        count = memento.explain(cell, h0, xs, memory="1GiB", executor="static").program_bytes
        f = jax.grad(functools.partial(_cell_loss, h0=h0, memory="1GiB"))
        compiled = _temp(f, w, xs)
    _assert_counted_closely(compiled, count)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("pieces", [((4, 40, 6), (40,)), ((10, 11, 9), (10,))])
def test_a_nest_before_steps_stored_whole_counts_its_refills_from_the_start(monkeypatch, pieces):
    # A leapfrog step (a position and a velocity) in a three-level nest and then steps
    # stored whole: XLA allocates the nest's refilled starts before it back-propagates
    # the steps stored whole, beside all the forward pass stored; the count holds that.
    _force_plan(monkeypatch, pieces)
    with jax.enable_x64(False):
        k = 1 + 0.1 * jnp.sin(jnp.arange(128.0))
        xs = 0.1 * jnp.cos(jnp.arange(1000 * 128.0)).reshape(1000, 128)
        init = (jnp.ones(128), jnp.zeros(128))

        def cell(c, x, k):
            q, v = c
            v = v - 0.05 * (jnp.sin(q) * k + x)
            return (q + 0.05 * v, v), jnp.mean(q)

        def loss(k):
            run = functools.partial(memento.scan, memory="1GiB", executor="static")
            (q, v), ys = run(functools.partial(cell, k=k), init, xs)
            return jnp.sum(ys) + jnp.sum(q) + jnp.sum(v)

        count = memento.explain(
            functools.partial(cell, k=k), init, xs, memory="1GiB", executor="static"
        ).program_bytes
        compiled = _temp(jax.grad(loss), k)
    _assert_counted_closely(compiled, count)


@pytest.mark.usefixtures("on_cpu")
def test_steps_stored_whole_keep_their_internal_states_and_read_their_xs(monkeypatch):
    # A batch of 64 x 32 times a weight, 8 KiB of x per step, 200 steps stored whole
    # after a nest: XLA stacks each step's internal state and reads its x from the
    # inputs, so the count holds no stack of xs.
    _force_plan(monkeypatch, ((4, 25), (200,)))
    with jax.enable_x64(False):
        w = jnp.eye(32) * 0.5
        h0 = jnp.zeros((64, 32))
        xs = 0.1 * jnp.sin(jnp.arange(300 * 64 * 32.0)).reshape(300, 64, 32)

        def loss(w):
            run = functools.partial(memento.scan, memory="1GiB", executor="static")
            h, ys = run(lambda h, x: (jnp.tanh(h @ w + x), jnp.mean(h)), h0, xs)
            return jnp.sum(ys) + jnp.sum(h)

        cell = lambda h, x: (jnp.tanh(h @ w + x), jnp.mean(h))
        plan = memento.explain(cell, h0, xs, memory="1GiB", executor="static", wrt=("closure",))
        compiled = _temp(jax.grad(loss), w)
    # 4,993,024 counted for 4,985,348 compiled; counting an x per step stored whole
    # made it 6,631,424.
    assert compiled <= plan.program_bytes <= 1.05 * compiled + 1024, (compiled, plan)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("pieces", [((40, 25),), ((10, 10, 10),), ((1000, 1),)])
def test_a_carry_cast_wider_counts_its_stack_of_starts_cast(monkeypatch, pieces, dtype):
    # A bfloat16 carry that the step casts to float32: XLA:CPU casts a nest's whole stack
    # of outer starts before its backward loop, and the count holds that copy too. It
    # keeps a float16 stack as it is, and the count does not add one (it once did: three
    # times the compiled bytes for a start stored per step).
    _force_plan(monkeypatch, pieces)
    with jax.enable_x64(False):
        w = jnp.linspace(0.5, 0.9, 512)
        h0, xs = jnp.zeros(512, dtype), jnp.ones((1000, 512)) * 0.1

        def cell(h, x, w):
            h = jnp.tanh(w * h.astype(jnp.float32) + x).astype(dtype)
            return h, jnp.mean(h.astype(jnp.float32))

        cell_w = lambda w: functools.partial(cell, w=w)

        def loss(w, xs):
            h, ys = memento.scan(cell_w(w), h0, xs, memory="1GiB", executor="static")
            return jnp.sum(ys) + jnp.sum(h.astype(jnp.float32))

        plan = memento.explain(cell_w(w), h0, xs, memory="1GiB", executor="static")
        compiled = _temp(jax.grad(loss), w, xs)
    assert str([list(p) for p in pieces]) in plan.why, plan.why
    _assert_counted_closely(compiled, plan.program_bytes)


def _elementwise_loss(w, xs, h0=None, memory=None, executor="auto"):
    h, ys = memento.scan(
        lambda h, x: (jnp.tanh(w * h + x), jnp.sum(h**2)), h0, xs, memory=memory, executor=executor
    )
    return jnp.sum(ys) + jnp.sum(h)


@pytest.mark.parametrize(
    "width,num_steps,share",
    [(1, 7, 0.5), (256, 3000, 0.1), (2**20, 12, 0.4)],  # a scalar to a 4 MiB carry
)
@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("executor", ["auto", "static", "rows", "recursion"])
def test_byte_budgets_hold_for_every_executor(width, num_steps, share, executor):
    # Every executor auto can pick keeps a byte budget: the compiled gradient's temp
    # bytes, give or take 5% and 4 KiB, or a clear refusal naming the least.
    with jax.enable_x64(False):
        w = jnp.linspace(0.1, 0.9, width)
        h0, xs = jnp.zeros(width), jnp.ones((num_steps, width)) * 0.1
        full = _temp(jax.grad(functools.partial(_elementwise_loss, h0=h0)), w, xs)
        budget = max(int(full * share), 1)
        f = jax.grad(
            functools.partial(_elementwise_loss, h0=h0, memory=f"{budget}B", executor=executor)
        )
        try:
            temp = _temp(f, w, xs)
        except ValueError as e:
            assert "smallest takes" in str(e) or "cannot hold" in str(e) or "least" in str(e), str(
                e
            )
            return
        assert temp <= budget * 1.05 + 4096, (temp, budget)
        want = jax.grad(_elementwise_loss)(w, xs, h0)
        np.testing.assert_allclose(f(w, xs), want, rtol=2e-4, atol=1e-5)  # float32 sums


def _batched_loss(u, xs, h0=None, memory=None, executor="auto"):
    h, ys = memento.scan(
        lambda h, x: (jnp.tanh(h @ u + x), jnp.sum(h)), h0, xs, memory=memory, executor=executor
    )
    return jnp.sum(ys) + jnp.sum(h)


@pytest.mark.parametrize("share", [0.005, 0.02, 0.3])
@pytest.mark.parametrize("executor", ["auto", "static", "rows", "recursion"])
def test_byte_budgets_count_the_weights_cotangents_a_batched_step_multiplies_out(share, executor):
    # A batch of rows times a weight matrix: each step's VJP computes the weight's
    # cotangent as a matrix product, a buffer of the weight's size before it is summed
    # into the gradient (64 KiB here, beside 4 KiB carries), which the budget counts; a
    # budget below a step's working set is refused, naming the least.
    with jax.enable_x64(False):
        u = jnp.eye(128) * 0.5
        h0, xs = jnp.zeros((8, 128)), jnp.ones((1000, 8, 128)) * 0.1
        full = _temp(jax.grad(functools.partial(_batched_loss, h0=h0)), u, xs)
        budget = int(full * share)
        f = jax.grad(
            functools.partial(_batched_loss, h0=h0, memory=f"{budget}B", executor=executor)
        )
        temp = _temp_or_refused(f, u, xs)
        assert temp is None or temp <= budget * 1.05 + 4096, (temp, budget)


def _temp_or_refused(f, *args) -> int | None:
    """``f``'s compiled temp bytes, or None where memento refuses the budget with an
    error naming the least."""
    try:
        return _temp(f, *args)
    except ValueError as e:
        assert re.search(r"smallest.* takes \d+ bytes \(memory='\d+B'\)", str(e)), str(e)
        return None


def _wide_loss(p, xs, h0=None, reduce=None, memory=None, executor="auto"):
    def cell(h, x):  # a reduction over a 48 x 256 broadcast of the carry and the weights
        z = h[:, None] * p[None, :] + x[:, None]
        return jnp.tanh(reduce(z, axis=1) * 0.1), jnp.sum(h)

    h, ys = memento.scan(cell, h0, xs, memory=memory, executor=executor)
    return jnp.sum(ys) + jnp.sum(h)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("share", [0.006, 0.02])
@pytest.mark.parametrize("executor", ["auto", "static", "rows", "recursion"])
@pytest.mark.parametrize("reduce", [jax.nn.logsumexp, jnp.max], ids=["logsumexp", "max"])
def test_byte_budgets_hold_where_a_step_keeps_wide_cotangents(reduce, executor, share):
    # A softmax's or a max's gradient over a wide intermediate: one step back-propagated
    # alone holds the intermediate, its kept exponentials (or mask) and the cotangent
    # that feeds both reductions, three arrays of 48 KiB beside one residual counted.
    # The rows, the recursion and one-step segments count that step as XLA compiles it.
    with jax.enable_x64(False):
        p = jnp.linspace(-1.0, 1.0, 256)
        h0, xs = jnp.zeros(48), jnp.linspace(-0.3, 0.3, 1000 * 48).reshape(1000, 48)
        loss = functools.partial(_wide_loss, h0=h0, reduce=reduce)
        full = _temp(jax.grad(loss), p, xs)
        budget = int(full * share)
        f = jax.grad(functools.partial(loss, memory=f"{budget}B", executor=executor))
        temp = _temp_or_refused(f, p, xs)
        if temp is None:
            return
        assert temp <= budget * 1.05 + 4096, (temp, budget)
        np.testing.assert_allclose(f(p, xs), jax.grad(loss)(p, xs), rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_byte_budgets_hold_for_a_weight_cast_to_bfloat16(share):
    # The cast weight is computed again where a step's pullback is rebuilt (not stored
    # per step), and its cotangent is a bfloat16 outer product cast back to float32:
    # both are in the working set a byte budget counts.
    with jax.enable_x64(False):
        w = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) / 16
        h0, xs = jnp.zeros(256), jnp.ones((1000, 256)) * 0.1

        def loss(w, xs, memory=None):
            def cell(h, x):
                z = (w.astype(jnp.bfloat16) @ h.astype(jnp.bfloat16)).astype(jnp.float32)
                return jnp.tanh(z + x), jnp.mean(h)

            h, ys = memento.scan(cell, h0, xs, memory=memory)
            return jnp.sum(ys) + jnp.sum(h)

        budget = int(_temp(jax.grad(loss), w, xs) * share)
        try:
            temp = _temp(jax.grad(functools.partial(loss, memory=f"{budget}B")), w, xs)
        except ValueError as e:  # below a step's working set: the least is named, and fits
            budget = int(re.search(r"memory='(\d+)B'", str(e)).group(1))
            temp = _temp(jax.grad(functools.partial(loss, memory=f"{budget}B")), w, xs)
        assert temp <= budget * 1.05 + 4096, (temp, budget)


def test_the_step_profile_counts_the_weight_cotangents_that_are_matrix_products():
    # Counted: a weight times a batch of rows (its cotangent contracts the rows), through
    # a transpose or a cast too, and a convolution's kernel; once per product. Not
    # counted: a matrix times a vector (an outer product, fused into the sum), a weight
    # that is not differentiated, and a literal operand.
    from memento.loops._body import make_body, step_profile

    f32 = functools.partial(jnp.ones, dtype=jnp.float32)
    u, v, k = f32((16, 16)), f32((32, 32)), f32((4, 2, 3, 3))

    def products(f, h, x, const_mask=None):
        body = make_body(f, h, x, name="t")
        if const_mask is not None:
            body = body.restrict(const_mask, [True] * len(body.carry_avals), [True])
        return step_profile(body).products

    h, x = f32((8, 16)), f32((8, 32))
    assert products(lambda h, x: (jnp.tanh(h @ u), x @ v), h, x) == u.nbytes + v.nbytes
    assert products(lambda h, x: (h, jnp.sum((v.T @ x.T).astype(jnp.bfloat16))), h, x) == v.nbytes
    assert products(lambda h, x: (jnp.tanh(h @ u + h @ u.T), x), h, x) == 2 * u.nbytes
    vec = f32(32)
    assert products(lambda h, x: (jnp.tanh(v @ h), x), vec, vec) == 0
    # A weight cast to another dtype before a matrix times a vector: the outer product
    # is cast back before it is summed, a buffer of its own (in the cast dtype).
    half = lambda h, x: ((v.astype(jnp.bfloat16) @ h.astype(jnp.bfloat16)).astype(h.dtype), x)
    assert products(half, vec, vec) == v.nbytes // 2
    assert products(lambda h, x: (jnp.tanh(h @ u), x), h, x, const_mask=[False]) == 0
    img = f32((1, 2, 8, 8))
    conv = lambda h, x: (jnp.tanh(lax.conv(h, k, (1, 1), "SAME"))[:, :2], x)
    assert products(conv, img, img) == k.nbytes


def test_the_step_profile_tells_the_intermediates_of_the_weights_alone_apart():
    # ``varying`` is the largest intermediate that depends on the carry or x: a weight's
    # cast (of the weights alone, through a call too) is not, however large; a literal
    # operand does not make a value depend on the step.
    from memento.loops._body import Work, make_body, step_profile

    w = jnp.ones((256, 256), jnp.float32)
    vec = jnp.ones(256, jnp.float32)

    def cell(h, x):
        wb = jax.jit(lambda w: w.astype(jnp.bfloat16) * 2)(w)
        z = (wb @ h.astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.tanh(z + x), x

    profile = step_profile(make_body(cell, vec, vec, name="t"))
    assert profile.largest == w.nbytes // 2  # the cast weight
    assert profile.varying == vec.nbytes  # z, the tanh: the step's own
    # The cast and the scaling, on the weights alone: work a loop of steps hoists (the
    # scaling reads the cast weight and the literal, a bfloat16 scalar).
    cast = w.nbytes // 2
    assert profile.hoisted == Work(2 * w.size, w.nbytes + cast + (cast + 2 + cast), 2)
    plain = step_profile(make_body(lambda h, x: (jnp.tanh(w @ h + x), x), vec, vec, name="t"))
    assert plain.varying == plain.largest == vec.nbytes
    assert plain.hoisted == Work()


def test_the_step_profile_leaves_out_what_xla_reduces_in_place():
    # An intermediate that only flows into a reduction through elementwise ops (an outer
    # product summed) is never an array in XLA's program; one a matrix product reads is.
    from memento.loops._body import make_body, step_profile

    vec, wide = jnp.ones(8, jnp.float32), jnp.ones(256, jnp.float32)
    summed = step_profile(
        make_body(lambda h, x: (jnp.tanh(h + x), jnp.sum(jnp.outer(h, wide))), vec, vec, name="t")
    )
    assert summed.largest == summed.varying == vec.nbytes
    w = jnp.ones((256, 8), jnp.float32)
    read = step_profile(
        make_body(
            lambda h, x: (jnp.tanh(h + x), jnp.sum(jnp.outer(h, wide) @ w)), vec, vec, name="t"
        )
    )
    assert read.largest == 8 * 256 * 4


@pytest.mark.usefixtures("on_cpu")
def test_a_reduced_outer_product_leaves_the_budget_to_the_stored_carries():
    # y = sum(outer(h, v)), 8 KiB that XLA never holds: a 6 KiB budget runs a static nest
    # within it (the count once took the outer product for the step's working set and
    # refused anything under 9 KiB), and the gradient is lax.scan's.
    with jax.enable_x64(True):
        u = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)) / 3)
        v = jnp.linspace(-1.0, 1.0, 256)
        xs = 0.1 * jnp.sin(jnp.arange(3000 * 8.0)).reshape(3000, 8)

        def loss(u, memory):
            cell = lambda h, x: (jnp.tanh(u @ h + x), jnp.sum(jnp.outer(h, v)))
            if memory is None:
                h, ys = lax.scan(cell, jnp.zeros(8), xs)
            else:
                h, ys = memento.scan(cell, jnp.zeros(8), xs, memory=memory)
            return jnp.sum(ys) + jnp.sum(h)

        grad = jax.jit(jax.grad(loss), static_argnums=1)
        temp = grad.lower(u, "6KiB").compile().memory_analysis().temp_size_in_bytes
        np.testing.assert_allclose(grad(u, "6KiB"), grad(u, None), rtol=1e-10)
    assert temp <= 6 * 1024, temp


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("cast", [jnp.bfloat16, None])
def test_the_recursion_takes_the_slots_a_byte_budget_holds_beside_large_weights(cast):
    # A weight of 256 KiB (cast to bfloat16, or not): the recursion sums its cotangent
    # in the gradient it returns, so a byte budget a few carries above the least named
    # holds that many slots (not one, as the rows' working set, which keeps the
    # cotangent in a buffer of its own, would leave), within the budget; in float64
    # (uncast) the gradient is lax.scan's.
    def step(w, h, x):
        z = w @ h if cast is None else (w.astype(cast) @ h.astype(cast)).astype(h.dtype)
        return jnp.tanh(z + x), jnp.mean(h)

    def loss(w, xs, h0, memory=None, executor="auto"):
        run = functools.partial(memento.scan, memory=memory, executor=executor)
        h, ys = (lax.scan if memory is None else run)(functools.partial(step, w), h0, xs)
        return jnp.sum(ys) + jnp.sum(h)

    with jax.enable_x64(cast is None):
        dtype = jnp.float32 if cast else jnp.float64
        w = (jax.random.normal(jax.random.PRNGKey(0), (256, 256)) / 16).astype(dtype)
        h0 = jnp.zeros(256, dtype)
        xs = (jax.random.normal(jax.random.PRNGKey(1), (1000, 256)) * 0.1).astype(dtype)
        cell = functools.partial(step, w)
        with pytest.raises(ValueError, match="smallest plan") as e:
            memento.explain(cell, h0, xs, memory="4KiB")
        least = int(re.search(r"memory='(\d+)B'", str(e.value)).group(1))
        budget = least + 8 * (h0.nbytes + 4)
        for executor in ("auto", "recursion"):
            plan = memento.explain(cell, h0, xs, memory=f"{budget}B", executor=executor)
            assert plan.executor == "recursion" and plan.slots >= 8, plan.why
            f = jax.grad(functools.partial(loss, h0=h0, memory=f"{budget}B", executor=executor))
            assert _temp(f, w, xs) <= budget * 1.05 + 4096, (_temp(f, w, xs), budget)
            if cast is None:
                want = jax.grad(functools.partial(loss, h0=h0))(w, xs)
                np.testing.assert_allclose(f(w, xs), want, rtol=1e-10, atol=1e-12)


def test_rows_refuse_a_byte_budget_their_rows_do_not_fit_and_name_the_least():
    # The rows executor keeps O(T) schedule rows on the device: forced, a byte budget
    # below them is a clear error naming the least, not a program past the budget; that
    # least then compiles within it.
    w, h0, xs = _params(2000)
    f = functools.partial(_cell_loss, h0=h0, executor="rows")
    with pytest.raises(ValueError, match=r"executor='rows' cannot run 2000 steps") as e:
        jax.grad(f)(w, xs, memory="4KiB")
    least = int(re.search(r"memory='(\d+)B'", str(e.value)).group(1))
    temp = _temp(jax.grad(functools.partial(f, memory=f"{least}B")), w, xs)
    assert temp <= least * 1.05 + 4096
    # auto falls back to what fits instead
    temp = _temp(
        jax.grad(functools.partial(_cell_loss, h0=h0, memory="4KiB", executor="auto")), w, xs
    )
    assert temp <= 4096 * 1.05 + 4096


def test_the_rows_count_their_first_sweeps_tables_in_a_byte_budget():
    # Near lax.scan's bytes the rows' ISM plan saves thousands of internal states in its
    # first sweep, and the tables that say where take 12 bytes a save: they count in the
    # budget.
    with jax.enable_x64(False):
        w = jnp.eye(8) * 0.5
        h0, xs = jnp.zeros(8), jnp.ones((3000, 8)) * 0.1
        full = _temp(jax.grad(functools.partial(_cell_loss, h0=h0, memory=None)), w, xs)
        budget = int(full * 0.85)
        loss = functools.partial(_cell_loss, h0=h0, memory=f"{budget}B", executor="rows")
        assert _temp(jax.grad(loss), w, xs) <= budget * 1.05 + 4096


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("share", [0.02, 0.3])
def test_the_recursion_counts_its_positions_in_a_byte_budget(share):
    # A 4-float carry is 16 bytes; the recursion keeps an int32 position (and, with the
    # suite's checks on, a tag) per slot: at 3000 slots that is past the 4 KiB slack.
    w, h0, xs = _params(3000, h=4)
    full = _temp(jax.grad(functools.partial(_cell_loss, h0=h0, executor="auto")), w, xs)
    budget = int(full * share)
    f = jax.grad(functools.partial(_cell_loss, h0=h0, memory=f"{budget}B", executor="recursion"))
    assert _temp(f, w, xs) <= budget * 1.05 + 4096


def test_a_budget_below_the_smallest_plan_names_it():
    w, h0, xs = _params(1000)
    with pytest.raises(ValueError, match=r"smallest takes \d+ bytes \(memory='\d+B'\)"):
        jax.grad(_cell_loss)(w, xs, h0, "100B")
    with pytest.raises(ValueError, match=r"smallest takes \d+ slots"):
        jax.grad(_cell_loss)(w, xs, h0, 2)


def test_static_refused_inside_shard_map_names_the_axes():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("rows_axis",))
    spec = jax.sharding.PartitionSpec("rows_axis")

    def grad_of(h):
        def loss(h):
            step = lambda c, x: (jnp.tanh(c + x), c)
            return memento.scan(step, h, jnp.ones((8, h.shape[0])), memory=3, executor="static")[
                1
            ].sum()

        return jax.grad(loss)(h)

    f = jax.shard_map(grad_of, mesh=mesh, in_specs=spec, out_specs=spec)
    with pytest.raises(
        NotImplementedError,
        match=r"does not run inside shard_map \(a value varies over mesh axes: rows_axis\)",
    ):
        f(jnp.ones(4))


def test_static_needs_policy_auto():
    _, h0, xs = _params(10)
    with pytest.raises(ValueError, match="executor='static'"):
        memento.scan(lambda h, x: (h, x), h0, xs, memory=3, policy="hsm", executor="static")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.complex64])
def test_dtypes(dtype):
    w, h0, xs = (a.astype(dtype) for a in _params(23))

    def loss(scan, w, h0, xs, **kw):
        h, ys = scan(lambda h, x: (jnp.tanh(w @ h + x), h * 2), h0, xs, **kw)
        return jnp.real(jnp.sum(ys) + jnp.sum(h))

    ref = GRAD(loss)(lax.scan, w, h0, xs)
    got = GRAD(loss)(memento.scan, w, h0, xs, memory=16, executor="static")
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(a, np.complex128), np.asarray(b, np.complex128),
                                   rtol=tol, atol=tol)  # fmt: skip


def test_vmap_reverse_unroll_and_xs_none(monkeypatch):
    _force(monkeypatch, (0, 2, 3))
    w, h0, xs = _params(20)
    batch = jnp.stack([xs, -xs, 2 * xs])

    def loss(scan, w, h0, xs, **kw):
        h, ys = scan(lambda h, x: (jnp.tanh(w @ h + x), h.sum()), h0, xs, **kw)
        return jnp.sum(ys) + jnp.sum(h)

    for kw in ({"reverse": True}, {"unroll": 3}, {"unroll": True}):
        mine = functools.partial(memento.scan, memory=3, executor="static", **kw)
        got = jax.vmap(functools.partial(GRAD(loss), mine), (None, None, 0))(w, h0, batch)
        theirs = functools.partial(lax.scan, **kw)
        ref = jax.vmap(functools.partial(GRAD(loss), theirs), (None, None, 0))(w, h0, batch)
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)

    def counter(scan, w, **kw):
        h, ys = scan(lambda h, _: (jnp.tanh(w @ h + 0.1), h[0]), h0, None, length=20, **kw)
        return jnp.sum(ys) + jnp.sum(h)

    np.testing.assert_allclose(
        jax.grad(lambda w: counter(memento.scan, w, memory=3, executor="static"))(w),
        jax.grad(lambda w: counter(lax.scan, w))(w),
        rtol=1e-12,
    )


def test_forward_over_reverse_is_exact(monkeypatch):
    _force(monkeypatch, (0, 2, 3))
    w, h0, xs = _params(17)

    def loss(scan, w, **kw):
        h, ys = scan(lambda h, x: (jnp.tanh(w @ h + x), h.sum()), h0, xs, **kw)
        return jnp.sum(ys**2) + jnp.sum(h)

    ref = jax.hessian(lambda w: loss(lax.scan, w))(w)
    got = jax.hessian(lambda w: loss(memento.scan, w, memory=3, executor="static"))(w)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


def test_zero_size_leaves_nan_and_negative_zero_cotangents(monkeypatch):
    _force(monkeypatch, (0, 3))
    w, h0, xs = _params(10)

    def run(scan, w, h0, xs, **kw):
        def step(c, x):
            h, e = c
            return (jnp.tanh(w @ h + x), e * 2), (h, e)

        return scan(step, (h0, jnp.zeros((0, 2))), xs, **kw)

    def vjp(ct, scan, **kw):
        out, pull = jax.vjp(functools.partial(run, scan, **kw), w, h0, xs)
        return pull(jax.tree.map(lambda a: jnp.full_like(a, ct), out))

    for ct in (jnp.nan, -0.0):
        ref = vjp(ct, lax.scan)
        got = vjp(ct, memento.scan, memory="1TiB", executor="static")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
            np.testing.assert_allclose(a, b, rtol=0, atol=0)


def test_the_program_is_bounded_whatever_the_number_of_steps():
    # A static plan has at most four levels and a few pieces, each traced once: the
    # program's size is bounded by a constant (one nest of two levels, here at 10^4
    # steps, to four pieces of up to four levels at 10^6), not proportional to the number
    # of steps.
    w, h0, _ = _params(1)
    sizes = []
    for num_steps in (10**3, 10**4, 10**5, 10**6):
        xs = jax.ShapeDtypeStruct((num_steps, 3), jnp.float64)
        f = jax.jit(jax.grad(functools.partial(_cell_loss, h0=h0, memory=400)))
        sizes.append(len(f.lower(w, xs).as_text()))
    assert max(sizes) <= 5 * min(sizes), sizes


def test_scan_schedule_returns_the_static_plan_as_rows():
    w, h0, xs = _params(200)
    s = memento.loops.scan_schedule(
        lambda h, x: (jnp.tanh(w @ h + x),) * 2, h0, xs, memory=30, executor="static"
    )
    assert s.policy == "static" and s.simulate().forward_evaluations == s.cost


def test_one_step_segments_give_way_to_a_nest_where_xla_cpu_would_run_them_as_dataflow():
    # On CPU, a one-step segment's backward iteration (the step run again and its VJP)
    # of a 16-wide matrix-vector cell has more than XLA:CPU's eight operations in order,
    # so it runs as a dataflow graph, slower per iteration than the nest's separate
    # loops: at a budget that holds every step's start, `auto` runs a nest of longer
    # segments instead. On other backends the term is not counted.
    w, h0, xs = _params(600, h=16)
    cell = lambda h, x: (jnp.tanh(w @ h + x),) * 2
    every_start = 600 * 16 * 8 + 64 * 1024
    plan = memento.explain(cell, h0, xs, memory=f"{every_start}B")
    if plan.backend != "cpu":
        pytest.skip("the dataflow term is XLA:CPU's")
    assert plan.executor == "static"
    starts = int(np.sum(plan.schedule.actions[:, 0] == int(Op.SAVE_HIDDEN)))
    assert starts < 600 // 4, plan.why
    ref = jax.grad(_cell_loss, argnums=(0, 1))(w, xs, h0, memory=None, executor="auto")
    got = jax.grad(_cell_loss, argnums=(0, 1))(w, xs, h0, memory=f"{every_start}B", executor="auto")
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def _counter_where(w, c, x):  # an integer counter, and a where that runs both branches
    i, h = c
    h = jnp.where(i % 2 == 0, jnp.tanh(w * h + x), jnp.sin(h) * 0.9)
    return (i + 1, h), jnp.sum(h)


def _field(w, h, x):  # a two-layer field: residuals that XLA does not keep all at once
    h = h + 0.1 * jnp.tanh(w[1] @ jnp.tanh(w[0] @ h + x))
    return h, jnp.sum(h)


_PER_STEP_BODIES = {
    "counter_where": (
        _counter_where, lambda: jnp.linspace(0.8, 0.9, 128), (jnp.int32(0), jnp.zeros(128)), 128
    ),
    "field": (_field, lambda: jnp.stack([jnp.eye(64) * 0.5, jnp.eye(64) * 0.3]), jnp.zeros(64), 64),
}  # fmt: skip


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("name", sorted(_PER_STEP_BODIES))
def test_the_per_step_idioms_plan_is_counted_within_its_bytes(monkeypatch, name):
    # Every step's start stored, each step run again alone: lax.scan(jax.checkpoint(step))
    # and memento's plan of one-step segments compile to the same bytes. The count takes
    # the step's gradient as XLA compiles it alone, so at exactly the idiom's bytes that
    # plan fits (the count once took the step's residuals as all live at once, up to a
    # kilobyte more, and ran a slower nest there).
    cell, weights, init, width = _PER_STEP_BODIES[name]
    num_steps = 300
    with jax.enable_x64(False):
        w, xs = weights(), jnp.linspace(-0.2, 0.2, num_steps * width).reshape(num_steps, width)

        def loss(w, scan):
            _, ys = scan(functools.partial(cell, w), init, xs)
            return jnp.sum(ys)

        idiom = _temp(
            jax.grad(
                functools.partial(loss, scan=lambda f, c, x: lax.scan(jax.checkpoint(f), c, x))
            ),
            w,
        )
        _force_plan(monkeypatch, ((num_steps, 1),))
        run = functools.partial(memento.scan, memory=f"{idiom}B", executor="static")
        plan = memento.explain(
            functools.partial(cell, w), init, xs, memory=f"{idiom}B", executor="static"
        )
        compiled = _temp(jax.grad(functools.partial(loss, scan=run)), w)
    assert plan.program_bytes <= idiom, (plan.program_bytes, idiom)
    _assert_counted_closely(compiled, plan.program_bytes)
    assert compiled <= idiom * 1.05 + 4096


def test_the_rows_floor_bounds_every_schedule_on_the_rows():
    # `rows_floor` lets `auto` rule the rows out before planning a schedule: every
    # schedule of every policy takes at least its evaluations, primal rows and bytes of
    # rows for the internal states its slots can hold, and some schedule takes exactly
    # that (the floor is tight).
    from memento.loops._interpreter import compile_schedule, rows_floor
    from memento.planning.internals import choose_schedule

    slack = [math.inf] * 3
    for num_steps in (1, 2, 3, 10, 100, 1000):
        for alpha in (1, 2, 5):
            slots = {1, 2, 3, 10, 100, num_steps, num_steps * alpha, num_steps * alpha + 1}
            for m in sorted(slots):
                for policy in ("auto", "hsm", "ism", "msm"):
                    try:
                        s = choose_schedule(num_steps, m, alpha, policy, name="t", charges=None)
                    except ValueError:
                        continue  # too few slots for ISM
                    prog = compile_schedule(s)
                    floor = rows_floor(num_steps, m // alpha)
                    got = (s.cost, len(prog.primal_rows), prog.runtime_bytes)
                    least = (floor.evaluations, floor.primal_rows, floor.runtime_bytes)
                    assert all(g >= f for g, f in zip(got, least)), (num_steps, m, policy)
                    slack = [min(a, g - f) for a, g, f in zip(slack, got, least)]
    assert slack == [0, 0, 0]


@pytest.mark.usefixtures("on_cpu")
def test_a_long_loop_does_not_plan_rows_that_cannot_win(monkeypatch):
    # At 10^6 steps a schedule on the rows takes seconds to plan. Where the least the rows
    # could take (their floor) cannot beat the static nest, or does not fit the byte
    # budget, `auto` plans none; where they can, the floors change no pick.
    planned = []
    for name in ("choose_schedule", "choose_policy"):
        planner = getattr(_choice, name)
        spy = lambda *a, planner=planner, **k: planned.append(a) or planner(*a, **k)
        monkeypatch.setattr(_choice, name, spy)
    w = jnp.ones((64, 64), jnp.float32) / 80
    h0 = jnp.zeros((64, 64), jnp.float32)
    cell = lambda h, x: (jnp.tanh(h @ w + x[:, None]),) * 2

    def loss(w, xs, memory):
        h, ys = memento.scan(
            lambda h, x: (jnp.tanh(h @ w + x[:, None]),) * 2, h0, xs, memory=memory
        )
        return jnp.sum(ys) + jnp.sum(h)

    xs = jax.ShapeDtypeStruct((10**6, 64), jnp.float32)
    for memory in ("8MiB", "256MiB", 10000):  # below the rows' own bytes; above; slots
        jax.jit(jax.grad(loss), static_argnums=2).lower(w, xs, memory)
    assert planned == []
    # The recursion, a nest, and each policy's schedule on the rows.
    picks = set()
    cases = [(300, 294912), (300, 1474560), (3000, 2949120), (3000, 103219200)]
    cases += [(300, 3), (3000, 30), (3000, 2000), (3000, 8000)]  # slots
    for num_steps, memory in cases:
        xs = jnp.zeros((num_steps, 64), jnp.float32)
        plans = []
        for floors in (True, False):
            with monkeypatch.context() as m:
                if not floors:
                    m.setattr(_choice, "_rows_floor_seconds", lambda fit: -math.inf)
                    m.setattr(_choice, "_rows_floor_bytes", lambda fit: 0)
                budget = memory if memory < 10**5 else f"{memory}B"
                p = memento.explain(cell, h0, xs, memory=budget, wrt=("closure",))
                plans.append((p.executor, p.policy, p.slots, p.evaluations, p.program_bytes))
        assert plans[0] == plans[1], (num_steps, memory, plans)
        picks.add(plans[0][:2])
    rows = {("rows", "hsm"), ("rows", "msm"), ("rows", "ism")}
    assert picks == {("recursion", "hsm"), ("static", "nest"), *rows}


def _counted_cell(w):
    """A state, a wide int32 count of its positive entries and a running sum: the count
    and the sum are outputs no later step's residuals depend on."""

    def cell(c, x):
        h, count, total = c
        h = jnp.tanh(w @ h + x)
        count = count + (jnp.tile(h, 8) > 0).astype(jnp.int32)
        return (h, count, total + jnp.sum(h)), h

    return cell


def test_the_kept_carry_leaves_are_those_later_residuals_depend_on():
    # `ResidualSpec.kept`: from the leaves the residuals read, closed under what their
    # next values read. A count read by no residual is left out; one that a `where`
    # reads, or that feeds a leaf the residuals read, or that an effect reads, is kept.
    from memento.loops._body import make_body

    w, h0, xs = _params(3, h=4)
    count0 = jnp.zeros(32, jnp.int32)

    def kept(cell, c0):
        return make_body(cell, c0, xs[0], name="t").residual_spec().kept

    assert kept(_counted_cell(w), (h0, count0, jnp.zeros((), h0.dtype))) == (True, False, False)

    def read_by_where(c, x):
        h, n = c
        return (jnp.tanh(jnp.where(n[:4] > 2, 0.5, 1.0) * (w @ h) + x), n + 1), h

    assert kept(read_by_where, (h0, count0)) == (True, True)

    def feeds(c, x):  # b's next value reads a, and the residuals read b
        a, b = c
        return (a * 0.9 + x, jnp.tanh(w @ b + a)), b

    assert kept(feeds, (h0, h0)) == (True, True)

    def printed(c, x):
        h, n = c
        jax.debug.callback(lambda n: None, n)
        return (jnp.tanh(w @ h + x), n + 1), h

    assert kept(printed, (h0, count0)) == (True, True)


@pytest.mark.parametrize("memory", ["4%", 20, "8%", "6000B", "30000B"])
def test_a_nest_stores_only_the_kept_carry_leaves_of_its_starts(memory):
    # Each start of a nest keeps the state alone; a run again from it takes the count
    # and the sum at the nest's first step (any values would do: nothing the backward
    # pass reads depends on them). The outputs are lax.scan's, the count and the sum
    # included, and the gradient too, in float64; the count is the program's.
    w, h0, xs = _params(600, h=4)
    c0 = (h0, jnp.zeros(32, jnp.int32), jnp.zeros((), h0.dtype))
    cell = _counted_cell(w)

    def loss(w, xs, scan):
        (h, count, total), ys = scan(_counted_cell(w), c0, xs)
        return jnp.sum(ys) + jnp.sum(h) + total, count

    run = functools.partial(memento.scan, memory=memory, executor="static")
    (value, count), grad = jax.value_and_grad(loss, (0, 1), has_aux=True)(w, xs, run)
    (want, want_count), want_grad = jax.value_and_grad(loss, (0, 1), has_aux=True)(w, xs, lax.scan)
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_allclose(value, want, rtol=1e-12)
    for g, r in zip(grad, want_grad):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)
    plan = memento.explain(cell, c0, xs, memory=memory, executor="static")
    assert plan.policy == "nest"
    if isinstance(memory, str) and memory.endswith("B"):
        f = jax.grad(lambda w, xs: loss(w, xs, run)[0])
        assert _temp(f, w, xs) <= plan.program_bytes * 1.05 + 4096


def test_a_byte_budget_keeps_more_starts_of_a_carry_whose_count_no_derivative_reads():
    # At the same bytes, a carry of a 4-float state and a 32-int count stores the starts
    # of the state alone: as many segments as the state alone allows, not a fifth.
    w, h0, xs = _params(3000, h=4)
    count0 = jnp.zeros(32, jnp.int32)
    alone = memento.explain(
        lambda h, x: (jnp.tanh(w @ h + x),) * 2, h0, xs, memory="12KiB", executor="static"
    )
    with_count = memento.explain(
        lambda c, x: ((jnp.tanh(w @ c[0] + x), c[1] + 1), c[0]), (h0, count0), xs,
        memory="12KiB", executor="static",
    )  # fmt: skip
    assert with_count.evaluations == alone.evaluations, (alone.why, with_count.why)


def test_a_step_run_again_is_priced_without_the_work_of_leaves_it_does_not_keep():
    # A nest's run again from a start computes only what the kept leaves' next values
    # and the ys depend on (XLA drops the tally, whose values are not used): the time
    # model prices it so. A body that keeps every leaf is priced as its step.
    from memento.loops._body import make_body, rerun_profile, step_profile

    w, h0, xs = _params(3, h=4)
    c0 = (h0, jnp.zeros(32, jnp.int32), jnp.zeros((), h0.dtype))
    body = make_body(_counted_cell(w), c0, xs[0], name="t")
    kept = body.residual_spec().kept
    full, again = step_profile(body), rerun_profile(body, kept)
    assert again.ops < full.ops and again.bytes < full.bytes and again.flops < full.flops
    # The state's own work is all there: the matvec's flops.
    assert again.flops >= 2 * 4 * 4
    plain = make_body(lambda h, x: (jnp.tanh(w @ h + x),) * 2, h0, xs[0], name="t")
    assert rerun_profile(plain, [True]) == step_profile(plain)


@pytest.mark.usefixtures("on_cpu")
def test_at_checkpoint_per_steps_bytes_a_tally_no_derivative_reads_fits():
    # lax.scan(jax.checkpoint(step)) stores the state alone per step; memento's plans at
    # its bytes count the tally once per nest and compile within them, with lax.scan's
    # gradient (`benchmarks/pareto.py --bodies tally256` times them).
    with jax.enable_x64(False):
        h0 = jnp.zeros(256)
        xs = jax.random.normal(jax.random.PRNGKey(3), (3001, 256)) * 0.3
        tally0 = jnp.zeros(1024, jnp.int32)
        p = jnp.full(256, 1.05)

        def cell(c, x, p=p):
            h, tally = c
            h = jnp.tanh(h * p + x)
            return (h, tally + (jnp.tile(h, 4) > 0).astype(jnp.int32)), jnp.sum(h)

        def loss(p, scan):
            (h, _), ys = scan(functools.partial(cell, p=p), (h0, tally0), xs)
            return jnp.sum(ys) + jnp.sum(h)

        checkpointed = lambda f, c, x: lax.scan(jax.checkpoint(f), c, x)
        idiom = _temp(jax.grad(lambda p: loss(p, checkpointed)), p)
        for executor in ("auto", "static"):
            run = functools.partial(memento.scan, memory=f"{idiom}B", executor=executor)
            grad = jax.grad(lambda p, run=run: loss(p, run))
            assert _temp(grad, p) <= idiom * 1.05 + 4096
            np.testing.assert_allclose(grad(p), jax.grad(loss)(p, lax.scan), rtol=2e-5)


def _unread_carry(w, xs, scan, h0):
    """A state beside leaves no later residual reads (a weakly typed running sum, an int
    count, a zero-size leaf): ``(h, total, empty, ys)``."""

    def cell(c, x):
        h, total, count, empty = c
        h = jnp.tanh(w @ h + x)
        return (h, total + jnp.sum(h), count + 1, empty * 2.0), h

    (h, total, _, empty), ys = scan(cell, (h0, 0.0, jnp.int32(0), jnp.zeros((0, 3))), xs)
    return h, total, empty, ys


def _unread_loss(w, xs, scan, h0):
    h, total, empty, ys = _unread_carry(w, xs, scan, h0)
    return jnp.sum(ys**2) + jnp.sum(h) + total**2 + jnp.sum(empty)


@pytest.mark.parametrize("memory", [30, "3000B"])
def test_unread_carry_leaves_through_hessians_vmap_and_odd_cotangents(memory):
    # A nest that keeps the state alone at its starts: float64 gradients, Hessians
    # (forward over reverse) and vmapped gradients equal lax.scan's; NaN and -0
    # cotangents pass through as lax.scan passes them.
    w, h0, xs = _params(300, h=4)
    run = functools.partial(memento.scan, memory=memory, executor="static")
    ours = functools.partial(_unread_loss, scan=run, h0=h0)
    ref = functools.partial(_unread_loss, scan=lax.scan, h0=h0)
    for f in (jax.grad, lambda g: jax.jacfwd(jax.grad(g))):
        np.testing.assert_allclose(f(ours)(w, xs), f(ref)(w, xs), rtol=1e-10, atol=1e-12)
    batch = jnp.stack([xs, xs * 0.5])
    got = jax.vmap(jax.grad(ours), (None, 0))(w, batch)
    np.testing.assert_allclose(got, jax.vmap(jax.grad(ref), (None, 0))(w, batch), rtol=1e-10)
    _, pull = jax.vjp(lambda w: _unread_carry(w, xs, run, h0), w)
    _, pull_ref = jax.vjp(lambda w: _unread_carry(w, xs, lax.scan, h0), w)
    zeros = (jnp.zeros(4), jnp.zeros(()), jnp.zeros((0, 3)), jnp.zeros((300, 4)))
    nan = (zeros[0], jnp.array(jnp.nan), *zeros[2:])
    negative_zero = (jnp.full(4, -0.0), *zeros[1:])
    for cts in (nan, negative_zero):
        (got,), (want,) = pull(cts), pull_ref(cts)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.isnan(pull(nan)[0]).all()  # the sum's NaN cotangent reaches every weight
