"""A randomized differential test: memento.torch against plain autograd on random layer
stacks and loop steps (Linear, Conv1d, LayerNorm, BatchNorm, Dropout, GELU, in-place
ReLU; nested carries with an integer counter; budgets from one slot to 1 TiB; autocast
on and off). Every case compares the loss, the gradients, the buffers and the caller's
random number stream after the backward pass with plain autograd's, same seeds."""

import random

import pytest

torch = pytest.importorskip("torch")

import memento.torch as mt  # noqa: E402

nn = torch.nn
BUDGETS = [1, 2, 3, 5, "1TiB"]
CASES = 80


def block(rng: random.Random, conv: bool, width: int, first: bool) -> tuple[list, int]:
    """A linear or convolution, then maybe a norm, an activation, a dropout."""
    out = rng.choice([4, 6, 8])
    layers: list = [nn.Conv1d(width, out, 3, padding=1) if conv else nn.Linear(width, out)]
    norm = rng.choice([None, "batch", "layer"])
    if norm == "batch":
        layers.append(nn.BatchNorm1d(out))
    elif norm == "layer":
        layers.append(nn.LayerNorm(7 if conv else out))
    act = rng.choice([None, "gelu", "relu_"])
    if act == "gelu":
        layers.append(nn.GELU())
    elif act == "relu_":
        layers.append(nn.ReLU(inplace=True))
    if rng.random() < 0.4:
        layers.append(nn.Dropout(rng.choice([0.1, 0.3])))
    return layers, out


def stack(rng: random.Random, conv: bool, dtype) -> nn.Sequential:
    layers, width = [], 3
    for i in range(rng.randint(1, 4)):
        more, width = block(rng, conv, width, i == 0)
        layers += more
    return nn.Sequential(*layers).to(dtype).train()


def snapshot(module: nn.Module) -> list:
    return [b.detach().clone() for b in module.buffers()]


def check_same(got, want, exact: bool):
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
        elif exact:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def run(fn, seed: int, autocast: bool):
    """fn() -> (loss, inputs) under a seed; loss, grads, RNG state after backward."""
    torch.manual_seed(seed)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast, cache_enabled=False):
        loss, inputs = fn()
    inputs = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(loss.float(), inputs, allow_unused=True)
    return loss.detach(), grads, torch.get_rng_state()


def chain_case(rng: random.Random, seed: int):
    conv, autocast = rng.random() < 0.5, rng.random() < 0.3
    dtype = torch.float32 if autocast else torch.float64
    torch.manual_seed(seed)
    net = stack(rng, conv, dtype)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(5, 3, 7, dtype=dtype) if conv else torch.randn(5, 3, dtype=dtype)
    x.requires_grad_(rng.random() < 0.7)
    memory, use_chain = rng.choice(BUDGETS), rng.random() < 0.5

    def loss(apply):
        def fn():
            y = apply()
            return (y.float() ** 2).sum() + y.float().sum(), [x, *net.parameters()]

        return fn

    net.load_state_dict(state)
    want = run(loss(lambda: net(x)), seed, autocast)
    want_buffers = snapshot(net)
    net.load_state_dict(state)
    ours = mt.chain if use_chain else mt.checkpoint_sequential
    got = run(loss(lambda: ours(net, x, memory=memory)), seed, autocast)
    exact = autocast  # bfloat16 recomputations are bit for bit; float64 sums may reorder
    check_same([got[0], *got[1]], [want[0], *want[1]], exact)
    check_same(snapshot(net), want_buffers, exact=True)
    assert torch.equal(got[2], want[2])


def scan_case(rng: random.Random, seed: int):
    autocast = rng.random() < 0.3
    dtype = torch.float32 if autocast else torch.float64
    torch.manual_seed(seed)
    n = 6
    lin, lin_x = nn.Linear(n, n).to(dtype), nn.Linear(3, n).to(dtype)
    norm = rng.choice([nn.LayerNorm(n), nn.BatchNorm1d(n), nn.Identity()]).to(dtype).train()
    drop = nn.Dropout(0.2) if rng.random() < 0.5 else nn.Identity()
    act = rng.choice([nn.GELU(), nn.ReLU(inplace=True), nn.Tanh()])
    modules = nn.ModuleList([lin, lin_x, norm, drop, act])
    state = {k: v.clone() for k, v in modules.state_dict().items()}
    inplace, counter = rng.random() < 0.5, rng.random() < 0.5
    T = rng.randint(1, 9)
    base = torch.randn(4, n, dtype=dtype, requires_grad=True)
    xs = {"a": torch.randn(T, 4, 3, dtype=dtype), "b": (torch.randn(T, 4, n, dtype=dtype),)}
    xs["a"].requires_grad_(rng.random() < 0.5)
    memory = rng.choice(BUDGETS)

    def step(carry, x):
        (h, aux), t = carry["h"], carry["t"]
        if inplace:
            h.mul_(0.9)  # plain autograd allows it: the previous step ended with an add
        if counter:
            t += 1
        z = act(norm(lin(h)))
        h = drop(z) + lin_x(x["a"]) + x["b"][0] * t.to(z.dtype)
        aux = aux + h.mean()
        return {"h": (h, aux), "t": t}, {"y": h.sum(-1)}

    def loss(use):
        def fn():
            h0 = {"h": (base * 1.0, torch.zeros((), dtype=dtype)), "t": torch.tensor(1)}
            if use == "plain":
                carry, ys = h0, []
                for p in range(T):
                    carry, y = step(carry, {"a": xs["a"][p], "b": (xs["b"][0][p],)})
                    ys.append(y["y"])
                ys = {"y": torch.stack(ys)}
            else:
                carry, ys = mt.scan(step, h0, xs, memory=memory)
            (h, aux), t = carry["h"], carry["t"]
            assert t.item() == (1 + T if counter else 1)
            value = (h.float() ** 2).sum() + aux.float() + (ys["y"].float() ** 3).sum()
            return value, [base, xs["a"], *modules.parameters()]

        return fn

    modules.load_state_dict(state)
    want = run(loss("plain"), seed, autocast)
    want_buffers = snapshot(modules)
    modules.load_state_dict(state)
    got = run(loss("memento"), seed, autocast)
    check_same([got[0], *got[1]], [want[0], *want[1]], exact=autocast)
    check_same(snapshot(modules), want_buffers, exact=True)
    assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("case", range(CASES))
def test_random_case_equals_plain_autograd(case):
    rng = random.Random(1000 + case)
    (chain_case if case % 2 == 0 else scan_case)(rng, seed=case)
