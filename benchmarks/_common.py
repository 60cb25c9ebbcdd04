"""Helpers shared by the benchmarks: compile, measure memory and size, time, write JSON.

The rules are those of DESIGN.md ("Measuring"): compile first, then take the median of
at least five runs, each ended by ``jax.block_until_ready``. The machines are shared and
noisy, so methods are timed round-robin (one run of each, then again) in one process and
compared as ratios.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A function compiled once for fixed arguments, with its static measurements.

    Attributes:
        call: runs the compiled executable on ``args``.
        args: the arguments it was compiled for.
        temp_bytes: XLA's temporary buffer size (``memory_analysis().temp_size_in_bytes``),
            exact and deterministic on CPU.
        argument_bytes, output_bytes: the sizes of the arguments and results.
        hlo_lines: lines of the optimised HLO text, a measure of program size.
        hlo_body: its computations only, without source names and lines, to tell
            whether two functions compiled to the same program.
        compile_s: seconds to lower and compile.
    """

    call: Callable[[], Any]
    args: tuple
    first_output: Any
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    hlo_lines: int
    hlo_body: str
    compile_s: float


def compile_fn(f: Callable, *args) -> Compiled:
    """Jits, lowers and compiles ``f`` for ``args``, then runs it once (warm-up)."""
    start = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    first_output = jax.block_until_ready(compiled(*args))
    hlo = compiled.as_text()
    return Compiled(
        call=lambda: compiled(*args),
        args=args,
        first_output=first_output,
        temp_bytes=int(mem.temp_size_in_bytes),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        hlo_lines=len(hlo.splitlines()),
        hlo_body=_program(hlo),
        compile_s=compile_s,
    )


SINGLE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def use_one_thread() -> None:
    """Makes XLA's CPU backend run each operation on one thread.

    On a small machine shared with other jobs, XLA's thread pool makes times depend on
    whether the other cores happen to be free (we saw the same program vary by 1.5x); one
    thread per run is both steadier and, there, faster. Must run before JAX creates its
    CPU backend (before the first array is made).

    Raises:
        RuntimeError: if the backend already exists (the flags would be ignored).
    """
    if jax._src.xla_bridge.backends_are_initialized():
        raise RuntimeError("use_one_thread: JAX's backends are already initialised.")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_FLAGS}".strip()


def _program(hlo: str) -> str:
    """The computations of an HLO text, without names of sources (files, lines, frames)."""
    start = min((i for i in (hlo.find("\n%"), hlo.find("\nENTRY")) if i >= 0), default=0)
    return re.sub(r",? ?(metadata|stack_frame_id)=(\{[^}]*\}|\d+)", "", hlo[start:])


def add_threads_option(parser) -> None:
    """``--threads one|all``: XLA:CPU threads per operation (see `use_one_thread`)."""
    parser.add_argument(
        "--threads",
        choices=("one", "all"),
        default="one",
        help="XLA:CPU threads per operation (one: steadier when shared)",
    )


def print_markdown(path: str | Path, render: Callable[[dict], str]) -> dict:
    """Prints ``render`` of an existing results JSON (a script's ``--markdown``)."""
    data = json.loads(Path(path).read_text())
    print(render(data), end="")
    return data


def time_once(call: Callable[[], Any]) -> float:
    """Seconds for one call, waiting for the results."""
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def first_call(f: Callable, *args) -> tuple[Any, dict[str, float]]:
    """``jax.jit(f)``'s first call on ``args``, timed by stage.

    Returns:
        The compiled function and ``{"first_s", "lower_s", "compile_s", "first_run_s"}``:
        the whole first call (trace + plan + lower, compile, run), then each stage.
    """
    start = time.perf_counter()
    lowered = jax.jit(f).lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    done = time.perf_counter()
    return compiled, {
        "first_s": done - start,
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "first_run_s": done - compiled_at,
    }


