"""memento.torch.scan against plain autograd (float64), evaluation counts, edge cases."""

import pytest

torch = pytest.importorskip("torch")

import memento  # noqa: E402
import memento.torch as mt  # noqa: E402

D = torch.float64
POLICIES = ["hsm", "ism", "msm", "auto"]


class Counted:
    """A tanh RNN step closing over W (leaf) and b (non-leaf), counting evaluations."""

    def __init__(self, n=4, dtype=D, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.W = (0.5 * torch.randn(n, n, generator=g, dtype=dtype)).requires_grad_()
        self.b0 = torch.randn(n, generator=g, dtype=dtype, requires_grad=True)
        self.calls = 0

    def __call__(self, h, x):
        self.calls += 1
        b = self.b0 * 2  # a closed-over tensor computed outside would be self.b
        h = torch.tanh(self.W @ h + x + b)
        return h, (h**2).sum()


def reference(step, h0, xs):
    h, ys = h0, []
    for x in xs:
        h, y = step(h, x)
        ys.append(y)
    return h, torch.stack(ys) if ys else torch.zeros(0, dtype=h0.dtype)


def grads_of(fn, inputs):
    h, ys = fn()
    loss = (h * torch.arange(1, h.numel() + 1, dtype=h.dtype).reshape(h.shape)).sum() + (
        ys**3
    ).sum()
    return torch.autograd.grad(loss, inputs)


def problem(T, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(n, generator=g, dtype=D, requires_grad=True)
    xs = torch.randn(T, n, generator=g, dtype=D, requires_grad=True)
    return h0, xs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T", [1, 2, 13])
def test_gradients_equal_autograd_every_budget_and_counts_equal_cost(policy, T):
    step = Counted()
    h0, xs = problem(T)
    inputs = [h0, xs, step.W, step.b0]
    expect = grads_of(lambda: reference(step, h0, xs), inputs)
    alpha = mt.scan_schedule(step, h0, xs, memory=1, policy="msm").alpha
    for memory in [1, 2, 3, alpha, 2 * alpha + 1, T * alpha + 1, "1GiB"]:
        if policy == "ism" and isinstance(memory, int) and memory < alpha:
            continue
        schedule = mt.scan_schedule(step, h0, xs, memory=memory, policy=policy)
        schedule.simulate()
        step.calls = 0
        got = grads_of(lambda m=memory: mt.scan(step, h0, xs, memory=m, policy=policy), inputs)
        assert step.calls == schedule.cost, (memory, schedule)
        for a, b in zip(got, expect):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_budget_above_need_is_capped_and_stores_everything():
    step = Counted()
    h0, xs = problem(20)
    s = mt.scan_schedule(step, h0, xs, memory="1TiB", policy="msm")
    assert s.memory == 20 * s.alpha + 1
    assert s.cost == 20  # every step evaluated once: all internal states kept
    assert mt.scan_schedule(step, h0, xs, memory=10**9, policy="hsm").cost == 2 * 20 - 1


def test_byte_budget_is_slots_of_the_carry():
    step = Counted()
    h0, xs = problem(12)
    carry = 4 * 8
    for memory in [f"{3 * carry}B", memento.bytes_budget(3 * carry)]:
        assert mt.scan_schedule(step, h0, xs, memory=memory, policy="hsm").memory == 3
    with pytest.raises(ValueError, match="cannot hold even one carry of 32 bytes"):
        mt.scan(step, h0, xs, memory="16B")


def test_alpha_is_measured_from_the_saved_tensors():
    # matmul saves its input h (32 B, W is a parameter: not counted), tanh its output
    # (the carry), y = sum(h^2) saves h (the carry) and y is 8 B: (32 + 8 + 32) / 32 -> 3.
    step = Counted()
    h0, xs = problem(5)
    assert mt.scan_schedule(step, h0, xs, memory=4, policy="msm").alpha == 3

    # A wide internal state: a 16x hidden layer inside the step.
    V = torch.randn(64, 4, dtype=D, requires_grad=True)

    def wide(h, x):
        z = torch.tanh(V @ h)  # saves its 64-float output
        return torch.tanh(V.T @ z + x), None

    assert mt.scan_schedule(wide, h0, xs, memory=4, policy="msm").alpha >= 16


def test_zero_steps():
    step = Counted()
    h0 = torch.randn(4, dtype=D, requires_grad=True)
    xs = torch.zeros(0, 4, dtype=D, requires_grad=True)
    h, ys = mt.scan(step, h0, xs, memory=2)
    assert h is h0 and ys.shape == (0,)
    h.sum().backward()
    torch.testing.assert_close(h0.grad, torch.ones(4, dtype=D))
    with pytest.raises(ValueError, match="0 steps"):
        mt.scan_schedule(step, h0, xs, memory=2)


def test_pytrees_and_integer_leaves():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(3, 3, generator=g, dtype=D, requires_grad=True)
    h0 = {"h": (torch.randn(3, generator=g, dtype=D, requires_grad=True),), "k": torch.tensor(0)}
    xs = [torch.randn(7, 3, generator=g, dtype=D, requires_grad=True), torch.arange(7)]

    def step(carry, x):
        (h,) = carry["h"]
        u, i = x
        h = torch.sin(A @ h) * u + i
        return {"h": (h,), "k": carry["k"] + i}, {"sq": h**2, "n": [h.sum()]}

    def loss(out):
        c, ys = out
        return (c["h"][0] ** 2).sum() + ys["sq"].sum() + (ys["n"][0] ** 2).sum()

    inputs = [A, h0["h"][0], xs[0]]
    expect = torch.autograd.grad(loss(reference_tree(step, h0, xs)), inputs)
    alpha = mt.scan_schedule(step, h0, xs, memory=1, policy="msm").alpha
    for policy in POLICIES:
        for memory in [1, 3, alpha, 100]:
            if policy == "ism" and memory < alpha:
                continue
            out = mt.scan(step, h0, xs, memory=memory, policy=policy)
            assert out[0]["k"].item() == sum(range(7)) and out[0]["k"].dtype == torch.int64
            for a, b in zip(torch.autograd.grad(loss(out), inputs), expect):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("policy", ["ism", "msm"])
def test_runs_of_backward_steps_are_one_autograd_call(policy, monkeypatch):
    """Steps marked by `backward_runs` are recorded on the graph below them and
    back-propagated together: one torch.autograd.grad a run, the same gradients and the
    same evaluations. The carry has a leaf passed through unchanged, an integer leaf and
    a leaf needing no grad; y is a carry leaf."""
    g = torch.Generator().manual_seed(5)
    A = torch.randn(3, 3, generator=g, dtype=D, requires_grad=True)
    h0 = (torch.randn(3, generator=g, dtype=D, requires_grad=True), torch.randn(3, dtype=D))
    h0 = (*h0, torch.tensor(0), torch.zeros(2, dtype=D))
    xs = torch.randn(40, 3, generator=g, dtype=D, requires_grad=True)
    calls = {"step": 0, "grad": 0}

    def step(carry, x):
        calls["step"] += 1
        h, keep, k, z = carry
        h = torch.tanh(A @ h + x * keep)
        return (h, keep, k + 1, z + 1), h

    def loss(out):
        (h, keep, _, _), ys = out
        return (h**2).sum() + (ys**3).sum() + keep.sum()

    inputs = [A, h0[0], xs]
    expect = torch.autograd.grad(loss(reference_tuple(step, h0, xs)), inputs)
    grad = torch.autograd.grad

    def counted(*args, **kwargs):
        calls["grad"] += 1
        return grad(*args, **kwargs)

    alpha = mt.scan_schedule(step, h0, xs, memory=1, policy="msm").alpha
    for memory in [alpha, 2 * alpha + 1, 6 * alpha, 40 * alpha + 1]:
        s = mt.scan_schedule(step, h0, xs, memory=memory, policy=policy)
        marks = memento.planning.internals.backward_runs(s)
        if memory == 40 * alpha + 1:
            assert marks.sum() == 39  # everything stored: a single reverse pass
        calls.update(step=0, grad=0)
        out = mt.scan(step, h0, xs, memory=memory, policy=policy)
        monkeypatch.setattr(torch.autograd, "grad", counted)
        got = torch.autograd.grad(loss(out), inputs)
        monkeypatch.setattr(torch.autograd, "grad", grad)
        assert calls["step"] == s.cost
        assert calls["grad"] == 1 + 40 - int(marks.sum())  # the caller's, then one a run
        for a, b in zip(got, expect):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def reference_tuple(step, h, xs):
    ys = []
    for x in xs:
        h, y = step(h, x)
        ys.append(y)
    return h, torch.stack(ys)


def reference_tree(step, h, xs):
    ys = []
    for p in range(xs[0].shape[0]):
        h, y = step(h, [x[p] for x in xs])
        ys.append(y)
    return h, {
        "sq": torch.stack([y["sq"] for y in ys]),
        "n": [torch.stack([y["n"][0] for y in ys])],
    }


@pytest.mark.parametrize("wrt", ["h0", "xs", "params", "h0+xs"])
def test_requires_grad_on_any_subset(wrt):
    W = torch.randn(4, 4, dtype=D, requires_grad="params" in wrt)
    h0 = torch.randn(4, dtype=D, requires_grad="h0" in wrt)
    xs = torch.randn(9, 4, dtype=D, requires_grad="xs" in wrt)

    def step(h, x):
        return torch.tanh(W @ h + x), h.sum()

    inputs = [t for t in (W, h0, xs) if t.requires_grad]
    expect = grads_of(lambda: reference(step, h0, xs), inputs)
    got = grads_of(lambda: mt.scan(step, h0, xs, memory=3, policy="msm"), inputs)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_no_storage_without_grad(mode):
    W = torch.randn(4, 4, dtype=D, requires_grad=mode != "nothing_requires_grad")
    calls = []

    def step(h, x):
        calls.append(1)
        return torch.tanh(W @ h + x), h

    h0, xs = torch.randn(4, dtype=D), torch.randn(11, 4, dtype=D)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad
    )
    with ctx():
        h, ys = mt.scan(step, h0, xs, memory=2)
    assert h.grad_fn is None and ys.grad_fn is None and not h.requires_grad
    assert len(calls) == 11  # each step once: nothing stored, nothing recomputed
    torch.testing.assert_close(h, reference(step, h0, xs)[0].detach())


def test_lstm_module_parameters_and_float32():
    torch.manual_seed(0)
    for dtype, tol in [(torch.float64, 1e-12), (torch.float32, 1e-5)]:
        cell = torch.nn.LSTMCell(3, 5).to(dtype)
        xs = torch.randn(16, 2, 3, dtype=dtype, requires_grad=True)
        h0 = (torch.zeros(2, 5, dtype=dtype), torch.zeros(2, 5, dtype=dtype))

        def step(hc, x, cell=cell):
            h, c = cell(x, hc)
            return (h, c), h

        inputs = [xs, *cell.parameters()]
        expect = grads_of(lambda s=step, h=h0, x=xs: ref_pair(s, h, x), inputs)
        for policy in POLICIES:
            got = grads_of(
                lambda p=policy, s=step, h=h0, x=xs: flat_h(mt.scan(s, h, x, memory=6, policy=p)),
                inputs,
            )
            for a, b in zip(got, expect):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def ref_pair(step, h, xs):
    ys = []
    for x in xs:
        h, y = step(h, x)
        ys.append(y)
    return h[1], torch.stack(ys)


def flat_h(out):
    return out[0][1], out[1]


def test_gradcheck_tiny():
    W = torch.randn(2, 2, dtype=D, requires_grad=True)

    for policy, memory in [("hsm", 1), ("ism", 3), ("msm", 2), ("auto", 100)]:

        def f(h0, xs, W=W, policy=policy, memory=memory):
            def step(h, x):
                h = torch.tanh(W @ h + x)
                return h, h.prod()

            h, ys = mt.scan(step, h0, xs, memory=memory, policy=policy)
            return h, ys

        h0 = torch.randn(2, dtype=D, requires_grad=True)
        xs = torch.randn(4, 2, dtype=D, requires_grad=True)
        assert torch.autograd.gradcheck(f, (h0, xs))
        assert torch.autograd.gradcheck(lambda W, h=h0, x=xs, f=f: f(h, x, W=W), (W,))


def test_nan_and_negative_zero_cotangents_pass_through():
    step = Counted()
    h0, xs = problem(5)
    h, ys = mt.scan(step, h0, xs, memory=2, policy="hsm")
    gh, gx = torch.autograd.grad(
        (h, ys),
        (h0, xs),
        (torch.full((4,), -0.0, dtype=D), torch.full((5,), float("nan"), dtype=D)),
    )
    assert torch.isnan(gx[:5]).any() and torch.isnan(gh).all()


def test_errors():
    step = Counted()
    h0, xs = problem(5)
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        mt.scan(step, h0, xs, memory=2, policy="fast")
    with pytest.raises(ValueError, match="cannot read memory='lots'"):
        mt.scan(step, h0, xs, memory="lots")
    with pytest.raises(ValueError, match="memory=0 slots is too small"):
        mt.scan(step, h0, xs, memory=0)
    with pytest.raises(ValueError, match="policy='ism' needs room for one internal state, 3"):
        mt.scan(step, h0, xs, memory=2, policy="ism")
    with pytest.raises(TypeError, match="changed carry leaf 0 from shape"):
        mt.scan(lambda h, x: (h[:2], None), h0, xs, memory=2)
    with pytest.raises(TypeError, match="another structure than h0"):
        mt.scan(lambda h, x: ((h, h), None), h0, xs, memory=2)
    with pytest.raises(TypeError, match=r"h0\[1\] is a float, not a tensor"):
        mt.scan(step, (h0, 1.0), xs, memory=2)
    with pytest.raises(TypeError, match="must return a pair"):
        mt.scan(lambda h, x: h, h0, xs, memory=2)
    with pytest.raises(ValueError, match="disagree on the number of steps"):
        mt.scan(step, h0, (xs, xs[:3]), memory=2)
    with pytest.raises(TypeError, match="step must be callable"):
        mt.scan(3, h0, xs, memory=2)


def test_torch_func_transforms_raise():
    step = Counted()
    h0, xs = problem(4)

    def f(h):
        return mt.scan(step, h, xs.detach(), memory=2)[0].sum()

    with pytest.raises(NotImplementedError, match=r"does not run under torch\.func"):
        torch.func.grad(f)(h0.detach())
    with pytest.raises(NotImplementedError, match=r"does not run under torch\.func"):
        torch.func.vmap(f)(h0.detach()[None])


def test_second_order_raises_and_a_second_backward_sweeps_again():
    step = Counted()
    h0, xs = problem(4)
    h, _ = mt.scan(step, h0, xs, memory=2)
    with pytest.raises(NotImplementedError, match="first order only"):
        torch.autograd.grad(h.sum(), h0, create_graph=True)
    h, _ = mt.scan(step, h0, xs, memory=2, policy="hsm")
    first = torch.autograd.grad(h.sum(), h0, retain_graph=True)[0]
    step.calls = 0
    again = torch.autograd.grad(h.sum(), h0)[0]
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    s = mt.scan_schedule(step, h0, xs, memory=2, policy="hsm")
    assert step.calls == s.cost + 1  # the schedule again, and scan_schedule's probe


def test_torch_compile_runs_the_scan_eagerly():
    step = Counted()
    h0, xs = problem(6)

    def f(h0, xs):
        h, ys = mt.scan(step, h0, xs, memory=2)
        return h.sum() + ys.sum()

    inputs = [h0, xs, step.W, step.b0]
    expect = torch.autograd.grad(f(h0, xs), inputs)
    got = torch.autograd.grad(torch.compile(f, backend="eager")(h0, xs), inputs)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_memory_none_is_plain_autograd():
    step = Counted()
    h0, xs = problem(6)
    inputs = [h0, xs, step.W, step.b0]
    expect = grads_of(lambda: reference(step, h0, xs), inputs)
    got = grads_of(lambda: mt.scan(step, h0, xs, memory=None), inputs)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b)


