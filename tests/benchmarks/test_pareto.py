"""benchmarks/pareto.py at a tiny size: its JSON has every field, its tables render, and
its nests and gradient check are right."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memento
import pareto


def test_main_writes_every_field_and_renders_the_tables(tmp_path, capsys):
    out = tmp_path / "pareto.json"
    argv = [
        "--steps",
        "64",
        "--bodies",
        "tanh4",
        "--rounds",
        "1",
        "--threads",
        "all",
        "--executors",
        "auto",
        "--out",
        str(out),
    ]
    data = pareto.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    assert data["cpu_model"] and data["jax"] == jax.__version__ and data["date"]
    assert set(data["executors"]) == set(pareto.EXECUTORS)
    (result,) = data["results"]
    assert (result["body"], result["T"], result["gradient_reference"]) == ("tanh4", 64, "lax.scan")
    for name in ("lax.scan", "checkpoint per step", "nested sqrt(T)", "nested 3 levels"):
        peer = result["peers"][name]
        assert peer["temp_bytes"] > 0 and peer["time_s"] > 0 and peer["grad_error"] < 1e-3
    nested = result["peers"]["nested sqrt(T)"]["temp_bytes"]
    per_step = result["peers"]["checkpoint per step"]["temp_bytes"]
    budgets = {b["budget"]: b for b in result["budgets"]}
    assert [budgets[k]["budget_bytes"] for k in pareto.BUDGETS] == [
        nested,
        per_step,
        int(nested * 0.25),
    ]
    for entry in budgets.values():
        record = entry["memento"]["auto"]
        assert record["status"] in ("ok", "refused")
        if record["status"] == "refused":
            assert "memory" in record["message"]
            continue
        assert record["temp_over_budget"] == record["temp_bytes"] / entry["budget_bytes"]
        reference = result["peers"][entry["time_reference"]]["time_s"]
        assert record["time_ratio"] == pytest.approx(record["time_s"] / reference)
        assert record["grad_error"] < 1e-3
        assert record["temp_ok"] == (record["temp_bytes"] <= entry["budget_bytes"] * 1.05 + 4096)
        assert record["pass"] == (record["temp_ok"] and record["time_ok"])
    assert (
        data["summary"]["auto"]["nested sqrt(T)"]["measured"]
        + data["summary"]["auto"]["nested sqrt(T)"]["refused"]
        == 1
    )
    printed = capsys.readouterr().out
    assert "memento at nested sqrt(T)'s bytes" in printed
    assert pareto.BODIES["tanh4"].label in printed

    pareto.main(["--markdown", str(out)])
    assert capsys.readouterr().out == pareto.markdown(data)


def test_nested_scan_equals_lax_scan_with_and_without_a_remainder(x64):
    # 97 steps in 3 levels: segments of 21 and a remainder of 13 (97 is prime); each
    # segment a nest of 7 x 3 (divisors), the remainder one of 13: 3 x 4 and 1 more.
    num_steps, levels = 97, 3
    assert pareto.segment_length(97, 3) == 21 and pareto.segment_length(21, 2) == 3
    xs = jnp.linspace(-1.0, 1.0, num_steps * 3, dtype=jnp.float64).reshape(num_steps, 3)

    def loss(run, w):
        carry, ys = run(lambda h, x: (jnp.tanh(w * h + x), jnp.sum(h**2)), jnp.ones(3), xs)
        return carry.sum() + ys.sum()

    nested = lambda f, c, x: pareto.nested_scan(f, c, x, levels)
    w = jnp.array([0.5, 0.9, -0.7])
    np.testing.assert_allclose(
        jax.grad(lambda w: loss(nested, w))(w),
        jax.grad(lambda w: loss(lax.scan, w))(w),
        rtol=1e-12,
    )


def test_check_gradient_refuses_a_wrong_gradient():
    good = {"W": np.ones((2, 2), np.float32)}
    assert pareto.check_gradient("same", good, good) == 0.0
    with pytest.raises(AssertionError, match="wrong"):
        pareto.check_gradient("wrong", {"W": good["W"] * 1.01}, good)


@pytest.mark.parametrize("name", sorted(pareto.BODIES))
def test_every_body_runs_and_mementos_gradient_is_lax_scans(name):
    # Each body at 8 steps: its inputs, its loss under lax.scan and under memento with a
    # budget of a few slots, the same gradient (float32). The bfloat16 product's is
    # rounded in another order (lax.scan sums the steps' weight cotangents in bfloat16,
    # memento casts each step's back to float32): each is about 8e-3 from the float64
    # gradient of the cell without the casts, so they agree to bfloat16's precision. So
    # does the bfloat16 state's, whose cotangent is rounded to bfloat16 at every step: a
    # last-bit difference in a step's float32 pullback moves it by bfloat16's precision
    # (lax.scan is 6e-3 from that float64 gradient, memento's recursion 7e-3, the same
    # loop unrolled in Python 1.2e-2).
    bf16 = name in ("mixed256", "bf16c512")
    tol = dict(rtol=0.0, atol=1.6e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
    body = pareto.BODIES[name]
    args = body.make(8)
    want = jax.grad(pareto.loss_of(body.cell, pareto.peer_runs(8)["lax.scan"]))(*args)
    got = jax.grad(pareto.loss_of(body.cell, lambda f, c, x: memento.scan(f, c, x, memory=3)))(
        *args
    )
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, **tol)


def test_keep_going_records_a_mismatch_and_fails_the_method():
    good = {"W": np.ones((2, 2), np.float32)}
    peers = {"lax.scan": pareto.Method(temp_bytes=0, compile_s=0.0, grad=good)}
    wrong = pareto.Method(temp_bytes=0, compile_s=0.0, grad={"W": good["W"] * 1.01})
    methods = {**peers, "memento auto @ x": wrong}
    with pytest.raises(AssertionError):
        pareto.check_gradients("here", peers, methods)
    reference, errors, mismatched = pareto.check_gradients("here", peers, methods, keep_going=True)
    assert reference == "lax.scan" and mismatched == {"memento auto @ x"}
    assert errors["memento auto @ x"] == pytest.approx(0.01)
    # A bfloat16 body's tolerance admits it.
    assert pareto.check_gradients("here", peers, methods, rtol=pareto.BF16_RTOL)[2] == set()


def test_first_calls_leave_out_a_lax_scan_past_the_machine(tmp_path, capsys):
    # --first-call alone (no grid): lax.scan past --max-run-bytes is left out, and the
    # times are compared with nested sqrt(T)'s.
    out = tmp_path / "first.json"
    argv = ["--steps", "", "--first-call", "--first-call-steps", "64", "--first-call-rounds"]
    argv += ["1", "--threads", "all", "--out", str(out)]
    for max_run in ("4e9", "1"):
        data = pareto.main([*argv, "--max-run-bytes", max_run])
        (fc,) = data["first_call"]
        assert data["results"] == [] and fc["T"] == 64 and fc["lax_scan_temp_bytes"] > 0
        m = fc["methods"]
        if max_run == "4e9":
            assert set(m) == {"lax.scan", "nested sqrt(T)", "memento auto"}
            assert fc["memento_ok"] == (m["memento auto"]["vs_lax_scan"] <= 2.0)
        else:
            assert set(m) == {"nested sqrt(T)", "memento auto"} and fc["memento_ok"] is None
            assert m["nested sqrt(T)"]["vs_nested"] == 1.0
            assert "not run" in capsys.readouterr().out
        for rec in m.values():
            assert rec["first_s"] >= rec["lower_s"] + rec["compile_s"] > 0
