"""A pre-imported Python for the tests' command-line runs (``python -m MODULE ARGS``, ``python -c CODE ARGS``).

On 2 cores a fresh ``python -m jagg_core.run`` spends about 7 s importing before its first line: 5 in torch and what
diffusers imports with it whenever it is installed (``torch._dynamo``, bitsandbytes, torchao), 2 in the Hugging Face
libraries. This server imports them once, in two tiers, and each run is a child forked from one of them:

- the **libraries** tier has imported the Hugging Face libraries too (diffusers, transformers, peft, accelerate,
  huggingface_hub), those modules of theirs that the project's commands import, under :func:`library_environment`:
  the tests' environment with ``HF_HUB_OFFLINE=1``, as :func:`conftest.run_cli` runs. The libraries read ``HF_HOME``,
  ``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and more as they import, so a run is forked from this tier only when its
  environment is that one but for the settings read as they are used (:data:`USE_TIME_SETTINGS`). The project's own
  modules are imported to find those of the libraries, then forgotten: a child imports them from its own path;
- the **torch** tier, for a run in any other environment: its child imports the libraries afresh under its own;
- a run whose environment differs from the server's in a setting read as the interpreter starts or a native library
  loads (:data:`START_SETTINGS`) starts a real process instead.

A child runs as a fresh interpreter would (:func:`run_request`): its environment, working folder and ``sys.argv``;
stdin from /dev/null, stdout and stderr to files; and exits as one would (:func:`exit_as_the_interpreter`) but for
the teardown of its modules. A test about the process itself (its first vector math, the modules a command imports,
signals sent to it while it runs) starts a real one.

Protocol, one run a connection on a tier's Unix socket: the client sends one JSON line ``{"args", "cwd", "env",
"stdout", "stderr"}``; the tier forks, answers ``{"pid": PID}`` and, once the child has exited, ``{"returncode":
CODE}`` (negative: the signal that ended it). Each tier serves one run at a time and exits when its stdin closes (the
test session's end).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: imported by the server once, shared by every child
PRELOADED = ("torch", "torch._dynamo", "bitsandbytes", "torchao")
#: environment variables that the interpreter reads as it starts and the pre-imported modules' native libraries as
#: they load: a run that sets them otherwise than the server's environment gets a real process. (torch's own
#: settings are read when used, by the child; torch sets some for itself as it runs, TORCHINDUCTOR_CACHE_DIR.)
START_SETTINGS = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "BNB_")
#: the modules whose imports the libraries tier makes: the project's commands that the tests run in a child
COMMANDS = ("jagg_core.run", "jagg_core.trainer", "jagg_core.generate", "jagg_core.evaluate", "jagg_core.compare",
            "jagg_core.hub", "jagg_core.bench")
#: environment variables read when used, not as a module imports (pytest's current test, the project's settings, the
#: compile cache torch sets for itself): a run that differs from :func:`library_environment` only in them is forked
#: from the libraries tier
USE_TIME_SETTINGS = ("PYTEST_CURRENT_TEST", "JAGG_", "TORCHINDUCTOR_CACHE_DIR")
#: the repository, whose project the libraries tier imports to find the libraries' modules
ROOT = Path(__file__).resolve().parent.parent


def _start_settings(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(START_SETTINGS)}


def library_environment(environment: dict[str, str]) -> dict[str, str]:
    """The environment the libraries tier imports under: the server's, offline."""
    return {**environment, "HF_HUB_OFFLINE": "1"}


def _read_on_import(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if not key.startswith(USE_TIME_SETTINGS)}


def tier_socket(path: str, tier_name: str) -> str:
    """The socket of the tier ``tier_name`` of the server whose torch tier listens on ``path``."""
    return path if tier_name == "torch" else f"{path}.{tier_name}"


def tier(args: list[str], env: dict[str, str]) -> str | None:
    """The tier of the server whose child runs ``python ARGS`` under ``env`` (``-m`` or ``-c``, and
    :data:`START_SETTINGS` those of the server's environment): "libraries" or "torch"; None: a real process."""
    if args[0] not in ("-m", "-c") or _start_settings(env) != _start_settings(_Server.environment):
        return None
    same_imports = _read_on_import(env) == _read_on_import(library_environment(_Server.environment))
    return "libraries" if same_imports else "torch"


# ----- the server ------------------------------------------------------------------------------------------------

def serve(path: str) -> dict | None:
    """Serve runs on the sockets ``path`` (the torch tier) and ``path.libraries`` (the libraries tier, forked from
    it) until stdin closes (None); in a forked child, return its request."""
    for module in PRELOADED:
        __import__(module)
    if os.fork() == 0:
        _import_libraries()
        return _serve_on(tier_socket(path, "libraries"))
    return _serve_on(path)


