"""Python client for a skyinfer server: every route, async (aiohttp) and sync, in the caller's
process (a trainer, a rollout worker, ``skyinfer status``).

::

    from skyinfer.client import AsyncClient, Client

    client = AsyncClient("http://127.0.0.1:8000", api_key=..., admin_key=...)
    out = await client.generate([1, 2, 3], {"max_tokens": 16, "logprobs": 1}, session_id="episode-7")
    await client.pause(mode="keep")
    ...
    Client("http://127.0.0.1:8000").engines()      # the same methods, blocking

An ``AsyncClient`` pickles (it holds settings, not connections): hand it to a
rollout worker process and use it there. Each event loop gets its own
connection pool, made on first use. The pool has no connection cap (a
training step may hold thousands of requests at once) and drops idle
connections before the server would (30 s against aiohttp's 75 s), so a
request never lands on a connection the server is closing.

Retries happen only where they cannot do anything twice: a connection that
could not be opened (nothing was sent), and a call that changes nothing on the
server (reads and generation) answered 503, cut off or timed out — what a
caller sees while an engine restarts. Admin and weight-transfer calls, once
sent, are never sent again.

Errors raise ``SkyinferError`` with the server's status and message.
"""

from .blocking import Client
from .multinode import MultiNodeClient
from .node import AsyncClient, SkyinferError

__all__ = ["AsyncClient", "Client", "MultiNodeClient", "SkyinferError"]
