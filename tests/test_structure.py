"""The code's shape: imports follow the data flow, the run directory owns its files, the CLI answers light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jagg_core import metrics
from jagg_core.rundir import RunDirectory, parse_iteration

from conftest import ROOT

#: (importer prefix, imported prefix): imports that would run back up the flow
FORBIDDEN = [
    ("app", "jagg_core.run"), ("app", "jagg_core.trainer"),
    ("jagg_core.rundir", "jagg_core.rewards"), ("jagg_core.rundir", "jagg_core.images"),
    ("jagg_core.models", "jagg_core.hub"), ("jagg_core.models", "jagg_core.model_card"),
    ("jagg_core.rewards", "jagg_core.tiny"), ("jagg_core.rewards", "jagg_core.models"),
    ("jagg_core.hubclient", "jagg_core.hub"), ("jagg_core.metrics", "jagg_core"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names (relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_import_runs_back_up_the_flow():
    sources = [p for folder in ("app", "jagg_core") for p in (ROOT / folder).rglob("*.py")]
    wrong = [(module_name(p), imported) for p in sources for imported in imports_of(p)
             for importer, target in FORBIDDEN
             if module_name(p).startswith(importer) and (imported == target or imported.startswith(target + "."))]
    assert not wrong


#: the one module outside the bench that runs it: the GPU check, whose step 3 is the bench
BENCH_RUNNERS = {"jagg_core.gpu_check"}


def test_nothing_in_the_library_imports_the_bench_but_the_gpu_check():
    sources = [p for folder in ("app", "jagg_core") for p in (ROOT / folder).rglob("*.py")]
    wrong = [(module_name(p), imported) for p in sources for imported in imports_of(p)
             if not module_name(p).startswith(("jagg_core.bench", *BENCH_RUNNERS))
             and (imported == "jagg_core.bench" or imported.startswith("jagg_core.bench."))]
    assert not wrong


#: what reads a peak of memory: CUDA's high-water mark, the process's, the class that counts live tensors
PEAK_READERS = ("max_memory_allocated(", "reset_peak_memory_stats(", '"VmHWM"', "class LiveBytes")


def test_there_is_one_memory_meter():
    """Every peak memory figure comes from :mod:`jagg_core.memory_meter` (the memory plan imports its LiveBytes)."""
    sources = [p for folder in ("app", "jagg_core", "scripts") for p in (ROOT / folder).rglob("*.py")]
    readers = {p.relative_to(ROOT).as_posix() for p in sources if any(word in p.read_text() for word in PEAK_READERS)}
    assert readers == {"jagg_core/memory_meter.py"}

PROBE = """
import sys
from jagg_core.run import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "diffusers", "transformers", "accelerate") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), "CODE=" + str(code), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["--list-presets"], ["--dry-run"], ["--preset", "nope"],
                                  ["--set", "rewards=[{name: http, options: {url: 5}}]"],
                                  ["--preset", "tiny-sd3", "--set", "train.learning_rate=inf"]])
