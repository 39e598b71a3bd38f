"""Several processes from the page's own launch code (gloo on this CPU): one status, Stop ends them all, and a
resume on another count says what that means."""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager

from app.jobs import JobControl, Placement, _group_alive, launch_command
from jagg_core.rundir import RunDirectory

from conftest import run_cli


def wait_for(condition) -> None:
    while not condition():
        time.sleep(0.2)


def test_the_launch_command_follows_the_placement(tmp_path):
    single = launch_command(tmp_path, "no", False)
    assert single[single.index("--num_processes") + 1] == "1" and "--multi_gpu" not in single
    assert "--main_process_port" not in single  # one process meets no one
    parallel = launch_command(tmp_path, "no", True, Placement(2))
    assert parallel[parallel.index("--num_processes") + 1] == "2" and "--multi_gpu" in parallel
    assert parallel[parallel.index("--main_process_port") + 1] == "0"  # a free one, accelerate's pick
    assert parallel[-1] == "--resume"
    sharded = launch_command(tmp_path, "bf16", False, Placement(4, sharded=True))
    assert sharded[sharded.index("--config_file") + 1].endswith("presets/accelerate/fsdp.yaml")
    assert "--multi_gpu" not in sharded and Placement(4, sharded=True).words() == \
        "4 processes, the transformer sharded (FSDP)"


@contextmanager
def accelerates_default_port_taken():
    """Port 29500, accelerate's default rendezvous, held as another job of several processes would hold it (if
    something else holds it already, it is taken all the same)."""
    with socket.socket() as other_job:
        try:
            other_job.bind(("127.0.0.1", 29500))
            other_job.listen()
        except OSError:
            pass
        yield


def test_two_processes_train_stop_together_and_resume_on_one_with_a_clear_line(tmp_path):
    """Two processes (while another job of several holds accelerate's default port) train, stop together, and the
    run resumes on one."""
    root = tmp_path / "runs"
    assert run_cli("--preset", "tiny-sd3", "--set", "train.iterations=6", "--set", "train.checkpoint_every=1",
                   "--set", "prompts.eval_count=2", "--queue", env={"JAGG_RUNS_DIR": str(root)}).returncode == 0
    jobs = JobControl(root)
    run_dir = jobs.queue.next()
    jobs.queue.started(run_dir.name)
    run = RunDirectory(run_dir)
    with accelerates_default_port_taken():
        job = jobs.launch(run_dir, "no", placement=Placement(2))
        wait_for(lambda: run.read_status().get("iteration", 0) >= 1 and run.checkpoint_iterations())
    assert run.read_run_info()["processes"] == 2
    jobs.stop()
    assert not _group_alive(job.pgid) and jobs.active() is None  # every process of the job ended
    assert run.read_status()["state"] == "stopped"
    jobs.launch(run_dir, "no", resume=True, placement=Placement(1))
    wait_for(lambda: jobs.active() is None)
    assert run.read_status()["state"] == "finished", run.log_tail(3000)
    assert "resumed on 1 process(es); the run trained on 2 before" in run.log_file.read_text()
    assert "already in use" not in run.output_log.read_text()  # accelerate's warning when its default port is taken
    assert run.read_run_info()["processes"] == 1
