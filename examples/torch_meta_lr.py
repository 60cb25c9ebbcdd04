"""Meta-learning a learning rate in PyTorch, through a long inner loop under a budget.

The inner loop trains a small regressor by gradient descent, ``theta <- theta - lr *
grad L(theta, batch)``; its steps run through `memento.torch.scan`, so the meta-gradient
(the validation loss after the loop, differentiated with respect to ``lr``) keeps only
``--memory`` carry-sized slots. The inner gradient is `memento.torch.fwdrev_grad`: its
backward pass (the Hessian-vector products of the meta-gradient) runs forward over
reverse, as MixFlow-MG's Listing 2 means. Each outer step prints the meta-gradient next
to plain autograd's (every step stored, ``create_graph=True``), in float64.

    python examples/torch_meta_lr.py [--small] [--inner-steps 200] [--memory 8]
"""

from __future__ import annotations

import argparse

import torch

import memento.torch


def inner_loss(theta, x, y):
    w1, w2 = theta
    return ((torch.tanh(x @ w1) @ w2 - y) ** 2).mean()


def meta_loss(lr, theta0, batches, val, *, memory, policy="auto"):
    """Validation loss after the inner loop, the loop run by memento.torch.scan."""
    grad = memento.torch.fwdrev_grad(inner_loss)

    def step(theta, batch):
        x, y = batch
        g = grad(theta, x, y)
        return tuple(t - lr * gt for t, gt in zip(theta, g)), None

    theta, _ = memento.torch.scan(step, theta0, batches, memory=memory, policy=policy)
    return inner_loss(theta, *val)


def meta_loss_plain(lr, theta0, batches, val):
    """The same loss with plain autograd: every inner step's graph kept."""
    theta = tuple(t.detach().requires_grad_() for t in theta0)
    for x, y in zip(*batches):
        g = torch.autograd.grad(inner_loss(theta, x, y), theta, create_graph=True)
        theta = tuple(t - lr * gt for t, gt in zip(theta, g))
    return inner_loss(theta, *val)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a quick run (the tests use it)")
    parser.add_argument("--inner-steps", type=int, default=200)
    parser.add_argument("--outer-steps", type=int, default=5)
    parser.add_argument("--memory", type=int, default=8, help="slots of one parameter set")
    args = parser.parse_args(argv)
    inner, outer = (20, 2) if args.small else (args.inner_steps, args.outer_steps)
    d, h, n = 4, 16, 32
    g = torch.Generator().manual_seed(0)
    D = torch.float64
    teacher = torch.randn(d, 1, generator=g, dtype=D)
    xs = torch.randn(inner, n, d, generator=g, dtype=D)
    batches = (xs, torch.sin(xs @ teacher))
    xv = torch.randn(n, d, generator=g, dtype=D)
    val = (xv, torch.sin(xv @ teacher))
    theta0 = (
        0.5 * torch.randn(d, h, generator=g, dtype=D),
        0.1 * torch.randn(h, 1, generator=g, dtype=D),
    )
    log_lr = torch.tensor(-2.0, dtype=D, requires_grad=True)
    opt = torch.optim.Adam([log_lr], lr=0.1)
    for k in range(outer):
        lr = log_lr.exp()
        loss = meta_loss(lr, theta0, batches, val, memory=args.memory)
        (meta,) = torch.autograd.grad(loss, log_lr)
        (plain,) = torch.autograd.grad(meta_loss_plain(log_lr.exp(), theta0, batches, val), log_lr)
        print(
            f"outer step {k}: val loss {loss.item():.6f}, lr {lr.item():.4f}, "
            f"meta-gradient {meta.item():.12e} with memory={args.memory}, "
            f"{plain.item():.12e} storing every step"
        )
        log_lr.grad = meta
        opt.step()


if __name__ == "__main__":
    main()