def test_the_cli_answers_without_loading_torch_or_diffusers(args):
    result = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True)
    assert "HEAVY= " in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_app_job_control_and_the_run_directory_load_no_deep_learning_library():
    probe = ("import sys, app.jobs, app.live, jagg_core.rundir, jagg_core.preflight;"
             "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True).stdout == "[]\n"


def test_old_run_directories_read_with_the_namespaced_keys(tmp_path):
    from app import live

    run = RunDirectory(tmp_path)
    rows = [{"iteration": 0, "eval_reward_mean": 0.5},
            {"iteration": 1, "reward_mean": 0.4, "reward_std": 0.1, "reward_shapes": 0.4, "loss": 0.02, "kl": 0.0,
             "time_rollout_s": 1.5, "time_train_s": 0.5, "jagg_routed_frac": 1.0}]
    run.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 2, "rew')
    read = run.read_metrics()
    assert read == [{metrics.ITERATION: 0, metrics.EVAL_REWARD_MEAN: 0.5},
                    {metrics.ITERATION: 1, metrics.REWARD_MEAN: 0.4, metrics.REWARD_STD: 0.1,
                     metrics.reward_part("shapes"): 0.4, metrics.LOSS: 0.02, metrics.KL: 0.0,
                     metrics.TIME_ROLLOUT: 1.5, metrics.TIME_TRAIN: 0.5, metrics.JAGG_ROUTED_FRAC: 1.0}]
    rewards, losses, fidelity = live.curves(tmp_path)
    assert set(rewards["series"]) == {"rollout reward", "eval reward (fixed seeds)"}
    assert rewards.dropna()["value"].tolist() == [0.5, 0.4] and losses.dropna()["value"].tolist() == [0.02, 0.0]
    assert fidelity.dropna().empty  # no audit in these runs


def test_iteration_names_and_incomplete_image_folders(tmp_path):
    assert parse_iteration("iter_000010") == 10 == parse_iteration("iter_10")
    assert parse_iteration("iter_x") is None and parse_iteration(".tmp-iter_000002-99") is None
    run = RunDirectory(tmp_path)
    folder = run.samples_dir(3)
    folder.mkdir(parents=True)
    (folder / "000.png").write_bytes(b"")
    assert run.samples(3) is None and run.sample_iterations() == []  # prompts.json is written last
    (folder / "prompts.json").write_text(json.dumps(["a", "b"]))
    assert run.sample_iterations() == [3] and run.samples(3).prompts == ["a"]


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, its docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_a_family_is_declared_once_in_its_file():
    """A family's pipeline class and Hub ids are written only in its file (jagg_core/models/<family>.py), and no
    other module keeps a table keyed by model names: the tables are derived from the declarations."""
    from jagg_core.family_names import MODELS_DIR, declared_families

    families = declared_families()
    family_files = {MODELS_DIR / f"{family.module}.py" for family in families}
    declared_strings = {name for family in families for name in (family.pipeline, *family.archs.values())}
    model_names = {name for family in families for name in (*family.tiny_models, *family.archs)}
    sources = [path for folder in ("app", "jagg_core", "scripts") for path in (ROOT / folder).rglob("*.py")
               if path not in family_files]
    written, tables = [], []
    for path in sources:
        tree = ast.parse(path.read_text())
        written += [(path.name, node.value) for node in _string_constants(tree) if node.value in declared_strings]
        tables += [(path.name, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Dict)
                   and any(isinstance(key, ast.Constant) and key.value in model_names for key in node.keys)]
    assert not written and not tables


def test_the_derived_tables_agree_with_the_declarations():
    from jagg_core.archs import ARCHS_DIR, HUB_IDS, transformer_config
    from jagg_core.config import ModelConfig
    from jagg_core.family_names import SAMPLING_FIELDS, DeclaredFamily, declared_families
    from jagg_core.model_index import tiny_models
    from jagg_core.models import FAMILIES, TINY_BUILDERS
    from jagg_core.models.editing import EditingFlowModel
    from jagg_core.models.registry import DECLARATIONS
    from jagg_core.models.wan import FirstFrameModel

    families = declared_families()
    assert list(DECLARATIONS) == [family.module for family in families]
    for declared in families:  # the torch-free reading of each file is its declaration
        family = DECLARATIONS[declared.module]
        assert declared == DeclaredFamily(declared.module, family.label, family.pipeline,
                                          tuple(family.tiny_builders), family.archs, family.depth_key,
                                          family.edits_images, family.edit_model is not None,
                                          family.max_input_images, family.requires, family.edit_pipeline,
                                          family.image_to_video, family.edit_label,
                                          *(getattr(family, name) for name in SAMPLING_FIELDS))
        assert not family.edit_label or family.edit_model is not None
        # prompted by rows with input images: an image editor, or Wan 2.1's image-to-video (a video from the image)
        assert family.edits_images == issubclass(family.model, (EditingFlowModel, FirstFrameModel))
        assert family.image_to_video == (family.edit_model or family.model).is_video
        assert family.edit_model is None or (  # an image editor, or a video model that starts from the image
            (issubclass(family.edit_model, EditingFlowModel) or family.edit_model.is_video)
            and issubclass(family.edit_model, family.model))
        assert not family.edit_pipeline or family.edit_model is not None
        assert FAMILIES[family.pipeline] is family.model
        for arch in family.archs:  # an arch's shipped pipeline is its family's, its depth under the declared key
            index = json.loads((ARCHS_DIR / arch / "model_index.json").read_text())
            assert index["_class_name"] == family.pipeline and family.depth_key in transformer_config(arch)
    assert len(FAMILIES) == len(families)  # one family per pipeline class
    assert list(TINY_BUILDERS) == tiny_models() == [name for family in families for name in family.tiny_models]
    assert HUB_IDS == {arch: repo for family in families for arch, repo in family.archs.items()}
    assert sorted(HUB_IDS) == sorted(path.parent.name for path in ARCHS_DIR.glob("*/model_index.json"))
    description = ModelConfig.model_fields["name"].description
    listed = [f"({', '.join(TINY_BUILDERS)})", f"({', '.join(family.label for family in families)})",
              f"(ARCH: {', '.join(HUB_IDS)})"]
    assert all(names in description for names in listed)


def test_the_space_runs_the_pinned_gradio_and_installs_the_programs_the_rewards_need():
    """A Hugging Face Space reads the README's front matter (its Gradio, its entry file) and installs the Debian
    packages of ``packages.txt``; the ocr reward needs Tesseract there too."""
    front = (ROOT / "README.md").read_text().split("---\n")[1]
    settings = dict(line.split(": ", 1) for line in front.splitlines() if ": " in line and not line.startswith(" "))
    pinned = next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("gradio"))
    assert settings["sdk"] == "gradio" and pinned.endswith(f"=={settings['sdk_version']}")
    assert (ROOT / settings["app_file"]).is_file()
    assert "tesseract-ocr" in (ROOT / "packages.txt").read_text().split()
