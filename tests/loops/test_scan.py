"""memento.scan against lax.scan: values, gradients, transformations, counts, program size."""

import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento
from memento.loops import _budget, _scan
from memento.loops._interpreter import compile_schedule
from memento.planning import internals

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"

T, H = 11, 3


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def rnn_params(seed=0, h=H, t=T):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(k[0], (h, h), jnp.float64) * 0.6
    xs = jax.random.normal(k[1], (t, h), jnp.float64)
    h0 = jax.random.normal(k[2], (h,), jnp.float64)
    return w, h0, xs


def rnn_loss(scan_fn, w, h0, xs):
    def cell(h, x):
        h = jnp.tanh(w @ h + x)
        return h, jnp.sum(h**2)

    h, ys = scan_fn(cell, h0, xs)
    return jnp.sum(jnp.sin(h)) + jnp.sum(ys * jnp.arange(ys.shape[0]))


def budgeted(**kw):
    return lambda f, init, xs=None, **k: memento.scan(f, init, xs, **k, **kw)


def assert_trees_close(a, b, rtol=1e-12, atol=1e-12):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        )


GRAD = functools.partial(jax.grad, argnums=(1, 2, 3))


# lax.scan's gradient, once for the 24 cases below (float64, as the fixture sets).
_lax_rnn_grad = functools.cache(lambda: GRAD(rnn_loss)(lax.scan, *rnn_params()))
MEMORIES = [1, 2, 3, 5, 8, 13, 40, 200]


def _rnn_schedule(policy, memory):
    w, h0, xs = rnn_params()

    def cell(h, x):  # rnn_loss's
        h = jnp.tanh(w @ h + x)
        return h, jnp.sum(h**2)

    return memento.loops.scan_schedule(cell, h0, xs, memory=memory, policy=policy)


def test_auto_runs_the_schedules_of_the_gradient_cases():
    # At every budget below, auto plans either a static plan (nested segments, see
    # test_scan_static.py) or exactly HSM's or MSM's schedule: the program that
    # test_gradients_equal_lax_scan compiles and checks for that policy.
    for memory in MEMORIES:
        auto = _rnn_schedule("auto", memory)
        if auto.policy == "static":
            assert auto.simulate().forward_evaluations == auto.cost, memory
            continue
        assert auto == _rnn_schedule(auto.policy, memory), memory
        assert auto.policy in ("hsm", "msm"), memory


def test_auto_charges_the_rows_by_backend():
    # The rows' per-step charge applies where HSM would run as the recursion: on a GPU
    # with executor="auto", never with the executor forced (then every policy runs as
    # forced), and on CPU below 2^16 steps HSM runs on the rows too.
    gpu = internals.auto_charges(1000, "auto", "gpu")
    assert (
        gpu.rows_step == 1.25 and gpu.internal == memento.planning.internals.INTERNAL_STATE_CHARGE
    )
    for args in [(1000, "rows", "gpu"), (1000, "recursion", "gpu"), (1000, "auto", "cpu"),
                 (2**16, "auto", "cpu"), (1000, "auto", "tpu")]:  # fmt: skip
        assert internals.auto_charges(*args).rows_step == 0, args


