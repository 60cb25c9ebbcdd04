"""The command line: `memento.cli.main` with captured output."""

import csv
import json
import re
import subprocess
import sys

import pytest

import memento.planning
from memento import cli


@pytest.fixture
def revolve_planner(monkeypatch):
    """`plan` replaced by revolve (HSM-optimal), to test the CLI on its own."""

    def plan(num_steps, memory, *, policy, alpha=None, beta=None):
        assert policy == "hsm" and alpha is None and beta is None
        return memento.planning.revolve(num_steps, memory)

    monkeypatch.setattr(memento.planning, "plan", plan, raising=False)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_human_output(capsys, revolve_planner):
    code, out, err = run(capsys, "plan", "--steps", "1000", "--memory", "10", "--policy", "hsm")
    assert code == 0 and err == ""
    # HSM's closed form: C(1000, 10) = 5 * 1000 - binom(14, 11) = 4636.
    assert "4636 forward steps, 4.636 per step" in out
    assert "10 slots at peak: 99.0% less than plain BPTT" in out
    # HSM counts h_0, so plain BPTT is h_0 plus every internal state.
    assert "(1001 slots: h_0 and 1000 internal states)" in out
    assert "REVOLVE stores hidden states only; h_0 takes one" in out and "alpha" not in out
    ratio = (4636 + 2000) / 3000
    assert f"{ratio:.3f}x plain BPTT" in out
    assert "peak 10 slots" in out


