"""The one-command GPU check without a GPU: its order and resume from the ledger, the isolation of each step
(a crash, a hang past its cap), the FLUX crash triage at toy size, the real-size steps at toy size (``--reduced``)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

import pytest

from conftest import ROOT
from jagg_core.config import load_config
from jagg_core.models.base import ENCODE_BATCH
from jagg_core.gpu_check import (CheckOptions, all_steps, format_tables, memory_presets, memory_recipe, next_batch,
                                 plan_order, read_ledger, run_check, step_names, triage_verdict)
from jagg_core.errors import UserError
from jagg_core.gpu_check.driver import README_END, README_START, write_readme
from jagg_core.gpu_check.ledger import describe_order
from jagg_core.gpu_check.settings import CurrentSettings, changed_settings, step_settings
from jagg_core.memory_plan import CUDA_CONTEXT_GB
from jagg_core.gpu_check.triage import FLUX_PATH_SETTINGS

OFFLINE = {"HF_HUB_OFFLINE": "1"}
REDUCED = CheckOptions(reduced=True)


def run_gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jagg_core.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **OFFLINE}, timeout=3600)


def write_record(folder, name, date, rows, reduced=False, settings=None):
    (folder / f"{name}.json").write_text(json.dumps({"date": date, "options": {"reduced": reduced}, "rows": rows,
                                                     **({"settings": settings} if settings else {})}))


def today(options=CheckOptions()):
    """Each step's settings as the product resolves them today."""
    return CurrentSettings(all_steps(options), options)


def test_the_check_has_a_step_for_each_figure_the_issue_asks_for():
    names = step_names()
    assert names[0] == "device" and "simulate-crash" not in names and "simulate-crash" in step_names(REDUCED)
    triage = [n for n in names if n.startswith("triage-")]
    backends = ("cudnn", "flash", "efficient", "math")
    assert {f"triage-sdpa-{b}-{t}" for b in backends for t in (1101, 1152)} <= set(triage)
    assert {"triage-lora-rank4", "triage-lora-rank16", "triage-flux-path-as-crashed",
            "triage-sdpa-cudnn-1101-permuted", "triage-sdpa-cudnn-1152-permuted"} <= set(triage)
    assert set(memory_presets()) == {"sd35-medium-pickscore-16gb", "flux-dev-pickscore-24gb",
                                     "qwen-image-pickscore-24gb", "flux2-klein-pickscore-24gb",
                                     "zimage-turbo-pickscore-24gb", "wan21-t2v-1.3b-pickscore-24gb",
                                     "wan22-ti2v-5b-pickscore-24gb", "wan22-ti2v-5b-i2v-pickscore-24gb",
                                     "flux-kontext-clipdir-24gb", "qwen-image-edit-clipdir-24gb",
                                     "flux2-klein-edit-clipdir-24gb", "sd35-medium-pickscore-nft-24gb"}
    assert {f"memory-{p}" for p in memory_presets()} | {"memory-sd35-medium-pickscore-16gb-offload",
                                                         "memory-sd35-medium-pickscore-16gb-expandable-segments"} \
        <= set(names)
    assert {f"bench-{a}" for a in ("sd35-medium", "flux-dev", "qwen-image", "flux2-klein-4b", "z-image-turbo",
                                   "wan21-t2v-1.3b")} <= set(names)
    assert {f"quantize-sd35-medium-{b}" for b in ("bf16", "int8", "nf4")} <= set(names)
    steps = all_steps(CheckOptions())
    assert all(0 < s.cap_s <= 300 for s in steps) and all(s.env == {"CUDA_LAUNCH_BLOCKING": "1"}
                                                          for s in steps if s.table == "triage")
    isolated = [s for s in steps if s.name.startswith(("triage-sdpa-", "triage-lora-"))]
    batches, queue = [], isolated
    while queue:
        batches.append(next_batch(queue, 4, 0.85 * 139))
        queue = [s for s in queue if s not in batches[-1]]
    assert len(isolated) == 12 and sum(max(s.cap_s for s in b) for b in batches) <= 180  # apart within 3 minutes
    timed = [s for s in steps if s.table in ("device", "bench", "quantize") or s.name.startswith("triage-flux-path")]
    assert all(s.shares_gb is None for s in timed)  # their seconds are figures, or the crash may be memory: alone
    alone = {s.name for s in steps if s.table == "memory" and s.shares_gb is None}
    assert all(s.shares_gb for s in isolated) and alone \
        == {"memory-flux-dev-pickscore-24gb", "memory-flux-kontext-clipdir-24gb", "memory-qwen-image-pickscore-24gb",
            "memory-qwen-image-edit-clipdir-24gb", "memory-wan22-ti2v-5b-pickscore-24gb",
            "memory-wan22-ti2v-5b-i2v-pickscore-24gb"}  # quantized: their random weights pass through host memory, disk


