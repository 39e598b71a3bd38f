"""Publishing to and loading from the Hub, against a local fake Hub (tests/fake_hub_server.py).

The real ``huggingface_hub`` client talks to the fake server: its endpoint constants are pointed at it, and the
token store and cache are moved into the test's temporary folder, so nothing leaves the machine.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from huggingface_hub import ModelCard, constants
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image

from jagg_core import hub as hub_module
from jagg_core.config import RunConfig
from jagg_core.errors import UserError
from jagg_core.hub import push_if_configured, push_run, write_model_card
from jagg_core.hubclient import resolve_lora, resolve_token
from jagg_core.model_card import reward_curve_figure
from jagg_core.models import build_tiny_pipeline
from jagg_core.rundir import LORA_FILE, TRANSFORMER_2_LORA_FILE, RunDirectory, adapter_filenames
from tests.fake_hub_server import FakeHub, validate_card_metadata

from conftest import HACKING_ALARM_LINE, add_judges

TOKEN = "hf_aliceWriteToken1234567890"
READ_TOKEN = "hf_aliceReadOnly0987654321"
BASE_MODEL = "stabilityai/stable-diffusion-3.5-medium"
PROMPTS = ["a red circle", "a blue square", "a green triangle"]
#: a judge's eval means at the fixture's evals (0, 2, 4): best at iteration 2, then it falls as the reward rises
JUDGES = {"shapes_fidelity": {0: 0.6, 2: 0.9, 4: 0.7}}
EXPECTED_FILES = {
    "pytorch_lora_weights.safetensors", "README.md", "config.yaml", "images/reward_curve.png",
    "images/before_after.png", "samples/000.png", "samples/001.png", "samples/002.png",
}


# --- fixtures ----------------------------------------------------------------------------------------------------

def _generate(pipe) -> np.ndarray:
    return pipe("a red circle", num_inference_steps=2, height=32, width=32, guidance_scale=1.0,
                generator=torch.Generator().manual_seed(0), output_type="np").images


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """Two diffusers LoRAs of the tiny SD3 model (final and an earlier checkpoint) and the final one's output."""
    pipe = build_tiny_pipeline("tiny-sd3")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                            target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    folders = {}
    for name, scale in [("final", 1.0), ("checkpoint", 0.5)]:
        folders[name] = tmp_path_factory.mktemp(name)
        layers = {k: v * scale for k, v in get_peft_model_state_dict(pipe.transformer).items()}
        pipe.save_lora_weights(folders[name], transformer_lora_layers=layers)
    return folders, _generate(pipe)


def _png(path, color) -> None:
    Image.new("RGB", (32, 32), color).save(path)


@pytest.fixture
def run_dir(tmp_path, loras):
    """A finished 4-iteration run as the trainer leaves it; the push token was (wrongly) saved in its config."""
    folders, _ = loras
    run = tmp_path / "run"
    config = RunConfig(model={"name": BASE_MODEL}, rewards=[
        {"name": "jpeg_compressibility", "weight": 1.0},
        {"name": "ocr", "weight": 0.5, "options": {"api_token": "secret-reward-key", "lang": "en"}}],
        description="Compressible shapes.").model_dump(mode="json")
    config["hub"]["token"] = TOKEN
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (run / "run_info.json").write_text(json.dumps({"family": "sd3", "base_model": BASE_MODEL}))
    (run / "status.json").write_text(json.dumps({"state": "finished"}))
    rows = [{"iteration": i, "reward_mean": 0.1 * i, "reward_std": 0.05, "loss": 0.01} for i in range(5)]
    for i, value in [(0, 0.25), (2, 0.5), (4, 0.75)]:
        rows[i]["eval_reward_mean"] = value
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"iterat')
    for iteration, color in [(0, "gray"), (2, "orange"), (4, "red")]:
        folder = run / "samples" / f"iter_{iteration:06d}"
        folder.mkdir(parents=True)
        for i in range(len(PROMPTS)):
            _png(folder / f"{i:03d}.png", color)
        (folder / "prompts.json").write_text(json.dumps(PROMPTS))
    for target, source in [("lora", "final"), ("checkpoints/iter_000002", "checkpoint")]:
        (run / target).mkdir(parents=True)
        adapter = folders[source] / "pytorch_lora_weights.safetensors"
        (run / target / "pytorch_lora_weights.safetensors").write_bytes(adapter.read_bytes())
    (run / "checkpoints/iter_000002/trainer_state.json").write_text(json.dumps({"iteration": 2}))
    return run


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A running fake Hub with alice's write and read-only tokens; the client points at it and has no token."""
    with FakeHub() as server:
        server.add_token(TOKEN, "alice", orgs=("alice-lab",))
        server.add_token(READ_TOKEN, "alice", role="read")
        _point_client_at(monkeypatch, server.url, tmp_path)
        yield server
    assert server.unrouted == []


