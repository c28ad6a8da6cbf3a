"""Routing policy: sticky sessions, otherwise the least-loaded engine.

Pure logic on plain numbers, so it can be unit-tested without engines.
A session stays on its engine because that engine holds its prefix cache;
it moves only when that engine can no longer serve.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs


@attrs.frozen
class Candidate:
    engine_id: int
    in_flight: int  # requests the front holds for that engine


class SessionRouter:
    def __init__(self, max_sessions: int = 100_000):
        self._max_sessions = max_sessions
        self._engine_of: OrderedDict[str, int] = OrderedDict()
        self._sessions_on: dict[int, int] = {}
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], session_id: str | None = None) -> int:
        """Return the engine id for a request; ``candidates`` are the engines that can serve now."""
        if not candidates:
            raise ValueError("no candidate engines")
        if session_id is None:
            return self._least_loaded(candidates, by_sessions=False)
        bound = self._engine_of.get(session_id)
        if bound is not None and any(c.engine_id == bound for c in candidates):
            self._engine_of.move_to_end(session_id)
            return bound
        # A new session brings more requests later: balance sessions too.
        chosen = self._least_loaded(candidates, by_sessions=True)
        self._bind(session_id, chosen)
        return chosen

    def engine_of(self, session_id: str) -> int | None:
        return self._engine_of.get(session_id)

    def session_count(self, engine_id: int) -> int:
        return self._sessions_on.get(engine_id, 0)

    def _least_loaded(self, candidates: Sequence[Candidate], by_sessions: bool) -> int:
        # Ties go round-robin, so that sequential traffic (nothing in flight) still spreads.
        self._turn += 1
        n = len(candidates)

        def key(i: int) -> tuple[int, int, int]:
            c = candidates[i]
            sessions = self._sessions_on.get(c.engine_id, 0) if by_sessions else 0
            return (c.in_flight, sessions, (i - self._turn) % n)

        return candidates[min(range(n), key=key)].engine_id

    def _bind(self, session_id: str, engine_id: int) -> None:
        previous = self._engine_of.pop(session_id, None)
        if previous is not None:
            self._sessions_on[previous] -= 1
        self._engine_of[session_id] = engine_id
        self._sessions_on[engine_id] = self._sessions_on.get(engine_id, 0) + 1
        while len(self._engine_of) > self._max_sessions:
            _, evicted_engine = self._engine_of.popitem(last=False)
            self._sessions_on[evicted_engine] -= 1