def test_import_memento_stays_numpy_only():
    import subprocess
    import sys

    code = (
        "import sys, memento, memento.planning; print('torch' in sys.modules, 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    code = "import sys, memento.torch; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_no_tensor_waits_for_the_garbage_collector():
    """Stored states are released by reference counting, as the schedule frees them: no
    reference cycle holds a tensor (one did: a recursive closure in the pytree code)."""
    import gc

    step = Counted()
    h0, xs = problem(12)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for policy in POLICIES:
            h, ys = mt.scan(step, h0, xs, memory=4, policy=policy)
            (h.sum() + ys.sum()).backward()
        mt.checkpoint_sequential([torch.tanh, torch.sin, torch.cos], h0, memory=1).sum().backward()
        gc.collect()
        leaked = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == []


def test_auto_charges_nothing_for_a_kept_graph():
    # The H200 run (benchmarks/results/gpu/torch_rnn.json): an LSTM step of alpha 8 at
    # 1779 slots for 1000 steps was planned as HSM (every carry kept, 1,000 one-step
    # backward calls, 2.05x plain autograd) where 355 slots, MSM, took 1.45x. JAX's
    # charge for storing an internal state (a pool copy) made ISM look dearer than HSM;
    # memento.torch keeps the step's graph and copies nothing, so it charges nothing.
    def step(h, x):  # eight tanh outputs saved: alpha 9
        for _ in range(8):
            h = torch.tanh(h + x)
        return h, None

    h0, xs = torch.zeros(4, dtype=D), torch.zeros(1000, 4, dtype=D)
    s = mt.scan_schedule(step, h0, xs, memory=1779)
    assert s.alpha == 9 and s.memory == 1779
    assert s.policy == "ism"
    runs = 1000 - int(memento.planning.internals.backward_runs(s).sum())
    assert runs < 10 and s.cost < 2 * 1000 - 1  # HSM's: 1,999 evaluations, 1,000 runs
    # JAX's executors copy internal states to a pool: the same planner charges for it.
    jax_pick = memento.planning.internals.choose_schedule(1000, 1779, 9, "auto", name="t")
    assert jax_pick.policy == "hsm"
