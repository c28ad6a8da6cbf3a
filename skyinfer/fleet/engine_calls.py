"""The front's calls to one engine's admin and weight routes: one reply each, and how failures add up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import aiohttp
import attrs

from .state import EngineRecord

CUT_SHORT = "cut short: another engine failed this step"


@attrs.frozen
class EngineReply:
    engine_id: int
    status: int
    body: dict

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def cut_short(self) -> bool:
        """It did not fail by itself: another engine's failure of the same step ended its call."""
        return self.status == 503 and self.body.get("error") == CUT_SHORT

    @property
    def code(self) -> str | int | None:
        """The error's code (the engine's own, or its status), None for an answer that succeeded."""
        error = self.body.get("error")
        return error.get("code") if isinstance(error, dict) else None

    @property
    def message(self) -> str:
        error = self.body.get("error")
        return error.get("message", str(error)) if isinstance(error, dict) else str(error or self.body)

    def as_json(self) -> dict:
        if self.ok:
            return {"engine": self.engine_id, "status": self.status, "result": self.body}
        return {"engine": self.engine_id, "status": self.status, "error": self.message}


def unix_client(socket_path: str) -> aiohttp.ClientSession:
    """A client over a Unix socket: an engine's, or (for a front worker) the control process's. No
    connection cap: the front may hold thousands of requests on one engine."""
    connector = aiohttp.UnixConnector(path=socket_path, limit=0)
    return aiohttp.ClientSession(
        base_url="http://engine",
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        auto_decompress=False,
    )


async def call_engine(
    record: EngineRecord,
    path: str,
    *,
    timeout_s: float,
    query: Any = None,
    body: dict | None = None,
    method: str = "POST",
) -> EngineReply:
    """Call one engine; a timeout or an unreachable engine is a reply too (504, 503). While the call
    runs, a probe of the engine that times out does not count against it (the call's own deadline
    judges it)."""
    if record.client is None:
        return EngineReply(record.engine_id, 503, {"error": f"engine is {record.state.value}"})
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        with record.answering_front(timeout_s):
            async with record.client.request(method, path, params=query, json=body, timeout=timeout) as r:
                payload = await r.json(content_type=None)
        return EngineReply(record.engine_id, r.status, payload if isinstance(payload, dict) else {"value": payload})
    except asyncio.TimeoutError:
        return EngineReply(record.engine_id, 504, {"error": f"{path} got no answer within {timeout_s:.0f}s"})
    except (aiohttp.ClientError, ValueError) as exc:
        return EngineReply(record.engine_id, 503, {"error": f"engine unreachable: {exc!r}"})


async def gather_until_failure(calls: list[tuple[EngineRecord, Awaitable[EngineReply]]]) -> list[EngineReply]:
    """Every engine's reply to one step of a collective, or, once one engine fails it, that
    failure and the others cut short (503): a broadcast that broke on one engine never
    completes on the rest, which would otherwise wait out the group's timeout."""
    tasks = [asyncio.ensure_future(call) for _, call in calls]
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(not task.result().ok for task in done):
            break
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [
        EngineReply(record.engine_id, 503, {"error": CUT_SHORT}) if task.cancelled() else task.result()
        for (record, _), task in zip(calls, tasks)
    ]


def failure(step: str, replies: list[EngineReply]) -> tuple[int, str] | None:
    """The status and message for a call that failed on some engines, or None if none failed.

    The status is the failed engines' common one, or 502 when they differ.
    """
    failed = [r for r in replies if not r.ok]
    if not failed:
        return None
    statuses = {r.status for r in failed}
    status = statuses.pop() if len(statuses) == 1 else 502
    message = f"{step} failed on {len(failed)} of {len(replies)} engine(s): " + "; ".join(
        f"engine {r.engine_id}: {r.message}" for r in failed
    )
    return status, message