def test_the_order_puts_the_device_the_triage_not_yet_answered_the_last_failed_then_the_never_measured(tmp_path):
    write_record(tmp_path, "old", "2026-11-30", [
        {"step": "device", "status": "ok"}, {"step": "tiny-sd3", "status": "ok"},
        {"step": "bench-flux-dev", "status": "failed", "reason": "CUDA error"},
        {"step": "memory-flux-kontext-clipdir-24gb", "status": "failed", "reason": "timed out after 34 s"},
        {"step": "bench-sd35-medium", "status": "ok"},
        {"step": "memory-flux2-klein-pickscore-24gb", "status": "skipped", "reason": "the 430 s budget is spent"}])
    write_record(tmp_path, "bench-sd35-medium", "2026-12-01T10:00:00+00:00",  # newer: it failed since
                 [{"step": "bench-sd35-medium", "status": "crashed", "reason": "killed by SIGSEGV"}])
    write_record(tmp_path, "tiny-flux", "2026-12-01T10:00:00+00:00", [  # skipped on this device is done
        {"step": "tiny-flux", "status": "ok"}, {"step": "tiny-flux", "status": "skipped", "reason": "NF4"}])
    write_record(tmp_path, "reduced", "2026-12-02", [{"step": "tiny-qwen", "status": "ok"}], reduced=True)
    write_record(tmp_path, "triage", "2026-12-04", [  # a triage case that failed has answered; one cut short has not
        {"step": "triage-flux-path-as-crashed", "status": "failed", "reason": "RuntimeError: cuDNN"},
        {"step": "triage-sdpa-cudnn-1101", "status": "crashed", "reason": "killed by SIGSEGV"},
        {"step": "triage-lora-rank4", "status": "timed out", "reason": "ran past its 20 s cap"}])
    ledger = read_ledger([tmp_path], CheckOptions())
    assert {name: o.status for name, o in ledger.items()} == {
        "device": "ok", "tiny-sd3": "ok", "tiny-flux": "ok", "bench-flux-dev": "failed",
        "memory-flux-kontext-clipdir-24gb": "failed", "bench-sd35-medium": "crashed",
        "triage-flux-path-as-crashed": "failed", "triage-sdpa-cudnn-1101": "crashed", "triage-lora-rank4": "timed out"}
    assert ledger["bench-sd35-medium"].date.startswith("2026-12-01")

    settings = today()
    order = [s.name for s in plan_order(all_steps(CheckOptions()), ledger, settings)]
    triage = [n for n in step_names() if n.startswith("triage-")
              and n not in ("triage-flux-path-as-crashed", "triage-sdpa-cudnn-1101")]
    assert "triage-lora-rank4" in triage
    never = [n for n in step_names() if n not in ledger and not n.startswith("triage-")]
    # the failures the triage is about (a dead process, a CUDA error) before the other failures; last, the steps
    # measured ok before the records kept their settings (stale: the product may have changed what they measure)
    assert order == ["device", *triage, "bench-sd35-medium", "bench-flux-dev", "memory-flux-kontext-clipdir-24gb",
                     *never, "tiny-sd3", "tiny-flux"]
    assert order.index("triage-sdpa-flash-1101") == 1 and "memory-flux2-klein-pickscore-24gb" in never
    assert "tiny-qwen" in never  # the reduced file is apart
    assert [s.name for s in plan_order(all_steps(CheckOptions()), ledger, settings, only=["tiny-sd3"])] == [
        "tiny-sd3"]


def test_a_step_measured_ok_under_todays_settings_is_done_and_under_others_is_stale_and_says_what_changed(
        tmp_path):
    settings = today()
    changed = json.loads(json.dumps(settings["tiny-flux"]))
    changed["int8"]["model.cudnn_attention"] = True  # a default the product has changed since
    for name, kept in (("tiny-sd3", settings["tiny-sd3"]), ("tiny-flux", changed), ("tiny-qwen", None)):
        write_record(tmp_path, name, "2026-12-01T10:00:00+00:00", [{"step": name, "status": "ok"}], settings=kept)
    write_record(tmp_path, "bench-flux-dev", "2026-12-01T10:00:00+00:00",  # failed: runs again whatever its settings
                 [{"step": "bench-flux-dev", "status": "failed"}], settings=settings["bench-flux-dev"])
    ledger, steps = read_ledger([tmp_path], CheckOptions()), all_steps(CheckOptions())
    order = plan_order(steps, ledger, settings)
    assert [s.name for s in order][-2:] == ["tiny-flux", "tiny-qwen"] and "tiny-sd3" not in [s.name for s in order]
    lines = describe_order(order, ledger, settings, CheckOptions())
    assert "tiny-flux: last ok on 2026-12-01, stale: int8: model.cudnn_attention true -> false, cap 60 s" in lines
    assert "tiny-qwen: last ok on 2026-12-01, stale: measured before the check kept its settings, cap 60 s" in lines
    assert "bench-flux-dev: last failed on 2026-12-01, cap 240 s" in lines
    table = format_tables(ledger, steps, CheckOptions(), settings)
    assert "| tiny-sd3 | 60 | ok | 2026-12-01 |" in table
    assert "| tiny-flux | 60 | ok, stale: int8: model.cudnn_attention true -> false | 2026-12-01 |" in table


def test_a_key_added_to_the_config_since_a_measurement_stales_it_only_away_from_its_default():
    """A new key's default keeps what the product did before it (model.input_images unset: the family's own count,
    1 input image a row for Qwen-Image-Edit)."""
    from jagg_core.gpu_check.settings import changed_settings
    now = today()["memory-qwen-image-edit-clipdir-24gb"]
    before = {label: {k: v for k, v in values.items() if k != "model.input_images"} for label, values in now.items()}
    assert now != before and changed_settings(before, now) == []
    two = {label: {**values, "model.input_images": 2} for label, values in now.items()}
    assert changed_settings(before, two) == ["model.input_images - -> 2"]
    assert changed_settings(now, before) == ["model.input_images null -> -"]  # a key gone is a change


