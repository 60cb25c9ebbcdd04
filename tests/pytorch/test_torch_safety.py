"""memento.torch on ordinary modules, as torch.utils.checkpoint handles them: dropout,
autocast, in-place operations, BatchNorm buffers, late parameters, steps that
differentiate, weights modified before backward; against plain autograd in float64."""

import pytest

torch = pytest.importorskip("torch")

import torch.utils.checkpoint as tuc  # noqa: E402

import memento.torch as mt  # noqa: E402

D = torch.float64
nn = torch.nn


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def run_seeded(fn, params, seed=7):
    """fn() -> loss under a fixed seed; (loss, grads, RNG state after)."""
    torch.manual_seed(seed)
    loss = fn()
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), grads, torch.get_rng_state()


def scan_loss(step, h0, xs, memory):
    h, ys = mt.scan(step, h0, xs, memory=memory) if memory != "plain" else plain(step, h0, xs)
    return (h**2).sum() + (ys**2).sum()


def plain(step, h0, xs):
    h, ys = h0, []
    for x in xs:
        h, y = step(h, x)
        ys.append(y)
    return h, torch.stack(ys)


# -- dropout ---------------------------------------------------------------------------


def test_scan_dropout_equals_plain_and_leaves_the_rng_stream():
    torch.manual_seed(0)
    cell, drop = nn.Linear(6, 6).to(D), nn.Dropout(0.3)
    xs = torch.randn(9, 6, dtype=D)
    h0 = torch.randn(6, dtype=D, requires_grad=True)

    def step(h, x):
        h = torch.tanh(drop(cell(h)) + x)
        return h, h.sum()

    params = [h0, *cell.parameters()]
    want = run_seeded(lambda: scan_loss(step, h0, xs, "plain"), params)
    for memory in [1, 2, 3, 5, "1TiB"]:
        got = run_seeded(lambda m=memory: scan_loss(step, h0, xs, m), params)
        close(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            close(a, b)
        assert torch.equal(got[2], want[2])  # the caller's stream is where plain leaves it


def _mlp_dropout():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(5, 16),
        nn.Dropout(0.4),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Dropout(0.2),
        nn.Tanh(),
        nn.Linear(16, 3),
    ).to(D)


@pytest.mark.parametrize("memory", [1, 2, 3, "1TiB"])
def test_checkpoint_sequential_dropout_first_call_equals_plain(memory):
    net = _mlp_dropout()
    x = torch.randn(4, 5, dtype=D, requires_grad=True)
    params = [x, *net.parameters()]
    want = run_seeded(lambda: (net(x) ** 2).sum(), params)
    theirs = run_seeded(
        lambda: (tuc.checkpoint_sequential(net, 3, x, use_reentrant=False) ** 2).sum(), params
    )
    for fn in (mt.checkpoint_sequential, mt.chain):
        got = run_seeded(lambda f=fn: (f(net, x, memory=memory) ** 2).sum(), params)
        close(got[0], want[0])
        for a, b, c in zip(got[1], want[1], theirs[1]):
            close(a, b)
            close(c, b)
        assert torch.equal(got[2], want[2])


def test_transformer_encoder_layers_with_dropout():
    torch.manual_seed(2)
    layers = [
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
        .to(D)
        .train()
        for _ in range(4)
    ]
    x = torch.randn(2, 5, 8, dtype=D, requires_grad=True)
    params = [x] + [p for layer in layers for p in layer.parameters()]

    def plain_loss():
        h = x
        for layer in layers:
            h = layer(h)
        return (h**2).sum()

    want = run_seeded(plain_loss, params)
    for memory in [1, 2, 3, "1TiB"]:
        got = run_seeded(lambda m=memory: (mt.chain(layers, x, memory=m) ** 2).sum(), params)
        close(got[0], want[0], 1e-10)
        for a, b in zip(got[1], want[1]):
            close(a, b, 1e-10)


# -- autocast ----------------------------------------------------------------------------


