"""Sharding the frozen transformer with FSDP2 (presets/accelerate/fsdp.yaml), on CPU processes over gloo.

The launches run ``accelerate launch --config_file presets/accelerate/fsdp.yaml --num_processes 2 -m jagg_core.run``
exactly as on GPUs; the unit tests check, with two threads standing in for two processes, that the JAGG routing
gives every process the same transformer passes, and that FSDP settings that would break the run are refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from jagg_core import metrics
from jagg_core.config import BackwardConfig
from jagg_core.errors import UserError
from jagg_core.grpo import LossSettings
from jagg_core.jagg import make_plan
from jagg_core.models import build_tiny_pipeline
from jagg_core.rundir import LORA_FILE, TRANSFORMER_2_LORA_FILE, RunDirectory
from jagg_core.sharding import Sharding

from conftest import ROOT, tiny_config

FSDP_CONFIG = ROOT / "presets" / "accelerate" / "fsdp.yaml"
# Training runs are waited on until they end; this cap only keeps a hung run from blocking CI for ever.
SAFETY_CAP_S = 900
# 7 rollout steps in windows of 4 and 3 steps: JAGG on the first saves two passes, on the second one, so with
# backward.frac=0.5 processes routing on their own scores could plan 5 and 6 passes.
SMALL = ["--preset", "tiny-sd3", "--set", "train.iterations=2", "--set", "sampling.num_steps=7",
         "--set", "backward.window=4", "--set", "grpo.num_generations=2", "--set", "prompts.eval_count=2",
         "--set", "train.sample_every=1", "--set", "train.checkpoint_every=1"]


def launch(run_dir, *launcher_args: str, extra: tuple[str, ...] = (), source: tuple[str, ...] | list[str] = SMALL
           ) -> subprocess.CompletedProcess:
    """``python -m jagg_core.run SOURCE EXTRA`` in 2 processes (``source``: :data:`SMALL`, or ``--config FILE``)."""
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, "--num_processes", "2",
         "--main_process_port", "0", "-m", "jagg_core.run", *source, *extra, "--output-dir", str(run_dir)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=SAFETY_CAP_S)


# half the windows routed to the exact backward by their linearity, and the fidelity audit at every iteration: both
# run transformer calls that are collectives under FSDP
ROUTED_AND_AUDITED = ("--set", "backward.frac=0.5", "--set", "backward.route_by=linearity",
                      "--set", "backward.audit_every=1")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """A 2-process FSDP run of :data:`SMALL` with :data:`ROUTED_AND_AUDITED`."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    result = launch(run_dir, "--config_file", str(FSDP_CONFIG), extra=ROUTED_AND_AUDITED)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_fsdp_launch_shards_the_transformer_and_keeps_the_lora_whole_and_identical(fsdp_run):
    run = RunDirectory(fsdp_run)
    status = run.read_status()
    assert status["state"] == "finished"
    assert status["processes"] == 2 and status["adapters_identical"] is True
    sharding = status["sharding"]
    assert sharding["strategy"] == "fsdp2" and sharding["shards"] == 2 and sharding["lora_sharded"] is False
    assert sharding["units"] >= 3  # the two transformer blocks and the rest
    assert len(sharding["held_fraction"]) == 2 and all(0.4 <= f <= 0.6 for f in sharding["held_fraction"])
    assert "transformer sharded with FSDP2 over 2 processes in " in run.log_file.read_text()
    rows = run.read_metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert all(metrics.EVAL_REWARD_MEAN in r for r in rows)  # the eval ran with every process taking part
    assert rows[1][metrics.JAGG_ROUTED_FRAC] == 0.5 and rows[1][metrics.BACKWARD_PASSES] in (5, 6)
    # the fidelity audit ran on every process at the same iterations (its transformer calls are collectives too)
    assert all(len(r[metrics.JAGG_WINDOW_COSINES]) == 2 and 1.0 in r[metrics.JAGG_WINDOW_COSINES] for r in rows[1:])
    # the saved adapter is the whole LoRA in diffusers format
    pipe = build_tiny_pipeline("tiny-sd3", seed=0)
    pipe.load_lora_weights(str(run.lora_dir))
    assert len(load_file(run.lora_file)) == 30  # lora_A and lora_B of the 8 + 7 attention projections


