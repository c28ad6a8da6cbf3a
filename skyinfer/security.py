"""Who may call what.

The API key guards the data plane (what an agent or a rollout worker
calls); the admin key guards everything that changes the service: control,
weight transfer, engine status. Without an admin key the admin routes take
the API key, so setting only ``--api-key`` never leaves them open. Health,
readiness and metrics stay open for probes and scrapers. The bind rule (no
admin key, no address beyond this machine) is checked with the rest of the
configuration: ``config.check_bind``.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from .errors import error_response
from .proxy import DATA_PLANE_GET, DATA_PLANE_POST
from .sessions import FINISH_SESSION_PATH
from .vllm_routes import PUBLIC, STORED_RESPONSE_PATHS

PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", *PUBLIC})
DATA_PLANE_PATHS = frozenset((*DATA_PLANE_POST, *DATA_PLANE_GET, *STORED_RESPONSE_PATHS, FINISH_SESSION_PATH))


def _bearer(request: web.Request) -> bytes | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


class AccessPolicy:
    def __init__(self, api_key: str | None, admin_key: str | None):
        self._data_key = api_key.encode() if api_key else None
        admin = admin_key or api_key
        self._admin_key = admin.encode() if admin else None

    def key_for(self, path: str) -> bytes | None:
        if path in PUBLIC_PATHS:
            return None
        return self._data_key if path in DATA_PLANE_PATHS else self._admin_key

    def middleware(self, checked_elsewhere: frozenset[str] = frozenset()):
        """``checked_elsewhere``: routes whose key another process checks (what a front worker
        passes on to the control process)."""

        @web.middleware
        async def require_key(request: web.Request, handler):
            resource = request.match_info.route.resource
            # Unknown routes fall through to a plain 404.
            unchecked_here = resource is None or resource.canonical in checked_elsewhere
            key = None if unchecked_here else self.key_for(resource.canonical)
            if key is not None:
                given = _bearer(request)
                # compare_digest: the time taken does not tell how much of the key matched.
                if given is None or not hmac.compare_digest(given, key):
                    which = "API" if key is self._data_key else "admin"
                    message = (
                        f"missing {which} key: send 'Authorization: Bearer <key>'"
                        if given is None
                        else f"invalid {which} key"
                    )
                    return error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
            return await handler(request)

        return require_key