@pytest.mark.parametrize("memory", [1, 2, 3])
def test_checkpoint_sequential_under_autocast_equals_plain_autocast(memory):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(6, 8, requires_grad=True)
    params = [x, *net.parameters()]
    with torch.autocast("cpu", torch.bfloat16):
        want_y = net(x)
    want = torch.autograd.grad(want_y.float().pow(2).sum(), params)
    with torch.autocast("cpu", torch.bfloat16):
        got_y = mt.checkpoint_sequential(net, x, memory=memory)
    assert got_y.dtype == want_y.dtype == torch.bfloat16
    got = torch.autograd.grad(got_y.float().pow(2).sum(), params)
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scan_bf16_carry_fp32_linear_under_autocast():
    torch.manual_seed(4)
    lin = nn.Linear(8, 8)
    h0 = torch.randn(3, 8).to(torch.bfloat16).requires_grad_()
    xs = torch.randn(7, 3, 8).to(torch.bfloat16)

    def step(h, x):
        h = torch.tanh(lin(h) + x)
        return h, h.float().sum()

    params = [h0, *lin.parameters()]

    def grads(memory, cache=True):
        with torch.autocast("cpu", torch.bfloat16, cache_enabled=cache):
            h, ys = (
                plain(step, h0, xs) if memory == "plain" else mt.scan(step, h0, xs, memory=memory)
            )
        return h, torch.autograd.grad(h.float().sum() + ys.sum(), params)

    want_h, want = grads("plain", cache=False)
    _, cached = grads("plain")
    for memory in [1, 2, "1TiB"]:
        h, got = grads(memory)
        assert h.dtype == torch.bfloat16
        torch.testing.assert_close(h, want_h, rtol=0, atol=0)
        # With the cast cache, plain autocast sums the steps' weight gradients in
        # bfloat16 (through one cached cast); memento sums each backward run's in float32
        # unless one run covers every step (all stored): bit for bit one or the other.
        for a, b, c in zip(got, want, cached):
            assert torch.equal(a, b) or torch.equal(a, c)
            torch.testing.assert_close(a, c, rtol=0, atol=2e-2 * float(c.abs().max()))


# -- in-place operations ---------------------------------------------------------------


@pytest.mark.parametrize("x_grad", [True, False])
def test_inplace_relu_layers_every_budget(x_grad):
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)).to(D)
    x = torch.randn(5, 4, dtype=D, requires_grad=x_grad)
    params = [x, *net.parameters()] if x_grad else list(net.parameters())
    want = torch.autograd.grad((net(x) ** 2).sum(), params)
    for memory in [1, 2, 3, "1TiB"]:
        got = torch.autograd.grad(
            (mt.checkpoint_sequential(net, x, memory=memory) ** 2).sum(), params
        )
        for a, b in zip(got, want):
            close(a, b)


def test_carry_modified_in_place_and_int_counter():
    torch.manual_seed(6)
    W = (0.4 * torch.randn(4, 4, dtype=D)).requires_grad_()
    base = torch.randn(4, dtype=D, requires_grad=True)
    xs = torch.randn(11, 4, dtype=D)

    def step(carry, x):
        h, t = carry
        h.mul_(0.5)  # plain autograd allows it: sin saved its input, not its output
        t += 1
        h = torch.sin(W @ h + x * t.to(D))
        return (h, t), h.sum() * t.to(D)

    def run(memory):
        h0 = (base * 1.0, torch.tensor(0))
        if memory == "plain":
            (h, t), ys = plain(step, h0, xs)
        else:
            (h, t), ys = mt.scan(step, h0, xs, memory=memory)
        loss = (h**2).sum() + (ys**2).sum()
        return loss.detach(), t.clone(), torch.autograd.grad(loss, [W, base]), t

    want = run("plain")
    assert want[1].item() == 11
    for memory in [1, 2, 3, 4, "1TiB"]:
        got = run(memory)
        close(got[0], want[0])
        assert got[1].item() == 11 and got[3].item() == 11  # after the backward, too
        for a, b in zip(got[2], want[2]):
            close(a, b)


def test_step_modifying_x_in_place_raises():
    W = torch.randn(3, 3, dtype=D, requires_grad=True)
    xs = torch.randn(4, 3, dtype=D)

    def step(h, x):
        x.mul_(2)
        return torch.tanh(W @ h + x), None

    with pytest.raises(
        RuntimeError, match=r"step 0 modified its input x \(leaf 0 of xs\) in place"
    ):
        mt.scan(step, torch.zeros(3, dtype=D), xs, memory=2)


# -- BatchNorm -----------------------------------------------------------------------


@pytest.mark.parametrize("memory", [1, 2, 3, "1TiB"])
def test_batchnorm_running_statistics_end_as_plain(memory):
    def make():
        torch.manual_seed(8)
        return nn.Sequential(
            nn.Conv1d(3, 6, 3),
            nn.BatchNorm1d(6),
            nn.ReLU(),
            nn.Conv1d(6, 4, 3),
            nn.BatchNorm1d(4),
            nn.Tanh(),
        ).to(D)

    x = torch.randn(5, 3, 12, dtype=D, generator=torch.Generator().manual_seed(0))
    ref, net = make(), make()
    want = torch.autograd.grad((ref(x) ** 2).sum(), list(ref.parameters()))
    got = torch.autograd.grad(
        (mt.checkpoint_sequential(net, x, memory=memory) ** 2).sum(), list(net.parameters())
    )
    for a, b in zip(got, want):
        close(a, b)
    for (name, a), (_, b) in zip(net.named_buffers(), ref.named_buffers()):
        close(a, b), name


