"""``python -m jagg_core.evaluate``: a run's adapter against its base model on prompts x noises, each reward's and
judge's scores with standard errors."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import ROOT, run_python, tiny_config
from jagg_core.errors import UserError
from jagg_core.evaluate import PROG as EVALUATE
from jagg_core.evaluate import Scored, evaluate, pair_seed, table
from jagg_core.rundir import RunDirectory


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny SD3 run of 2 iterations rewarded by JPEG compressibility and judged by incompressibility."""
    from jagg_core.trainer import Trainer
    run = tmp_path_factory.mktemp("run")
    config = tiny_config(eval__judges=[{"name": "jpeg_incompressibility"}], train__learning_rate=0.05)
    trainer = Trainer(config, run)
    trainer.setup()
    trainer.fit()
    return run


def sample_scores(run, prompts, index, noise_seed):
    """Prompt ``index``'s base and adapter JPEG compressibility from the noise of seed ``noise_seed``, sampled here on
    their own."""
    from jagg_core.config import validate_config
    from jagg_core.models import load_flow_model
    from jagg_core.rewards.jpeg import jpeg_size_kb
    from jagg_core.rundir import RunDirectory
    from jagg_core.sampler import initial_noise, ode_sample

    config = validate_config(RunDirectory(run).read_config())
    model = load_flow_model(config.model, "cpu", seed=config.train.seed)
    model.add_lora(config.lora)
    model.load_lora(RunDirectory(run).lora_file)
    size = config.sampling.size
    sigmas = model.sigmas(config.sampling.eval_num_steps or config.sampling.num_steps, size)
    z0 = initial_noise(model, 1, size, torch.Generator().manual_seed(noise_seed))
    cond = model.conditioning([prompts[index]])
    scores = []
    with torch.no_grad():
        for adapters in (False, True):
            model.transformer.enable_adapters() if adapters else model.transformer.disable_adapters()
            images = model.decode_samples(ode_sample(model, cond, sigmas, z0), cond).float()
            scores.append(-float(jpeg_size_kb(images)[0]))
    return scores


def test_each_reward_and_judge_scores_the_base_and_the_adapter_on_the_same_noises(tiny_run):
    settings, scored, _ = evaluate(tiny_run, images_per_prompt=2, batch=1, seed=3)
    assert [result.label for result in scored] == ["reward jpeg_compressibility", "judge jpeg_incompressibility"]
    prompts = settings["distinct_prompts"]
    assert prompts == 2 and all(len(r.base) == len(r.adapter) == 4 for r in scored)
    from jagg_core.config import validate_config
    from jagg_core.prompts import run_prompts
    from jagg_core.rundir import RunDirectory
    held_out = run_prompts(validate_config(RunDirectory(tiny_run).read_config()).prompts)[1]
    compress = scored[0]
    for k in range(2):  # the second noise of the second prompt, and the first of the first
        index = 1 - k
        base, tuned = sample_scores(tiny_run, held_out, index, pair_seed(3, k, index))
        pair = k * 2 + index
        assert compress.base[pair] == pytest.approx(base) and compress.adapter[pair] == pytest.approx(tuned)
    assert compress.base != compress.adapter  # the adapter draws otherwise
    torch.testing.assert_close(torch.tensor(scored[1].base), -torch.tensor(compress.base))  # its judge: the negative
    _, batched, _ = evaluate(tiny_run, images_per_prompt=2, batch=2, seed=3)
    torch.testing.assert_close(torch.tensor(batched[0].adapter), torch.tensor(compress.adapter))


