"""The engine's output, written by the engine itself: the front never carries it.

Every byte the engine's processes write to stdout or stderr (this process, and vLLM's EngineCore
and workers, which inherit both) goes through one pipe to a relay of the engine's own, forked
before anything else starts. The relay copies it to the stderr the engine inherited, each line
prefixed ``[engine i]`` (as the children of vLLM's DP supervisor write theirs), and into a bounded
tail file that the front quotes when the engine fails to start. It reads chunks, not lines, so no
line is too long for it (vLLM's ``--enable-log-requests`` writes a whole prompt on one line). It
runs in a session of its own, so that killing the engine's process group does not cut off what
was written before; it exits when the last process that can write to the pipe is gone.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal

# Each of the tail file's two generations; the front quotes the last lines of both.
TAIL_BYTES = 256 * 1024
TAIL_LINES = 40
_CHUNK = 64 * 1024


def relay_output(prefix: str, tail_path: str, then: tuple[str, str] | None = None) -> int:
    """Send this process's stdout and stderr, and its children's, through a relay (forked here);
    returns the relay's pid. With ``then`` (another prefix and tail file): on SIGUSR1 the relay
    goes on with those (a spare that loaded its engine becomes the engine: standby.py).

    Call it first, while the process has no other thread: the relay is a fork of it."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(write_fd)
            os.setsid()
            name_process(f"skyinfer::output {prefix.strip()}")
            relay = _Relay(prefix, _TailFile(tail_path, TAIL_BYTES))
            if then is not None:
                signal.signal(signal.SIGUSR1, lambda *_: relay.switch(then[0], _TailFile(then[1], TAIL_BYTES)))
            relay.run(read_fd)
        finally:
            os._exit(0)
    os.close(read_fd)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    return pid


def name_process(title: str) -> None:
    """What ps shows for this process."""
    # As vLLM names its processes (VLLM::EngineCore), so that ps and tests tell the relay apart.
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(title)


def keep_title() -> None:
    """Before this process's environment changes: setproctitle finds the room for a title next
    to the environment's strings, where the process started with them."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.getproctitle()


class _Relay:
    def __init__(self, prefix: str, tail: _TailFile):
        self.prefix = prefix.encode()
        self.tail = tail

    def switch(self, prefix: str, tail: _TailFile) -> None:
        self.prefix, self.tail = prefix.encode(), tail
        name_process(f"skyinfer::output {prefix.strip()}")

    def run(self, read_fd: int) -> None:
        at_line_start = True
        while chunk := os.read(read_fd, _CHUNK):
            _write_all(2, prefixed(chunk, self.prefix, at_line_start))
            at_line_start = chunk.endswith(b"\n")
            self.tail.write(chunk)


def prefixed(chunk: bytes, prefix: bytes, at_line_start: bool) -> bytes:
    """``chunk`` with ``prefix`` at the start of every line that begins in it."""
    ends_line = chunk.endswith(b"\n")
    body = chunk[:-1] if ends_line else chunk
    return (prefix if at_line_start else b"") + body.replace(b"\n", b"\n" + prefix) + (b"\n" if ends_line else b"")


def _write_all(fd: int, data: bytes) -> None:
    # A stderr that is gone (closed, a reader that left) loses the copy; the tail file keeps it.
    with contextlib.suppress(OSError):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


class _TailFile:
    """The end of the engine's output: the current file and the one before it, each at most ``limit`` bytes."""

    def __init__(self, path: str, limit: int):
        self.path = path
        self.limit = limit
        self._file: io.FileIO | None = self._open()

    def _open(self) -> io.FileIO | None:
        try:
            return open(self.path, "ab", buffering=0)
        except OSError:
            return None

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            return
        try:
            if self._file.tell() + len(chunk) > self.limit:
                self._file.close()
                os.replace(self.path, self.path + ".1")
                self._file = self._open()
            if self._file is not None:
                self._file.write(chunk[-self.limit :])
        except (OSError, ValueError):
            # A tail that cannot be written (a full disk, its directory removed at shutdown) is
            # given up; the relay goes on, so that no writer ever meets a broken pipe.
            self._file = None


def read_tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines an engine wrote (from its tail file and the one before it)."""
    data = b""
    for name in (path + ".1", path):
        with contextlib.suppress(OSError), open(name, "rb") as f:
            data += f.read()
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])