def _point_client_at(monkeypatch, url: str, tmp_path) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf-home" / ".agent_harnesses.json"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)


def _tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- a successful push -------------------------------------------------------------------------------------------

def test_push_uploads_the_run_in_one_commit(fake_hub, run_dir, loras):
    url = push_run(run_dir, "alice/shapes-lora", token=TOKEN)

    repo = fake_hub.repos["alice/shapes-lora"]
    assert url == f"{fake_hub.url}/alice/shapes-lora"
    assert set(repo.files) == EXPECTED_FILES
    assert len(repo.commits) == 1 and not repo.private
    adapter = run_dir / "lora/pytorch_lora_weights.safetensors"
    assert repo.files["pytorch_lora_weights.safetensors"] == adapter.read_bytes()
    for name in ["images/reward_curve.png", "images/before_after.png", "samples/000.png"]:
        Image.open(io.BytesIO(repo.files[name])).verify()
    grid = Image.open(io.BytesIO(repo.files["images/before_after.png"]))
    assert grid.getpixel((10, grid.height - 10)) == (255, 0, 0)  # bottom row: the latest samples (red)

    config = yaml.safe_load(repo.files["config.yaml"])
    assert config["model"]["name"] == BASE_MODEL and config["rewards"][1]["options"] == {"lang": "en"}
    assert "token" not in config["hub"]
    sent = b"".join(fake_hub.bodies) + b"".join(repo.files.values())
    assert TOKEN.encode() not in sent and b"secret-reward-key" not in sent


def test_model_card_metadata_and_body(fake_hub, run_dir):
    push_run(run_dir, "alice/shapes-lora", token=TOKEN)
    readme = fake_hub.repos["alice/shapes-lora"].files["README.md"].decode()
    card = ModelCard(readme)

    assert validate_card_metadata(readme) == []
    card.validate()  # the fake Hub's /api/validate-yaml applies the same rules
    data = card.data
    assert data.base_model == BASE_MODEL
    assert data.library_name == "diffusers" and data.pipeline_tag == "text-to-image"
    assert data.tags == ["lora", "diffusers", "grpo", "jagg", "sd3", "jpeg_compressibility", "ocr"]
    assert data.widget == [{"text": p, "output": {"url": f"samples/{i:03d}.png"}} for i, p in enumerate(PROMPTS)]
    assert 'pipe.load_lora_weights("alice/shapes-lora")' in card.text
    assert f'DiffusionPipeline.from_pretrained("{BASE_MODEL}"' in card.text
    assert "| before | 0 | 0.2500 |" in card.text and "| after | 4 | 0.7500 |" in card.text
    assert "(images/reward_curve.png)" in card.text and "(images/before_after.png)" in card.text
    assert "| `ocr` | 0.5 |" in card.text and "JAGG (window 5" in card.text and "4 of 10" in card.text
    assert "Compressible shapes." in card.text


def test_pushed_adapter_loads_back_from_the_hub(fake_hub, run_dir, loras, monkeypatch):
    _, trained_output = loras
    push_run(run_dir, "alice/shapes-lora", token=TOKEN)

    path = resolve_lora("alice/shapes-lora")
    assert path.name == "pytorch_lora_weights.safetensors"
    pipe = build_tiny_pipeline("tiny-sd3")
    pipe.set_progress_bar_config(disable=True)
    base_output = _generate(pipe)
    pipe.load_lora_weights(path.parent)
    np.testing.assert_allclose(_generate(pipe), trained_output, atol=1e-5)
    assert np.abs(base_output - trained_output).max() > 1e-3

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # once downloaded, the cache serves it offline
    assert resolve_lora("alice/shapes-lora") == path


def test_an_adapter_of_both_experts_is_pushed_and_downloaded_as_its_two_files(fake_hub, run_dir):
    """``model.expert: both``: the push uploads the low-noise expert's file beside the first, and ``lora.init_lora``
    (``resolve_lora`` with the run's file names) downloads both into one folder; a repo without it is one line."""
    second = run_dir / "lora" / TRANSFORMER_2_LORA_FILE
    second.write_bytes(b"the low-noise expert's weights")
    push_run(run_dir, "alice/both-experts", token=TOKEN)
    assert fake_hub.repos["alice/both-experts"].files[TRANSFORMER_2_LORA_FILE] == second.read_bytes()
    path = resolve_lora("alice/both-experts", files=adapter_filenames("both"))
    assert path.name == LORA_FILE and (path.parent / TRANSFORMER_2_LORA_FILE).read_bytes() == second.read_bytes()
    fake_hub.add_repo("alice/one-expert", {LORA_FILE: b"x"})
    with pytest.raises(UserError, match=f"the repo has no {TRANSFORMER_2_LORA_FILE}"):
        resolve_lora("alice/one-expert", files=adapter_filenames("both"))


