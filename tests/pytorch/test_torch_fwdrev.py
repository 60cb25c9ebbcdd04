"""memento.torch.fwdrev_grad and the bilevel example, against plain autograd in float64."""

import re
import runpy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memento.torch as mt  # noqa: E402

D = torch.float64
ROOT = Path(__file__).resolve().parents[2]


def loss(params, x, scale, k):
    w, b = params["w"], params["b"]
    return scale * ((torch.tanh(x @ w) + b) ** 2).sum() / k


def test_value_is_torch_func_grad():
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(3, 2, generator=g, dtype=D),
        "b": torch.randn(2, generator=g, dtype=D),
    }
    x, scale = torch.randn(5, 3, generator=g, dtype=D), torch.tensor(0.7, dtype=D)
    got = mt.fwdrev_grad(loss)(params, x, scale, 4)
    expect = torch.func.grad(loss)(params, x, scale, 4)
    for key in params:
        torch.testing.assert_close(got[key], expect[key], rtol=0, atol=0)


@pytest.mark.parametrize("wrt", ["params", "params+scale", "params+x+scale", "scale"])
def test_vjp_equals_reverse_over_reverse(wrt):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 2, generator=g, dtype=D, requires_grad="params" in wrt)
    b = torch.randn(2, generator=g, dtype=D, requires_grad="params" in wrt)
    x = torch.randn(5, 3, generator=g, dtype=D, requires_grad="x" in wrt)
    scale = torch.tensor(0.7, dtype=D, requires_grad="scale" in wrt)
    v = {"w": torch.randn(3, 2, generator=g, dtype=D), "b": torch.randn(2, generator=g, dtype=D)}
    inputs = [t for t in (w, b, x, scale) if t.requires_grad]

    ours = mt.fwdrev_grad(loss)({"w": w, "b": b}, x, scale, 4)
    got = torch.autograd.grad(sum((ours[k] * v[k]).sum() for k in v), inputs)
    # reverse over reverse, with autograd (create_graph)
    wr, br = (w, b) if w.requires_grad else (w.clone().requires_grad_(), b.clone().requires_grad_())
    gw, gb = torch.autograd.grad(loss({"w": wr, "b": br}, x, scale, 4), (wr, br), create_graph=True)
    expect = torch.autograd.grad((gw * v["w"]).sum() + (gb * v["b"]).sum(), inputs)
    for a, e in zip(got, expect):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_errors():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        mt.fwdrev_grad(3)
    with pytest.raises(TypeError, match="argument 0 must hold floating-point tensors"):
        mt.fwdrev_grad(lambda p: p.sum())(torch.arange(3))
    with pytest.raises(ValueError, match="mode must be one of"):
        mt.fwdrev_grad(lambda p: p.sum(), mode="fast")
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty tuple"):
        mt.fwdrev_grad(lambda p: p.sum(), argnums=())
    with pytest.raises(ValueError, match=r"argnums=2 is out of range for a call with 1"):
        mt.fwdrev_grad(lambda p: p.sum(), argnums=2)(torch.ones(2))


@pytest.mark.parametrize("mode", ["fwdrev", "revfwd", "revrev"])
def test_closed_over_tensor_gets_its_meta_gradient(mode):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 2, generator=g, dtype=D, requires_grad=True)
    c = torch.randn(2, generator=g, dtype=D, requires_grad=True)  # closed over
    base = torch.randn(5, 3, generator=g, dtype=D, requires_grad=True)
    x = base * 2  # closed over, not a leaf
    v = torch.randn(3, 2, generator=g, dtype=D)

    def inner(w):
        return ((torch.tanh(x @ w) * c) ** 2).sum()

    ours = mt.fwdrev_grad(inner, mode=mode)(w)
    got = torch.autograd.grad((ours * v).sum(), [w, c, base], retain_graph=True)
    (gw,) = torch.autograd.grad(inner(w), w, create_graph=True)
    expect = torch.autograd.grad((gw * v).sum(), [w, c, base])
    for a, e in zip(got, expect):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["fwdrev", "revfwd", "revrev"])
def test_argnums_has_aux_and_modes_equal_torch_func_grad(mode):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 2, generator=g, dtype=D, requires_grad=True)
    b = torch.randn(2, generator=g, dtype=D, requires_grad=True)
    x = torch.randn(5, 3, generator=g, dtype=D, requires_grad=True)

    def loss(x, params, k):
        w, b = params
        out = ((torch.tanh(x @ w) + b) ** 2).sum() / k
        return out, {"out": out.detach()}

    ours, aux = mt.fwdrev_grad(loss, argnums=(0, 1), has_aux=True, mode=mode)(x, (w, b), 3)
    ref, ref_aux = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(x, (w, b), 3)
    torch.testing.assert_close(aux["out"], ref_aux["out"], rtol=0, atol=0)
    gx, (gw, gb) = ours
    for a, e in zip((gx, gw, gb), (ref[0], *ref[1])):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    v = [torch.randn(t.shape, generator=g, dtype=D) for t in (x, w, b)]
    got = torch.autograd.grad(sum((a * u).sum() for a, u in zip((gx, gw, gb), v)), [x, w, b])
    rx, rw, rb = torch.autograd.grad(loss(x, (w, b), 3)[0], [x, w, b], create_graph=True)
    expect = torch.autograd.grad(sum((a * u).sum() for a, u in zip((rx, rw, rb), v)), [x, w, b])
    for a, e in zip(got, expect):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_bilevel_example_meta_gradient_equals_plain_autograd(capsys):
    namespace = runpy.run_path(str(ROOT / "examples" / "torch_meta_lr.py"), run_name="example")
    namespace["main"](["--small"])
    out = capsys.readouterr().out
    pairs = re.findall(r"meta-gradient (\S+) with memory=\d+, (\S+) storing", out)
    assert len(pairs) == 2
    for ours, plain in pairs:
        assert float(ours) == pytest.approx(float(plain), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm", "auto"])
def test_bilevel_every_policy_and_budget(policy):
    namespace = runpy.run_path(str(ROOT / "examples" / "torch_meta_lr.py"), run_name="example")
    g = torch.Generator().manual_seed(2)
    theta0 = (torch.randn(3, 4, generator=g, dtype=D), torch.randn(4, 1, generator=g, dtype=D))
    xs = torch.randn(9, 6, 3, generator=g, dtype=D)
    batches, val = (xs, xs.sum(-1, keepdim=True)), (xs[0], xs[0, :, :1])
    lr = torch.tensor(0.2, dtype=D, requires_grad=True)
    (expect,) = torch.autograd.grad(namespace["meta_loss_plain"](lr, theta0, batches, val), lr)
    for memory in [1, 2, 5, 1000]:
        try:
            loss = namespace["meta_loss"](lr, theta0, batches, val, memory=memory, policy=policy)
        except ValueError as e:  # ISM below one internal state
            assert policy == "ism" and "needs room for one internal state" in str(e)
            continue
        (got,) = torch.autograd.grad(loss, lr)
        torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-14)
