"""Routing policy: sticky sessions, prompt groups, otherwise the least-loaded engine.

Pure logic on plain numbers, so it can be unit-tested without engines.
A session stays on its engine because that engine holds its prefix cache;
it moves only when that engine can no longer serve, or, at its next request,
when that engine is far busier than the least-loaded one (recomputing the
prefix elsewhere costs less than queueing behind a long tail); its binding
ends when the trajectory finishes or goes idle.

Requests without a session whose prompts begin alike (the samples of one GRPO
group sent one by one) share a group key, and go to the engine that served the
key last while that one has at most ``group_slack`` more requests in flight
than the least-loaded engine: the shared prefill is computed once, and a key
that covers much of the traffic (a long common system prompt) cannot pile it
all on one engine, the collapse plain consistent hashing shows under load.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs


@attrs.frozen
class Candidate:
    engine_id: int
    in_flight: int  # requests the front holds for that engine


def _in_flight_on(candidates: Sequence[Candidate], engine_id: int | None) -> int | None:
    """Requests in flight on ``engine_id``; None if it is not a candidate (it cannot serve now)."""
    return next((c.in_flight for c in candidates if c.engine_id == engine_id), None)


class SessionRouter:
    """Sessions bound to engines, least recently used first. A binding ends when its trajectory
    says so (``finish``), when it has been idle for ``idle_ttl_s``, or when more than
    ``max_sessions`` are bound (the oldest go).

    A session moves at a request when its engine has more than
    ``rebalance_factor`` x (the least-loaded engine's + 1) requests in flight
    (0: never); ``moves`` counts them by the engine moved off."""

    def __init__(
        self,
        max_sessions: int = 100_000,
        idle_ttl_s: float = 0.0,
        rebalance_factor: float = 0.0,
        group_prefix_chars: int = 0,
        group_slack: int = 8,
        clock: Callable[[], float] = time.monotonic,
        max_groups: int = 4096,
    ):
        self._max_sessions = max_sessions
        self._idle_ttl_s = idle_ttl_s
        self._rebalance_factor = rebalance_factor
        # How much of a prompt (its JSON text) makes its group key; 0: no group affinity.
        self.group_prefix_chars = group_prefix_chars
        self._group_slack = group_slack
        self._max_groups = max_groups
        self._engine_of_group: OrderedDict[int, int] = OrderedDict()
        self._clock = clock
        self.moves: dict[int, int] = {}
        self._engine_of: OrderedDict[str, int] = OrderedDict()
        self._last_used: dict[str, float] = {}
        self._sessions_on: dict[int, int] = {}
        self._turn = 0

    def choose(
        self, candidates: Sequence[Candidate], session_id: str | None = None, group_key: int | None = None
    ) -> int:
        """Return the engine id for a request; ``candidates`` are the engines that can serve now."""
        if not candidates:
            raise ValueError("no candidate engines")
        if session_id is None and group_key is None:
            return self._least_loaded(candidates, by_sessions=False)
        if session_id is None:
            return self._for_group(candidates, group_key)
        now = self._clock()
        self._forget_idle(now)
        bound = self._engine_of.get(session_id)
        load = _in_flight_on(candidates, bound)
        if load is not None and not self._overloaded(load, candidates):
            self._engine_of.move_to_end(session_id)
            self._last_used[session_id] = now
            return bound
        if load is not None:
            self.moves[bound] = self.moves.get(bound, 0) + 1
        # A new session brings more requests later: balance sessions too.
        chosen = self._least_loaded(candidates, by_sessions=True)
        self._bind(session_id, chosen)
        return chosen

    def finish(self, session_id: str) -> int | None:
        """End a session's binding (its trajectory is over); the engine it was on, if any."""
        engine = self._engine_of.pop(session_id, None)
        if engine is not None:
            del self._last_used[session_id]
            self._sessions_on[engine] -= 1
        return engine

    def engine_of(self, session_id: str) -> int | None:
        return self._engine_of.get(session_id)

    def session_count(self, engine_id: int) -> int:
        return self._sessions_on.get(engine_id, 0)

    def _for_group(self, candidates: Sequence[Candidate], group_key: int) -> int:
        bound = self._engine_of_group.get(group_key)
        load = _in_flight_on(candidates, bound)
        if load is None or load > min(c.in_flight for c in candidates) + self._group_slack:
            bound = self._least_loaded(candidates, by_sessions=False)
        self._engine_of_group[group_key] = bound
        self._engine_of_group.move_to_end(group_key)
        if len(self._engine_of_group) > self._max_groups:
            self._engine_of_group.popitem(last=False)
        return bound

    def _overloaded(self, load: int, candidates: Sequence[Candidate]) -> bool:
        least = min(c.in_flight for c in candidates)
        return bool(self._rebalance_factor) and load > self._rebalance_factor * (least + 1)

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
        self.finish(session_id)
        self._engine_of[session_id] = engine_id
        self._last_used[session_id] = self._clock()
        self._sessions_on[engine_id] = self._sessions_on.get(engine_id, 0) + 1
        while len(self._engine_of) > self._max_sessions:
            self.finish(next(iter(self._engine_of)))

    def _forget_idle(self, now: float) -> None:
        # Least recently used first: stop at the first session still in use.
        while self._idle_ttl_s and self._engine_of:
            oldest = next(iter(self._engine_of))
            if now - self._last_used[oldest] <= self._idle_ttl_s:
                return
            self.finish(oldest)


# Stored responses remembered per server: far more than a run keeps chains open for.
MAX_STORED_RESPONSES = 200_000


class StoredResponses:
    """Which engine stored each Responses-API answer: vLLM keeps a stored response (and so
    a ``previous_response_id`` chain) in the memory of the engine that produced it, so the
    next turn, a read-back and a cancel must go there. Oldest forgotten first."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES):
        self._engine_of: OrderedDict[str, int] = OrderedDict()
        self._max_entries = max_entries

    def record(self, response_id: str, engine_id: int) -> None:
        self._engine_of[response_id] = engine_id
        self._engine_of.move_to_end(response_id)
        while len(self._engine_of) > self._max_entries:
            self._engine_of.popitem(last=False)

    def engine_of(self, response_id: str) -> int | None:
        return self._engine_of.get(response_id)
