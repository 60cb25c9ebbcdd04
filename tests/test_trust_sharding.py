"""Runs tests/sharding/test_trust_multidevice.py on 2 simulated CPU devices, in a
subprocess (the device count is fixed when JAX starts)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("part", ["scalar_leaf or lstm", "not (scalar_leaf or lstm)"])
def test_on_two_devices(part):
    # In two parts, each under a minute on 2 shared CPU cores.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    path = Path(__file__).parent / "sharding" / "test_trust_multidevice.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
         str(path), "-k", part],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
