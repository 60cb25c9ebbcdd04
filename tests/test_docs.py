"""The README and the documentation pages say only what runs and what was measured.

- Every ```python block of README.md and docs/*.md runs, each in a fresh namespace (so
  each is self-contained); blocks written as an interactive session (``>>>``) run as
  doctests and must print what they show. A block that deliberately does not run is
  preceded by ``<!-- not run: why -->``; there are at most ``MAX_NOT_RUN`` of them.
- A block that only includes a file (``--8<-- "examples/x.py"``) is run where that file
  is: README.md's sections here, the examples by tests/test_examples.py.
- The `memento plan` output the README quotes is what the command prints.
- The tables of measurements in the README and the docs are the committed results files
  (benchmarks/results/*.json), to the digits shown.
"""

import doctest
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_NOT_RUN = 2

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: \S.*?-->\s*$")
_INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$')


def _blocks(page: Path) -> list[tuple[str, int, str, str | None]]:
    """(language, line, code, why it is not run or None) of every fenced block."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        why = before if _NOT_RUN.search(before) else None
        line = text.count("\n", 0, match.start()) + 1
        found.append((match.group(1), line, match.group(2), why))
    return found


def _python_blocks():
    for page in PAGES:
        for language, line, code, why in _blocks(page):
            if language == "python":
                yield pytest.param(page, line, code, why, id=f"{page.name}:{line}")


PYTHON_BLOCKS = list(_python_blocks())


def test_there_are_blocks_and_few_are_not_run():
    assert len(PYTHON_BLOCKS) >= 8
    not_run = [p.id for p in PYTHON_BLOCKS if p.values[3] is not None]
    assert len(not_run) <= MAX_NOT_RUN, not_run


@pytest.mark.parametrize("page, line, code, why", PYTHON_BLOCKS)
def test_python_block_runs(page, line, code, why):
    if why is not None:
        pytest.skip(why)
    if include := _INCLUDE.match(code.strip()):
        target = include.group(1)
        path, _, section = target.partition(":")
        if path.startswith("examples/"):
            from test_examples import EXAMPLES  # run there, with their small sizes

            assert Path(path).name in EXAMPLES and (ROOT / path).is_file()
            return
        assert path == "README.md" and section, f"{page.name}:{line} includes {target}"
        start, end = f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"
        readme = (ROOT / "README.md").read_text()
        assert start in readme and end in readme  # the README's block runs as itself
        return
    pytest.importorskip("jax")
    if code.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(code, {}, page.name, str(page), line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        result = runner.summarize(verbose=False)
        assert result.attempted > 0 and result.failed == 0, f"{page.name}:{line}"
        return
    for needs in ("optax", "equinox", "diffrax", "flax", "torch"):
        if re.search(rf"^\s*(import|from) {needs}\b|import .*\b{needs}\b", code, re.M):
            pytest.importorskip(needs)
    exec(compile(code, f"{page.name}:{line}", "exec"), {"__name__": "snippet"})


def test_readme_plan_output_is_the_clis(capsys):
    from memento import cli

    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ memento plan --steps 1000 --memory 50 --policy ism\n", 1)[1]
    quoted = block.split("```", 1)[0]
    assert cli.main(["plan", "--steps", "1000", "--memory", "50", "--policy", "ism"]) == 0
    assert capsys.readouterr().out == quoted


# -- the pages' tables against benchmarks/results ----------------------------------------

_UNITS = {"s": 1.0, "ms": 1e-3, "KiB": 1.0, "MiB": 1024.0}


def _shown(text: str, value: float, unit_scale: float = 1.0) -> bool:
    """Whether ``text`` (a number as printed) is ``value / unit_scale`` to its digits."""
    digits = len(text.split(".")[1]) if "." in text else 0
    shown = float(text)
    scaled = value / unit_scale
    half = 0.5 * 10.0**-digits * (1 + 1e-9)
    return abs(scaled - shown) <= half


def _table(after_text: str, page: str = "README.md") -> list[list[str]]:
    """The first Markdown table after ``after_text`` in ``page``, without its rule line."""
    text = (ROOT / page).read_text()
    lines = text.split(after_text, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return [r for r in rows if not set("".join(r)) <= set("-: ")]


def _quantity(text: str) -> tuple[str, float]:
    number, unit = text.split()
    return number, _UNITS[unit]


def test_readme_headline_table_is_results_pareto_json():
    # "What it costs": benchmarks/pareto.py's headline table, rendered from its results.
    import pareto

    data = json.loads((ROOT / "benchmarks/results/pareto.json").read_text())
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in pareto.headline(data["results"]) if line.startswith("| ")]
    assert len(rows) >= 3
    for line in rows:
        assert line in readme, line


def test_benchmarks_gpu_table_is_results_gpu_pareto_jsons():
    # "On a GPU": pareto.py's headline rows of the H200 run, rendered from its results.
    import pareto

    results = []
    for name in ("pareto", "pareto_more", "pareto_more_2"):
        path = ROOT / "benchmarks/results/gpu/2026-11-30" / f"{name}.json"
        results += json.loads(path.read_text())["results"]
    page = (ROOT / "docs/benchmarks.md").read_text()
    rows = [line for line in pareto.headline(results) if line.startswith("| ")]
    assert len(rows) == 13
    for line in rows:
        assert line in page, line


def _grid_tables_on_page(name: str) -> dict:
    """Asserts that the headline and every executor's rows at each budget of
    ``benchmarks/results/{name}.json`` are on the Benchmarks page; returns the JSON."""
    import pareto

    data = json.loads((ROOT / f"benchmarks/results/{name}.json").read_text())
    page = (ROOT / "docs/benchmarks.md").read_text()
    rows = [line for line in pareto.markdown(data).splitlines() if line.startswith("| ")]
    rows = [line for line in rows if not line.startswith(("| body |", "| --- |"))]
    n = len(data["results"])
    assert len(rows) == 5 * n  # the headline, three budgets, the peers
    for line in rows[: 4 * n]:
        assert line in page, line
    return data


def test_benchmarks_reductions_tables_are_results_pareto_reductions_json():
    # "memento at its peers' bytes": the wide reductions' headline and every executor's
    # rows at each budget, rendered from their results.
    _grid_tables_on_page("pareto_reductions")


def test_benchmarks_tally_tables_are_results_pareto_tally_json():
    # The tally body's headline and every executor's rows at each budget; every auto
    # cell passes.
    data = _grid_tables_on_page("pareto_tally")
    assert all(b["memento"]["auto"]["pass"] for r in data["results"] for b in r["budgets"])


def test_benchmarks_first_call_table_is_results_pareto_first_call_json():
    # "First calls of bodies that take microseconds a step", rendered from its results.
    import pareto

    data = json.loads((ROOT / "benchmarks/results/pareto_first_call.json").read_text())
    page = (ROOT / "docs/benchmarks.md").read_text()
    rows = [line for line in pareto.markdown(data).splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(data["first_call"])
    for row in rows[2:]:
        assert row in page, row
    memento = [fc["methods"]["memento auto"] for fc in data["first_call"]]
    assert all(m.get("vs_lax_scan", m["vs_nested"]) <= 2.0 for m in memento)


def test_jax_guide_long_loop_table_is_results_long_json():
    results = json.loads((ROOT / "benchmarks/results/long.json").read_text())
    rows = {(r["method"], r["T"]): r for r in results["results"]}
    ratios = {
        (r["method"], r["T"]): r["first_call_vs_lax_scan"] for r in results["first_call_ratios"]
    }
    table = _table("`python benchmarks/long.py`", "docs/jax.md")
    assert table[0][0] == "T" and len(table) == 5
    for T_text, first, lax_first, ratio, per_grad, memory in table[1:]:
        T = 10 ** int(T_text.removeprefix("10^"))
        ours, lax = rows["memento_hsm", T], rows.get(("lax_scan", T))
        number, scale = _quantity(first)
        assert _shown(number, ours["first_s"], scale), (T, first, ours["first_s"])
        number, scale = _quantity(per_grad)
        assert _shown(number, ours["steady_s"], scale), (T, per_grad, ours["steady_s"])
        shown_memory = memory.split(" / ")
        number, scale = _quantity(shown_memory[0])
        assert _shown(number, ours["temp_kib"], scale), (T, memory, ours["temp_kib"])
        if lax is None:  # too large to run: the table says why instead of a number
            assert lax_first.startswith("(") and ratio == "" and len(shown_memory) == 1
            continue
        number, scale = _quantity(lax_first)
        assert _shown(number, lax["first_s"], scale), (T, lax_first, lax["first_s"])
        assert _shown(ratio, ratios["memento_hsm", T]), (T, ratio)
        number, scale = _quantity(shown_memory[1])
        assert _shown(number, lax["temp_kib"], scale), (T, memory, lax["temp_kib"])


def test_jax_guide_sharded_table_is_results_sharded_json():
    results = json.loads((ROOT / "benchmarks/results/sharded.json").read_text())
    rows = {(r["workload"], r["mode"], r["method"].split()[0]): r for r in results["rows"]}
    table = _table("`python benchmarks/sharded.py`", "docs/jax.md")
    assert table[0][:3] == ["workload", "sharding", "checkpoint/step"] and len(table) == 5
    for name, sharding, *cells in table[1:]:
        if not name.startswith(("LSTM", "residual block")) or not cells:
            raise AssertionError(name)
        workload = "lstm" if name.startswith("LSTM") else "block"
        mode = "dp" if sharding == "batch" else "mp"
        for method, cell in zip(["checkpoint/step", "memento", "equinox"], cells, strict=True):
            memory, time = (c.split()[0].removesuffix("x") for c in cell.split(","))
            row = rows[workload, mode, method]
            assert _shown(memory, row["memory_ratio"]), (name, sharding, method, cell)
            assert _shown(time, row["time_ratio"]), (name, sharding, method, cell)


def test_jax_guide_small_loops_table_is_results_small_loops_json():
    results = json.loads((ROOT / "benchmarks/results/small_loops.json").read_text())
    rows = {(r["threshold"], r["cell"], r["width"]): r for r in results["rows"]}
    table = _table("`python benchmarks/small_loops.py`", "docs/jax.md")
    assert table[0][0] == "cell, width" and len(table) == 9
    cells = {"`tanh(W @ h + x)`": "matvec", "`tanh(1.01 h + x)`": "elementwise"}
    for name, default, raised, times in table[1:]:
        body, width = name.rsplit(", ", 1)
        ran = [rows["default", cells[body], int(width)], rows["65536", cells[body], int(width)]]
        for shown, row in zip((default, raised), ran, strict=True):
            ratio = row["vs_checkpoint"]["memento recursion"]
            assert _shown(shown.removesuffix("x"), ratio), (name, shown, ratio)
        for shown, row in zip(times.split(" / "), ran, strict=True):
            number, scale = _quantity(shown)
            seconds = row["seconds"]["memento recursion"]
            assert _shown(number, seconds, scale), (name, shown, seconds)


def test_benchmarks_gpu_lstm_table_is_results_gpu_gpu_rnn_json():
    # Each number of the Benchmarks page's GPU LSTM table is a row of the three result files
    # (the first that has the method at that T), its time ratio against that file's
    # own lax.scan.
    rows = {}
    for name in ("gpu_rnn.json", "gpu_rnn_1e3_peers.json", "gpu_rnn_1e4.json"):
        data = json.loads((ROOT / "benchmarks/results/gpu" / name).read_text())
        lax = {r["steps"]: r["steady_s"] for r in data["rows"] if r["method"] == "lax.scan"}
        for r in data["rows"]:
            if "steady_s" in r:
                rows.setdefault((r["method"], r["steps"]), (r, lax[r["steps"]]))
    names = {"`lax.scan`": "lax.scan", "`lax.scan(jax.checkpoint(step))`": "lax.scan+ckpt",
             "nested sqrt(T) `lax.scan`s": "nested sqrt(T)", "Equinox, 5% checkpoints": "equinox 5%"}  # fmt: skip
    table = _table("`python benchmarks/gpu_rnn.py`", "docs/benchmarks.md")
    assert table[0][0] == "method" and len(table) == 8
    shown = 0
    for name, *cells in table[1:]:
        method = names.get(name, name)
        for steps, (peak, time, ratio) in zip((1000, 10000), (cells[:3], cells[3:])):
            if peak == "—":
                assert (method, steps) not in rows or "memento" in method, (method, steps)
                continue
            row, lax = rows[method, steps]
            number, unit = peak.split()
            assert unit == "MiB" and _shown(number, row["peak_bytes"] / 2**20), (method, peak)
            number, scale = _quantity(time)
            assert _shown(number, row["steady_s"], scale), (method, steps, time)
            assert _shown(ratio, row["steady_s"] / lax), (method, steps, ratio)
            shown += 1
    assert shown == 11
