"""Figures for the CLI: a schedule drawn as in Figure 3 of Gruslys et al., and their cost curves.

The curve data (`paper_curves`) is NumPy only; matplotlib is imported inside the drawing
functions, so importing this module stays cheap. Figures are drawn on a bare
`matplotlib.figure.Figure` (no pyplot, no global backend change).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import textwrap
from pathlib import Path

import numpy as np

from ..planning import Op, Schedule, chen_sqrt

__all__ = [
    "Curves",
    "chen_baseline",
    "paper_curves",
    "plot_curves",
    "plot_schedule",
    "write_curves",
]

# The paper's memory sizes (Figures 2a, 5a, 5b) and colours, in that order.
PAPER_MEMORIES = (10, 50, 100, 500, 1000)
PAPER_COLOURS = ("tab:red", "tab:green", "tab:blue", "tab:purple", "tab:cyan")
ALPHA = 5  # internal state / hidden state size in Figures 5b and 6
CHEN_BETAS = (2, 5, 10)  # Figure 7


@dataclasses.dataclass(frozen=True)
class Curves:
    """One panel: y-columns against the sequence length.

    Attributes:
        name: file stem (``fig2a_hsm``...).
        title: panel title.
        ylabel: what the columns are.
        t: sequence lengths, the x axis.
        columns: label -> values (NaN where undefined), one per line.
        reference: an optional horizontal line ``(label, y)``.
    """

    name: str
    title: str
    ylabel: str
    t: np.ndarray
    columns: dict[str, np.ndarray]
    reference: tuple[str, float] | None = None


def _per_step(table: np.ndarray, memory: int) -> np.ndarray:
    """Cost per step C(t, m) / t for t = 1..T, NaN where infeasible."""
    max_steps = table.shape[0] - 1
    t = np.arange(1, max_steps + 1)
    column = table[1:, min(memory, table.shape[1] - 1)] / t
    return np.where(np.isfinite(column), column, np.nan)


def paper_curves(max_steps: int) -> list[Curves]:
    """The data of Figures 2a, 5a, 5b, 6 and 7 of Gruslys et al., for t = 1..max_steps.

    Costs come from `memento.planning.cost_table` (one table per policy and sizes).
    Memory columns above what the longest sequence can use are read from the last
    column computed, where every policy already stores everything it needs.

    Args:
        max_steps: the longest sequence length T.

    Returns:
        A list of panels (`Curves`): fig2a_hsm, fig5a_ism, fig5b_msm, fig6a_10alpha,
        fig6b_20alpha, fig7a_chen_memory, fig7b_chen_cost.
    """
    from ..planning import cost_table

    T = max_steps
    t = np.arange(1, T + 1)
    bptt = ("standard BPTT", 1.0)

    # Costs stop falling once everything fits: T hidden states (HSM), T internal states
    # (ISM); larger budgets read that last column. MSM tables cost O(t m): see _msm.
    hsm = cost_table(T, min(max(PAPER_MEMORIES), T + 1), policy="hsm")
    ism = cost_table(T, min(max(PAPER_MEMORIES), T + 1), policy="ism")
    msm = _msm(T, [ALPHA * m for m in (*PAPER_MEMORIES, 10, 20)], ALPHA)
    panels = [
        Curves(
            "fig2a_hsm",
            "Figure 2a: BPTT-HSM, memory in hidden states",
            "forward operations per time step",
            t,
            {f"m={m}": _per_step(hsm, m) for m in PAPER_MEMORIES},
            bptt,
        ),
        Curves(
            "fig5a_ism",
            "Figure 5a: BPTT-ISM, memory in internal states",
            "forward operations per time step",
            t,
            {f"m={m}": _per_step(ism, m) for m in PAPER_MEMORIES},
            bptt,
        ),
        Curves(
            "fig5b_msm",
            f"Figure 5b: BPTT-MSM, memory in internal states (alpha={ALPHA})",
            "forward operations per time step",
            t,
            {f"m={m}": msm[ALPHA * m] for m in PAPER_MEMORIES},
            bptt,
        ),
    ]
    for tag, internal in (("a", 10), ("b", 20)):
        panels.append(
            Curves(
                f"fig6{tag}_{internal}alpha",
                f"Figure 6{tag}: {internal} internal or {ALPHA * internal} hidden states "
                f"(alpha={ALPHA})",
                "forward operations per time step",
                t,
                {
                    "BPTT-HSM": _per_step(hsm, ALPHA * internal),
                    "BPTT-ISM": _per_step(ism, internal),
                    "BPTT-MSM": msm[ALPHA * internal],
                },
                bptt,
            )
        )
    panels.extend(_chen_panels(T))
    return panels


def _msm(T: int, memories: list[int], alpha: int) -> dict[int, np.ndarray]:
    """MSM cost per step for t = 1..T at each budget in ``memories`` (slots, beta = alpha).

    With ``1 + (t - 1) alpha`` slots every step but the last keeps its internal state and
    C(t, m) = t; budgets at or above that for every t need no table. The table, O(t m),
    is computed only up to the largest budget that is still short somewhere (at T = 1000,
    2500 slots instead of 5000).
    """
    from ..planning import cost_table

    t = np.arange(1, T + 1)
    fits = 1 + (t - 1) * alpha
    short = [m for m in memories if m < fits[-1]]
    table = cost_table(T, max(short), policy="msm", alpha=alpha) if short else None
    out = {}
    for m in memories:
        cost = t.astype(np.float64)
        if table is not None and m in short:
            cost = np.where(m >= fits, cost, table[1:, m])
        out[m] = np.where(np.isfinite(cost), cost / t, np.nan)
    return out


def _chen_panels(T: int) -> list[Curves]:
    """Figure 7: MSM against Chen's sqrt(t) budget sqrt(t)(1 + beta), alpha = beta + 1."""
    from ..planning import cost_table

    t = np.arange(1, T + 1)
    chen_memory = np.sqrt(t)
    memory_ratio, cost = {}, {}
    for beta in CHEN_BETAS:
        budget = chen_memory * (1 + beta)
        # Enough columns for Chen's own budget (its schedule fits in about that).
        max_memory = math.ceil(budget[-1]) + 2 * (beta + 1) + 2
        table = cost_table(T, max_memory, policy="msm", alpha=beta + 1, beta=beta)
        # Left: the least memory whose optimal cost is at most 2 per step.
        fits = table[1:] <= 2 * t[:, None]
        least = np.where(fits.any(axis=1), fits.argmax(axis=1), np.nan)
        memory_ratio[f"beta={beta}"] = least / budget
        # Right: optimal cost per step within Chen's budget.
        rows = table[t, np.floor(budget).astype(int)] / t
        cost[f"beta={beta}"] = np.where(np.isfinite(rows), rows, np.nan)
    return [
        Curves(
            "fig7a_chen_memory",
            "Figure 7 (left): memory at cost 2 per step / sqrt(t)(1+beta)",
            "memory / (sqrt(t) (1 + beta))",
            t,
            memory_ratio,
            ("Chen's sqrt(t)", 1.0),
        ),
        Curves(
            "fig7b_chen_cost",
            "Figure 7 (right): cost per step with memory sqrt(t)(1+beta)",
            "forward operations per time step",
            t,
            cost,
            ("Chen's sqrt(t)", 2.0),
        ),
    ]


