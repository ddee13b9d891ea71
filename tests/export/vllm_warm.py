"""The vLLM Python for the engine tests at the price of one ``import vllm``.

Each engine check starts the vLLM venv's Python on a script (``autoprec/export/vllm_side.py``, or a test's own);
most of a small model's check is that interpreter importing vLLM (and torch under it), again for every check.
Here a server, started once by the vLLM venv's Python, imports vLLM and what the scripts import from it, and then
forks a fresh child for each script: the child runs it as ``python SCRIPT ARGS`` would (``runpy``, the script's own
argv, folder, environment, and the caller's stdin, stdout and stderr, passed over the socket as file descriptors);
its exit status, atexit handlers and an uncaught exception's traceback are the interpreter's. No engine is ever
built in the server, so each child builds its own from nothing, as a fresh process does.

The caller sees an executable (:func:`start`'s path) that it runs in place of the vLLM Python: a stub that hands
its command line to the server and exits with the child's status. The real interpreter start is still run by the
command-line engine test (``test_vllm_judge.py``), which gives ``--vllm-python`` the venv's own Python.

This file imports nothing outside the standard library but tests/cli_runner.py (whose children end as this one's
do, and which imports only the standard library): the server runs in the vLLM venv, where autoprec is not
installed, and the stub runs with no PYTHONPATH (the check clears it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["start"]

# What the scripts import from vLLM (vllm_side.py's imports, the MoE test's), imported once by the server.
WARM = ("torch", "safetensors", "vllm", "vllm.entrypoints.llm", "vllm.platforms", "vllm.config",
        "vllm.inputs", "vllm.model_executor.models", "vllm.engine.arg_utils", "vllm.v1.executor",
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe")
# what the check sets for vLLM (autoprec.export.judge._run_side): read when vLLM is imported, so the server has them
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


def start(python: str | Path, folder: Path) -> tuple[Path, subprocess.Popen]:
    """Start a server under ``python`` (a Python with vLLM) in ``folder``: (the stub to run in its place, the
    server's process, to kill when done)."""
    sock = folder / "socket"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    server = subprocess.Popen([str(python), __file__, "--serve", str(sock)], env={**env, **ENV},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    said = []  # vLLM logs to stdout as it is imported: every line up to "ready"
    for line in server.stdout:
        if line.strip() == "ready":
            break
        said.append(line)
    else:
        server.kill()
        raise RuntimeError(f"the vLLM server did not start under {python}: {''.join(said[-5:])}")
    stub = folder / "python"
    stub.write_text(f"#!/bin/sh\nexec {sys.executable} -S {Path(__file__).resolve()} --client {sock} \"$@\"\n")
    stub.chmod(0o755)
    return stub, server


# ---- the stub ----------------------------------------------------------------------------------------------------
def _client(sock: str, argv: list[str]) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(sock)
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n"
        socket.send_fds(conn, [request], [0, 1, 2])
        said = conn.makefile().readline().strip()
    # a child that died without an exit status (killed, or a crash) answers nothing
    return int(said) if said else 1


# ---- the server and its children ---------------------------------------------------------------------------------
def _serve(path: str) -> None:
    from cli_runner import import_and_freeze, serve_forks

    import_and_freeze(WARM)  # frozen: shared by the children's copy-on-write pages, never walked by their collections
    signal.signal(signal.SIGCHLD, _reap)  # waited for, so that their CPU time is counted as the server's
    serve_forks(path, _child, log=f"{path}.log")


def _reap(_signum, _frame) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        data += conn.recv(1 << 20)
    return json.loads(data), list(fds)


def _child(conn: socket.socket) -> None:
    import runpy

    from cli_runner import run_as_main

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the script's own subprocesses are waited for
    request, fds = _receive(conn)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, given in zip((0, 1, 2), fds):
        os.dup2(given, fd)
        os.close(given)
    script, *args = request["argv"]
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` puts the script's folder first
    run_as_main(conn, lambda: runpy.run_path(script, run_name="__main__"))


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        sys.path[0] = str(Path(__file__).resolve().parents[1])  # tests/, for cli_runner (standard library only)
        _serve(sys.argv[2])
    else:  # --client SOCKET ARGS...
        sys.exit(_client(sys.argv[2], sys.argv[3:]))
