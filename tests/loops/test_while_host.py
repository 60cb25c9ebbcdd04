"""memento.while_loop with a host level (host_memory=): gradients, evaluations, placement.

The forward pass keeps its online checkpoints in host slots; the backward pass reverses
each host interval from its first carry, copied back, by the device recursion. Checked
here against the unrolled loop in float64: host budgets from one slot to every carry,
device budgets from one slot, loops that stop early, after 0 or 1 step or at max_steps;
the body evaluations against `planning.online_evaluations`; vmap with members stopping
at their own steps; a nested loop writing an outer buffer; forward over reverse; the
placement of the host slots, by lowering for a GPU platform on the CPU; the errors.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_scan_host import _cuda_text, _placements
from test_while_loop import (  # noqa: F401 (x64: float64, autouse)
    ROWS,
    H,
    assert_close,
    cell,
    nested_saving_loss,
    params,
    x64,
)

import memento
from memento import planning
from memento.planning import internals

MAX = 12


def loss_while(w, b, h0, n, *, memory, host, max_steps=MAX):
    """A pytree carry with an int leaf, w closed over by the body, the stopping count n
    (traced) by the predicate."""

    def body(s):
        i, (h, acc) = s
        h = cell(w, b, h)
        return i + 1, (h, acc + jnp.sum(h) * 0.1)

    i, (h, acc) = memento.while_loop(
        lambda s: s[0] < n, body, (0, (h0, 0.0)), max_steps=max_steps, memory=memory,
        host_memory=host,
    )  # fmt: skip
    return jnp.sum(jnp.sin(h)) + acc**2, i


@functools.cache
def reference(n):
    """The gradient of the loop unrolled for n steps (a ``lax.scan`` of fixed length)."""

    def loss(w, b, h0):
        def step(c, _):
            h, acc = c
            h = cell(w, b, h)
            return (h, acc + jnp.sum(h) * 0.1), None

        (h, acc), _ = lax.scan(step, (h0, 0.0), None, length=n)
        return jnp.sum(jnp.sin(h)) + acc**2

    return jax.grad(loss, argnums=(0, 1, 2))(*params())


GRAD = jax.jit(
    jax.grad(loss_while, argnums=(0, 1, 2), has_aux=True),
    static_argnames=("memory", "host", "max_steps"),
)


# With memory=4 and one host slot the loop runs on the device alone (fewer host slots
# than device ones; see test_few_host_slots_leave_the_device_loop_as_it_is), so that
# case is the one-level loop's: still checked.
@pytest.mark.parametrize("host", [1, 3, math.inf])
@pytest.mark.parametrize("memory", [1, 2, 4])
def test_gradients_equal_unrolled(host, memory):
    w, b, h0 = params()
    for n in (0, 1, 2, 7, MAX, 40):  # 40 stops at max_steps
        g, i = GRAD(w, b, h0, n, memory=memory, host=host)
        assert int(i) == min(n, MAX)
        assert_close(g, reference(min(n, MAX)))


def counting_loss(counts, *, memory, host, max_steps):
    w, b, _ = params()

    def bump():
        counts[0] += 1

    def body(s):
        i, h = s
        jax.debug.callback(bump)
        return i + 1, cell(w, b, h)

    @jax.jit
    def grad(h0, n):
        def loss(h0):
            _, h = memento.while_loop(
                lambda s: s[0] < n, body, (0, h0), max_steps=max_steps, memory=memory,
                host_memory=host,
            )  # fmt: skip
            return jnp.sum(h)

        return jax.grad(loss)(h0)

    return grad


def test_the_documented_evaluation_counts():
    # The while_loop docstring's and the README's numbers: 1000 steps at memory=4.
    counts = [planning.online_evaluations(4, 1000, host_memory=h) for h in (0, 8, 32, 1000)]
    assert counts == [9376, 7146, 4559, 2000]


def test_a_host_that_keeps_every_carry_costs_2n_by_the_policy_too():
    # online_evaluations answers 2n for host_memory >= n without running the policy (for
    # 1001 slots up to the default cap that took 5 minutes): the policy agrees.
    for host in range(1, 13):
        for n in range(1, host + 1):
            for cap in (n, 40, None):
                kw = {} if cap is None else {"cap": cap}
                events = planning.online_events(host + 1, **kw)
                ps = [*internals.checkpoints_at(events, n), n]
                assert ps == list(range(n + 1)), (host, n, cap)  # every carry kept
                assert planning.online_evaluations(3, n, host_memory=host, **kw) == 2 * n


@pytest.mark.parametrize("host, memory", [(1, 1), (3, 2), (3, 4), (8, 3), (math.inf, 3)])
def test_evaluations_equal_the_two_level_model(host, memory):
    # n forward, then each host interval reversed with `memory` device slots: with every
    # carry on the host, 2n (each step once forward, once in its VJP: nothing recomputed).
    max_steps = 60
    counts = [0]
    grad = counting_loss(counts, memory=memory, host=host, max_steps=max_steps)
    h0 = params()[2]
    for n in (0, 1, 2, 9, 33, 60):
        counts[0] = 0
        jax.block_until_ready(grad(h0, n))
        if host == math.inf:
            assert counts[0] == 2 * n, n
        else:
            model = planning.online_evaluations(memory, n, max_steps, host_memory=host)
            assert counts[0] == model, (n, counts[0], model)
            # Never more than recomputing every interval from h_0 alone would cost.
            assert counts[0] <= planning.online_evaluations(1, n, max_steps)


def test_few_host_slots_leave_the_device_loop_as_it_is(monkeypatch):
    # A host level runs only when it keeps as many carries as the device would
    # (host_memory >= memory - 1); below, and with host_memory 0 or None, the program
    # is the one-level loop's.
    monkeypatch.delenv("MEMENTO_CHECKS", raising=False)  # no checks' callbacks to lower
    w, b, h0 = params()

    def text(**kw):
        return _cuda_text(jax.grad(lambda h0: loss_while(w, b, h0, 5, **kw)[0]), h0)

    one = text(memory=5, host=None)
    assert "pinned_host" not in one
    assert text(memory=5, host=0) == one
    assert text(memory=5, host=3) == one
    assert "pinned_host" in text(memory=5, host=4)
    assert "pinned_host" in text(memory=5, host=memento.bytes_budget(4 * (3 * 8 + 2 * 8)))
    # A device budget that keeps every carry needs no host level.
    assert "pinned_host" not in text(memory=MAX + 1, host=math.inf)


def test_vmap_members_stop_at_their_own_steps():
    w, b, h0 = params()
    ns = jnp.array([0, 3, 11, 5, 1])
    h0s = jnp.stack([h0, -h0, 2 * h0, h0 + 1, 0.5 * h0])

    def one(h0, n):
        return jax.grad(loss_while, argnums=(0, 2), has_aux=True)(
            w, b, h0, n, memory=2, host=2, max_steps=MAX
        )

    (gw, gh), i = jax.jit(jax.vmap(one))(h0s, ns)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ns))
    for k, n in enumerate(ns.tolist()):

        def ref(w, h0, n=n):
            h, acc = h0, 0.0
            for _ in range(n):
                h = cell(w, b, h)
                acc = acc + jnp.sum(h) * 0.1
            return jnp.sum(jnp.sin(h)) + acc**2

        assert_close((gw[k], gh[k]), jax.grad(ref, argnums=(0, 1))(w, h0s[k]))


@functools.cache
def nested_reference(n):
    w, b, h0 = params()
    loss = functools.partial(nested_saving_loss, steps=None, n=n)  # unrolled in Python
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(w, b, h0, jnp.full((ROWS, H), 0.5))


@pytest.mark.parametrize("host", [1, math.inf])
def test_nested_loop_writes_an_outer_buffer(host):
    # Step k writes k % 4 rows from a nested memento.while_loop into the outer loop's
    # buffer, one under a predicate (test_while_loop.py's case, the outer loop on two
    # levels).
    w, b, h0 = params()
    buf0 = jnp.full((ROWS, H), 0.5)
    grad = jax.grad(nested_saving_loss, argnums=(0, 1, 2, 3))
    kw = dict(steps=MAX, memory=2, inner_memory=1, host_memory=host)
    ours = jax.jit(functools.partial(grad, **kw))  # n traced: one compilation
    for n in (0, 9):
        assert_close(ours(w, b, h0, buf0, n=jnp.int32(n)), nested_reference(n))


def test_forward_over_reverse_and_truncation():
    # jax.hessian: the host slots stay on the device under the outer jvp (as memento.scan's).
    w, b, h0 = params()

    def f(h0, host):
        def body(s):
            return s[0] + 1, cell(w, b, s[1])

        (_, h), truncated = memento.while_loop(
            lambda s: s[0] < 20, body, (0, h0), max_steps=6, memory=2, host_memory=host,
            return_truncated=True,
        )  # fmt: skip
        return jnp.sum(jnp.sin(h)), truncated

    def ref(h0):
        for _ in range(6):
            h0 = cell(w, b, h0)
        return jnp.sum(jnp.sin(h0))

    assert_close(jax.jit(jax.hessian(lambda h: f(h, 2)[0]))(h0), jax.hessian(ref)(h0))
    for host in (2, math.inf):
        assert bool(f(h0, host)[1])


# -- placement: the lowered module for a GPU, on the CPU -----------------------------------


@pytest.mark.parametrize("host", [None, 2, math.inf])
def test_host_stores_and_loads_are_placed_on_the_host(monkeypatch, host):
    # A one-leaf carry (the predicate reads it): one host pool, placed on the host; one
    # store to it in the forward loop and one copy back in the backward one.
    monkeypatch.delenv("MEMENTO_CHECKS", raising=False)  # no tags: one leaf per carry
    W = jnp.eye(8) * 0.5
    f = lambda h: jnp.tanh(W @ h + 0.1)

    def loss(h0):
        h = memento.while_loop(
            lambda h: jnp.sum(h) > 0.2, f, h0, max_steps=30, memory=2, host_memory=host
        )
        return jnp.sum(h**2)

    text = _cuda_text(jax.grad(loss), jnp.ones(8))
    pools, stores, loads = (0, 0, 0) if host is None else (1, 1, 1)
    assert _placements(text, "pinned_host") == pools + stores
    assert _placements(text, "device") == loads


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(memory=2, host_memory=-1), ValueError, "host_memory=-1 slots is negative"),
        (dict(memory=2, host_memory=math.inf), ValueError, "pass max_steps or a finite host_memory"),
        (dict(memory=2, host_memory=4, transfer_cost=0.5), TypeError, "drop transfer_cost"),
        (dict(memory=2, transfer_cost=0.5), TypeError, "drop transfer_cost"),
        (dict(memory=None, max_steps=9, host_memory=4), ValueError, "needs a device budget"),
        (dict(memory=2, host_memory=2.5), TypeError, "host_memory must be None, an int"),
        (dict(memory=2, host_memory="1B"), ValueError, "host_memory=1 bytes holds no carry"),
        (dict(memory=2, host_memory="abc"), ValueError, "cannot read host_memory='abc'"),
        (dict(memory=2, host_memory="0B"), ValueError, "host_memory='0B' is 0 bytes"),
        (dict(memory="abc", host_memory=2), ValueError, "cannot read memory='abc'"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(kw, error, match):
    with pytest.raises(error, match=r"memento\.while_loop: .*" + re.escape(match)):
        memento.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0, **kw)


def test_host_budgets_above_the_policy_cap_warn():
    w, b, h0 = params()
    with pytest.warns(UserWarning, match=r"host_memory=200 slots .* 128"):
        g, i = GRAD(w, b, h0, 7, memory=2, host=200, max_steps=300)
    assert int(i) == 7
    assert_close(g, reference(7))


def test_device_memory_is_the_one_level_loops_plus_the_host_pools():
    # As test_scan_host's: on the CPU host memory is the same RAM and XLA:CPU counts the
    # host pools in its temporary bytes; a GPU reports them apart. Less the host pools, a
    # host level takes at most the one-level loop's bytes at the same device budget,
    # within a few carries (the carry copied back per interval, the interval's fresh
    # device stack) and a few int32 words per host slot (the kept stack's positions and
    # slot order, sorted once). A 16 KiB carry, as there: with 512 bytes the loops'
    # control state alone came to 14 carries on an H200.
    n = 2048
    W = jnp.full(n, 0.5)
    carry = n * 8

    def temp(**kw):  # (device bytes, host bytes) of the gradient's temporaries
        def loss(h0):
            body = lambda s: (s[0] + 1, jnp.tanh(W * s[1] + 0.01))
            _, h = memento.while_loop(lambda s: s[0] < 200, body, (0, h0), max_steps=200, **kw)
            return jnp.sum(h)

        m = jax.jit(jax.grad(loss)).lower(jnp.ones(n)).compile().memory_analysis()
        return m.temp_size_in_bytes, getattr(m, "host_temp_size_in_bytes", 0) or 0

    one, _ = temp(memory=4)
    for host in (5, 20, math.inf):
        two, two_host = temp(memory=4, host_memory=host)
        host_slots = 200 if host == math.inf else host
        host_bytes = host_slots * carry
        if two_host == 0:  # the CPU: the host pools are counted in the temporary bytes
            two, two_host = two - host_bytes, host_bytes
        assert two_host >= host_bytes  # the host pools are really allocated
        assert two <= one + 4 * carry + 32 * host_slots, (host, one, two)


def test_extremes_terabytes_empty_leaves_weak_types_nan_and_negative_zero():
    # A terabyte host budget (every carry with max_steps; capped at the policy's 128 slots,
    # with a warning, without); a carry with a zero-size leaf, a weakly typed float (typed
    # as lax.while_loop types it) and an int; jvp of grad; NaN and -0 cotangents: all as
    # the unrolled loop's, bit for bit where the values are special.
    w, b, h0 = params()

    def body(s):
        i, h, empty, acc = s
        h = cell(w, b, h)
        return i + 1, h, empty * 2.0, acc + jnp.sum(h)

    def f(h0, scale, *, max_steps, **kw):
        init = (0, h0, jnp.zeros((0, 2)), 0.0)  # acc: a weakly typed Python float
        _, h, empty, acc = memento.while_loop(
            lambda s: s[0] < 9, body, init, max_steps=max_steps, memory=2, **kw
        )
        lax_acc = lax.while_loop(lambda s: s[0] < 9, body, init)[3]
        assert empty.shape == (0, 2) and jax.typeof(acc) == jax.typeof(lax_acc)
        return jnp.sum(h * scale) + acc

    def ref(h0, scale):
        h, acc = h0, 0.0
        for _ in range(9):
            h = cell(w, b, h)
            acc = acc + jnp.sum(h)
        return jnp.sum(h * scale) + acc

    scale = jnp.array([1.0, jnp.nan, -0.0])  # a NaN and a -0 in the output's cotangent
    want = jax.grad(ref)(h0, scale)
    v = jnp.ones_like(h0)
    want_jvp = jax.jvp(lambda h: jax.grad(ref)(h, jnp.ones(3)), (h0,), (v,))
    for max_steps, host in ((12, "1TiB"), (None, "1TiB"), (12, 2)):
        kw = dict(max_steps=max_steps, host_memory=host)
        grad = jax.jit(jax.grad(functools.partial(f, scale=scale, **kw)))
        if max_steps is None:
            with pytest.warns(UserWarning, match=r"128"):
                got = grad(h0)
        else:
            got = grad(h0)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        assert_close(jnp.nan_to_num(got), jnp.nan_to_num(want))
        if max_steps is not None:
            g = jax.grad(functools.partial(f, scale=jnp.ones(3), **kw))
            assert_close(jax.jit(functools.partial(jax.jvp, g))((h0,), (v,)), want_jvp)