def test_the_gpu_rows_charge_is_what_the_h200_measured():
    # The table's charge from the committed H200 run (results/gpu/lstm_policy.json): the
    # same HSM plan on the rows and on the recursion at 50 slots, and HSM at 250 slots
    # for the evaluation's marginal time. Under it, auto picks the plan that ran fastest
    # at both budgets, where without it (as on CPU) it picked MSM at 250 and lost.
    data = json.loads((RESULTS / "gpu" / "lstm_policy.json").read_text())
    rows = data["rows"] if isinstance(data, dict) else data  # the first run wrote a list
    at = {(r["slots"], r["policy"], r["executor"]): r for r in rows}
    extra = at[50, "hsm", "rows"]["steady_s"] - at[50, "auto", "auto"]["steady_s"]
    dt = at[50, "auto", "auto"]["steady_s"] - at[250, "hsm", "auto"]["steady_s"]
    evals = at[50, "auto", "auto"]["cost_per_step"] - at[250, "hsm", "auto"]["cost_per_step"]
    measured = extra / (dt / evals)  # evaluations a step
    charge = internals.auto_charges(1000, "auto", "gpu").rows_step
    assert abs(measured - charge) < 0.05, measured
    alpha = at[250, "auto", "auto"]["alpha"]
    for slots in (50, 250):
        fastest = min((r for r in rows if r["slots"] == slots), key=lambda r: r["steady_s"])
        gpu = _budget.choose_policy(1000, slots, alpha, "auto", name="t",
                                    charges=internals.auto_charges(1000, "auto", "gpu"))  # fmt: skip
        assert gpu == fastest["planned"] == "hsm", slots
    cpu = _budget.choose_policy(1000, 250, alpha, "auto", name="t")
    assert cpu == at[250, "auto", "auto"]["planned"] == "msm"
    # The README's picks: that LSTM (alpha 8, 1000 steps) and the 4x4 cell (alpha 4,
    # 10^4 steps), on CPU and on a GPU.
    for t, a, cpu_msm_from in [(1000, 8, 100), (10**4, 4, 10)]:
        for slots in (10, 50, 100, 250):
            picks = [_budget.choose_policy(t, slots, a, "auto", name="t",
                                           charges=internals.auto_charges(t, "auto", backend))
                     for backend in ("cpu", "gpu")]  # fmt: skip
            assert picks == ["msm" if slots >= cpu_msm_from else "hsm", "hsm"], (t, slots)


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm"])
@pytest.mark.parametrize("memory", MEMORIES)
def test_gradients_equal_lax_scan(policy, memory):
    w, h0, xs = rnn_params()
    ref = _lax_rnn_grad()
    fn = budgeted(memory=memory, policy=policy)
    try:
        got = jax.jit(GRAD(rnn_loss), static_argnums=0)(fn, w, h0, xs)
    except ValueError as e:  # ISM below one internal state: the documented error
        assert policy == "ism" and "needs room for one internal state" in str(e)
        return
    assert_trees_close(got, ref)
    np.testing.assert_allclose(rnn_loss(fn, w, h0, xs), rnn_loss(lax.scan, w, h0, xs), rtol=1e-14)


@pytest.mark.parametrize("length", [1, 2, 3])
def test_short_sequences(length):
    w, h0, xs = rnn_params(t=length)
    ref = GRAD(rnn_loss)(lax.scan, w, h0, xs)
    for memory in (1, 2, 50):
        got = GRAD(rnn_loss)(budgeted(memory=memory), w, h0, xs)
        assert_trees_close(got, ref)


