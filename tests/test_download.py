"""A Hub base model's first download, against the fake Hub (tests/fake_hub_server.py) serving the embedded jagg-shapes
pipeline as a Hub repo, with files that ``from_pretrained`` does not fetch beside it.

The real ``huggingface_hub`` client talks to the fake: its endpoint constants point at it and the cache is the
test's temporary folder. Waits are on states (the status file, the server's records), never on the clock.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
from huggingface_hub import constants

from jagg_core.config import ModelConfig, RunConfig, load_config
from jagg_core.download import DownloadPlan, download_model, pipeline_files, storage_folder
from jagg_core.errors import UserError
from jagg_core.model_index import ASSETS_DIR
from jagg_core.preflight import check_model
from jagg_core.run import download_base_model
from jagg_core.rundir import RunDirectory
from tests.fake_hub_server import Drop, FakeHub

REPO = "tester/shapes-1.0-Diffusers"  # dotted, as the real ones (black-forest-labs/FLUX.1-dev)
GATED = "tester/gated"
ALICE, BOB = "hf_aliceReadToken1234567890", "hf_bobReadToken0987654321"
#: files of the repo that from_pretrained never fetches: another format, other frameworks, a variant, a single-file
#: checkpoint at the root (the pipeline's own README.md and build_info.json are not fetched either)
DECOYS = {"jagg-shapes.safetensors": 300_000, "vae/diffusion_pytorch_model.bin": 200_000,
          "text_encoder/flax_model.msgpack": 90_000, "text_encoder/model.onnx": 90_000,
          "transformer/diffusion_pytorch_model.fp16.safetensors": 150_000}
NOT_FETCHED = {*DECOYS, "README.md", "build_info.json"}
SAFETY_CAP_S = 120  # a wait on a state that never comes fails here instead of hanging the suite
Usage = namedtuple("Usage", "total used free")


def _pipeline_files() -> dict[str, bytes]:
    folder = ASSETS_DIR / "jagg-shapes"
    files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return {**files, **{path: bytes([i % 251 for i in range(size)]) for path, size in DECOYS.items()}}


FILES = _pipeline_files()
NEEDED = {path: data for path, data in FILES.items() if path not in NOT_FETCHED}
#: the bytes to download once the pre-flight has fetched model_index.json: each content once (the two text encoders
#: and the two tokenizers are the same files)
LEFT = sum(len(data) for data in set(NEEDED.values())) - len(NEEDED["model_index.json"])


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The fake Hub with the pipeline's repo and a gated copy that alice may read; the client points at it, with
    an empty cache and no token, online."""
    with FakeHub() as server:
        server.add_token(ALICE, "alice", role="read")
        server.add_token(BOB, "bob", role="read")
        server.add_repo(REPO, FILES)
        server.add_repo(GATED, FILES, gated=True, granted=("alice",))
        url = server.url
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf-home" / ".agent_harnesses.json"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)  # progress and partial files in small steps
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server
    assert server.unrouted == []


def _plan(name: str = REPO) -> DownloadPlan:
    plan = check_model(ModelConfig(name=name))
    assert plan is not None
    return plan


def _snapshot(plan: DownloadPlan) -> Path:
    return storage_folder(REPO) / "snapshots" / plan.commit


def _wait_for(condition, what: str):
    """Poll until ``condition()`` is truthy (a state), failing at the safety cap."""
    cap = time.monotonic() + SAFETY_CAP_S
    while not (value := condition()):
        assert time.monotonic() < cap, f"waited {SAFETY_CAP_S} s for {what}"
        time.sleep(0.02)
    return value


# --- which files ---------------------------------------------------------------------------------------------------

FLUX_INDEX = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
              "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
              "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
              "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
              "image_encoder": [None, None], "feature_extractor": [None, None]}
#: black-forest-labs/FLUX.1-dev's files
FLUX_FILES = {
    ".gitattributes", "LICENSE.md", "README.md", "ae.safetensors", "dev_grid.jpg", "flux1-dev.safetensors",
    "model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json", "text_encoder/model.safetensors",
    "text_encoder_2/config.json", "text_encoder_2/model-00001-of-00002.safetensors",
    "text_encoder_2/model-00002-of-00002.safetensors", "text_encoder_2/model.safetensors.index.json",
    "tokenizer/merges.txt", "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json", "tokenizer_2/special_tokens_map.json", "tokenizer_2/spiece.model",
    "tokenizer_2/tokenizer.json", "tokenizer_2/tokenizer_config.json", "transformer/config.json",
    "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00003-of-00003.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors"}