def test_a_row_is_the_means_their_standard_errors_over_the_prompts_the_paired_difference_and_the_wins():
    """A prompt's pairs share it: the standard errors are of the prompts' means (one prompt: of its pairs)."""
    result = Scored("reward x", base=[1.0, 2.0, 3.0, 4.0], adapter=[2.0, 2.0, 5.0, 3.0])
    row = result.row(2)  # pairs 0, 2 of prompt 0; 1, 3 of prompt 1
    assert row["pairs"] == 4
    assert row["base"] == pytest.approx((2.5, statistics.stdev([2, 3]) / 2 ** 0.5))  # prompt means 2 and 3
    assert row["adapter"] == pytest.approx((3.0, statistics.stdev([3.5, 2.5]) / 2 ** 0.5))
    # the prompts' mean differences 1.5 and -0.5: z = 0.5 / (stdev / sqrt 2) = 0.5
    error = statistics.stdev([1.5, -0.5]) / 2 ** 0.5
    assert row["difference"] == pytest.approx((0.5, error))
    assert row["adapter_wins"] == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    assert row["p_value"] == pytest.approx(2 * (1 - statistics.NormalDist().cdf(0.5 / error)))
    one_prompt = result.row(1)
    assert one_prompt["p_value"] is None and one_prompt["difference"] == pytest.approx(
        (0.5, statistics.stdev([1, 0, 2, -1]) / 2))
    assert Scored("y", [0.0] * 4, [1.0] * 4).row(2)["p_value"] == 0.0
    settings = {"adapter": "latest adapter", "run": "runs/x", "model": "m", "distinct_prompts": 2, "prompts": "p",
                "images_per_prompt": 2, "steps": 6, "resolution": "32"}
    text = table(settings, [result])
    assert "x 2 noises, 6 steps at 32 px (4 pairs); mean ± standard error over the 2 prompts' means; p: that" in text
    assert "| reward x | 2.5000 ± 0.5000 | 3.0000 ± 0.5000 | +0.5000 ± 1.0000 | 62% | 0.617 |" in text


def test_other_rewards_and_prompt_sets_are_named_on_the_command_line(tiny_run, tmp_path):
    settings, scored, _ = evaluate(tiny_run, source="shapes", limit=3, images_per_prompt=1,
                                given_rewards=["{name: jpeg_compressibility}", "shapes"])
    assert settings["distinct_prompts"] == 3
    assert [r.label for r in scored] == ["reward jpeg_compressibility", "reward shapes"]
    assert all(0 <= score <= 1 for score in scored[1].base + scored[1].adapter)
    for bad, message in [("{name: 3}", "give a reward's name"), ("nope", "unknown reward 'nope'"),
                         ("{name: geneval, options: {strict: maybe}}", "options.strict of reward 'geneval'")]:
        with pytest.raises(UserError, match=message):
            evaluate(tiny_run, given_rewards=[bad])
    with pytest.raises(UserError, match="--images-per-prompt, --batch and --limit must be at least 1"):
        evaluate(tiny_run, limit=0)
    with pytest.raises(UserError, match="the reward geneval cannot read the prompt"):
        evaluate(tiny_run, given_rewards=["geneval"])  # the run's prompts are not GenEval's