def test_pytrees_ints_reverse_and_xs_none():
    w, h0, xs = rnn_params()

    def run(scan_fn, w, h0, xs):
        def cell(carry, x):
            h, (count, acc) = carry
            h = jnp.tanh(w @ h + x["a"] * x["b"][0])
            return (h, (count + 1, acc + h[0])), {"y": h, "n": count}

        init = (h0, (jnp.int32(0), jnp.float64(0.0)))
        xs_tree = {"a": xs, "b": xs[:, :1] + 1.0}
        (h, (count, acc)), ys = scan_fn(cell, init, xs_tree, reverse=True)
        return jnp.sum(h) + acc + jnp.sum(ys["y"] ** 2) + 0.1 * jnp.sum(ys["n"]), (count, ys["n"])

    ref_g, (ref_c, ref_n) = jax.grad(run, argnums=(1, 2, 3), has_aux=True)(lax.scan, w, h0, xs)
    for memory, policy in [(2, "hsm"), (4, "auto"), (40, "ism")]:
        g, (c, n) = jax.grad(run, argnums=(1, 2, 3), has_aux=True)(
            budgeted(memory=memory, policy=policy), w, h0, xs
        )
        assert_trees_close(g, ref_g)
        assert int(c) == int(ref_c) == T
        np.testing.assert_array_equal(n, ref_n)

    def gen(scan_fn, h0):
        def cell(h, _):
            return jnp.cos(h) * 1.1, h

        h, ys = scan_fn(cell, h0, None, length=7)
        return jnp.sum(h) + jnp.sum(ys**3)

    assert_trees_close(
        jax.grad(functools.partial(gen, budgeted(memory=2)))(h0),
        jax.grad(functools.partial(gen, lax.scan))(h0),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_low_precision_matches_lax_scan(dtype):
    # Rounding differs with the order of accumulation, so both are held against the
    # float64 gradient: memento's error is no larger than twice lax.scan's own.
    params = rnn_params()
    exact = GRAD(rnn_loss)(lax.scan, *params)
    low = [a.astype(dtype) for a in params]
    ref = GRAD(rnn_loss)(lax.scan, *low)
    got = GRAD(rnn_loss)(budgeted(memory=3), *low)

    def err(x, e):
        return float(jnp.max(jnp.abs(x.astype(jnp.float64) - e)))

    for a, b, e in zip(got, ref, exact):
        assert a.dtype == b.dtype == dtype
        assert err(a, e) <= 2 * err(b, e) + 1e-6 * float(jnp.max(jnp.abs(e)))


def test_vmap_outside_and_inside():
    w, h0, xs = rnn_params()
    h0s = jnp.stack([h0, 2 * h0, -h0])
    xss = jnp.stack([xs, xs * 0.5, xs + 1])

    def batched(scan_fn):
        return jax.vmap(lambda h, x: GRAD(rnn_loss)(scan_fn, w, h, x))(h0s, xss)

    assert_trees_close(batched(budgeted(memory=3)), batched(lax.scan))

    def inner_vmap(scan_fn, w, h0, xs):
        def cell(h, x):
            h = jax.vmap(lambda hi, xi: jnp.tanh(w @ hi + xi))(h, x)
            return h, h.sum()

        h, ys = scan_fn(cell, h0s * h0, jnp.stack([xs] * 3, 1))
        return h.sum() + ys.sum()

    assert_trees_close(
        GRAD(inner_vmap)(budgeted(memory=2), w, h0, xs), GRAD(inner_vmap)(lax.scan, w, h0, xs)
    )


def test_vjp_and_nested_scan():
    w, h0, xs = rnn_params()

    def outer(scan_fn, inner_scan, w, h0, xs):
        def cell(h, x):
            def inner(g, _):
                return jnp.tanh(w @ g + x), None

            g, _ = inner_scan(inner, h, None, length=3)
            return g, g[0]

        h, ys = scan_fn(cell, h0, xs)
        return jnp.sum(h) + jnp.sum(ys**2)

    ref = jax.grad(outer, argnums=(2, 3, 4))(lax.scan, lax.scan, w, h0, xs)
    got = jax.grad(outer, argnums=(2, 3, 4))(budgeted(memory=3), budgeted(memory=1), w, h0, xs)
    assert_trees_close(got, ref)

    def values(w, xs):
        return lax.scan(lambda h, x: (jnp.tanh(w @ h + x), h), h0, xs)

    out, pull = jax.vjp(values, w, xs)
    out2, pull2 = jax.vjp(
        lambda w, xs: memento.scan(lambda h, x: (jnp.tanh(w @ h + x), h), h0, xs, memory=2), w, xs
    )
    assert_trees_close(out, out2)
    ct = jax.tree_util.tree_map(jnp.ones_like, out)
    assert_trees_close(pull(ct), pull2(ct))


@pytest.mark.parametrize("memory", [2, "2KiB"])
def test_jvp_and_grad_of_grad_equal_lax_scan(memory):
    w, h0, xs = rnn_params()

    def ours(w, h0):
        return rnn_loss(budgeted(memory=memory), w, h0, xs)

    def ref(w, h0):
        return rnn_loss(lax.scan, w, h0, xs)

    for d in (
        lambda f: jax.jvp(f, (w, h0), (jnp.cos(w), jnp.sin(h0))),
        lambda f: jax.grad(lambda h: jnp.sum(jax.grad(f, (0, 1))(w, h)[0] ** 2))(h0),
    ):
        assert_trees_close(jax.jit(d, static_argnums=0)(ours), d(ref))


# The counting cell's callbacks run inside the backward loop's fused steps. XLA in
# jaxlib 0.5.3 (the oldest JAX pyproject allows) drops or hoists them there, so they count
# fewer evaluations than were made (the gradients are still exact); the counts are checked
# from the JAX release where the callbacks all run.
COUNTS_RUN = pytest.mark.xfail(
    jax.__version_info__ < (0, 6),
    reason="jaxlib 0.5 drops debug callbacks inside the backward loop's fused steps",
    strict=False,
)


def counting_cell(w, counts):
    """An RNN cell that counts its forward evaluations and its pullbacks at run time."""

    def bump(name):
        def cb():
            counts[name] += 1

        return cb

    @jax.custom_vjp
    def core(w, h, x):
        return jnp.tanh(w @ h + x)

    def core_fwd(w, h, x):
        out = jnp.tanh(w @ h + x)
        return out, (w, h, out)

    def core_bwd(res, ct):
        w, h, out = res
        jax.debug.callback(bump("backward"))
        d = ct * (1 - out**2)
        return jnp.outer(d, h), w.T @ d, d

    core.defvjp(core_fwd, core_bwd)

    def cell(h, x):
        jax.debug.callback(bump("forward"))
        h = core(w, h, x)
        return h, h.sum()

    return cell


@COUNTS_RUN
@pytest.mark.parametrize(
    "policy,memory", [("hsm", 1), ("hsm", 3), ("ism", 4), ("auto", 6), ("msm", 7), ("hsm", 100)]
)
@pytest.mark.parametrize("unroll", [1, 3])
def test_forward_evaluations_equal_schedule_cost(policy, memory, unroll):
    w, h0, xs = rnn_params(t=23)
    counts = {"forward": 0, "backward": 0}
    cell = counting_cell(w, counts)

    def loss(h0, xs):
        h, ys = memento.scan(cell, h0, xs, memory=memory, policy=policy, unroll=unroll)
        return h.sum() + ys.sum()

    jax.block_until_ready(jax.jit(jax.grad(loss))(h0, xs))
    counts.update(forward=0, backward=0)
    jax.block_until_ready(jax.jit(jax.grad(loss))(h0, xs))  # cached: counts one run
    # grad(loss)(h0, xs) perturbs h0 only: that is what the executor differentiates.
    schedule = memento.loops.scan_schedule(cell, h0, xs, memory=memory, policy=policy, wrt=["init"])
    assert counts["forward"] == schedule.cost == schedule.simulate().forward_evaluations
    assert counts["backward"] == 23  # the VJP runs once per step, never for recomputation
    alpha = _budget.internal_slots(*_sizes(cell, h0, xs[0]))
    assert schedule.alpha == (1 if schedule.policy == "hsm" else alpha)


_EXECUTORS = [("rows", "hsm"), ("rows", "ism"), ("rows", "msm"), ("recursion", "hsm")]


# lax.scan's gradient with unroll, once per unroll for the executors below.
_lax_unrolled_grad = functools.cache(
    lambda unroll: GRAD(rnn_loss)(functools.partial(lax.scan, unroll=unroll), *rnn_params(t=23))
)


# unroll=3 (a remainder of 2 steps) and True for every executor; unroll=2 (a remainder
# of one step: the same two loops as 3) for one.
@pytest.mark.parametrize(
    "executor,policy,unroll",
    [(e, p, u) for u in (3, True) for e, p in _EXECUTORS] + [("rows", "hsm", 2)],
)
def test_unroll_equals_lax_scan_and_unrolls_recomputation(executor, policy, unroll, expanded_jaxpr):
    # unroll=k is lax.scan's in the first sweep, and the backward pass's recomputation
    # loops run k steps per iteration (GitHub issue 20): same gradients as lax.scan's.
    w, h0, xs = rnn_params(t=23)
    ref = _lax_unrolled_grad(unroll)
    for memory in (6, 9):
        scan = budgeted(memory=memory, policy=policy, executor=executor, unroll=unroll)
        assert_trees_close(jax.jit(GRAD(rnn_loss), static_argnums=0)(scan, w, h0, xs), ref)

    def tanhs(k):
        scan = budgeted(memory=6, policy=policy, executor=executor, unroll=k)
        return expanded_jaxpr(functools.partial(GRAD(rnn_loss), scan), w, h0, xs).count("tanh")

    # One recomputation loop: k steps per iteration, and a loop of single steps for the
    # rest; unroll=True is every step, 23.
    k = 23 if unroll is True else unroll
    assert tanhs(unroll) - tanhs(1) == k


def test_scan_schedule_bad_input():
    w, h0, xs = rnn_params()
    cell = counting_cell(w, {"forward": 0, "backward": 0})
    name = "memento.loops.scan_schedule"
    with pytest.raises(ValueError, match=f"{name}: memory=None is lax.scan"):
        memento.loops.scan_schedule(cell, h0, xs, memory=None)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=f"{name}: wrt must be a collection of 'closure'"):
        memento.loops.scan_schedule(cell, h0, xs, memory=3, wrt=["params"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=f"{name}: a scan of 0 steps runs lax.scan"):
        memento.loops.scan_schedule(cell, h0, xs[:0], memory=3)
    with pytest.raises(ValueError, match=f"{name}: unknown policy 'fast'"):
        memento.loops.scan_schedule(cell, h0, xs, memory=3, policy="fast")  # pyright: ignore[reportArgumentType]


def _sizes(cell, h0, x):
    from memento.loops._body import make_body, nbytes

    body = make_body(cell, h0, jax.ShapeDtypeStruct(x.shape, x.dtype), name="t")
    # grad(loss)(h0, xs) perturbs h0 only: that is what the executor differentiates.
    body = body.restrict([False] * len(body.consts), [True], [False])
    return nbytes(body.residual_spec().stored), nbytes(body.carry_avals)


def _grad_hlo(num_steps, memory, executor="auto"):
    w, h0, _ = rnn_params()
    xs = jnp.zeros((num_steps, H))
    fn = jax.jit(GRAD(rnn_loss), static_argnums=0)
    scan = budgeted(memory=memory, policy="hsm", executor=executor)
    compiled = fn.lower(scan, w, h0, xs).compile()
    return compiled


def test_program_size_constant_in_steps():
    # The rows program (the recursion's: tests/loops/test_scan_recursion.py).
    small = _grad_hlo(100, 10, executor="rows").as_text()
    large = _grad_hlo(100_000, 10, executor="rows").as_text()
    n_small, n_large = len(small.splitlines()), len(large.splitlines())
    assert abs(n_large - n_small) <= 0.05 * n_small, (n_small, n_large)


def test_temp_memory_follows_budget_not_steps():
    def temp(num_steps, memory):
        w, h0, _ = rnn_params(h=64)
        xs = jnp.zeros((num_steps, 64))
        fn = jax.jit(GRAD(rnn_loss), static_argnums=0)
        return (
            fn.lower(budgeted(memory=memory, policy="hsm"), w, h0, xs)
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    carry = 64 * 8
    # Growing the budget grows temp memory by about one carry per slot ...
    assert temp(2000, 400) - temp(2000, 10) >= 300 * carry
    # ... while growing the number of steps at a fixed budget adds only what lax.scan's
    # gradient needs per step anyway (the cotangents of xs and ys), not carries.
    per_step = temp(4000, 10) - temp(2000, 10)
    assert per_step <= 2000 * (64 * 8 + 8) * 2.1


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"memory": 0}, ValueError, "memory=0 slots is too small"),
        ({"memory": 2.5}, TypeError, "memory must be None, an int"),
        ({"memory": "lots"}, ValueError, "cannot read memory='lots'"),
        (
            {"memory": "8B"},
            ValueError,
            "cannot hold even one carry of 24 bytes; the minimum is 24 bytes",
        ),
        (
            {"memory": 2, "policy": "fast"},
            ValueError,
            "memento.scan: unknown policy 'fast'; pass one of 'auto'",
        ),
        ({"memory": 1, "policy": "ism"}, ValueError, "needs room for one internal state"),
    ],
)
def test_bad_input(kwargs, exc, pattern):
    w, h0, xs = rnn_params()
    with pytest.raises(exc, match=re.escape(pattern) if "." not in pattern else pattern):
        # The plan is made when the gradient is traced (from what it differentiates).
        GRAD(rnn_loss)(budgeted(**kwargs), w, h0, xs)


