"""What a user without the optional extras sees, and what the distribution ships."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each import runs in a fresh interpreter in which the dependency cannot be imported
# (``sys.modules[name] = None`` makes ``import name`` fail as a missing module does).
CASES = [
    ("jax", "import memento.loops", 'pip install "memento-jax[jax]"'),
    ("jax", "import memento.meta", 'pip install "memento-jax[jax]"'),
    ("jax", "import memento.diffrax", 'pip install "memento-jax[jax]"'),
    ("jax", "import memento; memento.scan", 'pip install "memento-jax[jax]"'),
    ("torch", "import memento.torch", 'pip install "memento-jax[torch]"'),
]


@pytest.mark.parametrize(("missing", "statement", "hint"), CASES)
def test_a_missing_extra_names_what_to_install(missing, statement, hint):
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "try:\n"
        f"    {statement}\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e.name, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.startswith(f"ModuleNotFoundError {missing} ")
    assert hint in out


def test_the_planner_and_cli_need_no_extra():
    code = (
        "import sys; sys.modules['jax'] = sys.modules['torch'] = None\n"
        "import memento, memento.planning, memento.planning.internals, memento.cli\n"
        "print(memento.plan(100, '5%').memory)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"


def test_metadata_names_the_license_and_a_short_readme():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    readme = (ROOT / project["readme"]).read_text()
    # The package page has no repository around it: no relative links, and short.
    assert "](" not in readme and "tests/" not in readme and "benchmarks/" not in readme
    assert len(readme.splitlines()) <= 60
    assert "Programming Language :: Python :: 3 :: Only" in project["classifiers"]
