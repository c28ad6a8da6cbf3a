"""The staged path of a weight update: every engine receives the push into staging copies while
it serves on, and the finish swaps them in, each engine stopping for the swap alone."""

from __future__ import annotations

import time

from ..engine_calls import EngineReply, call_engine, gather_until_failure
from ..errors import STAGING_DOES_NOT_FIT
from ..state import EngineRecord
from ..transfer.protocol import UpdateMetadata
from ..wire import KvRule
from .fleet import Fleet, SyncError
from .phases import Phase

__all__ = ("StagedPath", "host_memory_available")

# Host memory a staged push leaves free beside its staging copies.
_STAGING_HEADROOM_BYTES = 1 << 30


def host_memory_available() -> int:
    """The kernel's estimate of the memory new allocations can take without swapping (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _staged_copy(reply: EngineReply) -> dict:
    """What one engine's staging copy holds: bytes (all its workers), seconds, where."""
    return {key: reply.body[key] for key in ("bytes", "seconds", "place")}


class StagedPath:
    """Chunks go into every engine's staging copy (``/stage_weights``); the finish swaps the copies
    in (``/swap_staged``): the live weights are untouched until then, so an end before it costs
    nothing but dropping the copies."""

    receive_step = "staging the push"
    apply_step = "swapping in the staged push"

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def fits(self, records: list[EngineRecord], nbytes: int) -> None:
        """On CPU every worker keeps a whole copy of the push in host memory until the swap."""
        if self.fleet.registry.records[0].devices.kind != "cpu":
            return  # a GPU worker stages in device memory, or in pinned host memory if it has no room
        workers = sum(self.fleet.workers(records))
        needed = nbytes * workers
        available = host_memory_available()
        if needed > available - _STAGING_HEADROOM_BYTES:
            raise SyncError(
                409,
                f"a staged push of {nbytes / 2**30:.2f} GiB needs a staging copy per worker ({workers} workers:"
                f" {needed / 2**30:.2f} GiB), but the host has {available / 2**30:.2f} GiB available"
                f" (less {_STAGING_HEADROOM_BYTES >> 30} GiB kept free): push without staged",
                code=STAGING_DOES_NOT_FIT,
            )

    async def receive(
        self, records: list[EngineRecord], update_info: dict, meta: UpdateMetadata
    ) -> tuple[list[EngineReply], dict]:
        """Every engine receives a chunk into its staging copy, while it serves on."""
        update = self.fleet.update
        update.stage(meta.names)
        update.current.copies_held = True
        nbytes = meta.total_bytes()
        workers = self.fleet.transport.workers_per_engine
        for record in records:
            held = (record.staging or {}).get("bytes", 0)
            expected = held + nbytes * workers[record.engine_id]
            record.staging = {"state": "receiving", "bytes": held, "bytes_expected": expected}
        body = {"update_info": update_info, "update_nbytes": nbytes}
        query = {"timeout_s": self.fleet.timeout_s}
        timeout_s = self.fleet.timeout_s + 30
        replies = await gather_until_failure(
            [(r, call_engine(r, "/stage_weights", timeout_s=timeout_s, query=query, body=body)) for r in records]
        )
        for index, (record, reply) in enumerate(zip(records, replies)):
            record.staging = {"state": "staged", **_staged_copy(reply)} if reply.ok else None
            expected = len(update.received) * workers[record.engine_id]
            if reply.ok and reply.body["tensors"] != expected:
                # Never swap in a copy that lacks a tensor: the layers it misses would serve part new.
                error = f"engine holds {reply.body['tensors']} staged tensors, expected {expected}"
                replies[index] = EngineReply(record.engine_id, 500, {"error": error})
        if not all(reply.ok for reply in replies):
            return replies, {}
        copies = [_staged_copy(reply) for reply in replies]
        summary = {
            "bytes": sum(c["bytes"] for c in copies),
            "seconds": max(c["seconds"] for c in copies),
            "place": copies[0]["place"],
        }
        return replies, {"status": "staged", **summary}

    async def apply(self, records: list[EngineRecord], version: str, kv: KvRule) -> tuple[list[EngineReply], dict]:
        """One call per engine: the swap, the new version and the KV rule, handled by its EngineCore
        between two steps (engine/weights.py swap_staged). From here on its weights may be part new."""
        for record in records:
            record.mid_update = True
        self.fleet.update.step(Phase.RECEIVING)
        started = time.monotonic()
        replies = await self.fleet.call_all(records, "/swap_staged", body={"weight_version": version, "kv": kv})
        if all(reply.ok for reply in replies):
            self.fleet.update.current.copies_held = False  # a swap consumes them
        for record in records:
            record.staging = None
        return replies, {"swap_seconds": round(time.monotonic() - started, 4)}

    async def drop(self, records: list[EngineRecord]) -> list[EngineReply]:
        """Every engine throws its staging copy away (the update ended without its swap)."""
        replies = await self.fleet.call_all(records, "/drop_staged")
        for record in records:
            record.staging = None
        self.fleet.update.current.copies_held = False
        return replies