def test_bad_body():
    _, h0, xs = rnn_params()
    with pytest.raises(TypeError, match=r"differs at carry: float64\[3\] in, float32\[3\] out"):
        memento.scan(lambda h, x: (h.astype(jnp.float32), None), h0, xs, memory=2)
    with pytest.raises(TypeError, match="output carry has structure"):
        memento.scan(lambda h, x: ((h, h), None), h0, xs, memory=2)
    with pytest.raises(ValueError, match="different leading lengths"):
        memento.scan(lambda h, x: (h, None), h0, (xs, xs[:3]), memory=2)
    with pytest.raises(ValueError, match="pass length="):
        memento.scan(lambda h, x: (h, None), h0, None, memory=2)


@pytest.mark.parametrize(
    "new_carry,message",
    [
        (
            lambda c: {"a": c["a"], "b": [c["b"][0]], "c": c["a"]},
            "the body's output carry has structure PyTreeDef({'a': *, 'b': [*], 'c': *}), but "
            "the input carry has structure PyTreeDef({'a': *, 'b': (*, *)}); differs at "
            "carry['b'][1] (input only); carry['c'] (output only).",
        ),
        (
            lambda c: {"a": c["a"], "b": list(c["b"])},
            "differs at the containers, not the leaves.",
        ),
        (
            lambda c: {"a": c["a"].astype(jnp.int32), "b": (c["b"][0][:2], c["b"][1])},
            "the body must return a carry with the shapes and dtypes of the initial carry (cast "
            "inside the body, or change init); differs at carry['a']: float64[2] in, int32[2] "
            "out; carry['b'][0]: float64[3] in, float64[2] out.",
        ),
    ],
)
def test_carry_mismatch_names_every_leaf(new_carry, message):
    # As lax.scan's error: each differing leaf by its key path (jax.tree_util.keystr).
    init = {"a": jnp.zeros(2), "b": (jnp.zeros(3), jnp.zeros(1))}
    with pytest.raises(TypeError, match="memento.scan: .*" + re.escape(message)):
        memento.scan(lambda c, x: (new_carry(c), None), init, jnp.zeros(4), memory=2)
    with pytest.raises(TypeError, match="memento.while_loop: .*" + re.escape(message)):
        memento.while_loop(lambda c: True, new_carry, init, max_steps=3, memory=2)


