"""``AsyncClient``: one skyinfer server, every route."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from ..engine_wire import SESSION_HEADER

# Shorter than the server's keep-alive (aiohttp's default 75 s).
KEEPALIVE_S = 30.0


class SkyinferError(RuntimeError):
    """A call the server refused, or that failed: ``status`` (the HTTP status; 503 when the connection
    failed, 504 when the call timed out), ``message`` (the server's own) and ``body`` (the server's
    JSON answer where it sent one: each engine's result, for a call that went to every engine)."""

    def __init__(self, status: int, message: str, body: Any = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body

    @property
    def code(self) -> str | int | None:
        """The error body's ``code``: a string where the server names what the caller can do
        about it (``skyinfer.errors.TRANSFER_GROUP_GONE``), else the status."""
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return error.get("code") if isinstance(error, dict) else None


def _bool(value: bool) -> str:
    return "true" if value else "false"


class AsyncClient:
    """One skyinfer server, every route, async. ``api_key`` goes with data-plane calls, ``admin_key``
    (else the API key) with control, weight and engine calls; ``timeout_s`` bounds each call. Only a
    connection that could not be opened, and a call that changes nothing answered 503 (or cut off,
    or timed out), are tried again, up to ``retries`` times, ``retry_backoff_s`` apart and doubling."""

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
        if body.get("stream"):
            # The answer would be server-sent events, not one JSON object.
            raise ValueError(f"{path}: this client answers whole responses; for streams use the openai SDK")
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
        """The served models, as ``GET /v1/models`` lists them (its ``data``)."""
        return (await self._read("/v1/models", admin=False))["data"]

    async def generate(
        self, token_ids: list[int], sampling_params: dict | None = None, *, session_id: str | None = None, **fields
    ) -> dict:
        """Token in, token out (``/inference/v1/generate``): ids and, if asked, logprobs per token."""
        body = {"token_ids": list(token_ids), "sampling_params": sampling_params or {}, **fields}
        return await self._data("/inference/v1/generate", body, session_id)

    async def chat(
        self, messages: list[dict], *, model: str | None = None, session_id: str | None = None, **params
    ) -> dict:
        """An OpenAI chat completion (``POST /v1/chat/completions``), whole (not streamed); ``params`` are
        the request's other fields (``max_tokens``, ``logprobs``, ...). ``model``: the served model unless
        given; ``session_id``: calls with the same id go to the same engine (``X-Session-ID``)."""
        body = {"model": model or await self.model(), "messages": messages, **params}
        return await self._data("/v1/chat/completions", body, session_id)

    async def complete(self, prompt: Any, *, model: str | None = None, session_id: str | None = None, **params) -> dict:
        """An OpenAI completion (``POST /v1/completions``), whole (not streamed); ``params``, ``model`` and
        ``session_id`` as for ``chat``."""
        body = {"model": model or await self.model(), "prompt": prompt, **params}
        return await self._data("/v1/completions", body, session_id)

    async def tokenize(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, model: str | None = None, **params
    ) -> list[int]:
        """vLLM's ``POST /tokenize``: the token ids of ``prompt``, or of ``messages`` in the chat template."""
        body = {"model": model or await self.model(), **params}
        body.update({"messages": messages} if messages is not None else {"prompt": prompt})
        return (await self._data("/tokenize", body, None))["tokens"]

    async def detokenize(self, tokens: list[int], *, model: str | None = None) -> str:
        """vLLM's ``POST /detokenize``: the text of ``tokens``."""
        body = {"model": model or await self.model(), "tokens": list(tokens)}
        return (await self._data("/detokenize", body, None))["prompt"]

    # -- control plane -------------------------------------------------------------
    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> dict:
        """``POST /pause`` on every engine. ``mode``: ``abort`` the requests in flight, ``keep`` them frozen
        until resume, or ``wait`` for them to finish; ``clear_cache=False`` keeps the KV and prefix cache."""
        return await self._admin("/pause", {"mode": mode, "clear_cache": _bool(clear_cache)})

    async def resume(self) -> dict:
        """``POST /resume``: every paused engine schedules again."""
        return await self._admin("/resume")

    async def is_paused(self) -> bool:
        """Whether any engine is paused (``GET /is_paused``; a sleeping engine is paused too)."""
        return (await self._read("/is_paused"))["is_paused"]

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """``POST /sleep`` on every engine: ``level`` 0 (the scheduler only), 1 (weights and KV cache
        released) or 2 (weights discarded: stale until a push); ``mode`` as for ``pause``."""
        return await self._admin("/sleep", {"level": str(level), "mode": mode})

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        """``POST /wake_up``: wake ``tags`` (``weights``, ``kv_cache``), or everything when none are given."""
        return await self._admin("/wake_up", [("tags", t) for t in tags] if tags else None)

    async def is_sleeping(self) -> bool:
        """Whether any engine sleeps, as vLLM's ``is_sleeping`` answers (``GET /is_sleeping``)."""
        return (await self._read("/is_sleeping"))["is_sleeping"]

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> dict:
        """``POST /reset_prefix_cache`` on every engine; ``reset_running_requests`` and ``reset_external``
        (the connector's cache too) as vLLM's route takes them."""
        params = {"reset_running_requests": _bool(reset_running_requests), "reset_external": _bool(reset_external)}
        return await self._admin("/reset_prefix_cache", params)

    async def abort(self, request_ids: Sequence[str] | None = None, *, all_requests: bool = False) -> dict:
        """Abort these requests (response ids) on every engine; every request in flight only with ``all_requests``.

        An empty list aborts nothing (it asks the server nothing): a list
        that happens to be empty must never stop every rollout.
        """
        if all_requests == (request_ids is not None):
            raise ValueError("abort: give the request ids, or all_requests=True, not both or neither")
        if all_requests:
            return await self._admin("/abort_requests")
        if not request_ids:
            return {"status": "aborted", "aborted": 0}
        return await self._admin("/abort_requests", json={"request_ids": list(request_ids)})

    # -- weight transfer (vLLM's VLLMWeightSyncClient names) --------------------------
    async def get_world_size(self) -> int:
        """The fleet's inference workers (``GET /get_world_size``): a one-node group's ``world_size`` is
        this plus ``rank_offset``."""
        return (await self._read("/get_world_size"))["world_size"]

    async def init_weight_transfer_engine(self, init_info: dict) -> dict:
        """``POST /init_weight_transfer``: every engine joins the trainer's group (or takes a colocated
        transport's settings); answers once they have. ``init_info`` as vLLM's backend takes it."""
        return await self._admin("/init_weight_transfer", json={"init_info": init_info})

    async def start_weight_update(self, update_info: dict | None = None, *, staged: bool = False) -> dict:
        """``POST /start_weight_update``: open a weight update; ``update_info`` (names, dtypes, shapes) is
        checked against the served checkpoint, where the front can read it, before any byte moves.
        ``staged``: its chunks are received while the engines generate, its finish swaps them in."""
        body = {
            **({"update_info": update_info} if update_info is not None else {}),
            **({"staged": True} if staged else {}),
        }
        return await self._admin("/start_weight_update", json=body or None)

    async def update_weights(
        self,
        update_info: dict,
        weight_version: str | None = None,
        *,
        staged: bool = False,
        kv: str = "recompute",
        check_only: bool = False,
    ) -> dict:
        """``POST /update_weights``: every engine receives ``update_info``'s tensors while the trainer sends
        them; with no update open, one call starts, receives and finishes it (``weight_version``).
        ``staged``: received while the engines generate, swapped in between two steps; ``kv``: "keep"
        lets running requests go on over the KV they have. ``check_only``: the server raises what it
        would refuse the call for, and nothing moves."""
        body = {
            "update_info": update_info,
            **({"weight_version": weight_version} if weight_version is not None else {}),
            **({"staged": True} if staged else {}),
            **({"kv": kv} if kv != "recompute" else {}),
            **({"check_only": True} if check_only else {}),
        }
        return await self._admin("/update_weights", json=body)

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        verify: bool = False,
        expected_checksums: dict[str, str] | None = None,
        kv: str = "recompute",
    ) -> dict:
        """``verify``: afterwards every engine must hold the same weights (or ``expected_checksums``);
        one that differs is held out and the call raises. ``kv``: "keep" lets the requests running
        go on over the KV they have."""
        body = {"weight_version": weight_version, "verify": verify, **({"kv": kv} if kv != "recompute" else {})}
        if expected_checksums is not None:
            body["expected_checksums"] = expected_checksums
        return await self._admin("/finish_weight_update", json=body)

    async def weight_checker(self, action: str = "checksum", baseline: dict[str, str] | None = None) -> dict:
        """vLLM's route on every engine: ``checksum`` (an engine that differs from the fleet is held
        out), ``compare`` against ``baseline`` (report only), ``reset`` (zeroes weights; stale until a push)."""
        return await self._admin(
            "/weight_checker", json={"action": action, **({"baseline": baseline} if baseline else {})}
        )

    async def update_weight_version(self, new_version: str) -> dict:
        """A new label for the weights every engine serves, without a transfer (vLLM's route)."""
        return await self._admin("/update_weight_version", json={"new_version": new_version})

    async def shutdown_weight_transfer_engine(self) -> dict:
        """Every engine leaves the trainer's group (vLLM's route); ``init_weight_transfer_engine`` forms a new one."""
        return await self._admin("/shutdown_weight_transfer_engine")

    async def weight_info(self) -> dict:
        """``GET /weight_info``: the fleet's weight version, the update's phase, each engine's version and state."""
        return await self._read("/weight_info")

    # -- LoRA adapters (vLLM's routes, plus a push over the transfer group) -------------
    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False, version: str | None = None
    ) -> dict:
        """Load (``load_inplace``: reload) an adapter from a directory on the server's disk, on every engine."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": load_inplace}
        return await self._admin("/v1/load_lora_adapter", json={**body, **({"version": version} if version else {})})

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """``POST /v1/unload_lora_adapter``: every engine drops the adapter ``lora_name``."""
        return await self._admin("/v1/unload_lora_adapter", json={"lora_name": lora_name})

    async def update_lora_adapter(
        self, lora_name: str, peft_config: dict, update_info: dict, version: str | None = None, check_only: bool = False
    ) -> dict:
        """The HTTP half of an adapter push: the engines receive while the trainer broadcasts.
        ``check_only``: the server checks the adapter and the group, and nothing moves."""
        body = {
            "lora_name": lora_name,
            "peft_config": peft_config,
            "update_info": update_info,
            "check_only": check_only,
        }
        return await self._admin("/update_lora_adapter", json={**body, **({"version": version} if version else {})})

    # -- status ----------------------------------------------------------------------
    async def engines(self) -> list[dict]:
        """``GET /engines``: per engine, its state, process, devices, weight version and requests in flight."""
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
        """Whether every engine of the fleet is ready (``GET /ready`` answers 200)."""
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
        """``GET /metrics``: the Prometheus text (the front's metrics, then every engine's)."""
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
