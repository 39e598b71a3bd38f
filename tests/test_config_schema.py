"""The config schema documents every key; the config reference (docs/config.md) and the app's help text are derived
from it; non-finite numbers and seeds beyond 64 bits are refused with one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from app.form import KNOBS
from jagg_core.config import RunConfig, flat_keys, load_config, schema_field, section_type, yaml_value
from jagg_core.config_reference import REFERENCE_BEGIN, REFERENCE_END, config_reference
from jagg_core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "config.md"


def _sections() -> list[type[BaseModel]]:
    return [RunConfig] + [section_type(f.annotation) for f in RunConfig.model_fields.values()
                          if section_type(f.annotation) is not None]


def _keys() -> list[str]:
    keys = []
    for name, field in RunConfig.model_fields.items():
        section = section_type(field.annotation)
        if section is None:
            keys.append(name)
        else:
            keys += [f"{name}.{key}" for key in section.model_fields]
    return keys


def test_every_section_is_in_the_reference_with_a_docstring():
    sections = _sections()
    assert len(sections) == 13
    for section in sections:
        assert (section.__doc__ or "").strip(), f"{section.__name__} needs a docstring"


@pytest.mark.parametrize("key", _keys())
def test_every_field_has_a_one_line_description(key):
    description = schema_field(key).description
    assert description and description.strip(), f"config key '{key}' has no description"
    assert "\n" not in description


def test_all_121_keys_are_covered():
    """56 keys; train.lr_scheduler, lr_warmup_steps, lr_num_cycles, ema_decay and report_to; model.quantize (was
    quantize_4bit), cache_text_embeddings, vae_slicing and sampling.rollout_chunk; backward.audit_every and
    audit_samples; grpo.window_placement, trained_start, kl_form, group_by and global_std; backward.min_fidelity and
    route_by; prompts.eval_source; model.condition_resolution; grpo.kl_reference, slide_every and shared_prefix;
    sampling.num_frames, fps and reward_frames (video); grpo.branch_factor; train.algorithm with the nft (7,
    updates_per_rollout the last) and awm (9) sections; the eval section (judges, best_by, hacking_window,
    hacking_z) with train.on_hacking and doctor; model.cudnn_attention and bf16_reduced_precision_reduction (the
    FLUX crash's suspects); prompts.limit; sampling.sde_type; grpo.policy_loss and kl_mask_threshold; model.input_images;
    model.vae_tiling; model.expert and guidance_scale_2 (Wan 2.2 A14B); model.flow_shift; lora.use_dora and
    use_rslora."""
    assert len(_keys()) == 121


def test_the_reference_page_is_the_generated_one_and_the_readme_links_it():
    assert "[docs/config.md](docs/config.md)" in (ROOT / "README.md").read_text()
    text = REFERENCE.read_text()
    assert text.count(REFERENCE_BEGIN) == 1 and text.count(REFERENCE_END) == 1
    between = text.split(REFERENCE_BEGIN + "\n", 1)[1].split(REFERENCE_END, 1)[0]
    assert between == config_reference(), "regenerate it: python -m jagg_core.config_reference --update docs/config.md"


def test_reference_shows_every_key_default_and_choices():
    reference = config_reference()
    for key in _keys():
        table_key = key.replace("rewards.", "rewards[].")
        assert f"| `{table_key}` |" in reference, key
    assert "| `backward.mode` | `jagg` |" in reference and "Allowed: `exact`, `jagg`" in reference
    assert "| `rewards[].name` | required |" in reference
    assert "Allowed: `'no'`, `fp16`, `bf16`" in reference  # a bare `no` would be YAML false
    assert "Range: `[0, 2^63)`" in reference


def test_the_reference_and_list_rewards_give_every_reward_what_it_scores_and_its_options():
    from jagg_core.rewards.catalog import CATALOG
    from conftest import run_cli

    sections = dict(part.split("`\n", 1) for part in config_reference().split("\n#### `")[1:])
    assert list(sections) == list(CATALOG)
    for name, entry in CATALOG.items():
        assert entry.about[1:] in sections[name]
        rows = [line for line in sections[name].splitlines() if line.startswith("| `options.")]
        assert [row.split("`")[1] for row in rows] == [f"options.{key}" for key in entry.options.model_fields]
        assert rows or "No options." in sections[name]
    assert "| `options.url` | required |" in sections["http"]
    assert "Scoring models: 600 M parameters." in sections["geneval"]
    assert "A working model's samples score at most 0 (the doctor" in sections["jpeg_compressibility"]
    listed = run_cli("--list-rewards")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(CATALOG)
    assert lines[list(CATALOG).index("http")].endswith("(options: url, timeout, retries, retry_delay)")
    assert lines[list(CATALOG).index("motion")].endswith("(no options)")


def test_reference_command_prints_it_and_the_modules_are_light():
    out = subprocess.run([sys.executable, "-m", "jagg_core.config_reference"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout == config_reference()
    code = ("import sys, jagg_core.config, jagg_core.config_reference;"
            "print(sorted({'torch', 'diffusers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.key)
def test_knob_help_is_the_schema_description(knob):
    assert knob.info == schema_field(knob.key).description == RunConfig.describe(knob.key)
    assert knob.info


@pytest.mark.parametrize("override, key", [
    ("train.learning_rate=inf", "train.learning_rate"),
    ("train.learning_rate=.inf", "train.learning_rate"),
    ("train.learning_rate=nan", "train.learning_rate"),
    ("train.learning_rate=.nan", "train.learning_rate"),
    ("grpo.kl_beta=-.inf", "grpo.kl_beta"),
    ("rewards=[{name: jpeg_compressibility, weight: .nan}]", "rewards.0.weight"),
    ("rewards=[{name: jpeg_compressibility, weight: .inf}]", "rewards.0.weight"),
    ("train.seed=99999999999999999999999", "train.seed"),
    ("train.seed=9223372036854775808", "train.seed"),
    ("train.seed=-1", "train.seed"),
    ("train.eval_seed=99999999999999999999999", "train.eval_seed"),
    ("prompts.split_seed=99999999999999999999999", "prompts.split_seed"),
])
def test_non_finite_numbers_and_huge_seeds_are_refused(override, key):
    with pytest.raises(UserError) as err:
        load_config(preset="tiny-sd3", overrides=[override])
    message = str(err.value)
    assert f"for '{key}'" in message and "\n" not in message


def test_largest_seed_is_accepted():
    config = load_config(preset="tiny-sd3", overrides=[f"train.seed={2 ** 63 - 1}", "train.eval_seed=0",
                                                         f"prompts.split_seed={2 ** 63 - 1}"])
    assert config.train.seed == 2 ** 63 - 1


def test_cli_prints_one_line_and_exits_2():
    for override, key in (("train.learning_rate=inf", "train.learning_rate"),
                          ("train.seed=99999999999999999999999", "train.seed")):
        result = subprocess.run([sys.executable, "-m", "jagg_core.run", "--preset", "tiny-sd3", "--dry-run",
                                 "--set", override], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "bad value" in lines[0] and f"for '{key}'" in lines[0], result.stderr


def test_unknown_key_lookup_is_a_user_error():
    with pytest.raises(UserError, match="unknown config key 'train.nope'"):
        RunConfig.describe("train.nope")


def test_every_value_written_by_yaml_value_reads_back_through_set():
    """flat_keys and yaml_value write a config as ``--set KEY=VALUE`` lines (the app's command line, the trackers'
    hyper-parameters); applied to the defaults they give the config back."""
    config = load_config(preset="tiny-sd3", overrides=["description=", "rewards=[{name: shapes, weight: 2}]",
                                                       "train.report_to=[tensorboard]", "train.mixed_precision=no"])
    flat = flat_keys(config.model_dump(mode="json"))
    assert flat["train.mixed_precision"] == "no" and flat["rewards"][0]["weight"] == 2  # a list is one leaf
    again = load_config(preset="shapes", overrides=[f"{key}={yaml_value(value)}" for key, value in flat.items()])
    assert again == config
    assert flat_keys({"a": {"b": {"c": 1}, "d": {}}, "e": [1]}, separator="/") == {"a/b/c": 1, "a/d": {}, "e": [1]}


def test_a_config_written_with_the_old_rollout_batch_size_loads_as_the_rollout_chunk(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "tiny-sd3"}, "sampling": {"rollout_batch_size": 3}}))
    config = load_config(config_file=path)
    assert config.sampling.rollout_chunk == 3 and config.sampling.chunk(8) == 3 and config.sampling.eval_chunk(2) == 2
