"""The bench's outputs: Markdown tables, and curves of several runs on one chart (reward against wall clock)."""

from __future__ import annotations

from pathlib import Path

STYLES = ["-", "--", ":", "-."]


def cell(value, spec: str) -> str:
    """``value`` formatted with ``spec`` for a table cell, ``-`` where there is none."""
    return "-" if value is None else format(value, spec)


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A Markdown table of ``lines`` under ``header`` (no trailing newline)."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


SERIES_COLOURS = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                  "tab:pink", "tab:olive", "tab:cyan"]  # the reference (the first series) grey, then tab10's order


def series_colours(count: int) -> list:
    """``count`` distinct colours: :data:`SERIES_COLOURS` while they last, else grey for the reference and the
    others evenly spaced over a rainbow."""
    if count <= len(SERIES_COLOURS):
        return SERIES_COLOURS[:count]
    from matplotlib import colormaps
    return [SERIES_COLOURS[0], *(colormaps["turbo"](k / (count - 2)) for k in range(count - 1))]


def plot_curves(series: list[tuple[str, dict[str, list]]], title: str, xlabel: str, ylabel: str,
                path: str | Path) -> None:
    """One colour per ``(name, {seed: [[x, y], ...]})`` of ``series`` (:func:`series_colours`: grey, then blue,
    ...), one line style per seed; written as a PNG to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=110)
    for (name, curves), colour in zip(series, series_colours(len(series)), strict=True):
        for k, (seed, curve) in enumerate(curves.items()):
            xs, ys = zip(*curve)
            ax.plot(xs, ys, STYLES[k % len(STYLES)], marker="o", markersize=3, color=colour,
                    label=f"{name} (seed {seed})")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves, never over them
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