def test_cli_pushes_a_checkpoint_with_the_env_token(fake_hub, run_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_module.main(["push", str(run_dir), "--repo-id", "alice-lab/early", "--private", "--checkpoint", "iter_2"])

    assert capsys.readouterr().out.strip() == f"{fake_hub.url}/alice-lab/early"
    repo = fake_hub.repos["alice-lab/early"]
    assert repo.private
    checkpoint = run_dir / "checkpoints/iter_000002/pytorch_lora_weights.safetensors"
    assert repo.files["pytorch_lora_weights.safetensors"] == checkpoint.read_bytes()
    card = ModelCard(repo.files["README.md"].decode())
    assert "| after | 2 | 0.5000 |" in card.text and "iteration 2" in card.text
    grid = Image.open(io.BytesIO(repo.files["images/before_after.png"]))
    assert grid.getpixel((10, grid.height - 10)) == (255, 165, 0)  # iteration 2 samples (orange)


def test_push_again_and_bare_name_and_config_push(fake_hub, run_dir):
    config = RunConfig(hub={"push": True, "repo_id": "shapes-lora"})
    assert push_if_configured(run_dir, config, token=TOKEN) == f"{fake_hub.url}/alice/shapes-lora"
    assert push_if_configured(run_dir, RunConfig(), token=TOKEN) is None
    push_run(run_dir, "alice/shapes-lora", token=TOKEN)  # the repo exists: a second commit
    assert len(fake_hub.repos["alice/shapes-lora"].commits) == 2


def test_token_resolution_order(fake_hub, monkeypatch, tmp_path):
    assert resolve_token() is None
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text("hf_stored")
    assert resolve_token() == "hf_stored"
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert resolve_token() == "hf_env"
    assert resolve_token("hf_explicit") == "hf_explicit"


def test_model_card_preview_of_a_bare_run(tmp_path, capsys):
    """No run_info, metrics or samples, a non-Hub base model: still a valid card, with nothing invented."""
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    (run / "config.yaml").write_text(RunConfig().to_yaml())
    (run / "lora/pytorch_lora_weights.safetensors").write_bytes(b"x")
    hub_module.main(["card", str(run), "--repo-id", "alice/bare"])
    printed = capsys.readouterr().out
    card = ModelCard(printed)
    assert str(write_model_card(run, "alice/bare")) + "\n" == printed
    assert validate_card_metadata(printed) == []
    assert card.data.base_model is None and "widget" not in card.data.to_dict()
    assert card.data.tags == ["lora", "diffusers", "grpo", "jagg", "shapes"]
    assert "images/" not in card.text and 'pipe.load_lora_weights("alice/bare")' in card.text


def test_the_card_says_how_the_samples_were_made_beyond_the_defaults(tmp_path):
    """The evals' steps, the CFG scale and its negative prompt, the schedule shift: what sampling the adapter as it
    was trained and judged takes; none of it for a run at the defaults (the bare run above)."""
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    config = RunConfig(model={"guidance_scale": 4.5, "negative_prompt": "blurry", "flow_shift": 2.0},
                       sampling={"num_steps": 10, "eval_num_steps": 30})
    (run / "config.yaml").write_text(config.to_yaml())
    (run / "lora/pytorch_lora_weights.safetensors").write_bytes(b"x")
    card = str(write_model_card(run, "alice/cfg"))
    assert ('10 steps, SDE noise level 0.7, evals 30 steps, CFG 4.5, negative prompt "blurry", schedule shift 2.0; '
            "model dtype float32") in card
    assert "- **LoRA:** rank 8, alpha 8.0\n" in card  # a plain LoRA


def test_the_card_says_the_adapter_is_a_dora_of_rslora_scale(tmp_path):
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    (run / "config.yaml").write_text(RunConfig(lora={"use_dora": True, "use_rslora": True}).to_yaml())
    (run / "lora/pytorch_lora_weights.safetensors").write_bytes(b"x")
    assert ("- **LoRA:** rank 8, alpha 8.0, DoRA (`lora.use_dora`), rsLoRA scale alpha / sqrt(rank) "
            "(`lora.use_rslora`)\n") in str(write_model_card(run, "alice/dora"))


# --- judges, the best adapter, the hacking alarm ---------------------------------------------------------------------

def _judged(run_dir):
    """The fixture's run with a judge, its best adapter at iteration 2 (the checkpoint's) and the alarm at 4."""
    adapter = run_dir / "checkpoints/iter_000002/pytorch_lora_weights.safetensors"
    return add_judges(run_dir, JUDGES, best_iteration=2, adapter=adapter, alarm_iteration=4)


def test_the_best_adapter_is_pushed_with_a_card_that_says_which_and_why(fake_hub, run_dir, monkeypatch):
    record = _judged(run_dir)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_module.main(["push", str(run_dir), "--repo-id", "alice/best", "--checkpoint", "best"])

    repo = fake_hub.repos["alice/best"]
    assert repo.files["pytorch_lora_weights.safetensors"] == RunDirectory(run_dir).best_lora_file.read_bytes()
    assert repo.commits == ["JAGG Studio: best adapter, iteration 2"]
    card = ModelCard(repo.files["README.md"].decode()).text
    assert f"This is the best adapter of the run: iteration 2, {record['reason']}." in card
    assert "| | iteration | held-out reward | judge shapes_fidelity |" in card
    assert "| before | 0 | 0.2500 | 0.6000 |" in card and "| after | 2 | 0.5000 | 0.9000 |" in card
    assert "reward hacking" not in card  # the alarm fired after the best adapter's iteration
    grid = Image.open(io.BytesIO(repo.files["images/before_after.png"]))
    assert grid.getpixel((10, grid.height - 10)) == (255, 165, 0)  # iteration 2 samples (orange)


def test_the_latest_adapters_card_quotes_the_alarm_and_names_its_iteration(fake_hub, run_dir):
    _judged(run_dir)
    push_run(run_dir, "alice/latest", token=TOKEN)
    repo = fake_hub.repos["alice/latest"]
    assert repo.commits == ["JAGG Studio: latest adapter, iteration 4"]
    card = ModelCard(repo.files["README.md"].decode()).text
    assert "This is the latest adapter (iteration 4)." in card
    assert f"> ⚠️ **Warning, at iteration 4:** {HACKING_ALARM_LINE}." in card
    assert card.index("This is the latest adapter") < card.index("Warning") < card.index("## Results")
    assert "| after | 4 | 0.7500 | 0.7000 |" in card
    assert "This is checkpoint iter_000002." in str(write_model_card(run_dir, "alice/early", "iter_2"))


def test_the_reward_curve_plots_each_judge_dashed_beside_the_rewards(run_dir):
    _judged(run_dir)
    figure = reward_curve_figure(RunDirectory(run_dir).read_metrics())
    legend = next(axis.get_legend() for axis in figure.axes if axis.get_legend())
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == ["train reward (mean)", "held-out eval reward", "judge shapes_fidelity"]
    judge = next(line for axis in figure.axes for line in axis.lines if line.get_label() == "judge shapes_fidelity")
    assert judge.get_linestyle() == "--"
    assert list(judge.get_xdata()) == [0, 2, 4] and list(judge.get_ydata()) == [0.6, 0.9, 0.7]


# --- errors --------------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case, message", [
    ("no token", "no Hugging Face token: set HF_TOKEN, run `hf auth login`"),
    ("bad token", "cannot sign in to the Hugging Face Hub: the token is invalid or expired"),
    ("read-only token", "the Hugging Face token is read-only; create a token with write access"),
    ("someone else's repo", "cannot push to bob/theirs: user 'alice' cannot write to it; push to alice/theirs"),
    ("someone else's namespace", "cannot push to bob/new: user 'alice' cannot write to it"),
    ("hub unreachable", "the Hugging Face Hub is unreachable; check your connection and retry"),
    ("offline mode", "offline mode is on; unset HF_HUB_OFFLINE"),
    ("missing checkpoint", "has no checkpoint iter_000007; available: iter_000002"),
    ("no best adapter", "has no best adapter yet: it is written at the first eval after training starts"),
    ("token in the run", "refusing to push: the Hugging Face token appears in README.md"),
])
def test_push_errors_are_one_line_and_leave_the_run_intact(case, message, fake_hub, run_dir, monkeypatch, tmp_path):
    fake_hub.add_repo("bob/theirs", {"README.md": b"bob's"})
    repo_id, token, checkpoint = "alice/shapes-lora", TOKEN, None
    if case == "no token":
        token = None
    elif case == "bad token":
        token = "hf_wrong"
    elif case == "read-only token":
        token = READ_TOKEN
    elif case == "someone else's repo":
        repo_id = "bob/theirs"
    elif case == "someone else's namespace":
        repo_id = "bob/new"
    elif case == "hub unreachable":
        _point_client_at(monkeypatch, f"http://127.0.0.1:{_free_port()}", tmp_path)
    elif case == "offline mode":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    elif case == "missing checkpoint":
        checkpoint = "iter_7"
    elif case == "no best adapter":
        checkpoint = "best"
    elif case == "token in the run":
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        config["description"] = f"my token is {TOKEN}"
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    before = _tree(run_dir)

    with pytest.raises(UserError) as err:
        push_run(run_dir, repo_id, token=token, checkpoint=checkpoint)

    assert message in str(err.value) and "\n" not in str(err.value) and TOKEN not in str(err.value)
    assert fake_hub.repos["bob/theirs"].files == {"README.md": b"bob's"} and "alice/shapes-lora" not in fake_hub.repos
    assert _tree(run_dir) == before
    if case not in ("missing checkpoint", "no best adapter", "token in the run"):
        # fix the cause and retry: the push goes through
        _point_client_at(monkeypatch, fake_hub.url, tmp_path)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        push_run(run_dir, "alice/shapes-lora", token=TOKEN)
        assert set(fake_hub.repos["alice/shapes-lora"].files) == EXPECTED_FILES


