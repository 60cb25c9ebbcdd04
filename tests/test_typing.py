"""Type checkers see memento's real signatures, although ``import memento`` is lazy."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

USER_CODE = """\
import jax.numpy as jnp
import memento

def cell(h, x):
    return jnp.tanh(h + x), h.sum()

h0, xs = jnp.zeros(3), jnp.ones((10, 3))
carry, ys = memento.scan(cell, h0, xs, memory="1MiB")                 # right
carry, ys = memento.scan(cell, h0, xs, memory=8, policy="hsm")        # right
memento.scan(cell, h0, xs, memory=[8])                                # line 10: wrong type
memento.scan(cell, h0, xs, policy="fastest")                          # line 11: no such policy
memento.scan(cell, h0, xs, 10, False, 1, 8)                           # line 12: memory is keyword-only
reveal_type(memento.while_loop)
reveal_type(memento.fwdrev_grad)
reveal_type(memento.bytes_budget(1024))
"""


def pyright() -> str:
    exe = shutil.which("pyright", path=str(Path(sys.executable).parent)) or shutil.which("pyright")
    if exe is None:
        pytest.skip("pyright is not installed (pip install -e '.[dev]')")
    try:
        subprocess.run([exe, "--version"], capture_output=True, check=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"pyright is installed but does not run here: {e}")
    return exe


def test_pyright_sees_the_real_signatures(tmp_path):
    exe = pyright()
    (tmp_path / "user.py").write_text(USER_CODE)
    # extraPaths: this checkout's memento, ahead of any installed copy.
    config = {"extraPaths": [str(ROOT / "src")], "typeCheckingMode": "basic"}
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config))
    done = subprocess.run(
        [exe, "--outputjson", "--pythonpath", sys.executable, "user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    errors = {
        d["range"]["start"]["line"] + 1: d["message"]
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    }
    assert sorted(errors) == [10, 11, 12], errors
    assert "memory" in errors[10]
    assert "fastest" in errors[11]
    reveals = [d["message"] for d in report["generalDiagnostics"] if d["severity"] == "information"]
    # The lazily loaded names reveal their signatures, not "ModuleType | Any".
    assert "cond_fun" in reveals[0] and "memory" in reveals[0], reveals
    assert "loss_fn" in reveals[1] and "mode" in reveals[1], reveals
    assert reveals[2].endswith('is "Bytes"'), reveals
