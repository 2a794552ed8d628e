"""Verifier capacity (`mirror-sd bench --capacity`): how many concurrent streams a stack sustains while each
stream still gets a per-stream target, read off a concurrency bench's levels, per mode.

The target is either a decoding speed per stream (`10`: at least 10 tokens/s each, from the typical
stream's time per output token, 1000 / TPOT p50) or an inter-token latency (`itl:100`: ITL p50 at most
100 ms). A mode's capacity is the largest number of streams in flight that meets it, interpolated
linearly between the last measured level that met it and the first that did not (so 1, 2, 4, 8, 16, 32
levels give a figure between them, not only a power of two); "at least" the largest level when every
level met it, 0 when none did. With `--draft-link`, once per link level: capacity against RTT, for the
stack's remote drafts and its plain route side by side (capacity.md / capacity.png in the output folder).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_LEVELS = "1,2,4,8,16,32"


@dataclass(frozen=True)
class CapacityTarget:
    kind: str  # "rate": tokens/s per stream, at least; "itl": ITL p50 ms, at most
    value: float

    def describe(self) -> str:
        return f">= {self.value:g} tok/s per stream" if self.kind == "rate" else f"ITL p50 <= {self.value:g} ms"

    def measure(self, row) -> float | None:
        """The row's figure for this target (a concurrency LevelRow), None when it has none."""
        if self.kind == "itl":
            return row.itl_p50_ms
        return 1000.0 / row.tpot_p50_ms if row.tpot_p50_ms else None

    def met(self, figure: float) -> bool:
        return figure >= self.value if self.kind == "rate" else figure <= self.value


def parse_capacity_target(text: str) -> CapacityTarget:
    """`10` or `10tok/s` (tokens/s per stream) or `itl:100` (ms); ValueError naming the bad value."""
    raw = text.strip().lower()
    kind = "rate"
    if raw.startswith("itl:"):
        kind, raw = "itl", raw[4:].removesuffix("ms")
    else:
        raw = raw.removesuffix("tok/s")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--capacity {text!r}: give tokens/s per stream (10) or an ITL p50 in ms (itl:100)") \
            from None
    if value <= 0:
        raise ValueError(f"--capacity {text!r}: the target must be positive")
    return CapacityTarget(kind, value)


@dataclass
class Capacity:
    mode: str
    streams: float  # interpolated; the largest level when every level met the target
    at_least: bool  # every measured level met it: the capacity is above what was measured
    met_levels: list[int]
    figures: dict[int, float | None]  # concurrency -> the target's figure there


def capacity(points: list[tuple[int, float | None]], target: CapacityTarget, mode: str) -> Capacity:
    """points: (concurrency, figure) of one mode. Levels are read in order; the first that misses the
    target ends the count (a later level that meets it again is noise, not capacity)."""
    ordered = sorted(points)
    figures = dict(ordered)
    met: list[int] = []
    for index, (level, figure) in enumerate(ordered):
        if figure is None or not target.met(figure):
            if not met:
                return Capacity(mode, 0.0, False, [], figures)
            low_level, low_figure = ordered[index - 1]
            if figure is None or figure == low_figure:
                return Capacity(mode, float(low_level), False, met, figures)
            share = (low_figure - target.value) / (low_figure - figure)  # where the line crosses the target
            return Capacity(mode, round(low_level + share * (level - low_level), 1), False, met, figures)
        met.append(level)
    return Capacity(mode, float(ordered[-1][0]) if ordered else 0.0, bool(ordered), met, figures)


def capacities(rows, target: CapacityTarget) -> list[Capacity]:
    """Per mode of a concurrency bench's rows."""
    modes = list(dict.fromkeys(row.mode for row in rows))
    return [capacity([(row.concurrency, target.measure(row)) for row in rows if row.mode == mode], target, mode)
            for mode in modes]


def describe_capacity(found: Capacity) -> str:
    return f"{'>= ' if found.at_least else ''}{found.streams:g}"


def write_capacity(folder: Path, found: list[Capacity], target: CapacityTarget) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"Capacity: streams in flight each getting {target.describe()} (interpolated between levels)", "",
             "| mode | streams | levels that met it | figure per level |", "|---|---|---|---|"]
    for row in found:
        per_level = ", ".join(f"{level}: {'–' if value is None else f'{value:.1f}'}"
                              for level, value in row.figures.items())
        lines.append(f"| {row.mode} | {describe_capacity(row)} | {', '.join(map(str, row.met_levels)) or '–'} | "
                     f"{per_level} |")
    paths = [folder / "capacity.md", folder / "capacity.json"]
    paths[0].write_text("\n".join(lines) + "\n")
    paths[1].write_text(json.dumps({"target": asdict(target), "capacity": [asdict(row) for row in found]},
                                   indent=1))
    return paths


def headline(found: list[Capacity]) -> dict:
    """The figures a link level's row shows (links.md), one per mode."""
    return {f"capacity {row.mode}": describe_capacity(row) for row in found}


def capacity_figure(value) -> float:
    """A level's capacity as its row wrote it ("8", ">= 16"), or its turns' (services/bench/turns.py: "8 / 16"):
    the median."""
    import statistics

    return statistics.median(float(part.strip().removeprefix(">= ")) for part in str(value).split("/"))


def plot_capacity_vs_link(levels: list[tuple[str, dict]], target: CapacityTarget, path: Path) -> Path | None:
    """levels: (link label, its headline); capacity per mode against the link's RTT."""
    series: dict[str, list[tuple[float, float]]] = {}
    for label, figures in levels:
        rtt = float(label.split(":")[0].split("j")[0])
        for key, value in figures.items():
            if key.startswith("capacity "):
                series.setdefault(key.removeprefix("capacity "), []).append((rtt, capacity_figure(value)))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for mode, points in series.items():
        points.sort()
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
    axes.set_xlabel("draft link RTT (ms)")
    axes.set_ylabel("streams per verify worker")
    axes.set_title(f"Capacity at {target.describe()}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
