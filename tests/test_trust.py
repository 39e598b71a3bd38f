"""Results a user can trust: judges, the reward-hacking alarm, the best adapter and the first-iteration doctor, from
their rules to whole runs through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_rewards import Server

from jagg_core import metrics
from jagg_core.config import load_config
from jagg_core.doctor import (MAX_RATIO_DEVIATION, audit_check, gradient_check, range_check, ratio_check, report_lines,
                              reward_balance_check, rewards_check)
from jagg_core.errors import UserError
from jagg_core.judges import BestAdapter, EvalScores, HackingAlarm, check_judges
from jagg_core.rewards import build_reward
from jagg_core.rewards.catalog import reward_entry
from jagg_core.rundir import LORA_FILE, RunDirectory
from jagg_core.shapes_world import all_scenes, draw_array

from conftest import run_cli

# ----- the judge of the shapes world -----------------------------------------------------------


def shapes_images(scale: float = 0.42, noise: float = 0.0):
    scenes = all_scenes()[::29][:10]
    images = torch.stack([torch.from_numpy(draw_array(s, scale=scale)) for s in scenes])
    if noise:
        images = (images + noise * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    return images, [s.caption for s in scenes]


def test_shapes_fidelity_scores_what_the_shapes_reward_does_not():
    """Noise and a shape of the wrong size leave the shapes reward near 1 and lower the judge."""
    shapes, fidelity = build_reward(spec_named("shapes")), build_reward(spec_named("shapes_fidelity"))
    clean = shapes_images()
    assert float(fidelity(*clean).mean()) > 0.95
    for images, prompts in (shapes_images(noise=0.05), shapes_images(scale=0.25)):
        assert float(shapes(images, prompts).mean()) > 0.95
        assert float(fidelity(images, prompts).mean()) < 0.9
    low, high = reward_entry("shapes_fidelity").expected_range
    assert low <= float(fidelity(*clean).mean()) <= high


def spec_named(name: str, **options):
    from jagg_core.config import RewardSpec
    return RewardSpec(name=name, options=options)


# ----- judges in the config ---------------------------------------------------------------------


@pytest.mark.parametrize("judges,message", [
    ("[{name: shapes}]", "eval.judges: judge 'shapes' is also a training reward"),
    ("[{name: nope}]", "eval.judges: unknown reward 'nope'"),
    ("[{name: clip_score, options: {size: 3}}]", "eval.judges: unknown option(s) size"),
])
def test_a_bad_judge_is_one_line_before_anything_starts(judges, message, tmp_path):
    result = run_cli("--preset", "shapes", "--set", f"eval.judges={judges}", "--output-dir", str(tmp_path / "run"),
                     "--dry-run")
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_judge_with_other_options_than_the_training_reward_is_allowed_and_best_by_names_a_judge():
    config = load_config(overrides=["rewards=[{name: clip_score}]",
                                    "eval.judges=[{name: clip_score, options: {model_id: other/clip}}]",
                                    "eval.best_by=clip_score"])
    check_judges(config)
    with pytest.raises(UserError, match="eval.best_by 'aesthetic' must be reward or one of the judges"):
        load_config(overrides=["eval.best_by=aesthetic"])


def test_a_judge_that_fails_to_load_fails_the_run_in_one_line_before_the_base_eval(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("--preset", "tiny-sd3", "--output-dir", str(run_dir),
                     "--set", f"eval.judges=[{{name: clip_score, options: {{model_id: {tmp_path / 'no-clip'}}}}}]")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "judge 'clip_score' cannot score the eval samples: cannot load" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    status = RunDirectory(run_dir).read_status()
    assert status["state"] == "failed" and "judge 'clip_score'" in status["message"]
    assert not RunDirectory(run_dir).read_metrics()  # not even the base eval ran


# ----- the alarm's rule ---------------------------------------------------------------------------


def scores(iteration: int, reward: float, judge: float, jitter: float = 0.01) -> EvalScores:
    """Eight samples around the given means, their spread a per-sample pattern that changes from eval to eval (every
    10 iterations)."""
    pattern = [((k * 7 + iteration // 10 * 3) % 5 - 2) * jitter for k in range(8)]
    return EvalScores(iteration, [reward + p for p in pattern], {"sharpness": [judge - p for p in pattern]})


def test_the_alarm_fires_when_the_reward_rises_while_a_judge_falls_beyond_the_noise():
    alarm = HackingAlarm(window=2, z=2.0)
    assert alarm.observe(scores(0, 0.50, 0.90)) is None
    assert alarm.observe(scores(10, 0.55, 0.85)) is None  # one eval after the base: the window is not full yet
    line = alarm.observe(scores(20, 0.60, 0.80))
    assert line and "judge sharpness" in line and "iterations 0-20" in line and "rose +0.09" in line


@pytest.mark.parametrize("evals", [
    [(0.50, 0.90), (0.55, 0.91), (0.60, 0.80)],   # the judge did not fall at every eval
    [(0.50, 0.90), (0.49, 0.85), (0.60, 0.80)],   # the reward did not rise at every eval
    [(0.50, 0.90), (0.55, 0.95), (0.60, 0.99)],   # the judge rose with the reward: learning, not hacking
    [(0.50, 0.90), (0.501, 0.899), (0.502, 0.898)],  # changes far inside the eval's noise
])
def test_the_alarm_stays_silent_otherwise(evals):
    alarm = HackingAlarm(window=2, z=2.0)
    assert [alarm.observe(scores(10 * k, r, j)) for k, (r, j) in enumerate(evals)] == [None] * 3


def test_the_alarm_and_the_best_record_survive_a_checkpoint():
    alarm, best = HackingAlarm(window=2, z=2.0), BestAdapter("sharpness")
    for k, (r, j) in enumerate([(0.5, 0.9), (0.55, 0.85)]):
        alarm.observe(scores(10 * k, r, j))
        best.consider(10 * k, {metrics.judge_key("sharpness"): j})
    restored, restored_best = HackingAlarm(window=2, z=2.0), BestAdapter("sharpness")
    restored.load_state_dict(json.loads(json.dumps(alarm.state_dict())))
    restored_best.load_state_dict(json.loads(json.dumps(best.state_dict())))
    assert restored.observe(scores(20, 0.6, 0.8)) == alarm.observe(scores(20, 0.6, 0.8)) is not None
    assert restored_best.record == best.record


def test_the_best_adapter_is_the_highest_eval_of_the_adapter_and_says_why():
    best = BestAdapter("reward")
    assert not best.consider(0, {metrics.EVAL_REWARD_MEAN: 0.9})  # the base model is not an adapter
    assert best.consider(10, {metrics.EVAL_REWARD_MEAN: 0.6})
    assert not best.consider(20, {metrics.EVAL_REWARD_MEAN: 0.5})
    assert best.record["iteration"] == 10 and best.record["metric"] == metrics.EVAL_REWARD_MEAN
    assert best.record["reason"] == ("the highest held-out reward (0.6000) of the 2 evals of the adapter so far, at "
                                     "iteration 10")
    assert best.consider(30, {metrics.EVAL_REWARD_MEAN: 0.7}) and best.record["iteration"] == 30


# ----- the doctor's checks ----------------------------------------------------------------------------


def test_rewards_constant_within_groups_fail_with_their_fix():
    check = rewards_check(torch.tensor([0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7]), group_size=4)
    assert check.status == "fail" and "0 of 2 groups vary" in check.detail and "advantages are zero" in check.fix
    assert rewards_check(torch.tensor([0.1, 0.2, 0.7, 0.7]), group_size=2).status == "pass"
    assert rewards_check(torch.tensor([0.1, float("nan")]), group_size=2).status == "fail"


def test_each_check_passes_fails_or_skips_on_its_measurement():
    assert ratio_check(0.0).status == "pass" and ratio_check(None).status == "skip"
    assert ratio_check(10 * MAX_RATIO_DEVIATION).status == "fail"
    assert gradient_check(1e-3, 1e-4).status == "pass"
    assert [gradient_check(g, v).status for g, v in [(0.0, 0.0), (float("inf"), 0.1), (1e-3, 0.0), (None, None)]] \
        == ["fail"] * 4
    ranges = {"shapes": (0.3, 1.0), "http": (None, None)}
    assert range_check({"eval/reward/shapes": 0.8, "eval/reward/http": 5.0}, ranges).status == "pass"
    assert range_check({"eval/reward/shapes": 0.05}, ranges).status == "fail"
    assert range_check({"eval/reward/http": 5.0}, ranges).status == "skip"
    config = load_config()
    assert audit_check(0.9, config).status == "pass" and audit_check(0.2, config).status == "fail"
    assert audit_check(0.9, load_config(overrides=["backward.min_fidelity=0.95"])).status == "fail"
    assert audit_check(None, config).status == "skip"


def test_the_balance_check_fails_a_reward_drowned_out_of_a_sum_and_says_the_weight_that_lifts_it():
    """PickScore's signal beside clip_score's at equal weights (100x): under ``sum`` clip_score is drowned, and the
    fix names the weight that matches PickScore's signal; per_reward passes; a reward without spread fails either
    way; one reward is skipped."""
    weights = {"pickscore": 1.0, "clip_score": 2.0}
    drowned = reward_balance_check({"pickscore": 0.8, "clip_score": 0.016}, weights, "sum")
    assert drowned.status == "fail" and "the advantage is pickscore's nearly alone" in drowned.detail
    assert drowned.fix.startswith("raise clip_score's weight to 100 (a signal then matches pickscore's), or set "
                                  "grpo.multi_reward=per_reward")
    assert reward_balance_check({"pickscore": 0.8, "clip_score": 0.016}, weights, "per_reward").status == "pass"
    assert reward_balance_check({"pickscore": 0.8, "clip_score": 0.09}, weights, "sum").status == "pass"
    for multi_reward in ("sum", "per_reward"):
        silent = reward_balance_check({"pickscore": 0.8, "clip_score": 0.0}, weights, multi_reward)
        assert silent.status == "fail" and silent.fix.startswith("clip_score gives every sample of a group the same")
    assert reward_balance_check({"pickscore": 0.8}, {"pickscore": 1.0}, "sum").status == "skip"


# ----- whole runs -------------------------------------------------------------------------------------


def tiny_run_args(run_dir, *extra: str) -> list[str]:
    return ["--preset", "tiny-sd3", "--output-dir", str(run_dir), "--set", "sampling.num_steps=6",
            "--set", "backward.window=3", "--set", "prompts.eval_count=4", *extra]


def test_the_doctor_does_not_change_the_run(tmp_path):
    """The doctor's audit and velocity probe draw nothing from the run's generators and leave its gradients: the
    adapter is bit for bit that of a run without it."""
    adapters = []
    for doctor, hash_seed in (("true", "1"), ("false", "2")):
        run_dir = tmp_path / doctor
        result = run_cli(*tiny_run_args(run_dir, "--set", f"train.doctor={doctor}", "--set", "train.iterations=2",
                                        "--set", "lora.dropout=0.1"), env={"PYTHONHASHSEED": hash_seed})
        assert result.returncode == 0, result.stderr
        assert RunDirectory(run_dir).doctor_file.is_file() == (doctor == "true")
        adapters.append(RunDirectory(run_dir).lora_file.read_bytes())
    # equal weights give an equal file: the peft metadata's sets are written sorted, whatever the hash seed
    assert adapters[0] == adapters[1]


def test_doctor_cli_fails_a_reward_constant_within_groups_and_the_run_resumes(tmp_path):
    """``--doctor`` runs the base eval and one iteration, prints the checklist with the fix, exits 1, and leaves a
    run that ``--resume`` continues."""
    server = Server(lambda body: (200, json.dumps({"scores": [len(p) % 7 / 7 for p in body["prompts"]]})))
    run_dir = tmp_path / "run"
    try:
        result = run_cli(*tiny_run_args(run_dir, "--set", f"rewards=[{{name: http, options: {{url: {server.url}}}}}]",
                                        "--doctor"))
        assert result.returncode == 1, result.stderr
        output = result.stdout + result.stderr
        assert "[FAIL] rewards are finite and vary within groups: 0 of 2 groups vary" in output
        assert "fix: the reward gives every sample of a prompt the same score" in output
        assert "doctor FAILED" in output
        run = RunDirectory(run_dir)
        status, report = run.read_status(), run.read_doctor()
        assert status["state"] == "stopped" and status["iteration"] == 1 and status["doctor"] == report
        assert not report["passed"] and report["checks"][0]["status"] == "fail"
        assert run.checkpoint_iterations() == [1]
        resumed = run_cli("--resume", "--output-dir", str(run_dir))
        assert resumed.returncode == 0, resumed.stderr
        assert run.read_status()["state"] == "finished" and run.checkpoint_iterations()[-1] == 4
    finally:
        server.close()


def test_the_default_preset_passes_its_doctor(tmp_path):
    result = run_cli("--preset", "shapes", "--output-dir", str(tmp_path / "run"), "--doctor",
                     "--set", "prompts.eval_count=8")
    assert result.returncode == 0, result.stdout + result.stderr
    report = RunDirectory(tmp_path / "run").read_doctor()
    assert report["passed"] and [c["status"] for c in report["checks"]] == ["pass"] * 6 + ["skip"]  # one reward
    assert report_lines(report)[0] == "doctor (iteration 1): 6 passed, 0 failed, 1 skipped"


def test_a_planted_hack_raises_the_alarm_and_stop_ends_the_run_with_a_checkpoint(tmp_path):
    """A reward that rises with every call while a judge falls with every call: at the second eval after the base
    the alarm fires, names the judge, and ``train.on_hacking: stop`` ends the run there, resumable."""
    def drifting(step: float):
        calls = []

        def answer(body):
            calls.append(1)
            n = len(calls)
            return 200, json.dumps({"scores": [0.5 + step * n + 0.001 * ((n * 7 + i * 3) % 5)
                                               for i in range(len(body["prompts"]))]})
        return answer

    reward, judge = Server(drifting(+0.01)), Server(drifting(-0.02))
    run_dir = tmp_path / "run"
    try:
        result = run_cli(*tiny_run_args(
            run_dir, "--set", f"rewards=[{{name: http, options: {{url: {reward.url}}}}}]",
            "--set", f"eval.judges=[{{name: http, options: {{url: {judge.url}}}}}]", "--set", "eval.best_by=http",
            "--set", "train.iterations=6", "--set", "train.sample_every=1", "--set", "train.on_hacking=stop"))
        assert result.returncode == 3, result.stdout + result.stderr
        assert "stopped by the reward-hacking alarm" in result.stderr and "judge http fell" in result.stderr
        run = RunDirectory(run_dir)
        rows = run.read_metrics()
        assert [r[metrics.ITERATION] for r in rows] == [0, 1, 2]
        assert "judge http fell" in rows[-1][metrics.HACKING_ALARM]
        assert [metrics.judge_key("http") in r for r in rows] == [True] * 3
        status = run.read_status()
        assert status["state"] == "stopped" and "judge http fell" in status["alarm"]
        assert run.checkpoint_iterations()[-1] == 2
        assert "reward hacking suspected" in run.log_file.read_text()
        best = run.read_best()  # the judge fell at every eval: the best adapter is the first eval's
        assert best["iteration"] == 1 and best["metric"] == metrics.judge_key("http")
        assert set(load_file(run.best_lora_file)) == set(load_file(run.lora_file))
    finally:
        reward.close()
        judge.close()


def test_the_best_adapter_is_the_checkpoint_of_its_iteration(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*tiny_run_args(run_dir, "--set", "eval.judges=[{name: jpeg_incompressibility}]",
                                    "--set", "train.iterations=4", "--set", "train.sample_every=1",
                                    "--set", "train.checkpoint_every=1", "--set", "train.keep_checkpoints=4"))
    assert result.returncode == 0, result.stderr
    run = RunDirectory(run_dir)
    best = run.read_best()
    evals = {r[metrics.ITERATION]: r[metrics.EVAL_REWARD_MEAN] for r in run.read_metrics() if r[metrics.ITERATION]}
    assert best["iteration"] == max(evals, key=evals.get) and best["value"] == max(evals.values())
    assert best["reason"].startswith(f"the highest held-out reward ({best['value']:.4f}) of the 4 evals")
    saved, checkpoint = load_file(run.best_lora_file), load_file(run.checkpoint_dir(best["iteration"]) / LORA_FILE)
    assert all(torch.equal(saved[k], checkpoint[k]) for k in checkpoint)
    rows = run.read_metrics()
    assert all(metrics.judge_key("jpeg_incompressibility") in r for r in rows)


def test_the_alarm_stays_silent_on_a_non_finite_eval_score():
    alarm = HackingAlarm(window=1, z=2.0)
    alarm.observe(EvalScores(0, [0.5, 0.6], {"sharpness": [0.9, 0.8]}))
    assert alarm.observe(EvalScores(5, [float("nan"), 0.9], {"sharpness": [0.1, 0.2]})) is None
