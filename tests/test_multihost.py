"""memento where JAX's multi-controller SPMD runs: 2 processes x 4 CPU devices on loopback.

Each process runs ``tests/sharding/_multihost_worker.py`` (``jax.distributed`` on
127.0.0.1, gloo collectives): data- and model-parallel gradients of `memento.scan` and
`memento.while_loop` against ``lax.scan``'s and the unrolled loop's, and a
``while_loop`` whose predicate differs per device across the two processes (it
deadlocked before the weight's ``psum`` was moved out of the backward loop). Bounded:
a free port, a timeout on every wait, the children killed on any failure.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "sharding" / "_multihost_worker.py"
PROCESSES = 2
TIMEOUT_S = 180  # both children; each takes about 12 s on 2 idle CPU cores
EXPECTED = [
    f"{kind}-{name}" for kind in ("data", "model") for name in ("hsm", "ism", "hsm-rec", "while")
] + ["per-device-while"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes(tmp_path):
    try:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # pragma: no cover - a JAX built without gloo
        pytest.skip(f"no gloo CPU collectives: {e}")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")]
    )
    port = _free_port()
    # Output to files, not pipes: a pipe nobody reads while polling could fill and block.
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(PROCESSES)]
    procs = []
    for i, (out, err) in enumerate(logs):
        with out.open("w") as o, err.open("w") as e:
            args = [sys.executable, str(WORKER), str(i), str(PROCESSES), str(port)]
            procs.append(subprocess.Popen(args, env=env, stdout=o, stderr=e))
    # Poll: a child that fails makes the other wait on it forever, so any failure (or
    # the deadline) kills both. SIGKILL: jax.distributed catches SIGTERM (preemption).
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.wait(timeout=30) for p in procs]
    outs = [(c, o.read_text(), e.read_text()) for c, (o, e) in zip(codes, logs)]
    if time.monotonic() > deadline:
        tails = [out[-2000:] for _, out, _ in outs]
        pytest.fail(f"the processes did not finish in {TIMEOUT_S} s (a deadlock?): {tails}")
    # Every rank's code and tails: the first to fail is not always rank 0 (the others are
    # then killed, with -9).
    failed = [
        (r, c, o[-2000:], e[-2000:]) for r, (c, o, e) in enumerate(outs) if c or "DONE" not in o
    ]
    assert not failed, failed
    for rank, (_, out, _) in enumerate(outs):
        errors = {
            line.split()[1]: float(line.split()[2])
            for line in out.splitlines()
            if line.startswith("CHECK ")
        }
        assert list(errors) == EXPECTED, (rank, errors)
        for name, e in errors.items():
            assert e < 1e-9, (rank, name, e)
