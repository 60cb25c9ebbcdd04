"""The cookbook runs: each script in examples/ at a small size, and README's Quick look.

Each example's ``main(argv)`` runs in this process (no new interpreter to import jax
into), with ``--small`` or the smallest sizes its options allow.
"""

import re
import runpy
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMER = ["--small", "--outer-steps", "1", "--inner-steps", "1"]

# script -> (module it needs, arguments)
EXAMPLES = {
    "equinox_rnn.py": ("equinox", ["--small"]),
    "flax_nnx_rnn.py": ("flax", ["--small"]),
    "flax_linen_rnn.py": ("flax", ["--small"]),
    "optax_meta.py": ("optax", ["--small"]),
    "diffrax_neural_ode.py": ("diffrax", ["--small"]),
    "maml.py": ("optax", TRANSFORMER),
    "meta_learning_rates.py": ("optax", TRANSFORMER),
    # memento.torch's bilevel example (tests/pytorch/test_torch_fwdrev.py runs it too)
    "torch_meta_lr.py": ("torch", ["--small"]),
}


def test_every_example_is_tested():
    scripts = {p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(EXAMPLES)


def test_readme_names_every_example_and_the_extra_installs_what_they_need():
    import tomllib

    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Examples", 1)[1].split("\n## ", 1)[0]
    for script in EXAMPLES:
        assert f"`{script}`" in table, script
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[<>=\[]", r)[0] for r in extras["examples"]}
    # torch has its own extra (an unpinned install pulls a CUDA build): not in examples.
    names |= {re.split(r"[<>=\[]", r)[0] for r in extras["torch"]}
    assert {needs for needs, _ in EXAMPLES.values()} <= names


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(script, capsys):
    needs, argv = EXAMPLES[script]
    pytest.importorskip(needs)
    namespace = runpy.run_path(str(ROOT / "examples" / script), run_name="example")
    namespace["main"](argv)
    out = capsys.readouterr().out
    assert re.search(r"(outer|train) step +0:", out), out
    # The scripts that compare memento's gradient with the stored-everything one.
    if match := re.search(r"max \|grad - lax.scan grad\| = (\S+)", out):
        assert float(match.group(1)) < 1e-5
    if match := re.search(r"max \|grad - RecursiveCheckpointAdjoint grad\| = (\S+)", out):
        assert float(match.group(1)) < 1e-5
    if match := re.search(r"meta-gradient (\S+) with memory=\d+, (\S+) storing", out):
        assert float(match.group(1)) == pytest.approx(float(match.group(2)), rel=1e-5)


def quick_look() -> str:
    """The first Python block of README's "Quick look" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick look", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_look_runs_and_matches_lax_scan():
    import jax
    import numpy as np
    from jax import lax

    namespace: dict = {}
    exec(compile(quick_look(), "README.md (Quick look)", "exec"), namespace)

    def reference(W, h0, xs):
        def cell(h, x):
            h = jax.numpy.tanh(W @ h + x)
            return h, jax.numpy.sum(h**2)

        return lax.scan(cell, h0, xs)[1].sum()

    expect = jax.jit(jax.grad(reference))(namespace["W"], namespace["h0"], namespace["xs"])
    # float32: recomputation may move the last bits; compare against the largest entry.
    error = np.max(np.abs(namespace["grad_W"] - expect)) / np.max(np.abs(expect))
    assert error < 1e-5
