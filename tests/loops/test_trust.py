"""Trust at every size: the reproducers of budgets, sizes and shapes that once gave silently
wrong gradients, each against ``lax.scan`` (or a closed form) in float64.

Budgets far above need, byte budgets of terabytes, pools past 2^31 elements, zero-size and
scalar leaves, mixed dtypes, NaN / inf / -0.0 in values and cotangents, budget types, and
every executor (`memento.scan`'s ``executor=``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


EXECUTORS = ["rows", "recursion"]
POLICIES = ["auto", "hsm", "ism", "msm"]


def _scan(memory, policy="auto", executor="auto"):
    return lambda f, init, xs, **kw: memento.scan(
        f, init, xs, memory=memory, policy=policy, executor=executor, **kw
    )


def _runs(policy):
    # (policy, executor) pairs that exist: the recursion runs HSM. (It runs auto as HSM too,
    # the very program of policy="hsm": the auto cases take the rows.)
    return [(policy, "rows")] + ([(policy, "recursion")] if policy == "hsm" else [])


def _tanh_rnn_grad(scan, T=1000, dtype=jnp.float64):
    def loss(xs):
        def f(c, x):
            c = jnp.tanh(0.9 * c + x)
            return c, c

        c, ys = scan(f, jnp.asarray(0.1, dtype), xs)
        return ys.sum() + c

    return jax.grad(loss)(jnp.linspace(-1, 1, T, dtype=dtype))


# lax.scan's gradient, computed once for the tests that compare with it (float64).
_lax_tanh_rnn_grad = functools.cache(lambda: _tanh_rnn_grad(lax.scan))


# -- budgets above need (issue: packed depths wrapped in int32) -----------------------------

# The first report (16MiB), slot counts either side of 2^21, and terabytes; the sizes
# between 16MiB and 1TiB (64MiB to 1GiB) were the same string budgets, all capped alike.
BIG = ["16MiB", "1TiB", 2_000_000, 2_200_000, 2**40]


@pytest.mark.parametrize("memory", BIG)
@pytest.mark.parametrize("policy", POLICIES)
def test_budgets_far_above_need_are_exact(memory, policy):
    want = _lax_tanh_rnn_grad()
    for pol, executor in _runs(policy):
        got = _tanh_rnn_grad(_scan(memory, pol, executor))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_float32_scalar_rnn_at_16mib():
    # The first report: float32, memory="16MiB", gradient 292.88 against 568.42.
    got = _tanh_rnn_grad(_scan("16MiB"), dtype=jnp.float32)
    want = _tanh_rnn_grad(lax.scan, dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("memory", [10**7, 10**9, "1TiB", 2**40])
@pytest.mark.parametrize("executor", ["rows", "recursion", "auto"])
def test_temp_memory_is_capped_at_the_loops_need(memory, executor):
    # A 500-step scan with a 32-byte carry: temp memory never above lax.scan's (plus the
    # working set of one step), whatever number the budget is.
    def temp(scan):
        def loss(c):
            def f(c, x):
                c = jnp.tanh(c * 1.01 + x)
                return c, None

            return scan(f, c, jnp.zeros((500, 4)))[0].sum()

        compiled = jax.jit(jax.grad(loss)).lower(jnp.ones(4)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    policy = "hsm" if executor == "recursion" else "auto"
    ours, theirs = temp(_scan(memory, policy, executor)), temp(lax.scan)
    assert ours <= 2 * theirs + 4096, (ours, theirs)


@pytest.mark.parametrize("backend", [None, "gpu"])
@pytest.mark.parametrize("memory", [10**7, "1TiB"])
def test_schedule_of_a_huge_budget_is_store_everything(memory, backend, monkeypatch):
    # "gpu": planned as on a GPU, where auto charges plans on the rows per step (an H200
    # run found HSM, cost 99, planned here before that charge spared plans that store
    # every step).
    if backend is not None:
        monkeypatch.setattr(jax, "default_backend", lambda: backend)

    def f(c, x):
        return jnp.tanh(c + x), None

    s = memento.loops.scan_schedule(f, jnp.zeros(4), jnp.zeros((50, 4)), memory=memory)
    assert s.cost == 50  # every internal state kept: one evaluation per step
    assert s.memory <= 50 * s.alpha


# -- pools past 2^31 elements (issue: flat int32 element offsets) --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("executor", EXECUTORS)
def test_pool_past_2_31_elements(executor):
    # A carry with a 2 MiB uint8 leaf, HSM, 1,400 steps, 1,300 slots: 2.7e9 pool elements.
    # The float leaf's derivative is a product of cos(u_t[0] / 50) over the steps, so it
    # is right only if every reloaded u_t is: a closed form checks it (lax.scan would keep
    # 2.9 GB of residuals).
    T, n = 1400, 2**21

    def loss(s0):
        def f(c, _):
            u, s = c
            s = s * jnp.cos(u[0].astype(jnp.float64) / 50) + 0.01
            return (u + jnp.uint8(1), s), None

        (_, s), _ = memento.scan(
            f, (jnp.zeros(n, jnp.uint8), s0), None, length=T, memory=1300, policy="hsm",
            executor=executor,
        )  # fmt: skip
        return s

    got = jax.grad(loss)(jnp.float64(1.0))
    u0 = (np.arange(T) % 256).astype(np.float64)
    want = np.prod(np.cos(u0 / 50))
    np.testing.assert_allclose(got, want, rtol=1e-12)


# -- leaves of every size and kind --------------------------------------------------------


def _carry_cases():
    return {
        "empty-first": lambda: (jnp.zeros((0,)), jnp.array([0.3, -0.2]), jnp.int32(0)),
        "empty-last": lambda: (jnp.array([0.3, -0.2]), jnp.int32(0), jnp.zeros((2, 0))),
        "scalar-then-vector": lambda: (jnp.float64(0.5), jnp.array([0.3, -0.2, 0.1, 0.4])),
        "scalar-and-uint8": lambda: (jnp.float64(0.5), jnp.arange(4, dtype=jnp.uint8)),
        "f32-scalar-f64-vector": lambda: (jnp.float32(0.5), jnp.array([0.3, -0.2])),
    }


def _generic_step(c, x):
    # Works on any of the carries above: float leaves are updated, others advanced.
    out = []
    for leaf in c:
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            out.append(jnp.sin(leaf * 1.3 + x).astype(leaf.dtype))
        else:
            out.append(leaf + jnp.asarray(1, leaf.dtype))
    y = sum(
        jnp.sum(leaf.astype(jnp.float64) ** 2) for leaf in out
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    )  # fmt: skip
    return tuple(out), (y, jnp.zeros((0, 3)))


# One slot, a few, and far above need (the capped pools); a third of the 30 steps (10)
# made the same pools as 3 at another size.
_LAX_GRADS = {}


@pytest.mark.parametrize("case", list(_carry_cases()))
@pytest.mark.parametrize("memory", [1, 3, 10**6])
@pytest.mark.parametrize("policy", POLICIES)
def test_leaves_of_every_size_and_kind(case, memory, policy):
    init = _carry_cases()[case]()
    xs = jnp.linspace(-0.5, 0.5, 30)

    def loss(init, xs, scan):
        c, (ys, empty) = scan(_generic_step, init, xs)
        floats = [leaf for leaf in c if jnp.issubdtype(leaf.dtype, jnp.floating)]
        return ys.sum() + sum(jnp.sum(leaf) for leaf in floats) + empty.sum()

    floats = [i for i, leaf in enumerate(init) if jnp.issubdtype(leaf.dtype, jnp.floating)]

    def grads(scan):
        def of(fl, xs):
            full = list(init)
            for i, v in zip(floats, fl):
                full[i] = v
            return loss(tuple(full), xs, scan)

        # jitted: one program (eager gradients: test_budgets_far_above_need_are_exact)
        return jax.jit(jax.grad(of, argnums=(0, 1)))([init[i] for i in floats], xs)

    if case not in _LAX_GRADS:  # lax.scan's, once per carry
        _LAX_GRADS[case] = grads(lax.scan)
    want = _LAX_GRADS[case]
    for pol, executor in _runs(policy):
        try:
            got = grads(_scan(memory, pol, executor))
        except ValueError as e:  # ISM below one internal state: a clear refusal
            assert pol == "ism" and "needs room for one internal state" in str(e)
            continue
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=executor)


def test_empty_first_leaf_in_the_recursion():
    # A 30-step sin loop with carry (zeros((0,)), h, i): "no slots" was read from the
    # first leaf's size, and every segment was recomputed from h_0.
    def loss(h, scan):
        def f(c, _):
            e, h, i = c
            return (e, jnp.sin(h), i + 1), None

        (_, h, _), _ = scan(f, (jnp.zeros((0,)), h, jnp.int32(0)), None, length=30)
        return h.sum()

    h0 = jnp.array([1.5, 0.3])
    want = jax.grad(loss)(h0, lax.scan)
    for memory in (2, 5, 40):
        got = jax.grad(loss)(h0, _scan(memory, "hsm", "recursion"))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)


def test_empty_first_leaf_in_while_loop():
    def loss(h, loop):
        def body(c):
            e, h, i = c
            return e, jnp.sin(h), i + 1

        _, h, _ = loop(lambda c: c[2] < 30, body, (jnp.zeros((0,)), h, jnp.int32(0)))
        return h.sum()

    h0 = jnp.array([1.5, 0.3])

    def unrolled(h):
        for _ in range(30):
            h = jnp.sin(h)
        return h.sum()

    want = jax.grad(unrolled)(h0)
    for memory in (2, 5, 40):
        ours = lambda c, b, i, m=memory: memento.while_loop(c, b, i, memory=m)
        got = jax.grad(loss)(h0, ours)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)


# -- special values --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_nan_inf_and_negative_zero_flow_exactly(policy):
    # Values with -0.0, inf and NaN; a cotangent that is NaN on one element. Gradients
    # must equal lax.scan's bit for bit in where they are NaN and in their signs.
    def f(c, x):
        h = c * x
        y = jnp.where(jnp.isfinite(h), h, 0.0) * jnp.where(jnp.signbit(h), 2.0, 3.0)
        return h, y

    xs = jnp.array([[1.0, -1.0, 0.5, 2.0]] * 6)
    init = jnp.array([-0.0, jnp.inf, jnp.nan, 1.0])

    def loss_vjp(scan):
        out, vjp = jax.vjp(lambda i, x: scan(f, i, x), init, xs)
        ct = (jnp.array([1.0, jnp.nan, -0.0, 1.0]), jnp.ones_like(out[1]))
        return out, vjp(ct)

    want = loss_vjp(lax.scan)
    for pol, executor in _runs(policy):
        for memory in (1, 3, 100):
            try:
                got = loss_vjp(_scan(memory, pol, executor))
            except ValueError as e:  # ISM below one internal state: a clear refusal
                assert pol == "ism" and "needs room for one internal state" in str(e)
                continue
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
                np.testing.assert_array_equal(a, b)  # NaN positions equal too


# -- budget types ----------------------------------------------------------------------------


@pytest.mark.parametrize("memory", [np.int64(10), np.int32(10), jnp.int32(10), np.array(10)])
def test_integer_budgets_from_numpy_and_jax(memory):
    want = _tanh_rnn_grad(lax.scan, T=50)
    got = _tanh_rnn_grad(_scan(memory), T=50)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert memento.bytes_budget(np.int64(4096)).num_bytes == 4096


@pytest.mark.parametrize("memory", ["0B", "0.1B", "0KiB"])
def test_zero_byte_budgets_say_zero(memory):
    with pytest.raises(ValueError, match=r"is 0 bytes, which holds nothing"):
        memento.scan(lambda c, x: (c, None), 0.0, jnp.zeros(3), memory=memory)


@pytest.mark.parametrize("memory", [True, np.bool_(True), 2.5, np.float64(3.0), jnp.zeros(2)])
def test_non_integer_budgets_are_type_errors(memory):
    with pytest.raises(TypeError, match="memory must be None, an int"):
        memento.scan(lambda c, x: (c, None), 0.0, jnp.zeros(3), memory=memory)


# -- the executor choice ---------------------------------------------------------------------


def test_executor_is_validated():
    f = lambda c, x: (c, None)
    with pytest.raises(ValueError, match="executor must be one of"):
        memento.scan(f, 0.0, jnp.zeros(3), memory=2, executor="gpu")
    with pytest.raises(ValueError, match="executor='recursion' runs HSM"):
        memento.scan(f, 0.0, jnp.zeros(3), memory=2, policy="msm", executor="recursion")


# -- debug mode (MEMENTO_CHECKS) catches a broken executor ---------------------------------


def _corrupt(monkeypatch, what):
    # A program whose rows point at the wrong place: the executor itself is broken.
    import dataclasses

    from memento.loops import _choice

    real = _choice._compile.__wrapped__

    def compile_wrong(schedule):
        prog = real(schedule)
        if what == "load":  # every hidden load reads the first hidden slot
            rows = prog.primal_rows.copy()
            rows[(rows[:, 0] == 3) & (rows[:, 1] > 0), 1] = 0  # LOAD_HIDDEN branch
            return dataclasses.replace(prog, primal_rows=rows)
        rows = prog.backward_rows.copy()  # a stored backward reads another step's state
        stored = np.flatnonzero(rows[:, 0] == 0)
        rows[stored[1:], 2] = rows[stored[:-1], 2]
        return dataclasses.replace(prog, backward_rows=rows)

    monkeypatch.setattr(_choice, "_compile", compile_wrong)


@pytest.mark.parametrize("what,policy", [("load", "hsm"), ("backward", "ism")])
def test_checks_catch_a_broken_program(monkeypatch, what, policy):
    monkeypatch.setenv("MEMENTO_CHECKS", "1")
    _corrupt(monkeypatch, what)
    scan = _scan(6 if policy == "hsm" else 30, policy, "rows")
    with pytest.raises(Exception, match="executor invariant broken"):
        jax.block_until_ready(_tanh_rnn_grad(scan, T=40))


def test_checks_off_let_the_same_fault_through(monkeypatch):
    # Why the suite runs with them on: the same fault is silent without them.
    monkeypatch.setenv("MEMENTO_CHECKS", "0")
    _corrupt(monkeypatch, "load")
    got = _tanh_rnn_grad(_scan(6, "hsm", "rows"), T=40)
    assert not np.allclose(got, _tanh_rnn_grad(lax.scan, T=40))


def test_checks_catch_a_broken_recursion(monkeypatch):
    from memento.loops import _recursion

    monkeypatch.setenv("MEMENTO_CHECKS", "1")
    real = _recursion.CarrySlots.load
    # Every load from a slot asks for the slot below: the carry is at the wrong position.
    monkeypatch.setattr(
        _recursion.CarrySlots,
        "load",
        lambda self, stacks, init, slot, *a, **k: real(
            self, stacks, init, jnp.maximum(slot - 1, jnp.minimum(slot, 0)), *a, **k
        ),
    )
    with pytest.raises(Exception, match="executor invariant broken"):
        jax.block_until_ready(_tanh_rnn_grad(_scan(6, "hsm", "recursion"), T=40))


def test_lengths_past_int32_are_refused_before_tracing():
    def loss(c, xs):
        return memento.scan(lambda c, x: (c + x, None), c, xs, memory=10)[0].sum()

    xs = jax.ShapeDtypeStruct((2**31,), jnp.float32)
    with pytest.raises(ValueError, match="past the 2147483646 a budgeted scan indexes"):
        jax.jit(jax.grad(loss)).trace(jnp.float32(0), xs)