def test_push_says_first_what_the_user_can_fix_here_no_adapter_then_a_malformed_id_then_no_token(
        run_dir, fake_hub, monkeypatch, tmp_path):
    _point_client_at(monkeypatch, f"http://127.0.0.1:{_free_port()}", tmp_path)  # and the Hub is unreachable
    with pytest.raises(UserError, match="'not a repo id!' is not a valid Hub repo id"):
        push_run(run_dir, "not a repo id!")
    with pytest.raises(UserError, match="no Hugging Face token"):
        push_run(run_dir, "alice/fine")
    (run_dir / "lora" / "pytorch_lora_weights.safetensors").unlink()
    with pytest.raises(UserError, match="has no adapter yet"):
        push_run(run_dir, "not a repo id!")


def test_the_card_shows_the_captioned_eval_grids_of_the_base_model_and_the_adapter(run_dir, fake_hub):
    for iteration in (0, 4):
        _png(run_dir / "samples" / f"iter_{iteration:06d}" / "grid.png", "white")
    push_run(run_dir, "alice/grids", token=TOKEN)
    files = fake_hub.repos["alice/grids"].files
    assert {"images/eval_grid_iter_000000.png", "images/eval_grid_iter_000004.png"} <= set(files)
    card = files["README.md"].decode()
    assert card.index("images/eval_grid_iter_000000.png") < card.index("images/eval_grid_iter_000004.png")