def test_the_files_of_a_pipeline_are_the_ones_from_pretrained_fetches():
    extra = {"vae/diffusion_pytorch_model.bin", "text_encoder/flax_model.msgpack", "text_encoder/model.onnx",
             "transformer/diffusion_pytorch_model.fp16.safetensors", "flux1-dev.ckpt", "transformer/README.md",
             "image_encoder/config.json"}
    assert pipeline_files(FLUX_INDEX, FLUX_FILES | extra) == FLUX_FILES - {
        ".gitattributes", "LICENSE.md", "README.md", "ae.safetensors", "dev_grid.jpg", "flux1-dev.safetensors"}
    # a component without safetensors weights: diffusers then loads every component's .bin
    old = {"model_index.json", "vae/config.json", "vae/diffusion_pytorch_model.bin", "text_encoder/config.json",
           "text_encoder/pytorch_model.bin", "text_encoder/model.safetensors", "tokenizer/vocab.json"}
    index = {"_class_name": "X", "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"]}
    assert pipeline_files(index, old) == old - {"text_encoder/model.safetensors"}


# --- the pre-flight ------------------------------------------------------------------------------------------------

def test_the_preflight_tells_the_size_left_and_nothing_after_the_download(hub, monkeypatch, capsys):
    from jagg_core.run import main

    plan = _plan()
    assert {file.path for file in plan.files} == set(NEEDED)
    assert plan.total == sum(len(data) for data in NEEDED.values())
    assert plan.left == LEFT
    assert main(["--preset", "shapes", "--set", f"model.name={REPO}", "--dry-run"]) == 0
    assert f"the base model {REPO}: {plan.left / 1e6:.1f} MB to download (of {plan.total / 1e6:.1f} MB)" in \
        capsys.readouterr().err

    download_model(plan)
    after = _plan()
    assert after.left == 0 and after.pending == [] and after.commit == plan.commit
    assert {path: (_snapshot(plan) / path).read_bytes() for path in NEEDED} == NEEDED
    # each content once, none of the other files
    assert {d.path for d in hub.downloads} <= set(NEEDED)
    assert sorted(NEEDED[d.path] for d in hub.downloads) == sorted(set(NEEDED.values()))
    # offline, or with the Hub unreachable, a cached model passes as it is
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert check_model(ModelConfig(name=REPO)) is None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/"
                        "{filename}")
    assert check_model(ModelConfig(name=REPO)) is None