def test_a_default_of_an_algorithm_a_step_does_not_run_changes_none_of_its_figures():
    """AWM's steps a sample became a default that follows the schedule (6 -> null): the GRPO and DiffusionNFT
    measurements recorded 6 and stay measured; a change of a key their algorithm reads stales them."""
    from jagg_core.gpu_check.settings import changed_settings
    for name in ("tiny-sd3", "memory-sd35-medium-pickscore-nft-24gb"):
        now = today()[name]
        assert not any("awm.train_timesteps" in values for values in now.values())  # not AWM's: not kept
        before = {label: {**values, "awm.train_timesteps": 6} for label, values in now.items()}
        assert changed_settings(before, now) == []
    now = today()["memory-sd35-medium-pickscore-nft-24gb"]
    before = {label: {**values, "nft.beta": 0.5} for label, values in now.items()}
    assert changed_settings(before, now) == ["nft.beta 0.5 -> 1.0"]


def test_the_committed_ledger_marks_what_each_check_measured_with_its_date_and_names_the_flux_crashs_cause():
    ledger = read_ledger([ROOT / "docs" / "gpu"], CheckOptions())
    assert ledger["bench-sd35-medium"].status == "ok" and ledger["bench-sd35-medium"].date.startswith("2026-11-30")
    assert ledger["bench-flux-dev"].status == "ok" and ledger["bench-flux-dev"].date.startswith("2026-12-04")
    assert ledger["memory-flux-kontext-clipdir-24gb"].status == "failed"
    assert {"memory-sd35-medium-pickscore-16gb", "memory-zimage-turbo-pickscore-24gb", "tiny-qwen"} <= set(ledger)
    assert "memory-qwen-image-pickscore-24gb" not in ledger  # skipped for the budget: never measured
    table = format_tables(ledger, all_steps(CheckOptions()), CheckOptions(), today())
    assert "| bench-sd35-medium | 240 | ok, stale: measured before the check kept its settings | 2026-11-30 | 65 |" \
        in table
    assert "| triage-lora-rank4 | 20 | ok | 2026-12-04 | 11 |" in table
    assert "- The cause is cuDNN SDPA attention: the FLUX path fails as it crashed and with no-bf16-split-k" in table
    # the tables leave out torch's request for better error messages; the record keeps it
    crashed = "| triage-flux-path-as-crashed | failed: RuntimeError: Expected mha_graph.execute(handle, variant_pack, " \
              "workspace_ptr.get()).is_good() to be true, but got false. | - | - | - |"
    assert crashed in table and "Could this error message be improved" not in table
    assert "Could this error message be improved" in ledger["triage-flux-path-as-crashed"].rows[0]["reason"]
    assert "| triage-flux-path-no-cudnn-sdpa | ok | - | - | JAGG W=5 cached joint, model.cudnn_attention=false" in table
    # the triage has answered: the next check starts with what is not yet measured, not with the FLUX path's failures
    order = [step.name for step in plan_order(all_steps(CheckOptions()), ledger, today())]
    assert order[:4] == ["device", "triage-sdpa-cudnn-1101-permuted", "triage-sdpa-cudnn-1152-permuted",
                         "memory-flux-kontext-clipdir-24gb"]
    assert len([name for name in order if name.startswith("triage-")]) == 2 and "bench-flux-dev" not in order
    # a plan's "fits" adds CUDA_CONTEXT_GB to its peak: at least what the last device step measured, when it did
    context = ledger["device"].rows[0].get("cuda_context_gb")
    assert context is None or CUDA_CONTEXT_GB >= round(context, 2), f"CUDA_CONTEXT_GB: the GPU measured {context:.2f}"
    # what a user reads is the ledger: docs/gpu/gpu_check.md and the README's copy are its tables today
    assert (ROOT / "docs" / "gpu" / "gpu_check.md").read_text() == table
    assert f"{README_START}\n\n{table}\n{README_END}\n" in (ROOT / "README.md").read_text()


def test_the_table_command_puts_the_tables_into_a_readme_between_its_markers_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# A\n\ntext before\n\n{README_START}\nold tables\n\n{README_END}\n\ntext after\n")
    done = run_gpu_check("--table", "--out", str(tmp_path / "empty"), "--readme", str(readme))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("GPU check (real size). Last device: device not checked.")
    expected = f"# A\n\ntext before\n\n{README_START}\n\n{done.stdout}\n{README_END}\n\ntext after\n"
    assert readme.read_text() == expected
    write_readme(readme, done.stdout)
    assert readme.read_text() == expected  # again: the same file
    readme.write_text("# A README without the markers\n")
    with pytest.raises(UserError, match="has no line .* followed later by a line"):
        write_readme(readme, done.stdout)
    assert readme.read_text() == "# A README without the markers\n"
    done = run_gpu_check("--readme", str(readme))
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--readme goes with --table" in done.stderr



def test_a_crash_and_a_hang_leave_their_rows_and_the_next_step_still_runs(tmp_path):
    lines = []
    rows = run_check(tmp_path, REDUCED, budget_s=600, only=["simulate-crash", "simulate-hang", "triage-sdpa-math-1101"],
                     caps={"simulate-hang": 2}, log=lines.append)
    by_step = {row["step"]: row for row in rows}
    assert by_step["simulate-crash"]["status"] == "crashed" and "SIGSEGV" in by_step["simulate-crash"]["reason"]
    assert by_step["simulate-hang"] == {"step": "simulate-hang", "status": "timed out",
                                        "reason": "ran past its 2 s cap"}
    assert by_step["triage-sdpa-math-1101"]["status"] == "ok"
    for name in by_step:  # each step's record and whole log, beside each other
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["rows"] == [by_step[name]] and record["options"]["reduced"] and record["date"]
        assert (tmp_path / f"{name}.log").is_file()
    assert "killing this process with SIGSEGV" in (tmp_path / "simulate-crash.log").read_text()
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| simulate-crash | 60 | crashed: killed by SIGSEGV |" in table
    assert "| simulate-hang | 3 | timed out" in table


