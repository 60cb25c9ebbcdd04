"""memento.torch.checkpoint_sequential against plain autograd (float64)."""

import itertools

import pytest

torch = pytest.importorskip("torch")

import memento.torch as mt  # noqa: E402
from memento.planning import step_evaluations  # noqa: E402

D = torch.float64


class Count(torch.nn.Module):
    """Counts the evaluations of the layer it wraps."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def stack(seed=0):
    torch.manual_seed(seed)
    widths = [6, 16, 32, 4, 24, 8]
    layers = []
    for a, b in itertools.pairwise(widths):
        layers += [Count(torch.nn.Linear(a, b)), Count(torch.nn.Tanh())]
    return torch.nn.Sequential(*layers).to(D)


def loss_grads(y, inputs):
    return torch.autograd.grad((y**2).sum() + y.sum(), inputs, retain_graph=True)


@pytest.mark.parametrize("policy", ["auto", "hsm", "msm"])
def test_gradients_equal_autograd_and_counts_equal_plan(policy):
    net = stack()
    x = torch.randn(5, 6, dtype=D, requires_grad=True)
    inputs = [x, *net.parameters()]
    expect = loss_grads(net(x), inputs)
    for memory in [1, 2, 3, 5, 100, "1KiB", "2KiB", "1GiB"]:
        plan = mt.chain_plan(net, x, memory=memory, policy=policy)
        plan.schedule.simulate()
        assert plan.peak_bytes <= plan.budget_bytes
        for layer in net:
            layer.calls = 0
        got = loss_grads(mt.checkpoint_sequential(net, x, memory=memory, policy=policy), inputs)
        assert [layer.calls for layer in net] == step_evaluations(plan.schedule).tolist()
        for a, b in zip(got, expect):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_measuring_once_then_cached():
    net = stack(1)
    x = torch.randn(3, 6, dtype=D, requires_grad=True)
    for layer in net:
        layer.calls = 0
    mt.checkpoint_sequential(net, x, memory=3).sum().backward()
    plan = mt.chain_plan(net, x, memory=3)
    counts = step_evaluations(plan.schedule)
    assert [layer.calls for layer in net] == (counts + 1).tolist()  # one measuring pass
    for layer in net:
        layer.calls = 0
    mt.checkpoint_sequential(net, x, memory=3).sum().backward()
    assert [layer.calls for layer in net] == counts.tolist()


def test_budget_above_need_stores_every_internal_state():
    net = stack(2)
    x = torch.randn(3, 6, dtype=D, requires_grad=True)
    plan = mt.chain_plan(net, x, memory="1GiB", policy="msm")
    assert step_evaluations(plan.schedule).tolist() == [1] * len(net)
    hsm = mt.chain_plan(net, x, memory="1GiB", policy="hsm")
    assert step_evaluations(hsm.schedule).tolist() == [2] * (len(net) - 1) + [1]


def test_pytree_states_closures_and_subsets():
    W1 = torch.randn(4, 4, dtype=D, requires_grad=True)
    base = torch.randn(4, dtype=D, requires_grad=True)
    b = base * 3  # non-leaf, closed over

    def split(x):
        return {"a": torch.tanh(x @ W1), "b": x + b}

    def mix(d):
        return (d["a"] * d["b"], d["a"].sum(-1))

    def head(t):
        return torch.sin(t[0]).sum(-1) + t[1]

    layers = [split, mix, head]
    for x_grad in [True, False]:
        x = torch.randn(3, 4, dtype=D, requires_grad=x_grad)
        inputs = [W1, base] + ([x] if x_grad else [])
        expect = loss_grads(head(mix(split(x))), inputs)
        for memory in [1, 2, 100]:
            got = loss_grads(mt.checkpoint_sequential(layers, x, memory=memory), inputs)
            for a, c in zip(got, expect):
                torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_gradcheck_tiny():
    lin = torch.nn.Linear(3, 3).to(D)
    layers = [lin, torch.nn.Tanh(), lambda x: x * x, torch.nn.Softplus()]
    for memory in [1, 2, 100]:
        assert torch.autograd.gradcheck(
            lambda x, m=memory: mt.checkpoint_sequential(layers, x, memory=m),
            (torch.randn(2, 3, dtype=D, requires_grad=True),),
        )


def test_matches_torch_checkpoint_sequential_value_and_float32():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    x = torch.randn(4, 8, requires_grad=True)
    ours = mt.checkpoint_sequential(net, x, memory=2)
    theirs = torch.utils.checkpoint.checkpoint_sequential(net, 3, x, use_reentrant=False)
    torch.testing.assert_close(ours, theirs)
    g1 = torch.autograd.grad(ours.sum(), [x, *net.parameters()])
    g2 = torch.autograd.grad(theirs.sum(), [x, *net.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_grad_runs_plain():
    net = stack(3)
    x = torch.randn(2, 6, dtype=D)
    for layer in net:
        layer.calls = 0
    with torch.no_grad():
        y = mt.checkpoint_sequential(net, x, memory=1)
    assert y.grad_fn is None and all(layer.calls == 1 for layer in net)
    with torch.inference_mode():
        mt.checkpoint_sequential(net, x, memory=1)


def test_errors():
    net = stack(4)
    x = torch.randn(2, 6, dtype=D, requires_grad=True)
    with pytest.raises(ValueError, match="layers is empty"):
        mt.checkpoint_sequential([], x, memory=2)
    with pytest.raises(TypeError, match=r"layers\[1\] is not callable"):
        mt.checkpoint_sequential([net[0], 3], x, memory=2)
    with pytest.raises(
        TypeError, match=r"layers must be a sequence \(nn\.Sequential, list or tuple\)"
    ):
        mt.checkpoint_sequential(net[0], x, memory=2)
    with pytest.raises(ValueError, match="policy must be one of"):
        mt.checkpoint_sequential(net, x, memory=2, policy="ism")
    with pytest.raises(ValueError, match="cannot hold the input x_0 \\(96 bytes\\)"):
        mt.checkpoint_sequential(net, x, memory="50B")
    with pytest.raises(NotImplementedError, match=r"does not run under torch\.func"):
        torch.func.grad(lambda x: mt.checkpoint_sequential(net, x, memory=2).sum())(x.detach())
