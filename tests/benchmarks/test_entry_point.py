"""``python -m benchmarks``: the suites by name, each a script of benchmarks/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, capture_output=True, text=True
    )


def test_list_shows_every_suite_with_its_results_file():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.__main__ import SUITES
    finally:
        sys.path.remove(str(ROOT))
    done = run("--list")
    assert done.returncode == 0 and done.stderr == ""
    for name, suite in SUITES.items():
        assert f"  {name} " in done.stdout
        assert f"{suite.script} -> results/{suite.results}" in done.stdout
    # pareto.py is written beside this entry point; every other suite's script is here.
    missing = {s.script for s in SUITES.values() if not (ROOT / "benchmarks" / s.script).exists()}
    assert missing <= {"pareto.py"}
    for name in ("pareto", "planner", "scan-executors", "while-loop", "chain", "host-memory",
                 "torch", "metagrad", "diffrax", "sharded"):  # fmt: skip
        assert name in SUITES


def test_unknown_suite_is_refused_and_options_go_to_the_script():
    done = run("nope")
    assert done.returncode == 2 and "no suite 'nope'; --list shows the" in done.stderr
    done = run("planner", "--help")
    assert done.returncode == 0 and "usage: planner.py" in done.stdout
