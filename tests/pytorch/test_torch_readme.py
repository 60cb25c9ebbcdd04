"""README's "PyTorch" snippet runs, and its gradients equal plain autograd's."""

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## PyTorch", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_pytorch_snippet_runs_and_matches_autograd():
    ns: dict = {}
    exec(compile(snippet(), "README.md (PyTorch)", "exec"), ns)
    cell, step, h0, xs = ns["cell"], ns["step"], ns["h0"], ns["xs"]
    got = [p.grad.clone() for p in cell.parameters()]
    h, losses = h0, []
    for x in xs:
        h, loss = step(h, x)
        losses.append(loss)
    expect = torch.autograd.grad(torch.stack(losses).sum() + h[0].sum(), list(cell.parameters()))
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    model, x = ns["model"], ns["x"]
    gx = x.grad.clone()
    torch.testing.assert_close(gx, torch.autograd.grad(model(x).sum(), x)[0], rtol=1e-4, atol=1e-6)
