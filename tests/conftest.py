"""Shared helpers: tiny run configs and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from jagg_core.config import load_config
from jagg_core.quiet import quiet_environment

# the libraries' settings that the project's commands set as they start, set once for every test: a command run in
# a child sees the same environment whichever tests ran in this process before it (some quiet the libraries here)
quiet_environment()

from zygote import ROOT, run_python  # noqa: E402  (it keeps the environment above as its server's)



def tiny_config(model: str = "tiny-sd3", **overrides):
    """The tiny-sd3 preset, made smaller still, with ``section__key=value`` overrides."""
    base = {"train.iterations": 2, "sampling.num_steps": 6, "sampling.resolution": 32, "grpo.num_generations": 2,
            "grpo.prompts_per_iteration": 2, "prompts.eval_count": 2, "backward.window": 3,
            "train.sample_every": 1, "train.checkpoint_every": 1, "model.name": model}
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(preset="tiny-sd3", overrides=[f"{k}={v}" for k, v in base.items()])


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m jagg_core.run ARGS`` in the repository root, offline (forked from :mod:`zygote`)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return run_python(["-m", "jagg_core.run", *args], cwd=ROOT, env=full_env, timeout=timeout)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny random CLIP (32 px images, a letters-only tokenizer) saved as a model folder, and an aesthetic head for
    its 16-wide embeddings: ``(folder, head .pth)``."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor, CLIPTokenizer

    from jagg_core.rewards.clip import AestheticHead

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in [*letters, *(c + "</w>" for c in letters)]:
        vocab[token] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2),
        projection_dim=16,
    )
    folder = tmp_path_factory.mktemp("tiny-clip")
    CLIPModel(config).eval().save_pretrained(folder)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    head = tmp_path_factory.mktemp("head") / "head.pth"
    torch.save(AestheticHead(16).state_dict(), head)
    return str(folder), str(head)


def euler_ode(model, z0, sigmas, cond):
    """The sampler's Euler ODE from ``z0``, ``z_{i+1} = z_i + (sigma_{i+1} - sigma_i) v(z_i, sigma_i)``: the final
    latents and their decoding."""
    import torch

    z = z0
    with torch.no_grad():
        for i in range(len(sigmas) - 1):
            z = z + (sigmas[i + 1] - sigmas[i]) * model.velocity(z, sigmas[i], cond)
        return z, model.decode_samples(z, cond)


def pipeline_with_final_latents(pipe, **call):
    """``pipe(**call)`` and the latents after its last denoising step (from ``callback_on_step_end``)."""
    final = {}

    def keep_latents(_pipe, _step, _timestep, tensors):
        final["latents"] = tensors["latents"]
        return {}

    output = pipe(callback_on_step_end=keep_latents, **call)
    return output, final["latents"].float()


def snippet_arguments(model, size, batch: int = 1) -> dict:
    """The pipeline ``__call__`` arguments the model card's snippet gives for ``model``'s config at ``size`` (its
    family's ``pipeline_arguments``), for ``batch`` prompts: a negative prompt's text one a prompt, its embeddings
    (where the pipeline takes only those) from the pipeline's ``encode_prompt``, as the snippet computes them."""
    from jagg_core.family_names import TEXT_NEGATIVE_PROMPT, PromptEmbeddings
    from jagg_core.preflight import model_family

    arguments = model_family(model.config).pipeline_arguments(model.config, size)
    for name, value in arguments.items():
        if isinstance(value, PromptEmbeddings):
            embeddings = model.pipe.encode_prompt(value.text, max_sequence_length=arguments["max_sequence_length"])[0]
            arguments[name] = embeddings.repeat(batch, 1, 1)
        elif name == TEXT_NEGATIVE_PROMPT:
            arguments[name] = [value] * batch
    return arguments


def pipeline_kwargs(model, size, batch: int = 1) -> dict:
    """The pipeline ``__call__`` arguments that mean what ``model.config`` means to the sampler at ``size`` (the
    model card's, :func:`snippet_arguments`, and the size), for ``batch`` prompts."""
    return {"height": size.height, "width": size.width, **snippet_arguments(model, size, batch)}


def noise(model, batch: int, seed: int = 0, size=None):
    """Seeded standard normal latents of ``batch`` samples of ``model`` at ``size`` (default 32 x 32 px, the tiny
    models' tests' size)."""
    import torch

    from jagg_core.image_size import ImageSize
    size = size or ImageSize.square(32)
    return torch.randn((batch, *model.latent_shape(size)), generator=torch.Generator().manual_seed(seed))


def pipeline_latents(model, z):
    """The pipeline's ``latents`` argument for the sampler's ``z``: FLUX.2 takes the patchified grid [B, 4C, h, w]
    and packs it itself; the others take them as their denoising loop holds them (:func:`loop_latents`)."""
    if model.family.startswith("flux2"):
        return z.permute(0, 3, 1, 2).clone()
    return loop_latents(model, z).clone()


def loop_latents(model, z):
    """The sampler's ``z`` as the pipelines' denoising loop holds it: a packed family's grid [B, h, w, 4C] as its
    tokens row by row [B, h w, 4C] (FLUX, Qwen-Image, FLUX.2, the editing families), the others as it is."""
    from jagg_core.models.base import PackedFlowModel
    return z.flatten(1, 2) if isinstance(model, PackedFlowModel) else z


def add_moved_lora(model, **kind):
    """Add a rank-4 LoRA (alpha 8; ``kind``: more :class:`~jagg_core.config.LoraConfig` settings) to ``model`` and
    move all its weights off their initialisation (seeded), so that it changes the velocity; its parameters."""
    import torch

    from jagg_core.config import LoraConfig

    params = model.add_lora(LoraConfig(rank=4, alpha=8.0, **kind))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in params:
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return params


def adapter_and_base_velocity(model, z, sigma, cond):
    """The velocity with ``model``'s LoRA on, and with it off."""
    import torch

    with torch.no_grad():
        trained = model.velocity(z, sigma, cond)
        with model.adapters_disabled():
            return trained, model.velocity(z, sigma, cond)


#: the browser tests' waits end on the state they wait for; this is only a safety cap (ms) against a page that never
#: gets there, far above what a loaded 2-core machine needs (the longest wait, a 3-iteration run's end, is under a
#: minute), and short enough that a wait on a state that never comes fails with its page's state (below) in the log
BROWSER_CAP_MS = 300_000
#: the browser tests' pages, whose state a failed test's report shows while they are open
BROWSER_PAGES: list = []


def wait_on_states_only(page) -> None:
    """Every ``expect`` and page wait of the browser tests waits for its state, capped at :data:`BROWSER_CAP_MS`; a
    browser test that fails while ``page`` is open shows the page's text in its report."""
    from playwright.sync_api import expect
    expect.set_options(timeout=BROWSER_CAP_MS)
    page.set_default_timeout(BROWSER_CAP_MS)
    BROWSER_PAGES.append(page)


def page_state(page, limit: int = 6000) -> str:
    """What ``page`` shows: its address and the start of its visible text (``limit`` characters)."""
    text = page.locator("body").inner_text(timeout=10_000)
    return f"{page.url}\n{text[:limit]}" + ("\n[...]" if len(text) > limit else "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report holds the text of every browser page still open (the module-scoped page of
    :mod:`tests.test_app_ux_browser`): which state a wait that ran out waited for is in Playwright's message, what
    the page showed instead is here."""
    report = yield
    BROWSER_PAGES[:] = [page for page in BROWSER_PAGES if not page.is_closed()]
    if report.failed:
        for page in BROWSER_PAGES:
            try:
                report.sections.append((f"the page when {item.name} failed", page_state(page)))
            except Exception as error:  # a page that cannot answer: say so, the failure itself is the report
                report.sections.append((f"the page when {item.name} failed", f"not readable: {error}"))
    return report


#: the reward-hacking alarm's line, as the trainer writes it (jagg_core.metrics.HACKING_ALARM)
HACKING_ALARM_LINE = ("reward hacking suspected: the eval reward rose +0.081 over iterations 2-4 while judge "
                      "shapes_fidelity fell -0.052 (allowance 0.011)")
#: a first-iteration checklist (RUN/doctor.json) with a passed, a failed and a skipped check
DOCTOR_REPORT = {"iteration": 1, "passed": False, "checks": [
    {"check": "rewards vary within groups", "status": "pass", "detail": "std 0.12 within groups", "fix": ""},
    {"check": "the gradient moves the velocity", "status": "fail", "detail": "the velocity moved 0.0",
     "fix": "raise train.learning_rate"},
    {"check": "the JAGG audit agrees", "status": "skip", "detail": "no audit at iteration 1", "fix": ""}]}


def add_judges(run_dir: Path, judges: dict[str, dict[int, float]], best_iteration: int, adapter: Path,
               alarm_iteration: int | None = None) -> dict:
    """Give a fabricated run what a trainer with ``eval.judges`` writes, in place of any judges it had: the judges in
    its config, each judge's eval mean on its metrics rows (``judges``: name -> {iteration: mean}), the alarm's line
    on the row of
    ``alarm_iteration`` and in status.json, a copy of ``adapter`` as the best adapter of ``best_iteration`` (by the
    first judge) and :data:`DOCTOR_REPORT`. Returns the best's record."""
    import shutil

    import yaml

    from jagg_core import metrics
    from jagg_core.rundir import LORA_FILE, RunDirectory

    run = RunDirectory(run_dir)
    config = run.read_config()
    config["eval"] = {**(config.get("eval") or {}), "judges": [{"name": name, "options": {}} for name in judges],
                      "best_by": next(iter(judges))}
    run.write_config(yaml.safe_dump(config, sort_keys=False))
    rows = []
    for row in run.read_metrics():
        iteration = row[metrics.ITERATION]
        row = {key: value for key, value in row.items()
               if not key.startswith(metrics.JUDGE_PREFIX) and key != metrics.HACKING_ALARM}
        row.update({metrics.judge_key(name): means[iteration] for name, means in judges.items() if iteration in means})
        if iteration == alarm_iteration:
            row[metrics.HACKING_ALARM] = HACKING_ALARM_LINE
        rows.append(row)
    run.metrics_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    name = next(iter(judges))
    value = judges[name][best_iteration]
    record = {"iteration": best_iteration, "metric": metrics.judge_key(name), "label": f"judge {name}",
              "value": value, "reason": f"the highest judge {name} ({value:.3f}) of the "
                                        f"{sum(0 < i <= best_iteration for i in judges[name])} evals of the adapter "
                                        f"so far, at iteration {best_iteration}"}
    run.write_best(lambda folder: shutil.copyfile(adapter, folder / LORA_FILE), record)
    run.write_doctor(DOCTOR_REPORT)
    status = {key: value for key, value in run.read_status().items() if key != "alarm"}
    run.write_json(run.status_file, status | ({"alarm": HACKING_ALARM_LINE} if alarm_iteration is not None else {}))
    return record
