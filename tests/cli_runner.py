"""``python -m autoprec`` for the tests at the price of one ``import torch``.

A server process imports what ``python -m autoprec`` imports before it runs (``autoprec.cli``) once, and what
most commands import next (:data:`_WARM`), then forks a fresh child for each command line. The child runs it as
``python -m autoprec`` would: ``runpy`` runs ``autoprec.__main__`` with the command's own argv, folder, stdin,
stdout and stderr (file descriptors, so C-level output is caught too); its exit status, atexit handlers and an
uncaught exception's traceback are the interpreter's.
Starting an interpreter and importing torch is most of the time of a command-line test that stops at a bad input.

Environment variables are read when an interpreter starts (OMP_NUM_THREADS, PYTHONWARNINGS), so each environment
gets a server of its own, started with it. The console script and the interpreter start itself are still run for
real by the tests that are about them (``tests/cli/test_quiet.py``, ``tests/project/test_lean_import.py``,
``tests/project/test_packaging.py`` and ``real_autoprec`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["import_and_freeze", "run", "run_as_main", "serve_forks", "stop_servers"]

_SERVERS: dict[frozenset, _Server] = {}
# set anew for every test and read by nothing at an interpreter's start: one server serves every value
_PER_CALL = ("PYTEST_CURRENT_TEST",)
_LOCK = threading.Lock()


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="autoprec-cli-"))
        self.socket = self.folder / "socket"
        self.process = subprocess.Popen([sys.executable, __file__, str(self.socket)], env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the autoprec server did not start (it said {ready!r})")

    def run(self, args: list[str], cwd: str | None, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
        out, err = self.folder / f"{threading.get_ident()}.out", self.folder / f"{threading.get_ident()}.err"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket))
            conn.settimeout(timeout)
            request = {"args": args, "cwd": cwd or os.getcwd(), "out": str(out), "err": str(err), "env": env}
            conn.sendall((json.dumps(request) + "\n").encode())
            answer = conn.makefile()
            pid = int(answer.readline())
            try:
                said = answer.readline().strip()
            except TimeoutError:
                _kill(pid)
                raise subprocess.TimeoutExpired(["autoprec", *args], timeout, out.read_text(), err.read_text()) \
                    from None
        # a child that died without an exit status (killed, or a crash) answers nothing: -1
        code = int(said) if said else -1
        done = subprocess.CompletedProcess(["autoprec", *args], code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
        out.unlink(), err.unlink()
        return done

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(*args: str | Path, cwd: str | Path | None = None, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "autoprec", *args], capture_output=True, text=True, ...)``."""
    env = dict(os.environ if env is None else env)
    key = frozenset((k, v) for k, v in env.items() if k not in _PER_CALL)
    with _LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = _Server(env)
        server = _SERVERS[key]
    return server.run([str(a) for a in args], None if cwd is None else str(cwd), timeout, env)


def stop_servers() -> None:
    with _LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


atexit.register(stop_servers)


# ---- the server and its children ---------------------------------------------------------------------------
# Imported once by the server beside ``autoprec.cli``: what most commands go on to import (a tune's stages, Optuna,
# torch.export and dynamo, the plots). A child would import each of them itself, the same modules with the same
# result, in seconds per command; here they are imported once and then frozen out of the garbage collector, so
# the full collections a tune makes between stages do not walk them in every child (and fork's copy-on-write
# pages stay shared).
_WARM = ("autoprec.tune", "autoprec.cli.tuning", "autoprec.cli.exporting", "optuna", "sqlalchemy", "torch.export",
         "torch._dynamo", "matplotlib.pyplot", "transformers")


def import_and_freeze(names: tuple[str, ...]) -> None:
    """Import ``names`` (one this environment lacks is left out: what needs it says so itself) with matplotlib on
    Agg, as autoprec's plots choose it (:func:`autoprec.common.writing.plot_library`), then freeze every object
    alive out of the garbage collector: a tune's full collections between stages (``free_memory``) would walk
    them all, in every tune, and none of them is ever garbage."""
    import gc
    import importlib

    for name in ("matplotlib", *names):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if name == "matplotlib":
            module.use("Agg")
    gc.collect()
    gc.freeze()


def _serve(path: str) -> None:
    import autoprec.cli  # noqa: F401 - what `python -m autoprec` imports before it parses its arguments

    import_and_freeze(_WARM)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children reap themselves
    serve_forks(path, _child)


def serve_forks(path: str, child, log: str | None = None) -> None:
    """Listen on the Unix socket ``path``, print "ready", then fork a child running ``child(conn)`` (which never
    returns) for each connection; with ``log``, whatever the server itself says after "ready" goes to that file
    (nobody reads its pipe any more). Also tests/export/vllm_warm.py's."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            child(conn)  # never returns
        conn.close()


def _child(conn: socket.socket) -> None:
    import runpy

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
    request = json.loads(conn.makefile().readline())
    conn.sendall(f"{os.getpid()}\n".encode())
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(name, flags, 0o644), fd)
    sys.argv = ["autoprec", *request["args"]]
    sys.path[0] = os.getcwd()  # as `python -m` puts the folder it started in first
    run_as_main(conn, lambda: runpy.run_module("autoprec", run_name="__main__", alter_sys=True))


def run_as_main(conn: socket.socket, main) -> None:
    """Run ``main()`` as the interpreter runs ``__main__``, send its exit status on ``conn`` and end this process as
    the interpreter would (the status from SystemExit, an uncaught exception's traceback, non-daemon threads joined,
    atexit handlers run). Never returns. Also tests/export/vllm_warm.py's, for the scripts vLLM runs."""
    import traceback

    code = 1
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
    threading._shutdown()  # the interpreter's exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    conn.sendall(f"{code}\n".encode())
    os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])