def test_the_command_writes_the_table_and_every_score_and_a_run_without_an_adapter_is_one_line(tiny_run, tmp_path):
    out = tmp_path / "eval"
    done = run_python(["-m", "jagg_core.evaluate", str(tiny_run), "--images-per-prompt", "1", "--out", str(out)],
                      cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    text = (out / "evaluation.md").read_text()
    assert text in done.stdout and "| reward jpeg_compressibility |" in text
    assert "| judge jpeg_incompressibility |" in text
    assert Image.open(out / "evaluation.png").size[0] == 4 * 128  # two prompts a row, base and adapter
    saved = json.loads((out / "evaluation.json").read_text())
    assert saved["settings"]["adapter"] == "latest adapter"
    assert len(saved["scores"]["reward jpeg_compressibility"]["base"]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((Path(tiny_run) / "config.yaml").read_text())
    done = run_python(["-m", "jagg_core.evaluate", str(empty)], cwd=ROOT)
    assert done.returncode == 2 and "has no adapter yet" in done.stderr and "Traceback" not in done.stderr


def test_the_page_evaluates_the_chosen_adapter_on_a_built_in_set_and_a_push_carries_it(tiny_run, monkeypatch):
    from app.ui import Studio, hub
    studio = Studio(Path(tiny_run).parent)
    image, text = studio.evaluate(Path(tiny_run).name, "latest adapter", "shapes", 2, 1)
    assert Image.open(image).size[0] == 4 * 128 and "**latest adapter** of" in text and "2 prompts (shapes) x 1 noises" in text
    assert "| reward jpeg_compressibility |" in text and "| judge jpeg_incompressibility |" in text
    assert studio.evaluation_of(Path(tiny_run), "latest adapter") is not None  # a push takes it into the card
    assert studio.evaluation_of(Path(tiny_run), "iter_000001") is None
    pushed = {}
    monkeypatch.setattr(hub, "push_run", lambda *args, **kwargs: pushed.update(kwargs) or "https://hub/me/x")
    assert studio.push(Path(tiny_run).name, "latest adapter", "me/x", "private", "t").endswith(
        ", with its evaluation made here")
    assert (pushed["evaluation"] / "evaluation.json").is_file()
    adapter = Path(tiny_run) / "lora" / "pytorch_lora_weights.safetensors"
    weights = adapter.read_bytes()
    adapter.write_bytes(weights + b" ")  # trained on since: other weights
    try:
        assert studio.evaluation_of(Path(tiny_run), "latest adapter") is None
    finally:
        adapter.write_bytes(weights)
    assert studio.evaluate(Path(tiny_run).name, "latest adapter", "/etc", 0, 1)[1] == (
        "**Not evaluated:** '/etc' is not a built-in prompt set; choose one, or none for the run's")
    for limit, images in ((0, 0), (0, 65), (-1, 1)):
        assert studio.evaluate(Path(tiny_run).name, "latest adapter", "", limit, images)[1] == (
            "**Not evaluated:** give 1 to 64 images per prompt and 0 or more prompts at most")
    # Against another run: its latest adapter, by name only; such an evaluation is not the card's
    other = other_run(tiny_run, Path(tiny_run).parent / "against-run")
    commands = []
    monkeypatch.setattr("app.ui.subprocess.run", lambda command, **kwargs: commands.append(command) or
                        types.SimpleNamespace(returncode=2, stdout="", stderr=f"{EVALUATE}: error: the reason\n"))
    assert studio.evaluate(Path(tiny_run).name, "latest adapter", "", 0, 1, "against-run")[1] == (
        "**Not evaluated:** the reason")
    assert commands[-1][commands[-1].index("--against") + 1] == str(other) and "--against-checkpoint" not in commands[-1]
    checkpoint = RunDirectory(other).checkpoint_dir(1)  # the other run's checkpoint: Evaluate offers it beside
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    assert studio.against_adapters("against-run")["choices"] == [("latest adapter", "latest adapter"),
                                                                 ("iter_000001", "iter_000001")]
    studio.evaluate(Path(tiny_run).name, "latest adapter", "", 0, 1, "against-run", "iter_000001")
    assert commands[-1][commands[-1].index("--against-checkpoint") + 1] == "iter_000001"
    assert studio.evaluate(Path(tiny_run).name, "latest adapter", "", 0, 1, "against-run", "iter_000009")[1] == (
        "**Not evaluated:** the run 'against-run' has no adapter 'iter_000009'; choose one of its adapters")
    assert studio.evaluate(Path(tiny_run).name, "latest adapter", "", 0, 1, "../etc")[1] == (
        "**Not evaluated:** there is no run '../etc' to compare with; choose one of the runs")
    (Path(tiny_run).parent / "no-runs").mkdir(exist_ok=True)
    assert Studio(Path(tiny_run).parent / "no-runs").evaluate("", "latest adapter", "", 0, 1)[1] == (
        "**Not evaluated:** choose a run first.")


def test_prompts_the_geneval_reward_reads_are_also_reported_by_genevals_task():
    from jagg_core.evaluate import by_task, geneval_tasks
    prompts = ["a photo of a dog", "a photo of two cats", "a photo of a cat left of a dog", "a photo of a red car"]
    tasks = geneval_tasks(prompts)
    assert tasks == ["single_object", "counting", "position", "colors"]
    assert geneval_tasks([*prompts, "a red circle on a blue background, top left"]) is None
    # two noises: pair k N + i is prompt i's k-th
    result = Scored("reward geneval", base=[1, 0, 0, 1, 1, 1, 0, 0], adapter=[1, 1, 0, 1, 1, 1, 1, 1])
    rows = by_task(result, tasks)
    assert list(rows) == ["single_object", "counting", "colors", "position"]
    assert rows["counting"] == {"prompts": 1, "base": 0.5, "adapter": 1.0}
    assert rows["position"] == {"prompts": 1, "base": 0.0, "adapter": 0.5}
    text = table({"adapter": "best adapter", "run": "runs/x", "model": "m", "distinct_prompts": 4, "prompts": "p",
                  "images_per_prompt": 2, "steps": 6, "resolution": "32", "tasks": tasks}, [result])
    assert "| task | prompts | reward geneval |" in text and "| counting | 1 | 0.5000 -> 1.0000 |" in text


def test_a_push_carries_an_evaluation_of_the_adapter_it_pushes(tiny_run, tmp_path):
    from jagg_core.evaluate import write_evaluation
    from jagg_core.hub import write_model_card
    from jagg_core.model_card import publish_files, read_run
    out = tmp_path / "eval"
    out.mkdir()
    write_evaluation(out, *evaluate(tiny_run, images_per_prompt=1))
    card = str(write_model_card(tiny_run, "me/x", evaluation=out))
    assert "## Evaluation\n\n**latest adapter** of" in card and "| reward jpeg_compressibility |" in card
    assert "![First samples of the evaluation, the adapter's on the right](images/evaluation.png)" in card
    assert publish_files(read_run(tiny_run, None, out), "me/x")["images/evaluation.png"] == out / "evaluation.png"
    assert "## Evaluation" not in str(write_model_card(tiny_run, "me/x"))
    with pytest.raises(UserError, match=r"is of the latest adapter, but the iter_000001 is pushed: evaluate that one"):
        write_model_card(tiny_run, "me/x", "iter_000001", out)
    saved = json.loads((out / "evaluation.json").read_text())
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "evaluation.json").write_text(json.dumps({**saved, "settings": {**saved["settings"],
                                                                              "adapter_sha256": "0" * 64}}))
    (stale / "evaluation.md").write_text("x")
    with pytest.raises(UserError, match=r"is of other weights than the latest adapter now .*: evaluate it again$"):
        write_model_card(tiny_run, "me/x", evaluation=stale)
    other = tmp_path / "other"
    other.mkdir()
    saved["settings"]["run"] = "runs/someone-else"
    (other / "evaluation.json").write_text(json.dumps(saved))
    (other / "evaluation.md").write_text("x")
    with pytest.raises(UserError, match=r"is of the run 'someone-else', not '"):
        write_model_card(tiny_run, "me/x", evaluation=other)
    with pytest.raises(UserError, match=r"holds no evaluation: make one with python -m jagg_core.evaluate"):
        write_model_card(tiny_run, "me/x", evaluation=tmp_path / "nothing")


def test_sampling_needs_the_weights_but_not_trainings_state_and_a_gpu_without_room_refuses_in_one_line():
    """The floor of Try it's and evaluate's memory: the prompt encoders while they encode, then the transformer, VAE
    and LoRA weights without AdamW's states (or NFT's lagging copy), with the rewards and judges when they score."""
    from jagg_core.config import load_config
    from jagg_core.memory_plan import CUDA_CONTEXT_GB, GB, check_room_to_sample, plan_memory

    whole = plan_memory(load_config(preset="sd35-medium-pickscore-16gb"), trace=False)
    assert whole.encoder_bytes > 9e9 and whole.sampling_floor() == whole.encoder_bytes  # T5-XXL and the CLIPs first
    config = load_config(preset="sd35-medium-pickscore-16gb", overrides=["model.offload_text_encoders=true"])
    plan = plan_memory(config, trace=False)  # the encoders a layer at a time: the weights after them are the floor
    weights = sum(size for part, size in plan.resident.items() if part.startswith(("transformer", "VAE")))
    assert plan.encoder_bytes < 1e9 and plan.scorer_bytes > 3e9  # PickScore and two judges
    assert plan.sampling_floor() == pytest.approx(weights + 4 * plan.lora_params)
    assert plan.sampling_floor(scoring=True) == pytest.approx(weights + 4 * plan.lora_params + plan.scorer_bytes)
    nft = plan_memory(load_config(preset="sd35-medium-pickscore-nft-24gb"), trace=False)
    assert nft.training_state == nft.lora_params * (2 + 4 + 4)  # 8-bit AdamW's states, the EMA, the lagging copy

    needed = plan.sampling_floor() + CUDA_CONTEXT_GB * GB
    check_room_to_sample(config, int(needed) + 1)
    with pytest.raises(UserError, match=r"^the GPU has 3\.0 GB free, and sampling with this run's model needs "
                                        rf"{needed / GB:.1f} GB at least \(its weights and a CUDA context, before any "
                                        r"activation\): is a run training on it\? Wait for it to end, or stop it"):
        check_room_to_sample(config, int(3e9))


def test_try_it_and_evaluate_on_a_full_gpu_are_refused_before_the_model_loads(tiny_run, monkeypatch):
    """On a GPU (stood in for: torch asked whether there is one and how much of it is free) whose free memory cannot
    hold the run's weights, generate and evaluate stop in one line, before anything loads on it."""
    from jagg_core.generate import generate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 ** 6, 80 * 10 ** 9))
    with pytest.raises(UserError, match="^the GPU has 0.0 GB free, and sampling with this run's model needs"):
        generate(tiny_run, "a red square")
    with pytest.raises(UserError, match=r"at least \(its weights, rewards and judges and a CUDA context"):
        evaluate(tiny_run, images_per_prompt=1, limit=1)