def test_byte_budget():
    w, h0, xs = rnn_params()
    ref = GRAD(rnn_loss)(lax.scan, w, h0, xs)
    for memory in ("96B", memento.bytes_budget(24 * 5), "1KiB"):
        assert_trees_close(GRAD(rnn_loss)(budgeted(memory=memory), w, h0, xs), ref)
    with pytest.raises(TypeError, match="expected an int number of bytes"):
        memento.bytes_budget(1.5)
    assert _budget.parse_memory("1.5KiB", name="x") == _budget.Bytes(1536)


def test_memory_none_is_lax_scan():
    w, h0, xs = rnn_params()
    f = lambda h, x: (jnp.tanh(w @ h + x), h)
    a = jax.make_jaxpr(lambda h0, xs: memento.scan(f, h0, xs))(h0, xs)
    b = jax.make_jaxpr(lambda h0, xs: lax.scan(f, h0, xs))(h0, xs)
    assert str(a) == str(b)
    assert _scan.scan.__doc__ and "lax.scan" in _scan.scan.__doc__


def test_no_xs_cotangent_buffer_when_only_weights_are_differentiated():
    # A (T, *x.shape) cotangent for xs was once kept at every budget, even when only the
    # weights were differentiated: 16 MiB of the LSTM benchmark's 17 MiB at 5%.
    def temp(num_steps):
        w, h0, _ = rnn_params(h=64)
        xs = jnp.zeros((num_steps, 64))
        loss = functools.partial(rnn_loss, budgeted(memory=10, policy="hsm"))
        grad_w = jax.jit(jax.grad(loss))
        return grad_w.lower(w, h0, xs).compile().memory_analysis().temp_size_in_bytes

    def rows(num_steps):  # the schedule's rows: run-time data, not constants (issue 20)
        return compile_schedule(memento.plan(num_steps, 10, policy="hsm")).runtime_bytes

    # Only ys' cotangent (one float64 per step) and the schedule's rows (about 62 B a step
    # here) may grow with T, not one x (512 B) per step.
    assert temp(4000) - temp(2000) <= 2000 * 8 * 2 + rows(4000) - rows(2000)


