"""Who may call what.

The API key guards the data plane (what an agent or a rollout worker
calls); the admin key guards everything that changes the service: control,
weight transfer, engine status. Without an admin key the admin routes take
the API key, so setting only ``--api-key`` never leaves them open. Health,
readiness and metrics stay open for probes and scrapers. The bind rule (no
admin key, no address beyond this machine) is checked with the rest of the
configuration: ``config.check_bind``.

With no key on the admin routes (neither key set: the default on loopback), the address is the
only guard, and a web page the operator's browser opens reaches 127.0.0.1 too; so an admin route
then refuses what a browser sends for another site's page (``cross_site_refusal``).
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from aiohttp import web

from ..errors import error_response
from ..serving.proxy import DATA_PLANE_GET, DATA_PLANE_POST
from ..serving.sessions import FINISH_SESSION_PATH
from .vllm_routes import PUBLIC, STORED_RESPONSE_PATHS

PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", *PUBLIC})
DATA_PLANE_PATHS = frozenset((*DATA_PLANE_POST, *DATA_PLANE_GET, *STORED_RESPONSE_PATHS, FINISH_SESSION_PATH))


def cross_site_refusal(request: web.Request) -> str | None:
    """Why a request to an unkeyed admin route is refused as a browser's on another site's behalf
    (None: it is not). Refused:

    * ``Sec-Fetch-Site: cross-site`` or ``same-site``: the browser says another site's page sent it;
    * an ``Origin`` (what a browser sends on every POST and every cross-origin fetch) that is not
      this server's own, ``http(s)://`` and the ``Host`` the request came to; ``Origin: null``
      (a sandboxed frame, a local file) too;
    * a browser's request (an ``Origin``, or a ``Sec-Fetch-Site`` other than ``none``) to a ``Host``
      that is a name other than ``localhost``: DNS rebinding (a page whose name the attacker points
      at 127.0.0.1 is same-origin with the server it reaches); an address or ``localhost`` cannot
      be rebound.

    Allowed: what sends neither header (curl, requests, httpx, aiohttp, the openai SDK, skyinfer's
    client and trainers), and ``Sec-Fetch-Site: none`` (the operator typing the URL). This is
    Jupyter's rule (``check_origin``: no Origin, or Origin equal to Host; ``check_host``: no
    rebinding) with the Fetch metadata Ray's dashboard also reads to turn browsers away.

    No option allows named origins (Jupyter's ``allow_origin``): skyinfer serves no page of its own
    and answers no CORS preflight, so no browser tool could read an admin answer or send a key
    anyway; one that needs the admin routes should go through a process that holds the admin key.
    """
    site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
    if site in ("cross-site", "same-site"):
        return f"a page of another site sent it (Sec-Fetch-Site: {site})"
    host = request.headers.get("Host", "").strip().lower()
    origin = request.headers.get("Origin")
    if origin is not None:
        parts = urlsplit(origin.strip().lower())
        if parts.scheme not in ("http", "https") or not host or parts.netloc != host:
            return f"a page of another origin sent it (Origin: {origin}; this server: {host or 'no Host'})"
    if (origin is not None or site not in ("", "none")) and not _cannot_be_rebound(host):
        return f"a browser sent it to the name {host!r}, which a page could have pointed at this machine"
    return None


def _cannot_be_rebound(host: str) -> bool:
    """A ``Host`` of an IP address or ``localhost``: no page of another site can have that origin."""
    try:
        parts = urlsplit(f"//{host}")
        parts.port  # noqa: B018 (a malformed port is a ValueError)
        if parts.hostname != "localhost":
            ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return False
    return True


def _bearer(request: web.Request) -> bytes | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


class AccessPolicy:
    def __init__(self, api_key: str | None, admin_key: str | None):
        self._data_key = api_key.encode() if api_key else None
        admin = admin_key or api_key
        self._admin_key = admin.encode() if admin else None

    def admin_unkeyed(self, path: str) -> bool:
        """An admin route open to any caller who reaches the address (no admin key, no API key)."""
        return self._admin_key is None and path not in PUBLIC_PATHS and path not in DATA_PLANE_PATHS

    def key_for(self, path: str) -> bytes | None:
        if path in PUBLIC_PATHS:
            return None
        return self._data_key if path in DATA_PLANE_PATHS else self._admin_key

    def middleware(self, checked_elsewhere: frozenset[str] = frozenset()):
        """``checked_elsewhere``: routes whose key another process checks (what a front worker
        passes on to the control process, with the Host it came to).

        The data plane (``DATA_PLANE_PATHS``) takes browsers' calls from any page, as vLLM's and
        other OpenAI-compatible servers do (browser chat front-ends call them directly): a page can
        spend GPU time there but changes nothing of the service; ``--api-key`` keeps pages out, since a keyed
        cross-origin call needs a CORS preflight that is not answered."""

        @web.middleware
        async def require_key(request: web.Request, handler):
            resource = request.match_info.route.resource
            # Unknown routes fall through to a plain 404.
            unchecked_here = resource is None or resource.canonical in checked_elsewhere
            key = None if unchecked_here else self.key_for(resource.canonical)
            if not unchecked_here and self.admin_unkeyed(resource.canonical):
                why = cross_site_refusal(request)
                if why is not None:
                    return error_response(
                        403,
                        f"refused: {why}. With no admin key the admin routes take no calls from web pages, "
                        "which a browser on this machine would send for any site. Call without a browser "
                        "(curl, a script, the trainer), or start the server with --admin-key KEY (or "
                        "SKYINFER_ADMIN_KEY) and send 'Authorization: Bearer KEY'.",
                    )
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