def time_round_robin(
    calls: Mapping[str, Callable[[], Any]],
    *,
    repeats: int = 5,
    min_round_s: float = 0.0,
    log: Callable | None = None,
) -> dict[str, list[float]]:
    """Times every call ``repeats`` times, interleaved, so that load drifts hit all alike.

    Args:
        calls: name -> zero-argument function (already compiled and warmed up).
        repeats: rounds; each round runs every call once, in a rotated order so that no
            method always follows the same neighbour.
        min_round_s: a call faster than this runs back to back, as many times as one
            untimed call says fill this many seconds, and each round records their mean:
            a millisecond call timed once is mostly scheduler noise.
        log: called with a short progress string after each round, if given.

    Returns:
        name -> the list of seconds per call, one per round.
    """
    if repeats < 1:
        raise ValueError(f"time_round_robin: repeats must be >= 1, got {repeats}.")
    names = list(calls)
    inner = {n: 1 for n in names}
    if min_round_s > 0:
        for n in names:
            once = time_once(calls[n])
            inner[n] = max(1, min(1000, int(min_round_s / max(once, 1e-6))))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            times[name].append(
                sum(time_once(calls[name]) for _ in range(inner[name])) / inner[name]
            )
        if log is not None:
            log(f"round {r + 1}/{repeats} done")
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _cpu_model() -> str | None:
    """The CPU's model name where Linux tells it (hosts change between runs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line]
    return names[0] if names else None


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "git": git_state(),
    }


def torch_info() -> dict[str, Any]:
    """The torch version and intra-op threads (the torch benchmarks; torch imported here)."""
    import torch

    return {"torch": torch.__version__, "threads": torch.get_num_threads()}


def torch_device_info(device: str) -> dict[str, Any]:
    """`torch_info` plus the device, and the GPU's name where it is one."""
    import torch

    info = {**torch_info(), "device": device}
    if device.startswith("cuda"):
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def torch_peak_bytes(run: Callable[[], object], existing: Sequence, device: str) -> int:
    """Peak memory of ``run()`` above what was allocated before it, on ``device``.

    On a GPU: ``torch.cuda.max_memory_allocated()`` after
    ``torch.cuda.reset_peak_memory_stats()``, less the bytes allocated before ``run``
    (inputs, parameters). On CPU, where PyTorch keeps no count:
    `memento.torch.peak_bytes` (live tensor bytes above ``existing``).
    """
    import torch

    if not device.startswith("cuda"):
        import memento.torch

        return memento.torch.peak_bytes(run, existing)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def torch_synced(call: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``call`` with ``torch.cuda.synchronize()`` before and after it on a GPU (so that a
    timer around it measures the device's work); ``call`` itself elsewhere."""
    if not device.startswith("cuda"):
        return call
    import torch

    def synced():
        torch.cuda.synchronize(device)
        call()
        torch.cuda.synchronize(device)

    return synced


def warm_round_robin(calls: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """One warm-up call each, then `time_round_robin`'s medians (eager code: no compile)."""
    for call in calls.values():
        call()
    return {n: median(v) for n, v in time_round_robin(calls, repeats=repeats).items()}


def git_state() -> dict[str, Any]:
    """The commit measured, and the library files that differed from it (if any)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    changed = git("status", "--porcelain", "--", "src")
    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "uncommitted_src": [line[3:] for line in changed.splitlines()],
    }


def write_json(path: str | Path, data: Any) -> Path:
    """Writes ``data`` as indented JSON, creating the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def lstm_step(params, carry, x):
    """One LSTM step (gates from ``x @ W + h @ U + b``), the cell of the LSTM benchmarks;
    returns the new ``(h, c)`` and the mean of ``h**2`` as the step's output."""
    h, c = carry
    z = x @ params["W"] + h @ params["U"] + params["b"]
    i, f, g, o = jax.numpy.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jax.numpy.tanh(g)
    h = jax.nn.sigmoid(o) * jax.numpy.tanh(c)
    return (h, c), jax.numpy.mean(h * h)


def mib(num_bytes: float) -> float:
    return num_bytes / 2**20