def _import_libraries() -> None:
    """The libraries tier's imports: :data:`COMMANDS` under :func:`library_environment`, then the project's own
    modules forgotten."""
    os.environ.update(library_environment(dict(os.environ)))
    sys.path.insert(0, str(ROOT))
    for module in COMMANDS:
        __import__(module)
    sys.path.remove(str(ROOT))
    for name in [name for name in sys.modules if name == "jagg_core" or name.startswith("jagg_core.")]:
        del sys.modules[name]


def _serve_on(path: str) -> dict | None:
    """One tier's loop: a child forked for each run on the socket ``path``, until stdin closes (None); in the
    child, return its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:
            return None
        connection, _ = listener.accept()
        with connection, connection.makefile("r") as reader:
            request = json.loads(reader.readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                return request
            _say(connection, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            _say(connection, {"returncode": os.waitstatus_to_exitcode(status)})


def _say(connection: socket.socket, answer: dict) -> None:
    """One JSON line to the client, unless it has gone (a time-out: it killed the child)."""
    try:
        connection.sendall((json.dumps(answer) + "\n").encode())
    except OSError:
        pass


def run_request(request: dict) -> None:
    """In the forked child: become ``python ARGS`` (raises what the run raises, as the interpreter's top level)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    option, target, *rest = request["args"]
    if option == "-m":  # the working folder first on the import path, as ``-m`` puts it (``-c``: "")
        import runpy
        sys.path[0], sys.argv = os.getcwd(), [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        import types
        sys.path[0], sys.argv = "", ["-c", *rest]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


# ----- the client ------------------------------------------------------------------------------------------------

class _Server:
    """The server process, started on first use with the environment the tests started with, in a temporary
    folder (its socket, and its log: what its imports say) removed when the tests end."""

    lock = threading.Lock()
    process: subprocess.Popen | None = None
    socket = ""
    environment = dict(os.environ)

    @classmethod
    def socket_path(cls) -> str:
        with cls.lock:
            if cls.process is None:
                folder = tempfile.mkdtemp(prefix="zygote-")
                cls.socket = os.path.join(folder, "socket")
                with open(os.path.join(folder, "log"), "w") as log:
                    cls.process = subprocess.Popen([sys.executable, __file__, cls.socket], stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, stderr=log, text=True,
                                                   env=cls.environment)
                atexit.register(cls.stop, folder)
                if [cls.process.stdout.readline().strip() for _tier in ("torch", "libraries")] != ["ready"] * 2:
                    raise RuntimeError(f"the test zygote did not start (exit {cls.process.wait()})")
            return cls.socket

    @classmethod
    def stop(cls, folder: str) -> None:
        cls.process.stdin.close()
        cls.process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def run_python(args: list[str], *, cwd: Path | str, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` (``-m MODULE ...`` or ``-c CODE ...``) in ``cwd`` with ``env`` (default: this process's),
    stdout and stderr captured as text, as ``subprocess.run`` would: a child of the server, or a real process when
    ``env`` sets torch's settings otherwise."""
    env = dict(os.environ if env is None else env)
    command = [sys.executable, *args]
    server_tier = tier(args, env)
    if server_tier is None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(tier_socket(_Server.socket_path(), server_tier))
            with connection.makefile("rw") as stream:
                stream.write(json.dumps(request) + "\n")
                stream.flush()
                pid = json.loads(stream.readline())["pid"]
                connection.settimeout(timeout)
                try:
                    returncode = json.loads(stream.readline())["returncode"]
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(command, timeout, out.read_bytes(), err.read_bytes()) from None
        return subprocess.CompletedProcess(command, returncode, out.read_text(), err.read_text())


def exit_as_the_interpreter(run) -> None:
    """Call ``run()``, then end the process as the interpreter would after it, less the teardown of its modules (a
    second with torch imported: every child's exit, as with ``multiprocessing``'s): an uncaught exception's
    traceback and exit 1 (a ``KeyboardInterrupt``: killed by SIGINT), ``SystemExit``'s code, then the non-daemon
    threads joined, the atexit handlers run, the standard streams flushed."""
    code = 0
    try:
        run()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        frames = error.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename == __file__:  # the run's frames alone
            frames = frames.tb_next
        sys.excepthook(type(error), error.with_traceback(frames), frames)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    forked = serve(sys.argv[1])
    if forked is not None:
        exit_as_the_interpreter(lambda: run_request(forked))
