"""Admin-call parameters as typed objects, parsed from plain query strings and dicts.

vLLM's server takes admin parameters as query strings, so clients written for
``vllm serve`` send ``/pause?mode=keep``. The front parses them here (bad
input is a 400 before any engine is touched) and forwards the canonical
query to every engine, which parses it again with the same class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .errors import BadRequest

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


class WireError(BadRequest):
    """Bad admin input; the message says what is wrong and how to fix it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param=param)


def _one(query: Mapping[str, str], name: str, default: str) -> str:
    getall = getattr(query, "getall", None)
    values = getall(name, []) if getall else ([query[name]] if name in query else [])
    if len(values) > 1:
        raise WireError(f"query parameter {name!r} given {len(values)} times", name)
    return values[0] if values else default


def _choice(query: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = _one(query, name, default)
    if value not in allowed:
        raise WireError(f"{name} must be one of {', '.join(allowed)}; got {value!r}", name)
    return value


def _bool(query: Mapping[str, str], name: str, default: bool) -> bool:
    value = _one(query, name, "true" if default else "false").lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise WireError(f"{name} must be true or false; got {value!r}", name)


def _bool_str(value: bool) -> str:
    return "true" if value else "false"


def reject_body_params(body: Any, names: tuple[str, ...], path: str) -> None:
    """Refuse query parameters sent in a JSON body rather than silently ignoring them."""
    if isinstance(body, dict):
        misplaced = [n for n in names if n in body]
        if misplaced:
            example = "&".join(f"{n}={body[n]}" for n in misplaced)
            raise WireError(
                f"{', '.join(misplaced)} must be a query parameter, as in vLLM: POST {path}?{example}", misplaced[0]
            )


@attrs.frozen
class PauseParams:
    mode: str = "abort"
    clear_cache: bool = True
    QUERY_NAMES = ("mode", "clear_cache")

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> PauseParams:
        return cls(_choice(query, "mode", "abort", PAUSE_MODES), _bool(query, "clear_cache", True))

    def to_query(self) -> dict[str, str]:
        return {"mode": self.mode, "clear_cache": _bool_str(self.clear_cache)}


@attrs.frozen
class SleepParams:
    level: int = 1
    mode: str = "abort"
    QUERY_NAMES = ("level", "mode")

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> SleepParams:
        level = _choice(query, "level", "1", tuple(str(x) for x in SLEEP_LEVELS))
        return cls(int(level), _choice(query, "mode", "abort", PAUSE_MODES))

    def to_query(self) -> dict[str, str]:
        return {"level": str(self.level), "mode": self.mode}


@attrs.frozen
class WakeUpParams:
    # None wakes everything, as in vLLM.
    tags: tuple[str, ...] | None = None
    QUERY_NAMES = ("tags",)

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> WakeUpParams:
        getall = getattr(query, "getall", None)
        tags = tuple(getall("tags", [])) if getall else tuple(query.get("tags", ()))
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise WireError(f"unknown wake-up tag(s) {unknown}; known: {', '.join(WAKE_TAGS)}", "tags")
        return cls(tags or None)

    def to_query(self) -> list[tuple[str, str]]:
        return [("tags", t) for t in self.tags or ()]


@attrs.frozen
class ResetPrefixCacheParams:
    reset_running_requests: bool = False
    reset_external: bool = False
    QUERY_NAMES = ("reset_running_requests", "reset_external")

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ResetPrefixCacheParams:
        return cls(_bool(query, "reset_running_requests", False), _bool(query, "reset_external", False))

    def to_query(self) -> dict[str, str]:
        return {
            "reset_running_requests": _bool_str(self.reset_running_requests),
            "reset_external": _bool_str(self.reset_external),
        }


@attrs.frozen
class AbortParams:
    # None aborts every request in flight.
    request_ids: tuple[str, ...] | None = None

    @classmethod
    def from_body(cls, body: dict | None) -> AbortParams:
        ids = (body or {}).get("request_ids")
        if ids is None or ids == []:
            return cls(None)
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise WireError("request_ids must be a list of non-empty strings", "request_ids")
        return cls(tuple(ids))

    def to_body(self) -> dict:
        return {"request_ids": list(self.request_ids) if self.request_ids else None}