def test_scan_batchnorm_step_buffers_end_as_plain():
    def make():
        torch.manual_seed(9)
        return nn.Linear(4, 4).to(D), nn.BatchNorm1d(4).to(D)

    xs = torch.randn(6, 3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    h0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(2))

    def stepper(lin, bn):
        return lambda h, x: (torch.tanh(bn(lin(h)) + x), None)

    (lin_a, bn_a), (lin_b, bn_b) = make(), make()
    h, _ = plain(lambda h, x: (stepper(lin_a, bn_a)(h, x)[0], h.sum()), h0, xs)
    want = torch.autograd.grad((h**2).sum(), list(lin_a.parameters()) + list(bn_a.parameters()))
    h, _ = mt.scan(stepper(lin_b, bn_b), h0, xs, memory=2)
    got = torch.autograd.grad((h**2).sum(), list(lin_b.parameters()) + list(bn_b.parameters()))
    for a, b in zip(got, want):
        close(a, b)
    assert bn_b.num_batches_tracked.item() == bn_a.num_batches_tracked.item() == 6
    close(bn_b.running_mean, bn_a.running_mean)
    close(bn_b.running_var, bn_a.running_var)


# -- late parameters, steps that differentiate ------------------------------------------


def test_parameter_first_used_after_step_0_gets_its_gradient():
    g = torch.Generator().manual_seed(10)
    W = torch.randn(3, 3, dtype=D, generator=g, requires_grad=True)
    late = torch.randn(3, dtype=D, generator=g, requires_grad=True)
    xs = torch.randn(8, 3, dtype=D, generator=g)
    ts = torch.arange(8)

    def step(h, tx):
        t, x = tx
        h = torch.tanh(W @ h + x)
        if t.item() >= 3:
            h = h + late
        return h, None

    h0 = torch.zeros(3, dtype=D)
    h = h0
    for t, x in zip(ts, xs):
        h, _ = step(h, (t, x))
    want = torch.autograd.grad((h**2).sum(), [W, late])
    for memory in [1, 2, 3, "1TiB"]:
        hT, _ = mt.scan(step, h0, (ts, xs), memory=memory)
        got = torch.autograd.grad((hT**2).sum(), [W, late])
        for a, b in zip(got, want):
            close(a, b)


def test_hamiltonian_step_calling_autograd_grad():
    torch.manual_seed(11)
    hnet = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(D)
    J = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 1], [-1, 0, 0, 0], [0, -1, 0, 0]], dtype=D)
    z0 = torch.randn(3, 4, dtype=D, requires_grad=True)

    def step(z, _):
        with torch.enable_grad():
            zz = z if z.requires_grad else z.requires_grad_()
            (dH,) = torch.autograd.grad(hnet(zz).sum(), zz, create_graph=True)
        return z + 0.1 * dH @ J.T, None

    params = [z0, *list(hnet.parameters())[:-1]]  # dH does not depend on the last bias
    z = z0
    for _ in range(6):
        z, _ = step(z, None)
    want = torch.autograd.grad((z**2).sum(), params)
    for memory in [1, 2, 3, "1TiB"]:
        zT, _ = mt.scan(step, z0, length=6, memory=memory)
        got = torch.autograd.grad((zT**2).sum(), params)
        for a, b in zip(got, want):
            close(a, b)
    # as layers, too
    layers = [lambda z: step(z, None)[0]] * 6
    for memory in [1, 2, "1TiB"]:
        got = torch.autograd.grad((mt.chain(layers, z0, memory=memory) ** 2).sum(), params)
        for a, b in zip(got, want):
            close(a, b)


# -- weights modified before backward ------------------------------------------------


def test_weights_modified_in_place_before_backward_raise():
    torch.manual_seed(12)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(D)
    x = torch.randn(3, 4, dtype=D)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = net(x)
        opt.zero_grad()
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        (y**2).sum().backward()  # plain autograd raises
    for memory in [1, 2, "1TiB"]:
        y = mt.checkpoint_sequential(net, x, memory=memory)
        opt.step()
        with pytest.raises(
            RuntimeError,
            match=r"memento.torch.checkpoint_sequential: one of the tensors its backward pass "
            r"recomputes from .* was modified by an inplace operation",
        ):
            (y**2).sum().backward()

    W = torch.randn(3, 3, dtype=D, requires_grad=True)
    h, _ = mt.scan(
        lambda h, x: (torch.tanh(W @ h + x), None),
        torch.zeros(3, dtype=D),
        torch.randn(5, 3, dtype=D),
        memory=2,
    )
    with torch.no_grad():
        W.add_(1.0)
    with pytest.raises(RuntimeError, match=r"memento\.torch\.scan: one of the tensors"):
        h.sum().backward()
