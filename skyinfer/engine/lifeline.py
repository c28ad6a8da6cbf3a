"""The engine's tie to the front: when the front dies, however it dies, the
engine and every process vLLM started beneath it die too.

The front holds the only write end of a pipe; each engine holds a read end.
The kernel closes the write end when the front exits, SIGKILL and the OOM
killer included, and the read returns end-of-file. The engine then kills its
own process group (the front starts each engine as a group leader, and
vLLM's EngineCore, workers and resource tracker stay in that group): no
polling, no reliance on the engine's event loop or on vLLM shutting down
cleanly. A parent-death signal would reach the engine alone, not the
processes beneath it.
"""

from __future__ import annotations

import os
import signal
import threading


def die_with_front(read_fd: int) -> None:
    """Kill this process group once ``read_fd`` reports end-of-file (the front is gone)."""

    def watch() -> None:
        # Nothing is ever written: the read returns only at end-of-file.
        while os.read(read_fd, 1):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="skyinfer-lifeline", daemon=True).start()
