"""Smoke test of ``memento demo`` at tiny sizes."""

import re
import sys
import types

import pytest

pytest.importorskip("jax")

from memento.apps import demo as _demo


def test_demo_prints_table_and_saves_schedule(tmp_path, capsys):
    args = types.SimpleNamespace(steps=32, out=str(tmp_path / "demo"), quick=True)
    assert _demo.main(args) == 0
    out = capsys.readouterr().out
    for method in ("lax.scan (stores every step)", "jax.checkpoint", 'memento.scan, memory="1%"'):
        assert method in out
    assert "less memory than lax.scan" in out
    # The policy auto chose is named, and tiny timings are not rounded to 0 ms.
    assert re.search(
        r"'auto' \(the default\) picked (HSM|ISM|MSM) at \"1%\", (HSM|ISM|MSM) at \"5%\"", out
    )
    assert not re.search(r"(?<![\d.])0 (ms|us)\b", out)  # "1.0 ms" is fine
    # Every term is explained once, and the output ends with the line to try.
    for term in ("slot ", "alpha ", "lax.scan ", "HSM/ISM/MSM", "fwd evals", "grad error"):
        assert out.count(f"\n  {term}") == 1, term
    assert out.count("backpropagation through time (BPTT)") == 1
    assert (
        out.rstrip()
        .splitlines()[-1]
        .startswith('On your own loop: carry, ys = memento.scan(step, h0, xs, memory="5%")')
    )
    # The table's slots are the schedule's (after any refit), as the picture's title says.
    table = {
        line.split(":")[0]: line for line in out.splitlines() if line.startswith("memento.scan,")
    }
    alpha = int(re.search(r"measured: alpha=(\d+)", out).group(1))
    for budget in ("1%", "5%"):
        slots = int(table[f'memento.scan, memory="{budget}"'].split()[3])
        schedule = _demo.schedule_for(_demo.lstm_step, *_data(32), budget)
        assert slots == schedule.memory <= int(float(budget[:-1]) * 32 * alpha // 100)
    picture = re.search(r'at memory="1%" \((\d+) slots\)', out)
    assert picture and int(picture.group(1)) == int(table['memento.scan, memory="1%"'].split()[3])
    # Every method's gradient agrees with lax.scan's (float32 round-off only).
    errors = [
        float(line.split()[-1])
        for line in out.splitlines()
        if line.startswith(("lax.scan", "memento.scan,"))
    ]
    assert len(errors) == 4
    assert max(errors) < 1e-4
    pytest.importorskip("matplotlib")
    assert (tmp_path / "demo" / "schedule.png").stat().st_size > 0


def _data(num_steps):
    import jax

    _, hidden, batch = _demo.QUICK_SIZE
    k_params, k_data = jax.random.split(jax.random.PRNGKey(0))
    params = _demo.lstm_params(k_params, hidden)
    xs, init = _demo.lstm_data(k_data, num_steps, hidden, batch)
    return params, xs, init


def test_demo_without_matplotlib_skips_the_picture(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = types.SimpleNamespace(steps=20, out=str(tmp_path / "demo"), quick=True)
    assert _demo.main(args) == 0
    out = capsys.readouterr().out
    assert (
        'no schedule picture: matplotlib is not installed; pip install "memento-jax[plot]"' in out
    )
    assert "less memory than lax.scan" in out  # the summary still comes after the table
    assert not (tmp_path / "demo").exists()


def test_demo_rejects_too_few_steps(tmp_path):
    args = types.SimpleNamespace(steps=1, out=str(tmp_path), quick=True)
    with pytest.raises(ValueError, match="--steps must be at least 2, got 1"):
        _demo.main(args)
    args = types.SimpleNamespace(steps=4, out=str(tmp_path), quick=True)
    with pytest.raises(
        ValueError,
        match=r"--steps 4 is too short for memory='1%' to hold one slot \(1% of T x alpha = 4 x \d+ slots\); use --steps \d+ or more",
    ):
        _demo.main(args)


def test_schedule_for_matches_budget():
    import jax

    params = _demo.lstm_params(jax.random.PRNGKey(0), 4)
    xs, init = _demo.lstm_data(jax.random.PRNGKey(1), 20, 4, 2)
    schedule = _demo.schedule_for(_demo.lstm_step, params, xs, init, 5)
    assert schedule.num_steps == 20
    assert schedule.memory <= 5
    assert schedule.cost >= 20