def chen_baseline(max_steps: int, *, points: int = 60) -> Curves:
    """Chen's sqrt(t) schedules themselves, replayed, on a log-spaced grid of t.

    Returns memory / (sqrt(t)(1 + beta)) and cost per step for each beta of Figure 7.
    """
    t = np.unique(np.geomspace(1, max_steps, points).round().astype(int))
    columns = {}
    for beta in CHEN_BETAS:
        runs = [chen_sqrt(int(n), alpha=beta + 1, beta=beta) for n in t]
        columns[f"memory_ratio_beta={beta}"] = np.array(
            [s.memory / (math.sqrt(s.num_steps) * (1 + beta)) for s in runs]
        )
        columns[f"cost_per_step_beta={beta}"] = np.array([s.cost_per_step for s in runs])
    return Curves("fig7_chen_baseline", "Chen's sqrt(t), replayed", "", t, columns)


def _write_csv(curves: Curves, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t", *curves.columns])
        for i, n in enumerate(curves.t):
            writer.writerow([int(n), *(f"{v[i]:.6g}" for v in curves.columns.values())])


def _draw(ax, curves: Curves, colours) -> None:
    for (label, values), colour in zip(curves.columns.items(), colours, strict=False):
        if curves.reference is not None and np.allclose(values, curves.reference[1]):
            label += f" (= {curves.reference[0]} throughout)"
        ax.plot(curves.t, values, color=colour, label=label, linewidth=1.6)
    if curves.reference is not None:
        # Dashed and on top: a curve that reaches the reference (m=1000 in Figures 5a and
        # 5b is plain BPTT) shows through the gaps instead of hiding it.
        label, y = curves.reference
        ax.axhline(y, color="black", linewidth=1.2, linestyle=(0, (4, 4)), label=label, zorder=3)
    ax.set_title(curves.title, fontsize=10)
    ax.set_xlabel("sequence length t")
    ax.set_ylabel(curves.ylabel)
    ax.set_xlim(0, curves.t[-1])
    ax.grid(alpha=0.3)
    _legend_below(ax)


def _legend_below(ax) -> None:
    """The legend under the axes, where it cannot hide a curve."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)


def plot_curves(panels: list[Curves], out_dir: Path, *, chen: Curves | None = None) -> list[Path]:
    """Draws the figures of `paper_curves` as PNGs in ``out_dir``; returns their paths.

    Figure 6 and Figure 7 are drawn as two panels side by side, as in the paper; Chen's
    replayed schedules (`chen_baseline`) are overlaid on Figure 7 when given.
    """
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    by_name = {p.name: p for p in panels}
    three = ("tab:red", "tab:green", "tab:blue")
    layout = [
        ("fig2a_hsm", ["fig2a_hsm"], PAPER_COLOURS),
        ("fig5a_ism", ["fig5a_ism"], PAPER_COLOURS),
        ("fig5b_msm", ["fig5b_msm"], PAPER_COLOURS),
        ("fig6_compare", ["fig6a_10alpha", "fig6b_20alpha"], three),
        ("fig7_chen", ["fig7a_chen_memory", "fig7b_chen_cost"], three),
    ]
    written = []
    for stem, names, colours in layout:
        fig = Figure(figsize=(6.4 * len(names), 5.2), layout="constrained")
        axes = fig.subplots(1, len(names), squeeze=False)[0]
        for ax, name in zip(axes, names, strict=True):
            _draw(ax, by_name[name], colours)
        if stem == "fig7_chen" and chen is not None:
            for beta, colour in zip(CHEN_BETAS, colours, strict=True):
                axes[0].plot(
                    chen.t,
                    chen.columns[f"memory_ratio_beta={beta}"],
                    ":",
                    color=colour,
                    linewidth=1.5,
                    label=f"Chen, beta={beta} (replayed)",
                )
            axes[1].plot(
                chen.t,
                chen.columns[f"cost_per_step_beta={CHEN_BETAS[0]}"],
                ":",
                color="tab:grey",
                linewidth=1.8,
                label="Chen (replayed)",
            )
            for ax in axes:
                _legend_below(ax)
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=130)
        written.append(path)
    return written


def write_curves(max_steps: int, out_dir, *, log=None) -> list[Path]:
    """Computes the paper's curves for t = 1..max_steps; writes PNGs and CSVs to ``out_dir``.

    Nothing is written, and ``out_dir`` is not created, unless the curves can be computed
    and matplotlib imported.

    Args:
        max_steps: the longest sequence length T.
        out_dir: the folder (created if missing).
        log: called with a line of progress at each stage, if given.

    Returns:
        The paths written: one PNG per figure, one CSV per panel.
    """
    import matplotlib.figure  # noqa: F401  (fail before computing or writing anything)

    log = log or (lambda _: None)
    log(f"computing the HSM, ISM and MSM cost tables for t = 1..{max_steps} ...")
    panels = paper_curves(max_steps)
    log("replaying Chen's schedules ...")
    chen = chen_baseline(max_steps)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"drawing into {out_dir} ...")
    written = plot_curves(panels, out_dir, chen=chen)
    for curves in [*panels, chen]:
        path = out_dir / f"{curves.name}.csv"
        _write_csv(curves, path)
        written.append(path)
    return written


@dataclasses.dataclass
class _Drawing:
    """A schedule as line segments and dots in (position, row) coordinates."""

    forward: list = dataclasses.field(default_factory=list)
    backward: list = dataclasses.field(default_factory=list)
    held_h: list = dataclasses.field(default_factory=list)
    held_i: list = dataclasses.field(default_factory=list)
    dots_h: list = dataclasses.field(default_factory=list)
    dots_i: list = dataclasses.field(default_factory=list)
    rows: int = 1


def _segments(schedule: Schedule) -> _Drawing:
    d = _Drawing()
    live_h: dict[int, tuple[int, int]] = {}  # slot -> (pos, row saved)
    live_i: dict[int, tuple[int, int]] = {}
    row = 0
    for op, arg, pos in schedule.actions.tolist():
        if op == Op.ADVANCE:
            d.forward.append([(pos, row), (pos + arg, row)])
        elif op == Op.SAVE_HIDDEN:
            d.dots_h.append((pos, row))
            live_h[arg] = (pos, row)
        elif op == Op.SAVE_INTERNAL:
            d.forward.append([(pos, row), (pos + 1, row)])
            d.dots_i.append((pos + 0.5, row))
            live_i[arg] = (pos, row)
        elif op in (Op.BACKWARD_FUSED, Op.BACKWARD_INTERNAL):
            d.backward.append([(pos + 1, row), (pos, row)])
            row += 1
        elif op == Op.FREE_HIDDEN:
            x, start = live_h.pop(arg)
            d.held_h.append([(x, start), (x, row)])
        elif op == Op.FREE_INTERNAL:
            x, start = live_i.pop(arg)
            d.held_i.append([(x + 0.5, start), (x + 0.5, row)])
    d.rows = max(row, 1)
    # States never released are held until the end; h_0 too when it takes a slot.
    if schedule.counts_initial:
        live_h[-1] = (0, 0)
        d.dots_h.append((0, 0))
    d.held_h += [[(x, s), (x, d.rows)] for x, s in live_h.values()]
    d.held_i += [[(x + 0.5, s), (x + 0.5, d.rows)] for x, s in live_i.values()]
    return d


# Dark, saturated colours: thin lines stay visible on white at thousands of rows.
_GREEN, _BLUE, _RED = "#1a7f37", "#0a4fb0", "#d1242f"


def _draw_schedule(ax, d: _Drawing, *, width: float, size: float) -> None:
    from matplotlib.collections import LineCollection

    ax.add_collection(LineCollection(d.held_h, colors=_GREEN, linewidths=width, alpha=0.75))
    ax.add_collection(LineCollection(d.held_i, colors=_BLUE, linewidths=width, alpha=0.75))
    ax.add_collection(LineCollection(d.forward, colors="black", linewidths=width))
    # Backward steps on top and wider: at thousands of rows they form a visible front.
    ax.add_collection(
        LineCollection(d.backward, colors=_RED, linewidths=max(3.0, 2 * width), zorder=3)
    )
    if d.dots_h:
        ax.plot(*np.array(d.dots_h).T, "o", color=_GREEN, markersize=size)
    if d.dots_i:
        ax.plot(*np.array(d.dots_i).T, "s", color=_BLUE, markersize=size)
    ax.set_xlabel("logical time (position in the sequence)")
    ax.set_ylabel("execution order (backward steps done)")


def _zoom_window(d: _Drawing, width: int) -> tuple[float, float, float, float]:
    """Positions [0, width) over the rows that back-propagate them (and two before).

    Near the start of the sequence, at the end of execution, a dense schedule's fine
    structure (recomputed runs, stored states, one backward step per row) is readable.
    """
    first = min((r for (x0, r), (x1, _) in d.backward if min(x0, x1) < width), default=0)
    return -0.5, width + 0.5, d.rows + 0.5, max(first - 2, 0) - 0.5


_CAPTION = (
    "Black: forward steps (recomputation included); red: backward steps, one per row "
    "(a fused one re-runs its step first). Vertical lines: how long a stored state "
    "stays in memory, from its save (dot) to its release: green a hidden state, blue an "
    "internal state."
)


def plot_schedule(schedule: Schedule, path, *, title: str | None = None) -> None:
    """Draws ``schedule`` as Figure 3 of Gruslys et al. and saves it to ``path``.

    Logical time (the position in the sequence) runs left to right, execution top to
    bottom: each backward step ends a row. Black: forward computations; red: backward
    computations (a fused one re-runs its step first); green dots and lines: hidden
    states stored, from save to release; blue squares and lines: internal states.
    Schedules longer than 60 steps or rows get a second panel that zooms on the first
    positions, where the last rows run, so that single steps stay readable.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    d = _segments(schedule)
    t = schedule.num_steps
    dense = d.rows > 60 or t > 60
    if dense:
        fig = Figure(figsize=(14, 8.5), layout="constrained")
        ax, zoom = fig.subplots(1, 2, width_ratios=[3, 2])
    else:
        fig = Figure(figsize=(11, min(12, 3.5 + d.rows * 0.12)), layout="constrained")
        ax, zoom = fig.subplots(), None
    _draw_schedule(ax, d, width=1.4 if dense else 2.5, size=3 if dense else 7)
    ax.set_xlim(-0.02 * t - 0.5, t * 1.02 + 0.5)
    ax.set_ylim(d.rows + 0.5, -0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if title is None:
        title = (
            f"{schedule.policy}: t={t}, memory={schedule.memory} slots, "
            f"cost={schedule.cost} ({schedule.cost_per_step:.2f} forwards per step)"
        )
    ax.set_title(title, fontsize=10)
    if zoom is not None:
        x0, x1, y0, y1 = _zoom_window(d, min(t, 40))
        _draw_schedule(zoom, d, width=2.5, size=7)
        zoom.set_xlim(x0, x1)
        zoom.set_ylim(y0, y1)
        zoom.yaxis.set_major_locator(MaxNLocator(integer=True))
        zoom.set_title(f"zoom: positions 0-{int(x1)}, the last {int(y0 - y1)} rows", fontsize=10)
        ax.add_patch(
            Rectangle((x0, y1), x1 - x0, y0 - y1, fill=False, edgecolor="tab:orange", linewidth=2)
        )
    handles = [
        Line2D([], [], color="black", linewidth=2.5, label="forward computation"),
        Line2D([], [], color=_RED, linewidth=3, label="backward computation"),
        Line2D([], [], color=_GREEN, linewidth=2.5, marker="o", label="hidden state stored"),
        Line2D([], [], color=_BLUE, linewidth=2.5, marker="s", label="internal state stored"),
    ]
    if zoom is not None:
        handles.append(Line2D([], [], color="tab:orange", linewidth=2, label="zoomed area"))
    fig.legend(handles=handles, fontsize=9, loc="outside upper center", ncol=len(handles))
    fig.supxlabel(textwrap.fill(_CAPTION, 150 if dense else 120), fontsize=8)
    fig.savefig(path, dpi=130)