def test_offline_a_launch_needs_the_whole_model_in_the_cache_and_a_memory_plan_does_not(hub, monkeypatch):
    """A preset's model plans offline from the configs that ship; a run must not start without its weights."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    flux = ModelConfig(name="black-forest-labs/FLUX.1-dev")
    assert check_model(flux, disk=False) is None
    with pytest.raises(UserError, match="cannot load model 'black-forest-labs/FLUX.1-dev': the Hub is unreachable "
                                        "and it is not in the local cache; check your connection, or run `hf download"):
        check_model(flux)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    plan = _plan()
    download_model(DownloadPlan(plan.repo_id, plan.commit, tuple(f for f in plan.files if "vae/" not in f.path)))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=f"cannot load model '{REPO}': the Hub is unreachable and the local cache "
                                        "holds only part of it"):
        check_model(ModelConfig(name=REPO))


def test_a_disk_without_room_is_refused_before_anything_is_downloaded(hub, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 1_500_000_000, 1_500_000_000))
    with pytest.raises(UserError) as err:
        check_model(ModelConfig(name=REPO))
    assert str(err.value) == (
        f"cannot download the base model {REPO}: it needs {LEFT / 1e6:.1f} MB (and 2.0 GB to spare) in the Hugging "
        f"Face cache {constants.HF_HUB_CACHE}, whose disk has 1.5 GB free; free some space there, or set HF_HOME to "
        "a folder on a larger disk and start again")
    assert [d.path for d in hub.downloads] == ["model_index.json"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 0, 3 * 10**9))  # room now
    assert _plan().left > 0


def test_a_memory_plan_and_an_export_need_no_room_for_the_download_and_a_start_does(hub, monkeypatch, capsys,
                                                                                     tmp_path):
    from app.form import build_config, checked_config, preset_form
    from jagg_core.run import main

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 10**6, 10**6))
    assert main(["--preset", "shapes", "--set", f"model.name={REPO}", "--plan", "--gpu-memory", "16"]) == 0
    out, err = capsys.readouterr()
    assert "fits: planned peak" in out and f"the base model {REPO}: {LEFT / 1e6:.1f} MB to download" in err
    form = preset_form("shapes")
    form = type(form)(**{**form.__dict__, "model": REPO})
    assert build_config(form, tmp_path).model.name == REPO
    with pytest.raises(UserError, match="cannot download the base model"):
        checked_config(form, tmp_path)
    assert not [d for d in hub.downloads if not d.path.endswith(".json")]  # configs only


@pytest.mark.parametrize("token", [None, BOB])
def test_a_gated_repo_is_one_line_naming_the_fix(hub, monkeypatch, token):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(UserError) as err:
        check_model(ModelConfig(name=GATED))
    assert str(err.value) == (
        f"cannot load model '{GATED}': the repo is gated; accept its licence at {hub.url}/{GATED}, then "
        "`hf auth login` (or set HF_TOKEN) with a token of that account")
    monkeypatch.setenv("HF_TOKEN", ALICE)  # alice accepted it
    assert _plan(GATED).left > 0


# --- the downloading phase -----------------------------------------------------------------------------------------

def test_the_run_says_downloading_with_done_and_total_until_the_model_is_in(hub, tmp_path, capsys):
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    held = "transformer/diffusion_pytorch_model.safetensors"
    hub.holds[held] = threading.Event()  # its body waits until the test has seen the status
    total = sum(len(data) for data in NEEDED.values())
    config = RunConfig(model={"name": REPO})
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(download_base_model(config, run)))
    thread.start()

    def all_but_the_held_file() -> dict | None:
        status = run.read_status()
        return status if (status.get("download") or {}).get("done") == total - len(NEEDED[held]) else None

    try:
        status = _wait_for(all_but_the_held_file, "every file but the held one")
    finally:
        hub.holds[held].set()
    thread.join()
    assert status["state"] == "running" and status["phase"] == "downloading"
    assert status["download"]["total"] == total and status["download"]["rate"] >= 0
    assert status["message"].startswith(
        f"downloading {REPO}: {(total - len(NEEDED[held])) / 1e6:.1f} of {total / 1e6:.1f} MB, ")
    assert done == [True]
    final = run.read_status()
    assert final["phase"] == "downloading" and final["download"]["done"] == total
    out = capsys.readouterr().out
    assert f"jagg_core.run: downloading {REPO}: " in out and f"{total / 1e6:.1f} of {total / 1e6:.1f} MB" in out
    assert download_base_model(config, run) is False  # nothing left: no downloading phase


def test_a_text_cache_the_host_cannot_hold_is_refused_before_the_weights_download(hub, tmp_path, monkeypatch):
    """The cache is sized from the model's configs alone, so a run learns it before a download of many GB; a resume
    whose cache is written reads it back instead (checked as it is read), and a run without the cache downloads."""
    from jagg_core.memory_plan import plan_memory
    from jagg_core.models import text_embeddings
    run = RunDirectory(tmp_path / "run")
    run.path.mkdir()
    config = load_config(preset="shapes", overrides=[f"model.name={REPO}"])
    plan = plan_memory(config)
    monkeypatch.setattr(text_embeddings, "available_memory", lambda: plan.host_cache - 1)
    with pytest.raises(UserError) as err:
        download_base_model(config, run)
    assert str(err.value).startswith(
        f"the text-embedding cache of {plan.cached_prompts} prompts ({plan.bytes_per_cached_prompt / 1e6:.3g} MB "
        f"each) takes {plan.host_cache / 1e6:.1f} MB of host memory and of disk in {run.path}; this machine has ")
    assert not [d for d in hub.downloads if not d.path.endswith(".json")]  # configs only
    run.text_embeddings_file.write_bytes(b"")
    assert download_base_model(config, run, resume=True)
    shutil.rmtree(constants.HF_HUB_CACHE)
    assert download_base_model(load_config(preset="shapes", overrides=[f"model.name={REPO}",
                                                                      "model.cache_text_embeddings=false"]), run)


def test_an_interrupted_download_continues_where_it_stopped(hub):
    path = "transformer/diffusion_pytorch_model.safetensors"
    size = len(NEEDED[path])
    hub.drops[path] = Drop(at=size // 2, then_unavailable=True)  # the connection breaks, then the file is down
    with pytest.raises(UserError) as err:
        download_model(_plan())
    assert "the Hub answered HTTP 503; retry later (what is downloaded is kept" in str(err.value)
    assert "\n" not in str(err.value)
    plan = _plan()  # the next start
    kept = next(file for file in plan.files if file.path == path).have
    assert 0 < kept <= size // 2 and plan.left == size - kept
    hub.unavailable.clear()
    before = len(hub.downloads)
    download_model(plan)
    resumed = [d for d in hub.downloads[before:] if d.path == path]
    assert [(d.range, d.sent) for d in resumed] == [(f"bytes={kept}-", size - kept)]
    assert (_snapshot(plan) / path).read_bytes() == NEEDED[path]
    assert _plan().left == 0


def test_the_pipeline_loads_from_the_cache_without_fetching_more(hub):
    download_model(_plan())
    before = len(hub.downloads)
    from jagg_core.models import load_flow_model
    model = load_flow_model(ModelConfig(name=REPO))
    assert type(model.pipe).__name__ == "StableDiffusion3Pipeline"
    assert hub.downloads[before:] == []

