"""The bench's chart: every series drawn, each in its own colour, however many setups a bench trains."""

import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from jagg_core.report import plot_curves, series_colours


@pytest.mark.parametrize("count", [1, 4, 6, 12])
def test_every_series_is_drawn_in_a_colour_of_its_own(tmp_path, monkeypatch, count):
    drawn = {}
    save = Figure.savefig

    def keep_lines(figure, path, *args, **kwargs):
        drawn.update({line.get_label(): to_rgba(line.get_color()) for line in figure.axes[0].get_lines()})
        return save(figure, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_lines)
    series = [(f"setup {k}", {0: [[1, 0.5], [2, 0.6]], 1: [[1, 0.5], [2.5, 0.7]]}) for k in range(count)]
    plot_curves(series, "title", "seconds", "reward", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert set(drawn) == {f"setup {k} (seed {seed})" for k in range(count) for seed in (0, 1)}
    colours = [drawn[f"setup {k} (seed 0)"] for k in range(count)]
    assert len(set(colours)) == count
    assert all(drawn[f"setup {k} (seed 1)"] == colours[k] for k in range(count))  # a setup's seeds share its colour
    assert colours[0] == to_rgba("tab:gray")  # the reference comes first, in grey


def test_series_colours_stay_distinct_past_the_named_palette():
    colours = [to_rgba(c) for c in series_colours(30)]
    assert len(set(colours)) == 30 and colours[0] == to_rgba("tab:gray")
