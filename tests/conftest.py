import gc
import os
import sys
from pathlib import Path

import pytest

# The executors' tests (tests/loops, tests/conformance, and the multi-device runs the
# subprocesses start) run with memento's device-side invariant checks on (`memento.loops.
# _pool.checks_enabled`): a stored state loaded from the wrong place fails loudly, not as
# a slightly wrong gradient. The other tests (Diffrax, meta-learning, examples, docs,
# benchmarks) run as users do by default, checks off: they compare gradients with
# references too, and compile faster. MEMENTO_CHECKS=0 or 1 set outside applies to all.
_CHECKS_SET = "MEMENTO_CHECKS" in os.environ
os.environ.setdefault("MEMENTO_CHECKS", "1")
_CHECKED = {"loops", "conformance", "sharding"} | {
    f"test_{name}.py" for name in ("sharding", "trust_sharding", "multihost")
}

# The examples' helpers and the benchmarks' models and tasks (memento_bench) are not part
# of the memento package; the tests import them from the checkout.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT / "benchmarks"), str(_ROOT / "examples")]

# Every executable XLA:CPU compiles holds memory maps, and a process may hold at most
# vm.max_map_count of them (65530 by default). One suite compiles thousands of programs:
# the conformance file alone reached 36,000 maps, and the whole suite crashed XLA's
# compiler with a segmentation fault once past the limit. So caches are cleared whenever
# the process holds many maps.
_MAPS = Path("/proc/self/maps")
_MAX_MAPS = 20_000


def pytest_runtest_setup(item):
    """JAX before 0.6 had ``jax.enable_x64`` as ``jax.experimental.enable_x64``: the tests
    use the new name, and .ci/run runs a subset at the oldest JAX pyproject allows."""
    jax = sys.modules.get("jax")
    if jax is not None and not hasattr(jax, "enable_x64"):
        from jax.experimental import enable_x64

        jax.enable_x64 = enable_x64


@pytest.fixture(autouse=True)
def _checks_where_the_executors_are_tested(request, monkeypatch):
    top = Path(str(request.node.path)).relative_to(_ROOT / "tests").parts[0]
    if not _CHECKS_SET and top not in _CHECKED:
        monkeypatch.setenv("MEMENTO_CHECKS", "0")
    yield


# The extended tier: tests listed in slow.txt (node ids, or a prefix such as a file) are
# marked `slow`. A plain `python -m pytest` leaves them out, so that it stays under 15
# minutes on two cores; `python -m pytest -m slow` runs only them, and CI runs both. Tests
# named on the command line (a file, a node id) run whatever their tier.
_SLOW = [
    line.split("#", 1)[0].strip()
    for line in (Path(__file__).parent / "slow.txt").read_text().splitlines()
    if line.split("#", 1)[0].strip()
]


def _listed(rel: str, entry: str) -> bool:
    return (
        rel == entry
        or rel.startswith((entry + "::", entry + "["))
        or (entry.endswith((".py", "/")) and rel.startswith(entry))
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    listed, files = set(), set()
    for item in items:
        rel = (
            Path(str(item.path)).relative_to(_ROOT).as_posix()
            + item.nodeid[len(item.nodeid.split("::")[0]) :]
        )
        files.add(rel.split("::")[0])
        hits = [entry for entry in _SLOW if _listed(rel, entry)]
        if hits:
            item.add_marker(pytest.mark.slow)
            listed.update(hits)
    # An entry naming a collected file but no test in it is a renamed test, which would
    # otherwise slip silently into the default tier. (Where node ids were asked for, the
    # files were collected in part.)
    whole = not any("::" in str(a) for a in config.option.file_or_dir or ())
    stale = [e for e in _SLOW if e not in listed and e.split("::")[0] in files]
    if stale and whole:
        raise pytest.UsageError(f"tests/slow.txt names tests that do not exist: {stale}")
    if not config.option.file_or_dir and not config.option.markexpr:
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_collection_finish(session):
    """No test module may turn on float64 for the whole process at import: the tests
    that check float32 defaults would then depend on which modules a worker collected."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.jax_enable_x64 and "JAX_ENABLE_X64" not in os.environ:
        raise pytest.UsageError(
            "a test module enabled jax_enable_x64 at import; use the x64 fixture or "
            "`with jax.enable_x64(True)` in the test instead"
        )


@pytest.fixture(autouse=True)
def _x64_flag_restored(request):
    jax = sys.modules.get("jax")
    before = jax is not None and jax.config.jax_enable_x64
    yield
    jax = sys.modules.get("jax")
    after = jax is not None and jax.config.jax_enable_x64
    assert after == before, f"{request.node.nodeid} left jax_enable_x64 changed"


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    yield
    if "jax" not in sys.modules or not _MAPS.exists():
        return
    with _MAPS.open() as f:
        maps = sum(1 for _ in f)
    if maps > _MAX_MAPS:
        sys.modules["jax"].clear_caches()
        gc.collect()


@pytest.fixture
def x64():
    """Float64 for one test only: meta-gradients are compared to 1e-10 or so."""
    import jax  # here, so that tests/planning stays free of jax

    with jax.enable_x64(True):
        yield


@pytest.fixture
def on_cpu():
    """The test's loops on the CPU device, whatever the default backend: it checks plans
    or compiled bytes against XLA:CPU's buffer assignment, which byte budgets are counted
    with (on a GPU they can be exceeded; see the Limitations page)."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def expanded_jaxpr():
    """``expanded_jaxpr(f, *args)``: the text of ``jax.make_jaxpr(f)(*args)`` followed by
    the programs of memento's linear loop primitive (the tangent map, the backward pass,
    ...) wherever it appears, as they are lowered."""
    import jax

    def subjaxprs(value):
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for v in value:
                yield from subjaxprs(v)

    def linear_eqns(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "memento_loop_linear":
                yield eqn
            for sub in subjaxprs(list(eqn.params.values())):
                yield from linear_eqns(sub)

    def text(jaxpr) -> str:
        parts = [str(jaxpr)]
        for eqn in linear_eqns(jaxpr):
            op = eqn.params["op"]
            inner = jax.make_jaxpr(
                lambda *a, op=op: op.apply(list(a[: op.num_res]), list(a[op.num_res :]))
            )(*[v.aval for v in eqn.invars])
            parts.append(text(inner.jaxpr))
        return "\n".join(parts)

    return lambda f, *args: text(jax.make_jaxpr(f)(*args).jaxpr)
