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


def test_with_several_rewards_the_bench_reports_each_ones_held_out_gain_under_sum_and_per_reward(offline):
    """JPEG compressibility at weight 1 and its opposite at 0.5: each run's gains of the two are opposite, the
    held-out gain their weighted sum; the table has a column for each; per_reward trains with its own advantages."""
    from jagg_core.bench.training import format_training, setup_configs, training_rows

    config = tiny_config(train__iterations=1, rewards=[{"name": "jpeg_compressibility"},
                                                       {"name": "jpeg_incompressibility", "weight": 0.5}])
    assert setup_configs(config, ["per_reward"])["per_reward"].grpo.multi_reward == "per_reward"
    rows = training_rows(config, seeds=(0,), setups=("default", "per_reward"))
    for row in rows:
        run = row["runs"]["0"]
        smaller, larger = run["term_gains"]["jpeg_compressibility"], run["term_gains"]["jpeg_incompressibility"]
        assert larger == pytest.approx(-smaller) and smaller != 0
        assert run["gain"] == pytest.approx(smaller + 0.5 * larger)
        assert row["gain/jpeg_compressibility"] == smaller and row["gain/jpeg_compressibility_std"] is None
    table = format_training(rows)
    assert ("| held-out gain | held-out gain of jpeg_compressibility | held-out gain of jpeg_incompressibility |"
            in table)
    assert "| default, each reward's own advantage |" in table

def test_the_default_task_with_its_tree_rollouts_is_compared_with_flat_rollouts():
    """The default preset has tree rollouts, so the bench offers ``flat`` (every sample its own path) beside it and
    refuses ``tree``, which would train the default again."""
    from jagg_core.bench.training import comparison_setups, setup_configs, setup_label
    from jagg_core.config import load_config

    default = load_config(preset="shapes")
    assert default.grpo.branch_factor == 2
    setups = comparison_setups(default)
    assert "tree" not in setups and setups["flat"] == ["grpo.branch_factor=0"]
    configs = setup_configs(default, ["default", "flat", "guard+flat"])
    assert [configs[name].grpo.branch_factor for name in configs] == [2, 0, 0]
    assert setup_label("guard+flat") == "default, GRPO-Guard, flat rollout"
    dora = setup_configs(default, ["default", "dora", "dora+flat"])  # a DoRA in place of the LoRA, nothing else
    assert [config.lora.use_dora for config in dora.values()] == [False, True, True]
    assert dora["dora"].model_dump(exclude={"lora"}) == dora["default"].model_dump(exclude={"lora"})
    assert setup_label("dora+flat") == "default, DoRA, flat rollout"
    with pytest.raises(UserError, match="setup tree does not apply to this task .*flat: the config has tree"):
        setup_configs(default, ["tree"])


def test_a_journal_keeps_every_finished_run_and_a_second_bench_trains_only_what_is_missing(tmp_path, monkeypatch,
                                                                                           offline):
    from jagg_core.bench import training

    trained = []

    def fake_train(config, run_dir):
        trained.append((run_dir.name, config.train.seed))
        return {"gain": 0.01 * len(trained), "minutes": 1.0, "train_minutes": 0.5, "gain_per_minute": 0.01,
                "curve": [[0.0, 0.5], [60.0, 0.5 + 0.01 * len(trained)]]}

    monkeypatch.setattr(training, "train_once", fake_train)
    config, journal = tiny_config(train__iterations=1), tmp_path / "runs.jsonl"
    training.training_rows(config, seeds=(0,), setups=("exact", "default"), journal=journal)
    journal.write_text(journal.read_text() + '{"setup": "exact", "se')  # a bench killed while writing
    rows = training.training_rows(config, seeds=(0, 1), setups=("exact", "default"), journal=journal)
    assert trained == [("exact-0", 0), ("default-0", 0), ("exact-1", 1), ("default-1", 1)]
    assert [row["runs"]["0"]["gain"] for row in rows] == [pytest.approx(0.01), pytest.approx(0.02)]
    changed = with_overrides(config, ["train.learning_rate=0.002"])  # another config is trained anew
    training.training_rows(changed, seeds=(0,), setups=("default",), journal=journal)
    assert trained[-1] == ("default-0", 0) and len(trained) == 5
    assert "Every run with" not in training.format_training(rows)


