"""The bench's fidelity section (per-window cosines along the trajectory, the predictors' rank correlation) and its
whole-training comparison."""

from __future__ import annotations

import pytest

from jagg_core.bench.fidelity import fidelity_rows, ranks, spearman
from jagg_core.bench.tables import format_tables
from jagg_core.config import with_overrides
from jagg_core.errors import UserError

from conftest import tiny_config


def test_spearman_ranks_with_ties():
    assert ranks([0.3, 0.1, 0.3, 0.5]) == [2.5, 1.0, 2.5, 4.0]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 1, 2]) == pytest.approx(-0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_fidelity_rows_cover_every_interior_window(offline):
    config = tiny_config(sampling__num_steps=7, backward__audit_samples=2)
    rows = fidelity_rows(config, 2, noise_levels=(0.7,), layouts=((3, False),))
    (row,) = rows
    assert row["windows"] == [[0, 2], [3, 5]] and row["rollouts"] == 2  # 6-6 has no interior step
    assert len(row["window_cosines"]) == len(row["linearity"]) == 2
    assert all(-1 <= c <= 1 for c in row["window_cosines"] + row["window_cosines_min"])
    assert row["spearman_audit_n"] <= 1 and row["spearman_linearity_n"] <= 2
    assert "Spearman" in format_tables([{**row, "section": "fidelity"}])


def test_training_comparison_reports_gain_time_and_spread(tmp_path, offline):
    from jagg_core.bench.training import format_training, plot_training, training_rows

    config = tiny_config(train__iterations=1, backward__audit_every=1)
    rows = training_rows(config, seeds=(0, 1), setups=("flow_grpo", "exact", "default", "tree"))
    assert [(r["setup"], r["backward"]) for r in rows] == [("flow_grpo", "exact"), ("exact", "exact"),
                                                           ("default", "cached W=3"), ("tree", "cached W=3")]
    for row in rows:
        assert set(row["runs"]) == {"0", "1"} and row["gain_std"] is not None and row["minutes"] > 0
        for run in row["runs"].values():
            assert [point[1] for point in run["curve"]][-1] - run["curve"][0][1] == pytest.approx(run["gain"])
            assert run["gain_per_minute"] == pytest.approx(run["gain"] / run["minutes"])
            assert 0 < run["train_minutes"] < run["minutes"]
    assert "train-phase minutes" in format_training(rows) and "| Flow-GRPO default | exact |" in format_training(rows)
    assert "| default, tree rollout | cached W=3 |" in format_training(rows)
    with pytest.raises(UserError, match="setup tree does not apply"):  # a group of 3 cannot split 2 ways
        training_rows(with_overrides(config, ["grpo.num_generations=3"]), setups=("tree",))
    plot_training(rows, tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 0
