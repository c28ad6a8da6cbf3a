"""Waiting until the trainer listens at its group's address, before anyone joins the group: the front
before it asks the engines (weights/transports.py), each engine worker before it joins (gloo.py).
Imports neither torch nor vLLM."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

__all__ = ["CONNECT_TIMEOUT_S", "rendezvous_delays", "wait_until_listening"]

# How long one look may wait for the trainer's store to take the connection.
CONNECT_TIMEOUT_S = 2.0


def rendezvous_delays(first_s: float = 0.05, longest_s: float = 1.0) -> Iterator[float]:
    """How long to wait between looks for a trainer that does not listen yet: doubling from
    ``first_s`` to ``longest_s``, so that a trainer that comes late is met within a second (c10d's
    own connect retries wait random delays of a minute and more)."""
    delay = first_s
    while True:
        yield delay
        delay = min(2 * delay, longest_s)


def wait_until_listening(host: str, port: int, deadline: float, still_wanted: Callable[[], bool]) -> bool:
    """Block until something takes a connection at ``host:port``, looking ``rendezvous_delays()``
    apart: True then; False as soon as ``still_wanted()`` says no (asked before each look); a
    ``TimeoutError`` once the next look would come after ``deadline`` (``time.monotonic()``).

    Why wait rather than join at once: a c10d store client whose first connect finds nobody there
    lands in c10d's connect retries, whose random delays of a minute and more miss a trainer that
    comes seconds later (measured: an engine of tp 2 timed out in 2 of 2 runs), and keep the
    EngineCore busy meanwhile; an address where nobody will ever listen keeps it so for the whole
    timeout. Joined only once the trainer listens, the group forms at once.
    """
    for delay in rendezvous_delays():
        if not still_wanted():
            return False
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            return True
        except OSError:
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"nothing listened at {host}:{port}") from None
            time.sleep(delay)
