"""``POST /finish_session``: a trajectory is over, so its session's engine binding goes.

The next request with that id is routed as a new session. Unknown ids are a
no-op: a client may finish a session the front already forgot (idle, or
never bound).
"""

from __future__ import annotations

from aiohttp import web

from ..errors import json_response, parse_json_object
from ..fleet.registry import REGISTRY
from ..wire import FinishSessionParams, WireError, takes

# A data-plane route: the rollout client that opened the session ends it.
FINISH_SESSION_PATH = "/finish_session"


@takes(FinishSessionParams)
async def finish_session(request: web.Request) -> web.Response:
    """The trajectory is over: the session's engine binding goes (unknown ids are a no-op)."""
    raw = await request.read()
    p = FinishSessionParams.from_request(request.query, parse_json_object(raw) if raw else None)
    if p.session_id is None:
        raise WireError("session_id is required (the query string's or the body's)", "session_id")
    engine = request.app[REGISTRY].router.finish(p.session_id)
    return json_response({"status": "finished", "session_id": p.session_id, "engine": engine})