def other_run(tiny_run, folder: Path, rank: int = 2, model: str | None = None) -> Path:
    """A run beside ``tiny_run`` whose adapter is a random one of ``rank`` (not the run's 4), of the same base model
    unless ``model`` names another."""
    from jagg_core.config import LoraConfig, validate_config
    from jagg_core.models import load_flow_model
    from jagg_core.rundir import RunDirectory

    run = RunDirectory(folder)
    run.lora_dir.mkdir(parents=True)
    config = validate_config(RunDirectory(tiny_run).read_config())
    lora = LoraConfig(rank=rank, alpha=rank)
    config = config.model_copy(update={"lora": lora, "model": config.model.model_copy(
        update={"name": model or config.model.name})})
    run.write_config(config.to_yaml())
    flow = load_flow_model(config.model, "cpu", seed=config.train.seed)
    generator = torch.Generator().manual_seed(5)
    for param in flow.add_lora(lora):
        param.data = 0.3 * torch.randn(param.shape, generator=generator)
    flow.save_lora(run.lora_dir)
    return folder


def test_against_another_runs_adapter_each_side_is_that_adapter_sampled_alone_on_the_pairs_noise(tiny_run, tmp_path,
                                                                                                 monkeypatch):
    """``--against``: the other side of each pair is the other run's adapter (rank 2 beside the run's rank 4, loaded
    with its own), from the pair's noise, as sampled alone; the adapter's side is unchanged; the table and grid name
    the other adapter; the command names its folder after both."""
    from jagg_core.evaluate import main
    other = other_run(tiny_run, tmp_path / "other")
    settings, scored, grid = evaluate(tiny_run, images_per_prompt=1, batch=2, seed=3, against=other)
    _, alone, _ = evaluate(tiny_run, images_per_prompt=1, batch=2, seed=3)
    assert scored[0].adapter == alone[0].adapter and scored[0].base != alone[0].base
    prompts = evaluation_prompts_of(tiny_run)
    for index in range(len(prompts)):
        other_score = sample_scores(other, prompts, index, pair_seed(3, 0, index))[1]
        assert scored[0].base[index] == pytest.approx(other_score, abs=1e-4)
    assert settings["against"]["source"] == str(other) and settings["against"]["adapter"] == "latest adapter"
    text = table(settings, scored)
    assert "against the latest adapter of `other` (the same base model tiny-sd3)" in text
    assert "| reward | other latest adapter | adapter | adapter - other latest adapter | adapter wins | p |" in text

    out = tmp_path / "evaluations"
    monkeypatch.chdir(tmp_path)  # the default folder is under evaluations/ here
    assert main([str(tiny_run), "--images-per-prompt", "1", "--against", str(other),
                 "--reward", "jpeg_compressibility"]) == 0
    assert [p.name for p in out.iterdir()] == [f"{Path(tiny_run).name}-latest-adapter-vs-other-latest-adapter"]

    # a LoRA that is no run's (its file, or its folder): the same other side
    lora = tmp_path / "published"
    shutil.copytree(other / "lora", lora)
    for source in (lora, lora / "pytorch_lora_weights.safetensors"):
        settings, from_lora, _ = evaluate(tiny_run, images_per_prompt=1, batch=2, seed=3, against=source)
        assert from_lora[0].base == scored[0].base and settings["against"]["name"] == "published"
    assert "against the LoRA `" in table(settings, from_lora) and "| published LoRA | adapter |" in table(settings,
                                                                                                       from_lora)


