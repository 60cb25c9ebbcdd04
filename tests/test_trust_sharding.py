"""Runs tests/sharding/test_trust_multidevice.py on 2 simulated CPU devices, in a
subprocess (the device count is fixed when JAX starts)."""

import os
import subprocess
import sys
from pathlib import Path


def test_on_two_devices():
    # One interpreter for the whole file (about 55 CPU-seconds; two parts started JAX twice).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    path = Path(__file__).parent / "sharding" / "test_trust_multidevice.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
         str(path)],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
