"""Runs tests/sharding on 8 simulated CPU devices, in a subprocess (the device count is
fixed when JAX starts)."""

import os
import subprocess
import sys
from pathlib import Path


def test_on_eight_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    folder = Path(__file__).parent / "sharding"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", str(folder),
         f"--ignore={folder / 'test_trust_multidevice.py'}"],  # 2 devices: test_trust_sharding.py
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