def test_against_refuses_another_base_model_the_same_weights_and_a_checkpoint_without_its_run(tiny_run, tmp_path):
    flux = other_run(tiny_run, tmp_path / "flux", model="tiny-flux")
    with pytest.raises(UserError, match=r"^--against .*flux: its adapter is of tiny-flux, the run's of tiny-sd3; "
                                        r"compare adapters of the same base model$"):
        evaluate(tiny_run, against=flux)
    with pytest.raises(UserError, match=r"^--against: the iter_000002 of .* holds the same weights as the latest "
                                        r"adapter evaluated; name another run, checkpoint"):
        evaluate(tiny_run, against=Path(tiny_run), against_checkpoint="iter_2")
    with pytest.raises(UserError, match="--against-checkpoint names a checkpoint of the --against run"):
        evaluate(tiny_run, against_checkpoint="best")
    with pytest.raises(UserError, match=r"--against-checkpoint names a checkpoint of a run, but .*lora is a LoRA"):
        evaluate(tiny_run, against=flux / "lora", against_checkpoint="best")
    with pytest.raises(UserError, match="LoRA 'no/such/thing' is neither a local folder nor a Hub repo id"):
        evaluate(tiny_run, against="no/such/thing")
    broken = other_run(tiny_run, tmp_path / "broken")
    (broken / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match=r"pytorch_lora_weights.safetensors is not a LoRA of this sd3 model \("):
        evaluate(tiny_run, images_per_prompt=1, against=broken)
    _, scored, _ = evaluate(tiny_run, images_per_prompt=1, against=Path(tiny_run), against_checkpoint="iter_1")
    assert scored[0].base != scored[0].adapter  # two checkpoints of one run


def evaluation_prompts_of(run):
    from jagg_core.config import validate_config
    from jagg_core.evaluate import evaluation_prompts
    from jagg_core.rundir import RunDirectory
    return evaluation_prompts(validate_config(RunDirectory(run).read_config()), None, None, 0)
