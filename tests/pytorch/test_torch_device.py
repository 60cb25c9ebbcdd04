"""memento.torch on the inputs' device: CPU here, CUDA where there is a GPU (issue 22).

Everything the executors allocate follows the inputs' device (``device=``/``*_like``);
these tests run the same loop and stack on each device available and compare the
gradients with plain autograd's on that device, and check that no result left it.
"""

import pytest

torch = pytest.importorskip("torch")

import memento.torch as mt  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]
D = torch.float64


def close(a, b):
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm", "auto"])
@pytest.mark.parametrize("device", DEVICES)
def test_scan_on_device(device, policy):
    g = torch.Generator().manual_seed(0)
    n, steps = 5, 17
    W = (0.5 * torch.randn(n, n, generator=g, dtype=D)).to(device).requires_grad_()
    h0 = torch.randn(n, generator=g, dtype=D).to(device).requires_grad_()
    xs = torch.randn(steps, n, generator=g, dtype=D).to(device).requires_grad_()

    def step(h, x):
        h = torch.tanh(W @ h + x)
        return h, (h**2).sum()

    def loss(h, ys):
        return h.sum() + (ys**3).sum()

    h, ys = h0, []
    for x in xs:
        h, y = step(h, x)
        ys.append(y)
    expect = torch.autograd.grad(loss(h, torch.stack(ys)), [h0, xs, W])
    h, ys = mt.scan(step, h0, xs, memory=3, policy=policy)
    assert h.device == ys.device == h0.device
    got = torch.autograd.grad(loss(h, ys), [h0, xs, W])
    for a, b in zip(got, expect, strict=True):
        assert a.device == b.device
        assert close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_lstm_cell_scan_float32_on_device(device):
    torch.manual_seed(0)
    cell = torch.nn.LSTMCell(8, 8, device=device)
    xs = torch.randn(40, 3, 8, device=device)
    h0 = (torch.zeros(3, 8, device=device), torch.zeros(3, 8, device=device))

    def step(hc, x):
        return cell(x, hc), None

    hc = h0
    for x in xs:
        hc = cell(x, hc)
    expect = torch.autograd.grad(hc[0].sum(), list(cell.parameters()))
    (h, _), _ = mt.scan(step, h0, xs, memory=6)
    got = torch.autograd.grad(h.sum(), list(cell.parameters()))
    for a, b in zip(got, expect, strict=True):
        assert a.device.type == torch.device(device).type
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_sequential_and_peak_bytes_on_device(device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())]
    ).to(device=device, dtype=D)
    x = torch.randn(6, 16, dtype=D, device=device, requires_grad=True)
    params = list(net.parameters())
    y = net(x)
    expect = torch.autograd.grad((y**2).sum(), [x, *params])
    y = mt.checkpoint_sequential(net, x, memory=3)
    assert y.device == x.device
    got = torch.autograd.grad((y**2).sum(), [x, *params])
    for a, b in zip(got, expect, strict=True):
        assert close(a, b)
    peak = mt.peak_bytes(lambda: net(x).sum().backward(), [x, *params])
    assert peak > 0