def test_a_stopped_check_takes_its_running_step_with_it(tmp_path):
    """A step runs in a session of its own (a crash or a cap kills its children too), which Ctrl-C or a machine's
    SIGTERM to the check would not reach: the check kills it on its way out."""
    import psutil
    check = subprocess.Popen([sys.executable, "-m", "jagg_core.gpu_check", "--reduced", "--out", str(tmp_path),
                              "--only", "simulate-hang", "--cap", "simulate-hang=600", "--budget", "3600"], cwd=ROOT,
                             env={**os.environ, **OFFLINE}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "simulate-hang.log"
    while "waiting for a signal" not in (log.read_text() if log.is_file() else ""):  # the step runs
        assert check.poll() is None, "the check ended before its step ran"
        time.sleep(0.2)
    [step] = psutil.Process(check.pid).children()
    check.send_signal(signal.SIGTERM)
    assert check.wait() == 128 + signal.SIGTERM
    gone, left = psutil.wait_procs([step], timeout=60)  # a step left behind would hang on forever
    assert gone == [step] and not left


def test_the_steps_that_share_the_gpu_run_together_within_its_memory_and_the_parallel_bound():
    by_name = {s.name: s for s in all_steps(CheckOptions())}
    queue = [by_name[name] for name in (
        "memory-flux2-klein-pickscore-24gb", "memory-qwen-image-edit-clipdir-24gb", "memory-sd35-medium-pickscore-16gb",
        "memory-wan21-t2v-1.3b-pickscore-24gb", "memory-zimage-turbo-pickscore-24gb", "bench-sd35-medium", "tiny-sd3")]

    def names(parallel, room_gb, steps=queue):
        return [s.name.removeprefix("memory-") for s in next_batch(steps, parallel, room_gb)]

    h200 = 0.85 * 139
    assert names(4, h200) == ["flux2-klein-pickscore-24gb", "sd35-medium-pickscore-16gb",
                              "wan21-t2v-1.3b-pickscore-24gb", "zimage-turbo-pickscore-24gb"]  # 88 GB
    assert names(8, 0.85 * 80) == ["flux2-klein-pickscore-24gb", "sd35-medium-pickscore-16gb",
                                   "wan21-t2v-1.3b-pickscore-24gb", "tiny-sd3"]  # 66 of 68 GB
    assert names(1, h200) == ["flux2-klein-pickscore-24gb"]
    assert names(4, None, queue[1:]) == ["qwen-image-edit-clipdir-24gb"]  # a step that runs alone takes no company


def test_a_real_size_check_without_a_gpu_stops_after_the_device_step(tmp_path):
    lines = []
    rows = run_check(tmp_path, CheckOptions(), only=["device", "tiny-sd3"], log=lines.append)
    assert rows == [{"step": "device", "status": "failed", "cuda": False, "versions": rows[0]["versions"],
                     "tmp_free_gb": rows[0]["tmp_free_gb"],
                     "reason": "CUDA is not visible: torch.cuda.is_available() is False"}]
    assert rows[0]["tmp_free_gb"] == pytest.approx(shutil.disk_usage(tempfile.gettempdir()).free / 1e9, rel=0.05)
    assert "stopping" in lines[-1] and not (tmp_path / "tiny-sd3.json").exists()


def test_a_step_whose_cap_does_not_fit_is_not_started_and_a_shorter_one_is(tmp_path):
    lines = []
    rows = run_check(tmp_path, REDUCED, budget_s=50, only=["triage-flux-path-as-crashed", "simulate-hang"],
                     caps={"simulate-hang": 1}, log=lines.append)
    assert [row["step"] for row in rows] == ["simulate-hang"]
    assert "not started, their cap more than the time left: triage-flux-path-as-crashed (300 s > 50 s)" in lines[-1]
    assert not (tmp_path / "triage-flux-path-as-crashed.json").exists()


def test_the_triage_runs_on_a_cpu_at_toy_size_side_by_side_and_skips_the_kernels_it_lacks(tmp_path):
    names = ["triage-sdpa-cudnn-1101", "triage-sdpa-math-1152", "triage-lora-rank4"]
    lines = []
    rows = {row["step"]: row for row in run_check(tmp_path, REDUCED, budget_s=600, only=names, log=lines.append,
                                                  parallel=2)}
    started = [line for line in lines if line.endswith(" s left")]  # two at once, then the third
    assert len(started) == 2 and started[0].count("(cap 60 s)") == 2 and "side by side" in started[0]
    beside = {name: json.loads((tmp_path / f"{name}.json").read_text()).get("beside") for name in names}
    assert beside == {names[0]: [names[1]], names[1]: [names[0]], names[2]: None}
    cudnn, math_1152, lora = (rows[name] for name in names)
    assert cudnn["status"] == "skipped" and "no cudnn kernel" in cudnn["reason"]
    assert math_1152["status"] == "ok" and math_1152["tokens"] == 1152 // 16 and math_1152["out_err"] < 1e-5
    assert lora["status"] == "ok" and lora["rank"] == 4 and lora["grad_down_err"] < 1e-3



def test_the_permuted_attention_case_computes_attention_on_diffusers_layout_and_a_cpu_answers_nothing(tmp_path):
    from jagg_core.gpu_check.triage import attention_case
    for permuted in (False, True):  # the same math on views and on copies (float32 on a CPU)
        row, = attention_case("math", 1152, REDUCED, permuted=permuted)
        assert row["status"] == "ok" and row["out_err"] < 1e-5 and row["grad_err"] < 1e-5, row
        assert row["layout"] == ("permuted" if permuted else "contiguous") and row["tokens"] == 1152 // 16
    skipped, = attention_case("cudnn", 1101, REDUCED, permuted=True)
    assert skipped["status"] == "skipped" and skipped["step"] == "triage-sdpa-cudnn-1101-permuted"
    write_record(tmp_path, "cpu", "2026-12-05", [skipped], reduced=True)
    ledger = read_ledger([tmp_path], REDUCED)
    table = format_tables(ledger, all_steps(REDUCED), REDUCED, today(REDUCED))
    assert "- The triage has not answered yet" in table and "passes on diffusers' permuted layout" not in table
    assert "| triage-sdpa-cudnn-1101-permuted | skipped: no cudnn kernel" in table and ", permuted views |" in table


@pytest.mark.parametrize("outcome, says", [
    ({}, "has not answered yet"),
    ({"triage-sdpa-cudnn-1101": "crashed", "triage-sdpa-cudnn-1152": "ok", "triage-lora-rank4": "ok"},
     "cuDNN SDPA fails only at lengths not a multiple of 128: keep cuDNN attention out on this device (the "
     "product's default model.cudnn_attention=false)"),
    ({"triage-lora-rank4": "failed", "triage-lora-rank16": "ok"},
     "fail at rank 4 only (cuBLAS split-K): keep bf16 reductions in float32 (the product's default "
     "model.bf16_reduced_precision_reduction=false)"),
    ({"triage-flux-path-as-crashed": "crashed", "triage-flux-path-no-cudnn-sdpa": "ok"},
     "passes with no-cudnn-sdpa: that setting's key keeps its safe"),
    ({"triage-flux-path-as-crashed": "failed", "triage-flux-path-no-cudnn-sdpa": "ok",
      "triage-flux-path-no-bf16-split-k": "failed"},
     "The cause is cuDNN SDPA attention: the FLUX path fails as it crashed and with no-bf16-split-k, and passes with "
     "no-cudnn-sdpa; model.cudnn_attention=false stays the product's default, and cuBLAS bf16 split-K is cleared."),
    ({"triage-flux-path-as-crashed": "failed", "triage-flux-path-no-cudnn-sdpa": "failed",
      "triage-flux-path-no-bf16-split-k": "ok", "triage-lora-rank4": "ok", "triage-lora-rank16": "ok"},
     "cuBLAS bf16 split-K alone (lora-rank4, lora-rank16) passes at the crashed shapes: the failure needs the "
     "model's own inputs"),
    ({"triage-flux-path-as-crashed": "failed", "triage-flux-path-no-cudnn-sdpa": "ok", "bench-flux-dev": "ok"},
     "FLUX.1-dev at real size runs under the product's defaults (bench-flux-dev ok)."),
    ({"triage-sdpa-cudnn-1101": "ok", "triage-sdpa-cudnn-1152": "ok", "triage-sdpa-cudnn-1101-permuted": "failed",
      "triage-sdpa-cudnn-1152-permuted": "crashed"},
     "cuDNN attention fails on the layout diffusers hands to SDPA (permuted views; sdpa-cudnn-1101-permuted, "
     "sdpa-cudnn-1152-permuted), and passes on contiguous tensors of the same shapes: the layout is the trigger"),
    ({"triage-sdpa-cudnn-1101-permuted": "ok", "triage-sdpa-cudnn-1152-permuted": "ok"},
     "cuDNN attention passes on diffusers' permuted layout too: the trigger is elsewhere"),
    ({"triage-flux-path-as-crashed": "failed", "triage-flux-path-no-cudnn-sdpa": "failed"}, "neither suspect"),
    ({"triage-flux-path-as-crashed": "ok"}, "needs the real depth"),
])
def test_the_triage_verdict_names_the_fix_each_outcome_implies(outcome, says):
    assert says in " ".join(triage_verdict(outcome))


@pytest.fixture
def torch_kernel_switches():
    """Restores torch's process-wide cuDNN-attention and bf16-reduction switches after the test."""
    import torch
    saved = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    yield
    torch.backends.cuda.enable_cudnn_sdp(saved[0])
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved[1]


@pytest.mark.parametrize("setting, cudnn_attention, bf16_reduction", [
    (None, False, False),  # the product's default: both suspects off
    ("as-crashed", True, True), ("no-cudnn-sdpa", False, True), ("no-bf16-split-k", True, False)])
def test_the_flux_path_cases_set_the_products_kernel_keys_and_loading_a_model_applies_them(
        setting, cudnn_attention, bf16_reduction, torch_kernel_switches):
    import torch
    from jagg_core.models import load_flow_model
    torch.backends.cuda.enable_cudnn_sdp(not cudnn_attention)  # the opposite first: the loader must set both
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not bf16_reduction
    config = load_config(preset="tiny-sd3", overrides=list(FLUX_PATH_SETTINGS[setting]) if setting else [])
    assert (config.model.cudnn_attention, config.model.bf16_reduced_precision_reduction) == (cudnn_attention,
                                                                                              bf16_reduction)
    load_flow_model(config.model, "cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_attention
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is bf16_reduction


@pytest.mark.parametrize("preset", ["sd35-medium-pickscore-16gb", "flux-dev-pickscore-24gb",
                                    "qwen-image-pickscore-24gb", "wan21-t2v-1.3b-pickscore-24gb"])
def test_the_measured_recipe_keeps_what_memory_depends_on(preset):
    full, measured = load_config(preset=preset), memory_recipe(preset, CheckOptions())
    same = ["model.dtype", "model.quantize", "model.max_sequence_length", "model.cache_text_embeddings",
            "sampling.resolution", "sampling.num_frames", "sampling.rollout_chunk", "lora.rank",
            "lora.target_modules",
            "backward.mode", "backward.window", "backward.joint", "backward.velocities", "train.optimizer",
            "train.mixed_precision", "train.gradient_checkpointing", "grpo.kl_beta", "sampling.num_steps"]
    for key in same:
        section, name = key.split(".")
        assert getattr(getattr(measured, section), name) == getattr(getattr(full, section), name), key

    def micro_batch(config):
        samples = config.grpo.num_generations * config.grpo.prompts_per_iteration
        return math.ceil(samples / config.train.gradient_accumulation_steps)

    assert micro_batch(measured) == micro_batch(full)
    assert measured.model.name.startswith("random:") and "@" not in measured.model.name  # the real depth
    assert [r.name for r in measured.rewards] == ["jpeg_compressibility"]
    assert measured.grpo.prompts_per_iteration == 1 and measured.prompts.eval_count <= measured.grpo.num_generations
    assert measured.prompts.limit == ENCODE_BATCH  # the set-up encodes the same batches, fewer of them


def test_a_reduced_check_runs_each_kind_of_real_size_step_and_writes_its_tables(tmp_path):
    names = ("tiny-sd3", "bench-sd35-medium", "memory-sd35-medium-pickscore-nft-24gb")
    no_caps = [arg for name in names for arg in ("--cap", f"{name}=1200")]  # a loaded CPU: no time limit here
    done = run_gpu_check("--reduced", "--out", str(tmp_path), "--budget", "3600", "--only", ",".join(names), *no_caps)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads((tmp_path / f"{name}.json").read_text()) for name in names]
    assert not any("beside" in record for record in records)  # on a CPU one step at a time: they share its cores
    settings = today(REDUCED)
    assert [record["settings"] for record in records] == [settings[name] for name in names]
    assert records[0]["settings"]["int8"]["model.quantize"] == "int8"
    order = plan_order(all_steps(REDUCED), read_ledger([tmp_path], REDUCED), settings)
    assert not set(names) & {s.name for s in order}  # measured under today's settings: done
    rows = {(r["step"], r.get("recipe") or r.get("mode")): r for record in records for r in record["rows"]}
    for recipe in ("bf16", "int8"):  # 2 iterations in bf16 with 8-bit AdamW, then the loss and rewards
        tiny = rows[("tiny-sd3", recipe)]
        assert tiny["status"] == "ok" and math.isfinite(tiny["loss"]) and math.isfinite(tiny["eval_reward"])
    assert rows[("tiny-sd3", "nf4")]["status"] == "skipped" and "CUDA" in rows[("tiny-sd3", "nf4")]["reason"]

    exact, jagg = rows[("bench-sd35-medium", "exact")], rows[("bench-sd35-medium", "cached")]
    assert exact["model"] == "random:sd35-medium@1" and exact["resolution"] == 64
    assert jagg["window"] == 5 and jagg["joint"] and 0 < jagg["grad_cosine"] < 0.9999
    assert exact["grad_cosine"] == pytest.approx(1)
    assert jagg["train_s"] > 0 and jagg["iteration_speedup"] > 0
    log = (tmp_path / "bench-sd35-medium.log").read_text()  # where the step's time went, for the next lease's caps
    assert re.search(r"\[bench\] random:sd35-medium@1: set up and first rollout in \d+\.\d s", log)
    assert re.search(r"1 warm-up and 2 timed repeat\(s\) of 2 variants in \d+\.\d s", log)

    memory = rows[("memory-sd35-medium-pickscore-nft-24gb", None)]  # a forward process's; an int8 base's: test_memory.py
    assert memory["status"] == "ok", memory
    assert 0.98 <= memory["planned_over_measured"] <= 1.02, memory
    assert memory["preset_planned_gb"] > 5 * memory["planned_setup_gb"]  # the preset at 512 px with the real encoders

    table = (tmp_path / "gpu_check.md").read_text()
    assert "| tiny-sd3 | int8 | ok |" in table and "JAGG W=5 cached joint" in table
    assert "| random:sd35-medium@1 | none | 64 | JAGG W=5 cached joint | ok |" in table
    assert "| sd35-medium-pickscore-nft-24gb | ok |" in table
    assert table in done.stdout and "0 step(s) not ok" in done.stdout


def test_the_nf4_steps_are_skipped_on_a_cpu_before_they_build_anything():
    from jagg_core.gpu_check.steps import step_bench, step_quantize
    for rows in (step_bench("qwen-image", "nf4", REDUCED), step_quantize("nf4", REDUCED)):
        assert [(r["status"], r["reason"]) for r in rows] == [("skipped", "NF4 (bitsandbytes) needs a CUDA GPU")]


def test_an_unknown_step_or_a_parallel_below_one_is_one_line(tmp_path):
    done = run_gpu_check("--only", "tiny-sdxl", "--out", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown step(s) tiny-sdxl; steps: device, triage-sdpa-cudnn-1101" in done.stderr
    done = run_gpu_check("--parallel", "0", "--out", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--parallel must be at least 1" in done.stderr


def test_the_variants_measure_the_16gb_recipe_with_one_setting_each(tmp_path):
    """Settings on in no 16/24 GB preset have steps of their own on the SD3.5 16 GB recipe, beside the others on the
    card it is made for: ``model.offload_text_encoders`` (its plan's set-up holds one layer of the encoders) and the
    allocator's expandable segments (an environment variable of the step's process: the same config, the reserved
    peak to compare). Their rows say which in the memory table."""
    steps = {step.name: step for step in all_steps(CheckOptions())}
    plain = steps["memory-sd35-medium-pickscore-16gb"]
    offload = steps["memory-sd35-medium-pickscore-16gb-offload"]
    expandable = steps["memory-sd35-medium-pickscore-16gb-expandable-segments"]
    assert offload.shares_gb == expandable.shares_gb == plain.shares_gb == 16
    assert offload.cap_s == expandable.cap_s == plain.cap_s
    assert plain.env == offload.env == {} and expandable.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert changed_settings(step_settings(plain, CheckOptions()), step_settings(offload, CheckOptions())) == [
        "model.offload_text_encoders false -> true"]
    assert changed_settings(step_settings(plain, CheckOptions()), step_settings(expandable, CheckOptions())) == []
    row = {"status": "ok", "preset": "sd35-medium-pickscore-16gb", "planned_setup_gb": 5.2, "measured_setup_gb": 5.4,
           "planned_gb": 6.1, "measured_gb": 6.3, "planned_over_measured": 0.97, "preset_planned_gb": 13.7}
    write_record(tmp_path, offload.name, "2026-12-07", [
        {**row, "step": offload.name, "overrides": ["model.offload_text_encoders=true"]}])
    write_record(tmp_path, expandable.name, "2026-12-07", [
        {**row, "step": expandable.name, "env": expandable.env, "measured_reserved_gb": 6.4}])
    text = format_tables(read_ledger([tmp_path], CheckOptions()), list(steps.values()), CheckOptions(), today())
    assert ("| sd35-medium-pickscore-16gb + model.offload_text_encoders=true | ok | 5.20 / 5.40 | 6.10 / 6.30 | 0.97 "
            "| - | 13.70 |") in text
    assert ("| sd35-medium-pickscore-16gb + PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True | ok | 5.20 / 5.40 | "
            "6.10 / 6.30 | 0.97 | 6.40 | 13.70 |") in text


def test_the_tables_read_without_a_gpu_or_a_ledger():
    text = format_tables({}, all_steps(CheckOptions()), CheckOptions(), today())
    assert text.startswith("GPU check (real size). Last device: device not checked.")
    assert "| device | 30 | never measured | - | - |" in text and "The triage has not answered yet" in text


def test_the_tables_show_the_cuda_context_and_the_allocators_reserved_peak_a_gpu_measured(tmp_path):
    """What a plan's "fits" leaves out of its peak: the memory outside torch's allocator (the device step, with
    cuBLAS, cuDNN and attention loaded) and the allocator's cached blocks and fragments (a memory step's reserved
    peak). Rows measured before either was kept show "-"."""
    write_record(tmp_path, "device", "2026-12-05T10:00:00+00:00", [
        {"step": "device", "status": "ok", "versions": {"torch": "2.13.0"}, "gpu": "NVIDIA H200",
         "cuda_context_gb": 0.8123, "tmp_free_gb": 57.4}])
    memory = {"step": "memory-sd35-medium-pickscore-16gb", "status": "ok", "preset": "sd35-medium-pickscore-16gb",
              "planned_setup_gb": 5.2, "measured_setup_gb": 5.3, "planned_gb": 6.1, "measured_gb": 6.3,
              "planned_over_measured": 0.97, "preset_planned_gb": 11.3}
    write_record(tmp_path, "memory-sd35-medium-pickscore-16gb", "2026-12-05", [{**memory, "measured_reserved_gb": 7.25}])
    write_record(tmp_path, "memory-zimage-turbo-pickscore-24gb", "2026-12-05", [
        {**memory, "step": "memory-zimage-turbo-pickscore-24gb", "preset": "zimage-turbo-pickscore-24gb"}])
    text = format_tables(read_ledger([tmp_path], CheckOptions()), all_steps(CheckOptions()), CheckOptions(), today())
    assert text.startswith("GPU check (real size). Last device: NVIDIA H200; torch 2.13.0, checked 2026-12-05; CUDA "
                           "context with cuBLAS, cuDNN and attention loaded: 0.81 GB; 57 GB free in its temporary "
                           "folder.")
    assert "| training planned / measured GB | planned / measured | training reserved GB | preset's plan GB |" in text
    assert "| sd35-medium-pickscore-16gb | ok | 5.20 / 5.30 | 6.10 / 6.30 | 0.97 | 7.25 | 11.30 |" in text
    assert "| zimage-turbo-pickscore-24gb | ok | 5.20 / 5.30 | 6.10 / 6.30 | 0.97 | - | 11.30 |" in text


def test_a_failed_context_measurement_leaves_the_device_step_ok_so_the_check_goes_on(monkeypatch):
    """The device step gates the whole check (no GPU: stop): its context figure failing must not fail it."""
    import torch
    from jagg_core.gpu_check import steps
    for name, value in {"is_available": True, "mem_get_info": (140e9, 150e9), "get_device_name": "NVIDIA H200",
                        "get_device_capability": (9, 0), "is_bf16_supported": True}.items():
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)

    def fails():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(steps, "_cuda_context_gb", fails)
    [row] = steps.step_device(CheckOptions())
    assert row["status"] == "ok" and row["gpu"] == "NVIDIA H200" and "cuda_context_gb" not in row
    assert row["cuda_context_error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_the_script_runs_the_check_into_its_folder_and_its_archive_and_the_next_call_resumes(tmp_path):
    """A lent GPU machine returns at most 8 files: the check's files also travel as one archive. The next call
    shows its order: the device (every call), the triage but its step measured, the crashed step, then the never
    measured."""
    archive, out = tmp_path / "back" / "gpu_check.tar.gz", str(tmp_path / "out")
    archive.parent.mkdir()
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--out", out, "--reduced", "--only",
                           "device,simulate-crash,triage-sdpa-math-1101", "--archive", str(archive)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 1, done.stderr  # the simulated crash is a step not ok
    files = [f"{step}.{kind}" for step in ("device", "simulate-crash", "triage-sdpa-math-1101") for kind in ("json", "log")]
    files = sorted([*files, "gpu_check.md"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == files
    assert "3 rows this run, 1 step(s) not ok: simulate-crash" in done.stdout
    assert [p.name for p in archive.parent.iterdir()] == ["gpu_check.tar.gz"]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == files
        assert tar.extractfile("gpu_check.md").read().decode() == (tmp_path / "out" / "gpu_check.md").read_text()

    again = run_gpu_check("--reduced", "--out", out, "--budget", "0")
    assert again.returncode == 0, again.stderr
    order = [line.split("]   ")[1] for line in again.stderr.splitlines() if "]   " in line]
    triage = [line for line in order if line.startswith("triage-")]
    assert order[0].startswith("device: last ok on 20") and order[1:len(triage) + 1] == triage  # every call
    after = order[len(triage) + 1:]  # the last failed, then the never measured
    assert after[0].startswith("simulate-crash: last crashed on 20") and after[1].startswith("simulate-hang: never")
    assert not any(line.startswith("triage-sdpa-math-1101") for line in order)  # measured: not run again


def test_todays_plan_is_within_15_percent_of_each_peak_a_gpu_measured():
    """The committed ledger's memory rows (an H200, real size, random weights), set-up and training apart, against
    the plan the code makes of the same recipe today (a change of the plan that drifts from what a GPU measured
    fails here). The set-up's measured peak is the transformer, VAE and LoRA arriving after the text encoders have
    left; the plan says so."""
    from jagg_core.memory_plan import SETUP_PHASE, plan_memory
    rows = [row for path in sorted((ROOT / "docs" / "gpu").glob("*.json"))
            for row in json.loads(path.read_text()).get("rows", []) if row.get("measured_setup_gb")]
    assert {row["preset"] for row in rows} >= {"sd35-medium-pickscore-16gb", "flux-dev-pickscore-24gb",
                                               "zimage-turbo-pickscore-24gb"}
    for row in rows:
        totals = plan_memory(memory_recipe(row["preset"], CheckOptions(), tuple(row.get("overrides", ())))).totals
        setup, training = totals[SETUP_PHASE] / 1e9, max(t for p, t in totals.items() if p != SETUP_PHASE) / 1e9
        assert 0.85 <= setup / row["measured_setup_gb"] <= 1.15, (row["preset"], setup, row["measured_setup_gb"])
        assert 0.85 <= training / row["measured_gb"] <= 1.15, (row["preset"], training, row["measured_gb"])



def test_the_bitsandbytes_wheel_keeps_the_libraries_of_the_machines_cuda_major_alone(tmp_path):
    """scripts/gpu_wheels.sh trims the 43 MB wheel so that the repo and the wheels fit a device call's 64 MiB."""
    import zipfile
    libraries = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm72", "xpu2026"]
    files = {"bitsandbytes/__init__.py": b"", **{f"bitsandbytes/libbitsandbytes_{lib}.so": lib.encode()
                                                 for lib in libraries}}
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items()) + "b.dist-info/RECORD,,\n"
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in {**files, "b.dist-info/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    subprocess.run([sys.executable, "scripts/trim_wheel.py", "13", str(wheel)], cwd=ROOT, check=True)
    kept = [f"bitsandbytes/libbitsandbytes_{lib}.so" for lib in ("cpu", "cuda130", "cuda132", "xpu2026")]
    with zipfile.ZipFile(wheel) as archive:
        assert archive.namelist() == ["bitsandbytes/__init__.py", *kept, "b.dist-info/RECORD"]
        assert archive.read("bitsandbytes/libbitsandbytes_cuda130.so") == b"cuda130"
        assert [line.split(",")[0] for line in archive.read("b.dist-info/RECORD").decode().splitlines()] == [
            "bitsandbytes/__init__.py", *kept, "b.dist-info/RECORD"]
    assert [p.name for p in tmp_path.iterdir()] == [wheel.name]
