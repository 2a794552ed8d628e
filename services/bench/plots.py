"""PNG plots of a bench run: speedup per category per mode, acceptance per draft position."""

from __future__ import annotations

import logging
from pathlib import Path

from services.bench.report import Aggregate

logger = logging.getLogger(__name__)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _label(row: Aggregate) -> str:
    return f"{row.mode} (synthetic)" if row.synthetic else row.mode


def _save(plt, figure, axes, title: str, path: Path) -> Path:
    axes.set_title(title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_speedup(rows: list[Aggregate], path: Path) -> Path | None:
    """Grouped bars: one group per category (and the open/grounded groups), one bar per non-ar mode."""
    measured = [row for row in rows if row.mode != "ar" and row.speedup_vs_ar is not None]
    if not measured:
        return None
    plt = _pyplot()
    scopes = sorted({row.scope for row in measured}, key=lambda s: (not s.startswith("group:"), s))
    modes = list(dict.fromkeys(_label(row) for row in measured))
    value = {(_label(row), row.scope): row.speedup_vs_ar for row in measured}
    width = 0.8 / len(modes)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.0 * len(scopes) + 2), 4.5))
    for index, mode in enumerate(modes):
        xs = [position + index * width for position in range(len(scopes))]
        axes.bar(xs, [value.get((mode, scope), 0.0) for scope in scopes], width, label=mode)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks([position + 0.4 - width / 2 for position in range(len(scopes))])
    axes.set_xticklabels([scope.split(":", 1)[-1] for scope in scopes], rotation=30, ha="right")
    axes.set_ylabel("speedup over ar (tokens/s)")
    return _save(plt, figure, axes, "Speedup per category", path)


def plot_acceptance_per_position(rows: list[Aggregate], path: Path) -> Path | None:
    """One line per drafting mode: acceptance rate at draft position 1, 2, ... (scope `all`)."""
    drafting = [row for row in rows if row.scope == "all" and row.acceptance_rate_per_pos]
    if not drafting:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    for row in drafting:
        positions = range(1, len(row.acceptance_rate_per_pos) + 1)
        axes.plot(positions, row.acceptance_rate_per_pos, marker="o", label=_label(row))
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0.0, 1.05)
    return _save(plt, figure, axes, "Acceptance per position", path)