@pytest.mark.parametrize("source, message", [
    ("alice/missing", "cannot download the LoRA alice/missing: no such Hub repo, or it is private"),
    ("alice/not-a-lora", "the repo has no pytorch_lora_weights.safetensors"),
    ("bob/private", "no such Hub repo, or it is private"),
    ("not a repo!", "is neither a local folder nor a Hub repo id"),
])
def test_resolve_lora_errors(source, message, fake_hub):
    fake_hub.add_repo("alice/not-a-lora", {"README.md": b"hi"})
    fake_hub.add_repo("bob/private", {"pytorch_lora_weights.safetensors": b"x"}, private=True)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_lora(source, token=TOKEN)


def test_resolve_lora_local_and_offline(fake_hub, tmp_path, loras, monkeypatch):
    folders, _ = loras
    assert resolve_lora(str(folders["final"])) == folders["final"] / "pytorch_lora_weights.safetensors"
    with pytest.raises(UserError, match="has no pytorch_lora_weights.safetensors"):
        resolve_lora(str(tmp_path))
    _point_client_at(monkeypatch, f"http://127.0.0.1:{_free_port()}", tmp_path)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # skip the download's retry backoff (~25 s)
    with pytest.raises(UserError, match="unreachable and it is not in the local cache"):
        resolve_lora("alice/shapes-lora")


def test_cli_error_is_one_line_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jagg_core.hub", "push", str(tmp_path), "--repo-id", "a/b"],
                            capture_output=True, text=True, timeout=60,
                            env={"HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf-home"), "PATH": ""})
    assert result.returncode == 2
    assert result.stderr == f"jagg_core.hub: error: {tmp_path} is not a JAGG run directory (no config.yaml)\n"

