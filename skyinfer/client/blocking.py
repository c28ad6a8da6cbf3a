"""``Client``: the async clients' methods, blocking, for scripts that are not async."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any

from .multinode import MultiNodeClient
from .node import AsyncClient


class Client:
    """The ``AsyncClient`` (or, given several URLs, ``MultiNodeClient``) methods, blocking.

    Calls run on a private event loop in a background thread, so the client
    may be used from several threads at once (a trainer broadcasting while
    ``update_weights`` waits, say).
    """

    def __init__(self, base_url: str | Sequence[str], *, router_url: str | None = None, **settings):
        if isinstance(base_url, str) and router_url is None:
            self._async: AsyncClient | MultiNodeClient = AsyncClient(base_url, **settings)
        else:
            urls = [base_url] if isinstance(base_url, str) else list(base_url)
            self._async = MultiNodeClient(urls, router_url=router_url, **settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"_async": self._async}

    def __setstate__(self, state: dict) -> None:
        self._async = state["_async"]
        self._loop = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Client({self._async!r})"

    @property
    def base_url(self) -> str:
        """The server's URL (the first node's, given several)."""
        return self._async.base_url

    def _run(self, coro: Coroutine) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self._loop.run_forever, name="skyinfer-client", daemon=True)
                thread.start()
                # Connections are closed and the thread ends when the client is
                # closed, garbage-collected, or the interpreter exits.
                self._finalizer = weakref.finalize(self, _shut_down, self._loop, thread, self._async)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the connections and end the client's background thread (a later call starts them again)."""
        if self._loop is not None:
            self._finalizer()
            self._loop = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _blocking(name: str, method) -> Any:
    """``Client.<name>``: the async method of the same name, run on the client's loop."""

    @functools.wraps(method)
    def call(self: Client, *args, **kwargs):
        return self._run(getattr(self._async, name)(*args, **kwargs))

    return call


# Real methods on the class, made once from the async clients' own (their
# names, signatures and docstrings): what a runtime-checkable protocol such
# as vLLM's VLLMWeightSyncClient sees on Python 3.12+, unlike __getattr__.
for _cls in (MultiNodeClient, AsyncClient):
    for _name, _method in vars(_cls).items():
        if not _name.startswith("_") and _name != "aclose" and inspect.iscoroutinefunction(_method):
            setattr(Client, _name, _blocking(_name, _method))


def _shut_down(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: AsyncClient | MultiNodeClient
) -> None:
    closing = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
    if threading.current_thread() is not thread:  # never wait on the loop from inside it
        closing.result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