@pytest.mark.parametrize("executor", ["rows", "recursion"])
def test_a_step_whose_pullback_holds_a_closed_over_array(executor):
    # A rematerialised step that calls fwdrev_grad of a loss closing over an array (an
    # rmsprop-like update, as memento.meta.inner_loop builds): the step's pullback holds
    # that array itself, a concrete value captured when the body was traced. The probe
    # of the residuals sees it as such, and every step returns the same array, which is
    # not stored per step.
    rng = np.random.default_rng(5)
    data = jnp.asarray(rng.normal(size=(4, 3)))
    w0 = jnp.asarray(rng.normal(size=3))
    xs = jnp.asarray(rng.uniform(0.05, 0.2, size=7))

    def loss(w):
        return jnp.sum((data @ w - 1.0) ** 2)

    def step(c, lr):
        w, v = c
        g = memento.fwdrev_grad(loss)(w)
        v = 0.9 * v + 0.1 * g**2
        return (w - lr * g / (jnp.sqrt(v) + 1e-3), v), jnp.sum(g)

    step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)

    def run(scan, w0, xs):
        (w, v), ys = scan(step, (w0, jnp.zeros(3)), xs)
        return jnp.sum(w**2) + jnp.sum(v) + jnp.sum(jnp.sin(ys))

    ours = functools.partial(memento.scan, memory=2, policy="hsm", executor=executor)
    got = jax.jit(jax.grad(functools.partial(run, ours), (0, 1)))(w0, xs)
    want = jax.jit(jax.grad(functools.partial(run, lax.scan), (0, 1)))(w0, xs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert float(jnp.max(jnp.abs(want[1]))) > 0.1  # a gradient worth comparing
    body = memento.loops._body.make_body(step, (w0, jnp.zeros(3)), xs[0], name="test")
    spec = body.restrict([False] * len(body.consts), [True, True], [True]).residual_spec()
    assert any(c is data for c in spec.captured)
    assert all(s.shape != data.shape for s in spec.stored)


def _weights_and_inputs(seed: int, *, width: int, steps: int, scale: float):
    """``(w, xs, h0)`` in float64: a ``width`` x ``width`` weight (normal / ``scale``),
    ``steps`` inputs and an initial carry."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(k[0], (width, width), jnp.float64) / scale
    xs = jax.random.normal(k[1], (steps, width), jnp.float64)
    return w, xs, jax.random.normal(k[2], (width,), jnp.float64)


def test_a_step_is_linearized_once_where_its_residuals_are_probed(monkeypatch):
    # Every later step of every segment evaluates the probe's own trace (its carry, ys and
    # stored residuals): the step is not linearized again per segment, which the first
    # call would pay for in tracing. A captured array, an integer leaf and a residual of
    # the weights alone are among the step's residuals.
    from memento.loops import _body

    calls = []
    linearize = _body.Body.linearize
    monkeypatch.setattr(
        _body.Body, "linearize", lambda self, *a: calls.append(1) or linearize(self, *a)
    )
    w, xs, h0 = _weights_and_inputs(3, width=8, steps=300, scale=3)
    table = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float64)

    @jax.checkpoint
    def inner(h):
        return jnp.sin(h) * table

    def cell_of(w):
        def cell(c, x):
            i, h = c
            h = jnp.tanh((w.T * 0.9) @ inner(h) + x * jnp.cos(0.01 * i))
            return (i + 1, h), h[0]

        return cell

    def loss(scan_fn, w, h0, xs):
        (_, h), ys = scan_fn(cell_of(w), (jnp.int32(0), h0), xs)
        return jnp.sum(h) + jnp.sum(ys**2)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    want = grad(lax.scan, w, h0, xs)
    plan = memento.explain(cell_of(w), (jnp.int32(0), h0), xs, memory=40, executor="static")
    assert plan.policy == "nest"  # segments run again, each step's residuals saved anew
    calls.clear()
    got = grad(budgeted(memory=40, executor="static"), w, h0, xs)
    assert_trees_close(got, want)
    assert len(calls) == 1


@pytest.mark.parametrize("executor", ["static", "rows", "recursion"])
def test_residuals_of_the_weights_alone_are_computed_again_not_stored_per_step(executor):
    # The step transposes, scales and indexes its weights. Those residuals are the same in
    # every step: lax.scan hoists them out of its loop, and memento computes them again
    # where it rebuilds a step's pullback instead of storing a copy per step.
    w, xs, h0 = _weights_and_inputs(0, width=32, steps=200, scale=6)
    p = jnp.array([0.9, 0.5], jnp.float64)

    def loss(scan_fn, w, p, h0, xs):
        def cell(h, x):
            h = jnp.tanh(p[0] * ((w.T * jnp.exp(p[1])) @ h) + p[1] * x)
            return h, jnp.sum(h * h)

        h, ys = scan_fn(cell, h0, xs)
        return jnp.sum(h) + jnp.sum(ys)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4)), static_argnums=0)
    want = grad(lax.scan, w, p, h0, xs)
    run = budgeted(memory="40%", executor=executor)
    assert_trees_close(grad(run, w, p, h0, xs), want)

    def cell(h, x):
        return jnp.tanh(p[0] * ((w.T * jnp.exp(p[1])) @ h) + p[1] * x), h

    plan = memento.explain(cell, h0, xs, memory="40%", executor=executor)
    # Stored per step: a few vectors of 32 (alpha carry slots); the scaled w.T alone
    # would be 32 carries.
    assert plan.schedule.alpha < 8
    temp = {
        name: jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
        .lower(fn, w, p, h0, xs)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for name, fn in [
            ("scan", lax.scan),
            ("memento", budgeted(memory="100%", executor=executor)),
        ]
    }
    assert temp["memento"] <= temp["scan"] * 1.05 + 4096, temp


@pytest.mark.parametrize("executor", ["static", "rows", "recursion"])
def test_residuals_computed_again_keep_hessians_jvp_of_grad_and_vmap_exact(executor):
    # The weight-only residuals computed again in the backward pass carry their tangents:
    # forward-over-reverse and vmap of the gradient equal lax.scan's in float64.
    w, xs, h0 = _weights_and_inputs(1, width=5, steps=30, scale=3)
    p = jnp.array([0.9, 0.5], jnp.float64)

    def loss(scan_fn, w, xs):
        def cell(h, x):
            return jnp.tanh(p[0] * ((w.T * jnp.exp(p[1])) @ h) + p[1] * x), jnp.sum(h * h)

        h, ys = scan_fn(cell, h0, xs)
        return jnp.sum(h) + jnp.sum(ys)

    def derivatives(scan_fn):
        def grad_w(w, xs=xs):
            return jax.grad(loss, argnums=1)(scan_fn, w, xs)

        return (
            jax.hessian(loss, argnums=2)(scan_fn, w, xs),
            jax.jvp(grad_w, (w,), (jnp.ones_like(w),))[1],
            jax.vmap(lambda x: grad_w(w, x))(jnp.stack([xs, 0.5 * xs])),
        )

    got = derivatives(budgeted(memory="30%", executor=executor))
    assert_trees_close(got, derivatives(lax.scan), rtol=1e-10, atol=1e-10)
