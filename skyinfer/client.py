"""Python client for a skyinfer server: every route, async (aiohttp) and sync.

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
could not be opened (nothing was sent), and a 503 on a call that changes
nothing on the server (reads and generation) — what a caller sees while an
engine restarts. Admin and weight-transfer calls are never re-sent.

Errors raise ``SkyinferError`` with the server's status and message.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import inspect
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any

import aiohttp
import orjson

from .weights.layout import RankLayout

SESSION_HEADER = "X-Session-ID"
# Shorter than the server's keep-alive (aiohttp's default 75 s).
KEEPALIVE_S = 30.0


class SkyinferError(RuntimeError):
    def __init__(self, status: int, message: str, body: Any = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body


def _bool(value: bool) -> str:
    return "true" if value else "false"


class AsyncClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        # The server takes the API key on admin routes when it has no admin key.
        self.admin_key = admin_key or api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._model: str | None = None
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
            weakref.WeakKeyDictionary()
        )

    # -- pickling: settings travel, connections don't --------------------------
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_sessions"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._sessions = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"AsyncClient({self.base_url!r})"

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
            session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s), json_serialize=_dumps
            )
            self._sessions[loop] = session
        return session

    async def aclose(self) -> None:
        """Close this event loop's connections."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- one request -------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        *,
        admin: bool = False,
        json: Any = None,
        params: dict | None = None,
        headers: dict | None = None,
        retry_unavailable: bool = False,
        raw: bool = False,
    ) -> Any:
        key = self.admin_key if admin else self.api_key
        headers = {**(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})}
        attempt = 0
        while True:
            try:
                async with self._session().request(
                    method, self.base_url + path, json=json, params=params, headers=headers
                ) as resp:
                    body = await resp.read()
                    if resp.status < 400:
                        return body.decode() if raw else orjson.loads(body or b"null")
                    error = _error(resp.status, body)
            except aiohttp.ClientConnectorError as exc:
                # The connection was never made: nothing reached the server.
                error = SkyinferError(503, f"cannot connect to {self.base_url}: {exc}")
                retry = True
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                # The request may have reached the server: re-sent only if that is harmless.
                status = 504 if isinstance(exc, asyncio.TimeoutError) else 503
                error = SkyinferError(status, f"{method} {path} on {self.base_url} failed: {exc!r}")
                retry = retry_unavailable
            else:
                retry = retry_unavailable and error.status == 503
            if not retry or attempt >= self.retries:
                raise error
            await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            attempt += 1

    async def _data(self, path: str, body: dict, session_id: str | None) -> dict:
        headers = {SESSION_HEADER: session_id} if session_id else None
        return await self._request("POST", path, json=body, headers=headers, retry_unavailable=True)

    async def _admin(self, path: str, params: dict | None = None, json: Any = None) -> dict:
        return await self._request("POST", path, admin=True, params=params, json=json)

    async def _read(self, path: str, admin: bool = True) -> Any:
        return await self._request("GET", path, admin=admin, retry_unavailable=True)

    async def model(self) -> str:
        """The served model's name (asked once)."""
        if self._model is None:
            self._model = (await self.models())[0]["id"]
        return self._model

    # -- data plane ---------------------------------------------------------------
    async def models(self) -> list[dict]:
        return (await self._read("/v1/models", admin=False))["data"]

    async def generate(
        self, token_ids: list[int], sampling_params: dict | None = None, *, session_id: str | None = None, **fields
    ) -> dict:
        """Token in, token out (``/inference/v1/generate``): ids and, if asked, logprobs per token."""
        body = {"token_ids": list(token_ids), "sampling_params": sampling_params or {}, **fields}
        return await self._data("/inference/v1/generate", body, session_id)

    async def chat(self, messages: list[dict], *, model: str | None = None, session_id: str | None = None, **params) -> dict:
        body = {"model": model or await self.model(), "messages": messages, **params}
        return await self._data("/v1/chat/completions", body, session_id)

    async def complete(self, prompt: Any, *, model: str | None = None, session_id: str | None = None, **params) -> dict:
        body = {"model": model or await self.model(), "prompt": prompt, **params}
        return await self._data("/v1/completions", body, session_id)

    async def tokenize(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, model: str | None = None, **params
    ) -> list[int]:
        body = {"model": model or await self.model(), **params}
        body.update({"messages": messages} if messages is not None else {"prompt": prompt})
        return (await self._data("/tokenize", body, None))["tokens"]

    async def detokenize(self, tokens: list[int], *, model: str | None = None) -> str:
        body = {"model": model or await self.model(), "tokens": list(tokens)}
        return (await self._data("/detokenize", body, None))["prompt"]

    # -- control plane -------------------------------------------------------------
    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> dict:
        return await self._admin("/pause", {"mode": mode, "clear_cache": _bool(clear_cache)})

    async def resume(self) -> dict:
        return await self._admin("/resume")

    async def is_paused(self) -> bool:
        return (await self._read("/is_paused"))["is_paused"]

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        return await self._admin("/sleep", {"level": str(level), "mode": mode})

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        return await self._admin("/wake_up", [("tags", t) for t in tags] if tags else None)

    async def is_sleeping(self) -> bool:
        return (await self._read("/is_sleeping"))["is_sleeping"]

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> dict:
        params = {"reset_running_requests": _bool(reset_running_requests), "reset_external": _bool(reset_external)}
        return await self._admin("/reset_prefix_cache", params)

    async def abort(self, request_ids: list[str] | None = None) -> dict:
        """Abort these requests (response ids) on every engine, or every request when None."""
        return await self._admin("/abort_requests", json={"request_ids": request_ids} if request_ids else None)

    # -- weight transfer (vLLM's VLLMWeightSyncClient names) --------------------------
    async def get_world_size(self) -> int:
        return (await self._read("/get_world_size"))["world_size"]

    async def init_weight_transfer_engine(self, init_info: dict) -> dict:
        return await self._admin("/init_weight_transfer", json={"init_info": init_info})

    async def start_weight_update(self, update_info: dict | None = None) -> dict:
        return await self._admin("/start_weight_update", json=None if update_info is None else {"update_info": update_info})

    async def update_weights(self, update_info: dict, weight_version: str | None = None) -> dict:
        body = {"update_info": update_info, **({"weight_version": weight_version} if weight_version is not None else {})}
        return await self._admin("/update_weights", json=body)

    async def finish_weight_update(self, weight_version: str | None = None) -> dict:
        return await self._admin("/finish_weight_update", json={"weight_version": weight_version})

    async def weight_info(self) -> dict:
        return await self._read("/weight_info")

    # -- status ----------------------------------------------------------------------
    async def engines(self) -> list[dict]:
        return (await self._read("/engines"))["engines"]

    async def health(self) -> dict:
        """The body of ``/health`` (it lists every engine), whatever the status."""
        try:
            return await self._request("GET", "/health")
        except SkyinferError as exc:
            if exc.status == 503 and isinstance(exc.body, dict) and "engines" in exc.body:
                return exc.body
            raise

    async def ready(self) -> bool:
        try:
            await self._request("GET", "/ready")
            return True
        except SkyinferError as exc:
            if exc.status == 503:
                return False
            raise

    async def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Wait until every engine is ready (after start-up, a restart, or a resume)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                if await self.ready():
                    return
            except SkyinferError as exc:
                if exc.status != 503:  # not up yet: cannot connect
                    raise
            if loop.time() > deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)

    async def metrics(self) -> str:
        return await self._request("GET", "/metrics", raw=True)


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _error(status: int, body: bytes) -> SkyinferError:
    try:
        payload = orjson.loads(body)
        message = payload["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        payload, message = None, body.decode(errors="replace")[:1000] or f"HTTP {status}"
    return SkyinferError(status, message, payload)


class MultiNodeClient:
    """Several skyinfer nodes as one: the ``AsyncClient`` methods, fanned out.

    Generation goes to ``router_url`` when given (a vllm-router in front of the
    nodes), else to the node that ``X-Session-ID`` hashes to (no session:
    round-robin). Control and weight calls go to every node at once; a node
    that fails makes the call raise, naming it, whatever the others did.
    In the weight-transfer group the trainer is rank 0 and node k's workers
    follow the workers of the nodes before it.
    """

    def __init__(self, node_urls: Sequence[str], *, router_url: str | None = None, **settings):
        if not node_urls:
            raise ValueError("need at least one node URL")
        self.nodes = [AsyncClient(url, **settings) for url in node_urls]
        self.router = AsyncClient(router_url, **settings) if router_url else None
        self._turn = 0

    def __repr__(self) -> str:
        return f"MultiNodeClient({[n.base_url for n in self.nodes]!r}, router_url={self.router and self.router.base_url!r})"

    @property
    def base_url(self) -> str:
        return self.nodes[0].base_url

    def node_for(self, session_id: str | None) -> AsyncClient:
        """Where a generation request goes."""
        if self.router is not None:
            return self.router
        if session_id is None:
            self._turn += 1
            return self.nodes[self._turn % len(self.nodes)]
        digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
        return self.nodes[int.from_bytes(digest, "big") % len(self.nodes)]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in [*self.nodes, *([self.router] if self.router else [])]))

    async def __aenter__(self) -> MultiNodeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _fanout(self, method: str, *args, **kwargs) -> list[Any]:
        """Call ``method`` on every node at once."""
        return await self._gather(method, [getattr(node, method)(*args, **kwargs) for node in self.nodes])

    async def _gather(self, what: str, calls: list[Coroutine]) -> list[Any]:
        """Await one call per node; raise naming every node that failed, whatever the others did."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(node, r) for node, r in zip(self.nodes, results) if isinstance(r, BaseException)]
        for _node, exc in failed:
            if not isinstance(exc, SkyinferError):
                raise exc
        if failed:
            statuses = {exc.status for _node, exc in failed}
            per_node = [
                {"node": n.base_url, "status": r.status, "error": r.message} if isinstance(r, SkyinferError)
                else {"node": n.base_url, "status": 200, "result": r}
                for n, r in zip(self.nodes, results)
            ]  # fmt: skip
            raise SkyinferError(
                statuses.pop() if len(statuses) == 1 else 502,
                f"{what} failed on {len(failed)} of {len(self.nodes)} node(s): "
                + "; ".join(f"{node.base_url}: {exc.message}" for node, exc in failed),
                {"nodes": per_node},
            )
        return results

    def _report(self, results: list[Any]) -> dict:
        statuses = {r.get("status") for r in results if isinstance(r, dict)}
        report = {"nodes": [{"node": n.base_url, "result": r} for n, r in zip(self.nodes, results)]}
        return {"status": statuses.pop(), **report} if len(statuses) == 1 else report

    async def _fanout_report(self, method: str, *args, **kwargs) -> dict:
        return self._report(await self._fanout(method, *args, **kwargs))

    # -- data plane ---------------------------------------------------------------
    async def models(self) -> list[dict]:
        return await self.nodes[0].models()

    async def model(self) -> str:
        return await self.nodes[0].model()

    async def generate(self, token_ids, sampling_params=None, *, session_id=None, **fields) -> dict:
        return await self.node_for(session_id).generate(token_ids, sampling_params, session_id=session_id, **fields)

    async def chat(self, messages, *, model=None, session_id=None, **params) -> dict:
        model = model or await self.model()
        return await self.node_for(session_id).chat(messages, model=model, session_id=session_id, **params)

    async def complete(self, prompt, *, model=None, session_id=None, **params) -> dict:
        model = model or await self.model()
        return await self.node_for(session_id).complete(prompt, model=model, session_id=session_id, **params)

    # Every node serves the same model: any one tokenizes.
    async def tokenize(self, prompt=None, **kwargs) -> list[int]:
        return await self.nodes[0].tokenize(prompt, **kwargs)

    async def detokenize(self, tokens, **kwargs) -> str:
        return await self.nodes[0].detokenize(tokens, **kwargs)

    # -- control plane: every node -------------------------------------------------
    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> dict:
        return await self._fanout_report("pause", mode, clear_cache)

    async def resume(self) -> dict:
        return await self._fanout_report("resume")

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        return await self._fanout_report("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        return await self._fanout_report("wake_up", tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> dict:
        return await self._fanout_report("reset_prefix_cache", reset_running_requests, reset_external)

    async def abort(self, request_ids: list[str] | None = None) -> dict:
        return await self._fanout_report("abort", request_ids)

    async def is_paused(self) -> bool:
        return any(await self._fanout("is_paused"))

    async def is_sleeping(self) -> bool:
        return any(await self._fanout("is_sleeping"))

    # -- weight transfer: one group over every node's workers ----------------------------
    async def node_world_sizes(self) -> list[int]:
        return await self._fanout("get_world_size")

    async def get_world_size(self) -> int:
        return sum(await self.node_world_sizes())

    async def init_weight_transfer_engine(self, init_info: dict) -> dict:
        """Join every node to the trainer's group, node k's ranks after those of nodes 0..k-1."""
        sizes = await self.node_world_sizes()
        layout = RankLayout.build(int(init_info.get("rank_offset", 1)), int(init_info["world_size"]), tuple(sizes))
        calls = [
            node.init_weight_transfer_engine({**init_info, "rank_offset": layout.rank_offset(k)})
            for k, node in enumerate(self.nodes)
        ]
        return self._report(await self._gather("init_weight_transfer", calls))

    async def start_weight_update(self, update_info: dict | None = None) -> dict:
        return await self._fanout_report("start_weight_update", update_info)

    async def update_weights(self, update_info: dict, weight_version: str | None = None) -> dict:
        return await self._fanout_report("update_weights", update_info, weight_version)

    async def finish_weight_update(self, weight_version: str | None = None) -> dict:
        return await self._fanout_report("finish_weight_update", weight_version)

    async def weight_info(self) -> dict:
        infos = await self._fanout("weight_info")
        versions = {i["weight_version"] for i in infos}
        return {
            "weight_version": versions.pop() if len(versions) == 1 else None,
            "nodes": [{"node": n.base_url, **i} for n, i in zip(self.nodes, infos)],
        }

    # -- status ----------------------------------------------------------------------
    async def engines(self) -> list[dict]:
        per_node = await self._fanout("engines")
        return [{"node": n.base_url, **e} for n, engines in zip(self.nodes, per_node) for e in engines]

    async def health(self) -> dict:
        return {"nodes": [{"node": n.base_url, **h} for n, h in zip(self.nodes, await self._fanout("health"))]}

    async def ready(self) -> bool:
        return all(await self._fanout("ready"))

    async def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        await self._fanout("wait_ready", timeout_s, poll_s)

    async def metrics(self) -> dict[str, str]:
        return {n.base_url: text for n, text in zip(self.nodes, await self._fanout("metrics"))}


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

    @classmethod
    def wrapping(cls, async_client: AsyncClient | MultiNodeClient) -> Client:
        client = cls(async_client.base_url)
        client._async = async_client
        return client

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
        return self._async.base_url

    def _run(self, coro: Coroutine) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="skyinfer-client", daemon=True).start()
                # Connections closed before the interpreter tears the loop down.
                atexit.register(_close_at_exit, weakref.ref(self))
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop is not None:
            self._run(self._async.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        method = getattr(type(self._async), name, None)
        if name.startswith("_") or not inspect.iscoroutinefunction(method):
            raise AttributeError(name)
        bound = getattr(self._async, name)

        @functools.wraps(method)
        def call(*args, **kwargs):
            return self._run(bound(*args, **kwargs))

        return call


def _close_at_exit(ref: weakref.ref) -> None:
    client = ref()
    if client is not None:
        client.close()