def test_plan_json(capsys, revolve_planner):
    code, out, _ = run(
        capsys, "plan", "--steps", "100", "--memory", "5", "--policy", "hsm", "--json",
        "--backward-cost", "3",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    assert record["cost"] == memento.planning.revolve_cost(100, 5)
    assert record["cost_per_step"] == record["cost"] / 100
    assert record["time_ratio"] == pytest.approx((record["cost"] + 300) / 400)
    assert record["backward_cost"] == 3.0
    assert record["replay"]["forward_evaluations"] == record["cost"]
    assert record["memory"] == record["replay"]["peak_memory"] == 5


def test_plan_plot(capsys, revolve_planner, tmp_path):
    path = tmp_path / "schedule.png"
    code, out, _ = run(
        capsys, "plan", "--steps", "30", "--memory", "4", "--policy", "hsm", "--plot", str(path)
    )
    assert code == 0 and str(path) in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_headline(capsys):
    # Gruslys et al. section 3.2: ISM at t = 1000 with 50 internal states saves 95% of
    # the memory for about a third more time than plain BPTT (backward = 2 forwards).
    code, out, _ = run(capsys, "plan", "--steps", "1000", "--memory", "50", "--policy", "ism")
    assert code == 0
    per_step = float(re.search(r"(\d+\.\d+) per step", out).group(1))
    saved = float(re.search(r"(\d+\.\d)% less", out).group(1))
    ratio = float(re.search(r"(\d+\.\d+)x plain BPTT", out).group(1))
    assert per_step == pytest.approx(1.95, abs=0.01)
    assert saved == pytest.approx(95.0)
    assert ratio == pytest.approx(1.32, abs=0.01)


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm"])
def test_plan_policies_json(capsys, policy):
    argv = ["plan", "--steps", "200", "--memory", "30", "--policy", policy, "--json"]
    if policy == "msm":
        argv += ["--alpha", "3", "--beta", "2"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    record = json.loads(out)
    assert record["policy"] == policy
    assert record["replay"]["forward_evaluations"] == record["cost"]
    assert record["memory"] <= 30


def test_plan_wording(capsys):
    code, out, _ = run(capsys, "plan", "--steps", "10000", "--memory", "2", "--policy", "ism")
    assert code == 0
    # 1 - 2/10000 is 99.98%, never rounded up to 100%.
    assert "99.98% less than plain BPTT (10000 slots: 10000 internal states)" in out
    assert "h_0 is given, not counted" in out and "alpha=1 slot;" in out
    code, out, _ = run(capsys, "plan", "--steps", "1", "--memory", "3", "--policy", "hsm")
    assert "1 step, 3 slots" in out and "1 forward step," in out and "1 action checked" in out


def test_plan_auto_is_the_default(capsys):
    code, out, _ = run(capsys, "plan", "--steps", "1000", "--memory", "50")
    assert code == 0
    assert out.startswith("ISM schedule (policy auto, as memento.scan with alpha=1): 1000 steps")
    code, out, _ = run(
        capsys, "plan", "--steps", "1000", "--memory", "50", "--alpha", "5", "--json"
    )
    record = json.loads(out)
    assert record["requested_policy"] == "auto" and record["alpha"] == 5
    assert record["policy"] in ("hsm", "ism", "msm")
    code, _, err = run(capsys, "plan", "--steps", "10", "--memory", "5", "--beta", "2")
    assert (
        code == 2 and "memento.plan: beta=2 applies to policy='msm' only; 'auto' plans MSM" in err
    )


def test_plan_memory_in_bytes(capsys):
    argv = ["plan", "--steps", "1000", "--memory", "5MiB", "--policy", "ism"]
    code, out, _ = run(capsys, *argv, "--carry-bytes", "40960")
    assert code == 0
    assert "1000 steps, 128 slots = 5MiB in 40960-byte carries (a slot" in out
    code, _, err = run(capsys, *argv)
    assert (
        code == 2
        and "--memory 5MiB is a size in bytes; plans count slots of one carry, so give the carry's size too (--carry-bytes 4KiB, say)"
        in err
    )
    code, _, err = run(capsys, *argv, "--carry-bytes", str(6 * 2**20))
    assert code == 2 and "cannot hold even one carry" in err
    code, _, err = run(capsys, "plan", "--steps", "9", "--memory", "5", "--carry-bytes", "8")
    assert code == 2 and "already a number of slots" in err


def test_curves(capsys, tmp_path):
    code, out, _ = run(capsys, "curves", "--steps", "60", "--out", str(tmp_path))
    assert code == 0
    pngs = {"fig2a_hsm", "fig5a_ism", "fig5b_msm", "fig6_compare", "fig7_chen"}
    for stem in pngs:
        path = tmp_path / f"{stem}.png"
        assert str(path) in out
        assert path.read_bytes()[:4] == b"\x89PNG"
    with open(tmp_path / "fig2a_hsm.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["t", "m=10", "m=50", "m=100", "m=500", "m=1000"]
    assert len(rows) == 61
    # HSM cost per step is C(t, m) / t, revolve's closed form.
    for t, *values in rows[1:]:
        expect = memento.planning.revolve_cost(int(t), 10) / int(t)
        assert float(values[0]) == pytest.approx(expect, rel=1e-5)
    for name in ("fig5a_ism", "fig5b_msm", "fig6a_10alpha", "fig7b_chen_cost"):
        assert (tmp_path / f"{name}.csv").stat().st_size > 0


def test_curves_bad_steps_writes_nothing(capsys, tmp_path):
    code, _, err = run(capsys, "curves", "--steps", "0", "--out", str(tmp_path / "figs"))
    assert code == 2 and "num_steps must be >= 1, got 0" in err
    assert not (tmp_path / "figs").exists()


def test_missing_matplotlib_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out, err = run(capsys, "curves", "--steps", "5", "--out", str(tmp_path / "figs"))
    assert code == 1 and out == ""
    assert (
        err
        == 'memento curves: needs matplotlib, which is not installed: pip install "memento-jax[plot]"\n'
    )
    assert not (tmp_path / "figs").exists()
    argv = ["plan", "--steps", "5", "--memory", "2", "--policy", "hsm", "--plot", "x.png"]
    code, _, err = run(capsys, *argv)
    assert code == 1 and 'pip install "memento-jax[plot]"' in err


def test_missing_jax_hint(capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "memento.apps.demo", raising=False)
    monkeypatch.setitem(sys.modules, "jax", None)
    code, _, err = run(capsys, "demo", "--quick")
    assert code == 1
    assert (
        err == 'memento demo: needs jax, which is not installed: pip install "memento-jax[jax]"\n'
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--steps", "0", "--memory", "5", "--policy", "hsm"], "0"),
        (["plan", "--steps", "10", "--memory", "0", "--policy", "hsm"], "0"),
    ],
)
def test_bad_values_exit_2(capsys, revolve_planner, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("memento plan: error: memento.revolve:")
    assert message in err and "Traceback" not in err


def test_bad_backward_cost_exit_2(capsys, revolve_planner):
    code, _, err = run(
        capsys, "plan", "--steps", "10", "--memory", "3", "--policy", "hsm",
        "--backward-cost", "0",
    )  # fmt: skip
    assert code == 2
    assert "backward_cost must be > 0, got 0.0" in err


def test_bad_policy_exit_2(capsys):
    code, _, err = run(capsys, "plan", "--steps", "10", "--memory", "3", "--policy", "nope")
    assert code == 2
    assert "nope" in err and "Traceback" not in err


def test_unwritable_output_exit_2(capsys, revolve_planner, tmp_path):
    target = tmp_path / "missing" / "schedule.png"
    code, _, err = run(
        capsys, "plan", "--steps", "10", "--memory", "3", "--policy", "hsm", "--plot", str(target)
    )
    assert code == 2
    assert err.startswith("memento plan: error:") and "schedule.png" in err


def test_usage_errors(capsys):
    assert cli.main(["plan", "--steps", "10"]) == 2
    assert "required: --memory" in capsys.readouterr().err
    assert cli.main(["plan", "--steps", "ten", "--memory", "2", "--policy", "hsm"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"memento {memento.__version__}"


def test_hooks_dispatch_lazily(capsys, monkeypatch):
    calls = []
    fake = type(sys)("memento.apps.demo")
    fake.main = lambda args: calls.append(("demo", args.steps, args.out, args.quick))
    monkeypatch.setitem(sys.modules, "memento.apps.demo", fake)
    assert cli.main(["demo", "--steps", "7", "--out", "d", "--quick"]) == 0
    assert calls == [("demo", 7, "d", True)]


def test_hooks_missing_module(capsys, monkeypatch):
    # A module that cannot be imported: the hook says so and exits non-zero.
    monkeypatch.setitem(sys.modules, "memento.apps.demo", None)
    code, _, err = run(capsys, "demo", "--quick")
    assert code == 1
    assert "memento demo: not available" in err and "memento.apps.demo" in err


def test_python_m_memento_and_light_import():
    # `python -m memento` works; importing memento (or the CLI) loads neither jax nor
    # matplotlib.
    code = (
        "import sys, memento, memento.cli, memento.planning; "
        "print(sorted(m for m in ('jax', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    done = subprocess.run(
        [sys.executable, "-m", "memento", "plan", "--steps", "5"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "required" in done.stderr


def test_long_plan_reports_progress_on_stderr(capsys):
    argv = ["plan", "--steps", "30000", "--memory", "100", "--policy", "hsm", "--json"]
    code, out, err = run(capsys, *argv)
    assert code == 0
    assert json.loads(out)["num_steps"] == 30000  # stdout stays one JSON object
    assert err.startswith("memento plan: planning 30000 steps ...\n")


# --------------------------------------------------------------------------- two levels


def test_plan_two_level_human_output(capsys):
    argv = ["plan", "--steps", "1000", "--memory", "10", "--host-memory", "inf"]
    code, out, err = run(capsys, *argv, "--transfer-cost", "2")
    assert code == 0 and err == ""
    s = memento.planning.plan(1000, 10, host_memory=float("inf"), transfer_cost=2.0)
    r = s.simulate()
    assert "two-level HSM schedule: 1000 steps, device 10 slots" in out and "host unbounded" in out
    assert f"cost            {s.cost:.10g} step units" in out
    assert f"{r.forward_evaluations} forward evaluations + {r.transfer_time:.10g}" in out
    assert "device only     4636 forward steps" in out  # HSM's C(1000, 10)
    assert f"host peak       {r.peak_host_memory} slots" in out
    assert f"transfers       {r.host_stores} to the host, {r.host_loads} back" in out
    assert "device peak     10 slots" in out and "planner only" in out


def test_plan_two_level_json(capsys):
    code, out, _ = run(
        capsys, "plan", "--steps", "200", "--memory", "6", "--host-memory", "5",
        "--transfer-cost", "0.5,3", "--policy", "msm", "--alpha", "2", "--overlap", "none",
        "--json",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    s = memento.planning.plan(
        200, 6, policy="msm", alpha=2, host_memory=5, transfer_cost=(0.5, 3.0), overlap="none"
    )
    assert record["cost"] == s.cost == record["replay"]["cost"]
    assert record["device_only_cost"] == memento.planning.plan(200, 6, policy="msm", alpha=2).cost
    assert record["cost"] <= record["device_only_cost"]
    assert record["host_memory"] == 5 and record["transfer_cost"] == [0.5, 3.0]
    assert record["replay"]["peak_host_memory"] <= 5 and record["replay"]["peak_memory"] <= 6
    assert record["overlap"] == "none" and record["policy"] == "msm"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--transfer-cost", "2"], "--transfer-cost and --overlap apply with --host-memory"),
        (
            ["--host-memory", "x", "--transfer-cost", "2"],
            "--host-memory 'x' is not a number of slots, a percentage such as 5%, or a size",
        ),
        (["--host-memory", "4"], "host_memory=4 needs transfer_cost"),
        (["--host-memory", "4", "--transfer-cost", "a,b"], "a number or WRITE,READ"),
        (["--host-memory", "4", "--transfer-cost", "-1"], "transfer_cost must be finite and >= 0"),
        (
            ["--host-memory", "4", "--transfer-cost", "1", "--policy", "ism"],
            "policy='hsm' or 'msm'",
        ),
        (["--host-memory", "4", "--transfer-cost", "1", "--plot", "x.png"], "--plot draws"),
    ],
)
def test_plan_two_level_bad_values(capsys, argv, message):
    code, out, err = run(capsys, "plan", "--steps", "30", "--memory", "3", *argv)
    assert code == 2 and out == "" and message in err


def test_plan_percent_of_every_internal_state(capsys):
    # 1% of 10000 steps' internal states (alpha 1): 100 slots, as memento.plan reads it.
    code, out, err = run(capsys, "plan", "--steps", "10000", "--memory", "1%", "--json")
    assert code == 0 and err == ""
    record = json.loads(out)
    assert record["budget"] == 100 == memento.plan(10000, "1%").memory
    assert record["cost"] == memento.plan(10000, 100).cost
    code, out, _ = run(capsys, "plan", "--steps", "200", "--memory", "5%", "--alpha", "3")
    assert code == 0 and "200 steps, 30 slots" in out
    code, _, err = run(capsys, "plan", "--steps", "100", "--memory", "0.1%")
    assert (
        code == 2
        and "of 100 slots (every step's internal state, --steps x --alpha) is less than one; pass at least '1%'"
        in err
    )
    code, _, err = run(capsys, "plan", "--steps", "100", "--memory", "150%")
    assert code == 2 and "memory='150%' is outside (0%, 100%]" in err


def test_plan_sizes_with_units_everywhere(capsys):
    code, out, _ = run(
        capsys, "plan", "--steps", "1000", "--memory", "5MiB", "--carry-bytes", "40KiB",
        "--policy", "ism",
    )  # fmt: skip
    assert code == 0 and "1000 steps, 128 slots = 5MiB in 40960-byte carries" in out
    code, _, err = run(
        capsys, "plan", "--steps", "9", "--memory", "5MiB", "--carry-bytes", "4 apples"
    )
    assert code == 2 and "argument --carry-bytes: '4 apples' is not a size in bytes" in err
    code, _, err = run(capsys, "plan", "--steps", "9", "--memory", "1.5")
    assert code == 2 and "--memory 1.5 is not a whole number of slots" in err
    code, _, err = run(capsys, "plan", "--steps", "9", "--memory", "5%", "--carry-bytes", "8")
    assert code == 2 and "--memory 5% is already a percentage: drop --carry-bytes" in err
    argv = ["plan", "--steps", "100", "--memory", "10", "--transfer-cost", "1", "--json"]
    code, out, _ = run(capsys, *argv, "--host-memory", "1MiB", "--carry-bytes", "64KiB")
    assert code == 0 and json.loads(out)["host_memory"] == 16
    code, out, _ = run(capsys, *argv, "--host-memory", "5%")
    assert code == 0 and json.loads(out)["host_memory"] == 5


@pytest.mark.parametrize(("policy", "alpha"), [("HSM", []), ("Ism", []), ("MSM", ["--alpha", "2"])])
def test_policy_in_any_case(capsys, policy, alpha):
    code, out, _ = run(capsys, "plan", "--steps", "50", "--memory", "6", *alpha,
                       "--policy", policy, "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["policy"] == policy.lower()


def test_closed_pipe_exits_quietly():
    # `memento plan ... | head`: the reader is gone before the output is written.
    proc = subprocess.Popen(
        [sys.executable, "-m", "memento", "plan-chain", "--costs", ",".join(["1"] * 400),
         "--hidden", ",".join(["1"] * 401), "--internal", ",".join(["3"] * 400),
         "--memory", "20", "--rows"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert err == ""
