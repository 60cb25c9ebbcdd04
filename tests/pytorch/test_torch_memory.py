"""memento.torch.peak_bytes / LiveBytes: exact counts on known allocations, and what
they show of memento.torch.scan: memory set by the budget, not by the number of steps."""

import pytest

torch = pytest.importorskip("torch")

import memento.torch as mt  # noqa: E402


def test_counts_each_storage_while_it_lives():
    def run():
        a = torch.ones(1000, dtype=torch.float64)  # 8000 bytes
        b = a * 2  # 16000 alive
        del a  # 8000
        c = b + 1  # 16000 again
        return c.view(10, 100)  # a view: no new storage

    assert mt.peak_bytes(run) == 16000
    with mt.LiveBytes() as mem:
        x = torch.zeros(0)
        y = torch.empty(5, dtype=torch.int32)
    assert (mem.peak, mem.live) == (20, 20)
    del x, y
    assert mem.live == 0


def test_existing_storages_are_never_counted():
    x = torch.ones(100)
    assert mt.peak_bytes(lambda: x[10:].view(-1, 10), existing=[x]) == 0
    assert mt.peak_bytes(lambda: x * 1, existing=[x]) == 400


def test_scan_memory_follows_the_budget_not_the_steps():
    W = (0.3 * torch.randn(64, 64, dtype=torch.float64)).requires_grad_()

    def step(h, x):
        return torch.tanh(h @ W + x), None

    def peaks(T):
        h0 = torch.zeros(8, 64, dtype=torch.float64)
        xs = torch.randn(T, 8, 64, dtype=torch.float64)

        def plain():
            h = h0
            for x in xs:
                h = step(h, x)[0]
            h.sum().backward()

        def ours():
            mt.scan(step, h0, xs, memory=6, policy="hsm")[0].sum().backward()

        ours()  # plan outside the measurement
        W.grad = None
        p = mt.peak_bytes(plain, [h0, xs, W])
        W.grad = None
        return p, mt.peak_bytes(ours, [h0, xs, W])

    plain50, ours50 = peaks(50)
    plain400, ours400 = peaks(400)
    assert plain400 > 5 * plain50  # autograd keeps every step
    carry = 8 * 64 * 8
    # memento: 6 slots of the carry, and a few steps' working memory, at any length.
    assert ours400 <= ours50 + 2 * carry and ours400 < plain50
