"""The tests' pre-imported Python (tests/zygote.py) runs a command as a fresh interpreter does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from zygote import library_environment, run_python, tier

COMMANDS = [
    ["-c", "import os, sys; print(os.getcwd(), os.environ['JAGG_PROBE'], sys.argv, sys.path[0]); sys.exit(3)", "a"],
    ["-c", "raise ValueError('the traceback, exit 1')"],
    ["-c", "import sys; sys.exit('a message, exit 1')"],
    ["-c", "raise KeyboardInterrupt"],
    ["-c", "import atexit, threading, time; atexit.register(print, 'atexit');"
           "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start(); print('main')"],
    ["-c", "import sys; print(sys.stdin.read() == '')"],
    ["-m", "jagg_core.run", "--preset", "no-such-preset"],
]


@pytest.mark.parametrize("offline", [False, True], ids=["torch-tier", "libraries-tier"])
@pytest.mark.parametrize("args", COMMANDS)
def test_a_forked_command_gives_what_a_fresh_process_gives(args, offline, tmp_path):
    env = {**os.environ, "JAGG_PROBE": "probed", "HF_HUB_OFFLINE": "1" if offline else "0"}
    cwd = ROOT if args[0] == "-m" else tmp_path
    assert tier(args, env) == ("libraries" if offline else "torch")
    fresh = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    forked = run_python(args, cwd=cwd, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_command_past_its_time_is_killed_with_what_it_said():
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], cwd=ROOT, timeout=1)
    assert expired.value.stdout == b"started\n"  # bytes, as subprocess.run gives
    assert run_python(["-c", "print('next')"], cwd=ROOT).stdout == "next\n"  # the server goes on


def test_the_libraries_tier_has_imported_the_libraries_and_not_the_project():
    """A run in the tests' offline environment (but for the settings read when used) is forked from the tier that has
    imported diffusers; the project's modules it imports afresh, from its own path; another environment (a Hub
    endpoint of its own) gets the torch tier, which has not imported diffusers."""
    probe = ["-c", "import sys; print('diffusers' in sys.modules, 'jagg_core.trainer' in sys.modules)"]
    offline = {**library_environment(dict(os.environ)), "PYTEST_CURRENT_TEST": "another", "JAGG_RUNS_DIR": "runs"}
    assert run_python(probe, cwd=ROOT, env=offline).stdout == "True False\n"
    elsewhere = {**offline, "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert tier(probe, elsewhere) == "torch" and run_python(probe, cwd=ROOT, env=elsewhere).stdout == "False False\n"