def test_the_benchs_overrides_are_kept_in_its_rows_and_named_under_its_table(monkeypatch, offline):
    from jagg_core.bench import training

    monkeypatch.setattr(training, "train_once", lambda config, run_dir: {
        "gain": config.grpo.timestep_fraction, "minutes": 1.0, "train_minutes": 0.5, "gain_per_minute": 0.01,
        "curve": [[0.0, 0.5], [60.0, 0.5 + config.grpo.timestep_fraction]]})
    overrides = ["grpo.timestep_fraction=0.9", "sampling.noise_level=0.7"]
    rows = training.training_rows(tiny_config(train__iterations=1), seeds=(0,), setups=("exact", "default"),
                                  overrides=overrides)
    assert [row["overrides"] for row in rows] == [overrides, overrides]
    assert [row["gain"] for row in rows] == [pytest.approx(0.9)] * 2  # the runs trained with them
    assert training.format_training(rows).endswith(
        "\nEvery run with `--set grpo.timestep_fraction=0.9` `--set sampling.noise_level=0.7`.\n")
    assert training.shared_overrides([rows[0], {**rows[1], "overrides": overrides[:1]}]) == \
        ["grpo.timestep_fraction=0.9"]


def _training_row(setup: str, curves: dict[str, list], minutes: float, measured: str | None = None) -> dict:
    """A row of ``--training --json`` with the given runs' curves (seconds, held-out reward)."""
    runs = {seed: {"gain": c[-1][1] - c[0][1], "minutes": minutes, "train_minutes": minutes / 2,
                   "gain_per_minute": (c[-1][1] - c[0][1]) / minutes, "curve": c} for seed, c in curves.items()}
    row = {"section": "training", "model": "jagg-shapes", "setup": setup, "backward": "exact", "iterations": 10,
           "seeds": [int(s) for s in curves], "runs": runs}
    for key in ("gain", "minutes", "train_minutes", "gain_per_minute"):
        values = [run[key] for run in runs.values()]
        row[key], row[f"{key}_std"] = sum(values) / len(values), None
    return {**row, **({"measured": measured} if measured else {})}


def test_the_training_table_says_the_gain_per_minute_against_flow_grpo_and_the_time_to_the_defaults_final_reward():
    """The earlier rows of setups not trained now are kept and marked; the time to the default's final reward is
    each seed's first eval at or above it, and the first eval of the seeds' mean curve at or above it."""
    from jagg_core.bench.training import format_training, minutes_to_reward, with_earlier

    earlier = [_training_row("flow_grpo", {"0": [[0, 0.5], [600, 0.6]]}, 10.0, measured="this session"),
               _training_row("default", {"0": [[0, 0.5], [300, 0.7]], "1": [[0, 0.5], [300, 0.9]]}, 5.0),
               _training_row("nft", {"0": [[0, 0.5], [60, 0.55]]}, 1.0)]
    now = [_training_row("nft", {"0": [[0, 0.5], [30, 0.79], [60, 0.81], [90, 0.85]],
                                 "1": [[0, 0.5], [30, 0.6], [60, 0.7]]}, 1.5)]
    rows = with_earlier(now, earlier, "old.json")
    assert [(r["setup"], r["measured"]) for r in rows] == [
        ("flow_grpo", "earlier (old.json)"), ("default", "earlier (old.json)"), ("nft", "this run")]
    assert minutes_to_reward(now[0]["runs"]["0"]["curve"], 0.8) == 1.0
    assert minutes_to_reward(now[0]["runs"]["1"]["curve"], 0.8) is None
    table = format_training(rows)
    assert ("gain per minute vs Flow-GRPO's | minutes to the default's final reward (0.800) | the seeds' mean curve "
            "reaches it at |") in table
    nft_line = next(line for line in table.splitlines() if "DiffusionNFT" in line)
    # nft: gains (0.35 + 0.2) / 2 in 1.5 min against Flow-GRPO's 0.1 in 10 min; seed 0 reaches 0.8 at 60 s, a fifth
    # of the default's 5 min; the mean curve, cut at seed 1's 3 evals, ends at (0.81 + 0.7) / 2
    assert nft_line.endswith("| 18.3x | 1.00 (20% of the default's time), 1 of 2 seeds | not reached |")
    default_line = next(line for line in table.splitlines() if "| default |" in line)
    # the default's seeds end at 0.7 and 0.9: their mean curve reaches its own final reward at its last eval
    assert default_line.endswith("| 5.00 (100% of the default's time), 1 of 2 seeds "
                                 "| 5.00 (100% of the default's time) |")
