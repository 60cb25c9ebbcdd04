"""mkdocs hooks: the figures and benchmark tables the pages show, generated at build time.

Nothing generated is committed. ``on_files`` draws the paper's curves (``memento curves``)
and two small schedules into a temporary folder and adds them to the site as
``figures/*.png``; ``on_page_markdown`` replaces ``<!-- results: NAME -->`` markers with
``benchmarks/results/NAME`` (a Markdown file as is, a JSON file as tables).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURE_STEPS = 1000  # the paper's t range; about 3 s of planning
_tmp = tempfile.TemporaryDirectory(prefix="memento-docs-")


def _figures() -> list[Path]:
    from memento import plan
    from memento.apps.plotting import plot_schedule, write_curves

    out = Path(_tmp.name)
    written = [p for p in write_curves(FIGURE_STEPS, out) if p.suffix == ".png"]
    for name, schedule in {
        "schedule_hsm": plan(30, 4, policy="hsm"),
        "schedule_ism": plan(30, 6, policy="ism"),
        "schedule_msm": plan(30, 10, policy="msm", alpha=3),
    }.items():
        path = out / f"{name}.png"
        plot_schedule(schedule, path)
        written.append(path)
    return written


def on_files(files, config):
    for path in _figures():
        files.append(File.generated(config, f"figures/{path.name}", abs_src_path=str(path)))
    return files


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None or isinstance(value, (list, dict)):
        return ""
    return str(value).replace("|", "\\|")


def _json_tables(data: dict) -> str:
    """Every list of records in ``data`` as a table of its scalar columns."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            columns = [c for c in value[0] if not isinstance(value[0][c], (list, dict))]
            lines = [f"**{key}**", "", "| " + " | ".join(columns) + " |"]
            lines.append("|" + "---|" * len(columns))
            lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in value]
            parts.append("\n".join(lines))
        elif isinstance(value, dict) and key in ("machine", "environment"):
            described = ", ".join(f"{k}: {_cell(v)}" for k, v in value.items() if _cell(v))
            parts.append(f"*{key}*: {described}")
    return "\n\n".join(parts)


def _results(name: str) -> str:
    path = RESULTS / name
    if path.suffix == ".json":
        return _json_tables(json.loads(path.read_text()))
    text = path.read_text()
    # The file's own title would be a second h1 in the page: demote every heading.
    return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


def on_page_markdown(markdown, page, config, files):
    import re

    return re.sub(r"<!-- results: (\S+) -->", lambda m: _results(m.group(1)), markdown)