def test_sharded_and_data_parallel_runs_train_the_same_adapter(fsdp_run, tmp_path):
    """Sharding changes where the base weights live, not the training (its routing and audits included): bit for bit
    the plain data-parallel result."""
    sharded, data_parallel = fsdp_run, tmp_path / "ddp"
    result = launch(data_parallel, "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", extra=ROUTED_AND_AUDITED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharding" in RunDirectory(sharded).read_status()
    status = RunDirectory(data_parallel).read_status()  # gradients averaged across the processes
    assert "sharding" not in status and status["processes"] == 2 and status["adapters_identical"] is True
    a = load_file(RunDirectory(sharded).lora_file)
    b = load_file(RunDirectory(data_parallel).lora_file)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    evals = [[row.get(metrics.EVAL_REWARD_MEAN) for row in RunDirectory(run).read_metrics()]
             for run in (sharded, data_parallel)]
    assert evals[0] == evals[1]


def test_a_sharded_dora_keeps_its_magnitudes_whole_and_trains_the_data_parallel_adapter(tmp_path):
    """A DoRA's magnitudes sit in the sharded blocks beside lora_A and lora_B; they stay whole on every process too,
    and the run trains, bit for bit, the DoRA of plain data parallel."""
    dora = ("--set", "lora.use_dora=true")
    sharded = launch(tmp_path / "fsdp", "--config_file", str(FSDP_CONFIG), extra=dora)
    data_parallel = launch(tmp_path / "ddp", "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no",
                           "--dynamo_backend", "no", extra=dora)
    assert sharded.returncode == 0 and data_parallel.returncode == 0, (sharded.stderr + data_parallel.stderr)[-3000:]
    status = RunDirectory(tmp_path / "fsdp").read_status()
    assert status["adapters_identical"] is True and status["sharding"]["lora_sharded"] is False
    a, b = (load_file(RunDirectory(tmp_path / run).lora_file) for run in ("fsdp", "ddp"))
    assert len(a) == 45 and sum(key.endswith(".lora_magnitude_vector") for key in a) == 15  # and A, B of 15 layers
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_fsdp_shards_each_expert_of_a_two_expert_model_that_trains_both(tmp_path):
    """Wan 2.2 A14B with ``model.expert: both``: each expert is sharded on its own, both LoRAs stay whole and
    identical on every process, and the adapter is the two files."""
    result = launch(tmp_path / "run", "--config_file", str(FSDP_CONFIG), extra=(
        "--set", "model.name=tiny-wan-a14b", "--set", "model.expert=both", "--set", "sampling.num_frames=5",
        "--set", "sampling.resolution=32", "--set", "train.iterations=1", "--set", "model.max_sequence_length=16",
        "--set", "rewards=[{name: jpeg_compressibility}]"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDirectory(tmp_path / "run")
    status = run.read_status()
    assert status["state"] == "finished" and status["adapters_identical"] is True
    assert status["sharding"]["components"] == ["transformer", "transformer_2"] and status["sharding"]["shards"] == 2
    assert "transformer and transformer_2 sharded with FSDP2 over 2 processes" in run.log_file.read_text()
    assert sorted(file.name for file in run.lora_dir.iterdir()) == [LORA_FILE, TRANSFORMER_2_LORA_FILE]


def test_fsdp_trains_both_experts_with_a_forward_process_algorithm(tmp_path):
    """DiffusionNFT with both experts sharded: every process draws its rows' steps alike (its noise its own), so the
    processes call the sharded experts alike, each call a collective (steps drawn apart would hang); both LoRAs stay
    whole and identical on every process."""
    config = tiny_config("tiny-wan-a14b", sampling__num_frames=5, train__iterations=1, model__max_sequence_length=16,
                         model__expert="both", rewards="[{name: jpeg_compressibility}]").for_algorithm("nft")
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    result = launch(tmp_path / "run", "--config_file", str(FSDP_CONFIG),
                    source=("--config", str(tmp_path / "config.yaml")))
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDirectory(tmp_path / "run")
    status = run.read_status()
    assert status["state"] == "finished" and status["adapters_identical"] is True
    assert status["sharding"]["components"] == ["transformer", "transformer_2"]
    assert sorted(file.name for file in run.lora_dir.iterdir()) == [LORA_FILE, TRANSFORMER_2_LORA_FILE]


class ThreadProcesses:
    """``size`` threads standing in for processes: :meth:`gather` is a real collective between them."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=600)  # a safety cap: the threads meet on the state
        self.slots: list[torch.Tensor | None] = [None] * size

    def accelerator(self, rank: int):
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor
            self.barrier.wait()
            gathered = torch.cat(self.slots)
            self.barrier.wait()
            return gathered
        return SimpleNamespace(distributed_type=DistributedType.NO, device=torch.device("cpu"), mixed_precision="no",
                               gather=gather)

    def run(self, work) -> list:
        """``work(rank, accelerator)`` on every rank at once; each rank's result or exception."""
        results: list = [None] * len(self.slots)

        def target(rank):
            try:
                results[rank] = work(rank, self.accelerator(rank))
            except Exception as err:  # noqa: BLE001 - handed back to the test (a rank left waiting times out)
                results[rank] = err
        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(len(self.slots))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results


def rollout_batch(linear_window: int):
    """7 steps in windows [0, 3] and [4, 6]; the window ``linear_window`` has velocities on a line (score 1), the
    other has intermediate velocities orthogonal to its endpoints' (score 0)."""
    velocities = torch.zeros(7, 2, 3)
    velocities[:] = torch.tensor([1.0, 0.0, 0.0])
    bent = [1, 2] if linear_window == 1 else [5]
    velocities[bent] = torch.tensor([0.0, 1.0, 0.0])
    return SimpleNamespace(velocities=velocities, sigmas=torch.linspace(1, 0, 8), batch_size=2)


SETTINGS = LossSettings(clip_range=0.2, kl_beta=0.0)
CONFIG = BackwardConfig(mode="jagg", window=4, frac=0.5, route_by="linearity")


def test_routing_on_agreed_scores_gives_every_process_the_same_passes():
    batches = [rollout_batch(linear_window=0), rollout_batch(linear_window=1)]
    local = [make_plan(CONFIG, batch, 7, SETTINGS) for batch in batches]
    assert local[0].use_jagg == [True, False] and local[1].use_jagg == [False, True]
    assert len(local[0].pass_steps) == 5 and len(local[1].pass_steps) == 6  # a sharded transformer would hang

    def plan(rank, accelerator):
        sharding = Sharding(accelerator)
        agreed = make_plan(CONFIG, batches[rank], 7, SETTINGS, agree=sharding.agree)
        sharding.check_same_plan(agreed)
        return agreed
    plans = ThreadProcesses(2).run(plan)
    assert not any(isinstance(p, Exception) for p in plans), plans
    assert plans[0].use_jagg == plans[1].use_jagg
    assert plans[0].pass_steps == plans[1].pass_steps and plans[0].interpolated == plans[1].interpolated
    assert plans[0].scores == plans[1].scores == [0.5, 0.5]  # the mean of (1, 0) and (0, 1)


def test_processes_that_planned_different_passes_fail_instead_of_hanging():
    batches = [rollout_batch(linear_window=0), rollout_batch(linear_window=1)]

    def plan(rank, accelerator):
        Sharding(accelerator).check_same_plan(make_plan(CONFIG, batches[rank], 7, SETTINGS))
    errors = ThreadProcesses(2).run(plan)
    assert all(isinstance(e, RuntimeError) and "planned different backward passes" in str(e) for e in errors), errors


@pytest.fixture
def fsdp_env(monkeypatch):
    """The variables ``accelerate launch`` sets for presets/accelerate/fsdp.yaml, restored after the test (reading
    them, accelerate's plugin also writes FSDP_CPU_RAM_EFFICIENT_LOADING)."""
    for key, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
                       "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_ACTIVATION_CHECKPOINTING": "false"}.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def cpu_processes():
    return SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, device=torch.device("cpu"),
                           mixed_precision="no", gather=None)


@pytest.mark.parametrize("settings, message", [
    ({"FSDP_VERSION": "1"}, "set fsdp_version: 2"),
    ({"FSDP_RESHARD_AFTER_FORWARD": "false"}, "fsdp_reshard_after_forward must be true"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "use train.gradient_checkpointing instead"),
    ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_SYNC_MODULE_STATES": "true"}, "cpu_ram_efficient_loading"),
])
def test_fsdp_settings_that_break_the_run_are_refused(settings, message, fsdp_env):
    for key, value in settings.items():
        fsdp_env.setenv(key, value)
    with pytest.raises(UserError, match=message):
        Sharding(cpu_processes())


def test_only_an_fsdp_launch_shards(fsdp_env):
    assert Sharding(cpu_processes()).enabled
    fsdp_env.delenv("ACCELERATE_USE_FSDP")
    assert not Sharding(cpu_processes()).enabled
