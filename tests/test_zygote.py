"""The tests' pre-imported Python (tests/zygote.py) runs a command as a fresh interpreter does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from zygote import forks, run_python

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


@pytest.mark.parametrize("args", COMMANDS)
def test_a_forked_command_gives_what_a_fresh_process_gives(args, tmp_path):
    env = {**os.environ, "JAGG_PROBE": "probed"}
    cwd = ROOT if args[0] == "-m" else tmp_path
    assert forks(args, env)
    fresh = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    forked = run_python(args, cwd=cwd, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_command_past_its_time_is_killed_with_what_it_said():
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], cwd=ROOT, timeout=1)
    assert expired.value.stdout == b"started\n"  # bytes, as subprocess.run gives
    assert run_python(["-c", "print('next')"], cwd=ROOT).stdout == "next\n"  # the server goes on
