"""The queue of runs: its order and changes, the CLI's ``--queue``, and the app's worker starting queued runs in
turn when the machine is free."""

from __future__ import annotations

import time

import pytest

from app.jobs import JobControl
from jagg_core.errors import UserError
from jagg_core.run_queue import RunQueue
from jagg_core.rundir import RunDirectory

from conftest import run_cli


def queued_run(root, name: str) -> RunDirectory:
    run = RunDirectory(root / name)
    run.write_config(f"name: {name}\n")
    return run


def test_the_queue_keeps_its_order_through_changes_and_restarts(tmp_path):
    queue = RunQueue(tmp_path)
    for name in ("a", "b", "c"):
        assert queue.add(queued_run(tmp_path, name).path) == queue.names().index(name) + 1
    assert RunDirectory(tmp_path / "b").read_status() == {**RunDirectory(tmp_path / "b").read_status(),
                                                          "state": "queued", "message": "queued: position 2"}
    assert queue.move("c", -1) == 2 and queue.names() == ["a", "c", "b"]
    assert queue.move("a", +5) == 3 and queue.names() == ["c", "b", "a"]
    queue.remove("b")
    assert RunDirectory(tmp_path / "b").read_status()["state"] == "stopped"
    assert RunQueue(tmp_path).names() == ["c", "a"]  # another process (an app restarted) reads the same queue
    assert RunQueue(tmp_path).next() == tmp_path / "c"
    (tmp_path / "c" / "config.yaml").unlink()
    import shutil
    shutil.rmtree(tmp_path / "c")
    assert RunQueue(tmp_path).names() == ["a"]  # a deleted run leaves the queue
    with pytest.raises(UserError, match="b is not queued"):
        queue.move("b", 1)
    with pytest.raises(UserError, match="is not a run folder of"):
        queue.add(tmp_path / "elsewhere")


def test_the_cli_queues_a_checked_run_in_the_apps_runs_folder(tmp_path):
    root = tmp_path / "runs"
    result = run_cli("--preset", "tiny-sd3", "--set", "train.iterations=1", "--queue",
                     env={"JAGG_RUNS_DIR": str(root)})
    assert result.returncode == 0, result.stderr
    (queued,) = RunQueue(root).names()
    assert queued.startswith("tiny-sd3-") and f"queued {root / queued} at position 1" in result.stdout
    assert RunDirectory(root / queued).read_status()["state"] == "queued"
    assert RunDirectory(root / queued).read_config()["train"]["iterations"] == 1
    outside = run_cli("--preset", "tiny-sd3", "--queue", "--output-dir", str(tmp_path / "elsewhere"),
                      env={"JAGG_RUNS_DIR": str(root)})
    assert outside.returncode == 2 and "--queue: the run folder must be directly in" in outside.stderr
    bad = run_cli("--preset", "tiny-sd3", "--queue", "--set", "rewards=[{name: nope}]", env={"JAGG_RUNS_DIR": str(root)})
    assert bad.returncode == 2 and "unknown reward 'nope'" in bad.stderr and RunQueue(root).names() == [queued]


def test_the_app_starts_queued_runs_in_order_when_the_machine_frees(tmp_path):
    root = tmp_path / "runs"
    for name in ("first", "second"):
        assert run_cli("--preset", "tiny-sd3", "--set", f"name={name}", "--set", "train.iterations=1",
                       "--set", "prompts.eval_count=2", "--queue", env={"JAGG_RUNS_DIR": str(root)}).returncode == 0
    jobs = JobControl(root)
    first, second = (root / name for name in RunQueue(root).names())
    assert first.name.startswith("first-")
    jobs.run_queue_in_background(poll_s=0.2)
    while RunDirectory(second).read_status().get("state") != "finished":
        time.sleep(0.2)
    ended, began = RunDirectory(first).read_status(), RunDirectory(second).read_status()
    assert ended["state"] == "finished" and ended["updated_at"] <= began["started_at"]  # one after the other
    assert RunQueue(root).names() == []
