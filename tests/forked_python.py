"""The tests' helper scripts (trainers, clients: ``tests/*.py``) in processes forked from one Python
that imported torch and skyinfer's trainer once, instead of each process importing them again
(about 2.5 CPU-seconds a trainer on these machines, on its test's path): a fork server, as
multiprocessing's ``forkserver``, for scripts with pipes.

    ForkedPopen([script, *args], stdout=subprocess.PIPE, text=True)  # a subprocess.Popen
    run_python([script, *args], capture_output=True, text=True, timeout=60)  # as subprocess.run
    run_python([script, *args], preload=VLLM_PRELOAD)  # from a second server that imported vLLM too

A script that imports vLLM's trainer pieces (vLLM's own NCCL trainer engine, its weight-sync
client) is forked from a server of its own that imported them once: vLLM's import is 16-21
CPU-seconds a process on these machines, paid once per pytest instead of once per trainer. The
scripts that need no vLLM keep the lighter server (forking from a server with vLLM imported costs
them nothing more, but its start would be on their first test's path).

Each script runs in a process of its own, as ``python script args...`` would: its own pid (killed
as any process), the caller's environment and working directory, its pipes, ``__name__ ==
"__main__"``, and an ordinary interpreter exit (threads joined, atexit run). It is the server's
grandchild: a watcher between them waits for it and sends its exit status to the caller. What the
server's imports read of the environment when they ran (libgomp's ``OMP_*``, for one) is the
server's: the caller's environment when it first started a script.

    python tests/forked_python.py SOCKET   # the server (started by the first call in a process)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

STATUS = struct.Struct("i")
# What every helper script imports: what the server imports once, before it forks them.
PRELOAD = ("torch", "torch.distributed", "requests", "safetensors.torch", "skyinfer.client", "skyinfer.trainer")
# What the scripts that drive vLLM's own trainer classes import besides (tests/nccl_trainer.py,
# tests/vllm_trainer.py): a ``preload`` of ForkedPopen and run_python.
VLLM_PRELOAD = (
    "vllm.distributed.utils",
    "vllm.distributed.device_communicators.pynccl",
    "vllm.distributed.weight_transfer.nccl_engine",
    "vllm.distributed.weight_transfer.clients",
)


class ForkedPopen(subprocess.Popen):
    """A ``subprocess.Popen`` of a Python script forked by the fork server, not executed: ``args`` is
    ``[script, *arguments]``; stdin, stdout, stderr, cwd and env as ``Popen`` takes them; ``preload``:
    what the server it is forked from imported besides ``PRELOAD``."""

    def __init__(self, args, *popen_args, preload: tuple[str, ...] = (), **popen_kwargs):
        self._preload = preload
        super().__init__(args, *popen_args, **popen_kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *more):  # fmt: skip
        assert not shell and preexec_fn is None and not pass_fds, (
            "a forked script takes no shell, preexec_fn or pass_fds"
        )
        # The child's ends of its pipes; -1: what this process has there.
        fds = [p2cread, c2pwrite, errwrite]
        fds = [fd if fd != -1 else std for fd, std in zip(fds, (0, 1, 2))]
        request = {
            "argv": [os.fspath(a) for a in args],
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (env if env is not None else os.environ).items()},
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(_server_socket(self._preload))
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
            (self.pid,) = STATUS.unpack(conn.recv(STATUS.size))
        except BaseException:
            conn.close()
            raise
        finally:
            # As Popen's own: the child's ends of the pipes this call made are the child's alone now.
            for child_end, ours in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if child_end != -1 and ours != -1:
                    os.close(child_end)
            if hasattr(self, "_devnull"):
                os.close(self._devnull)
        self._status = conn
        self._child_created = True

    def _receive_status(self, block: bool, timeout: float | None = None) -> int | None:
        with self._waitpid_lock:
            if self.returncode is not None:
                return self.returncode
            self._status.settimeout(timeout if block else 0.0)
            try:
                data = self._status.recv(STATUS.size)
            except (BlockingIOError, TimeoutError):
                return None
            if not data:
                raise RuntimeError(f"the fork server's watcher of process {self.pid} ended without its status")
            self.returncode = os.waitstatus_to_exitcode(STATUS.unpack(data)[0])
            self._status.close()
            return self.returncode

    def _internal_poll(self, _deadstate=None, **unused):
        return self._receive_status(block=False)

    def _wait(self, timeout):
        if self._receive_status(block=True, timeout=timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def run_python(argv: list, *, timeout: float | None = None, input=None, capture_output=False,
               **popen_kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run([sys.executable, *argv], ...)`` for a helper script, forked from the fork server."""
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
    with ForkedPopen(argv, **popen_kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


_started = threading.Lock()
# A fork server per preload: its process and its socket.
_servers: dict[tuple[str, ...], tuple[subprocess.Popen, str]] = {}


def _server_socket(preload: tuple[str, ...]) -> str:
    """The socket of the fork server that imported ``preload`` besides ``PRELOAD``; the server starts
    on the first call for it in this process and is stopped when this process exits."""
    with _started:
        server = _servers.get(preload)
        if server is None or server[0].poll() is not None:
            folder = tempfile.mkdtemp(prefix="skyinfer-forks-")
            path = os.path.join(folder, "socket")
            process = subprocess.Popen(
                [sys.executable, __file__, path, *preload],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            atexit.register(process.kill)
            line = process.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"the fork server did not start: {line!r}")
            server = _servers[preload] = (process, path)
        return server[1]


def _serve(path: str, preload: list[str]) -> tuple[dict, list[int]]:
    """Fork a script's process for each request. Returns in that process only (its request and its
    stdin, stdout and stderr); the server and the watchers never return."""
    for name in (*PRELOAD, *preload):
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers: reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            conn.send(STATUS.pack(pid))
            _, status = os.waitpid(pid, 0)
            try:
                conn.send(STATUS.pack(status))
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _become(request: dict, fds: list[int]) -> None:
    """This process as ``python SCRIPT ARGS...`` would start: its pipes, directory, environment, argv."""
    for std, fd in enumerate(fds):
        os.dup2(fd, std)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))


def _run() -> int:
    """The script, to its exit status as the interpreter would make it."""
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit(status: int) -> None:
    """Exit as the interpreter does, less its teardown of every module: in a forked process that
    touches each object the server imported (copying its pages): 1.5-2 s a script, measured under load."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A pipe its reader closed, or a stream the script closed, as the interpreter ignores them.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    request, fds = _serve(sys.argv[1], sys.argv[2:])
    _become(request, fds)
    _exit(_run())
