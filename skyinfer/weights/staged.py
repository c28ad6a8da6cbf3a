"""The staged path of a weight update: every engine receives the push into staging copies while
it serves on, and the finish swaps them in, each engine stopping for the swap alone."""

from __future__ import annotations

import logging
import time

from ..devices import DEVICE_HEADROOM_BYTES, HOST_HEADROOM_BYTES, gpu_free_bytes, host_memory_available
from ..errors import STAGING_DOES_NOT_FIT
from ..fleet.engine_calls import EngineReply, call_engine, gather_until_failure
from ..fleet.state import EngineRecord
from ..transfer.protocol import DTYPE_SIZES, UpdateMetadata
from ..wire import KvRule
from .fleet import Fleet, SyncError
from .phases import Phase

__all__ = ("StagedPath",)

log = logging.getLogger("skyinfer.weights")

# On CPU a staging copy holds the push twice: the shadow's tensors in the served dtype, and the
# kernels packed from them (engine/targets.py ShadowTarget); an engine's tp workers each hold their
# shards, so an engine holds this many copies of the push in all, whatever its tp.
_CPU_COPIES = 2


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


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

    def fits(self, records: list[EngineRecord], meta: UpdateMetadata | None) -> None:
        """Refuse (409, with the figures) a staged push whose copies would not fit beside what the
        engines hold: ``meta`` the tensors of a chunk (or of the whole push, at its start), or None
        for a start without metadata, which may carry the whole checkpoint."""
        if meta is None and self.fleet.spec is None:
            return  # nothing to size it by yet: each chunk is checked as it comes
        elements = meta.elements() if meta is not None else self.fleet.spec.elements
        served = DTYPE_SIZES.get(records[0].model_dtype or "", 4)
        if records[0].devices.kind == "cpu":
            self._host_fits(_CPU_COPIES * elements * served * len(records), f"{_CPU_COPIES} copies per engine")
            return
        # A GPU worker stages on its GPU: an unquantized model in its own layout, every parameter at
        # once (its layers then processed there, as at start-up); a quantized one as pushed, whole
        # (every tp worker), or in pinned host memory where its GPU has no room (the engine decides so
        # for the whole push).
        quantized = self.fleet.serves_quantized()
        if not quantized and self.fleet.spec is not None:
            per_worker = self.fleet.spec.elements * served
        else:
            per_worker = meta.total_bytes() if meta is not None else elements * served
        first_gpus = [group[0] for r in records for group in r.devices.worker_ids]
        try:
            free_bytes = gpu_free_bytes(tuple(first_gpus))
        except Exception as exc:  # NVML unavailable: each worker still checks its own GPU and the host
            log.warning("staged push: no GPU memory figures from NVML (%s): the engines place their copies", exc)
            free_bytes = []
        spilled = sum(free - per_worker <= DEVICE_HEADROOM_BYTES for free in free_bytes)
        if spilled and not quantized:
            raise SyncError(
                409,
                f"a staged push needs {_gib(per_worker)} of GPU memory per worker for its staging copy, and"
                f" {spilled} worker(s) have no room (less {_gib(DEVICE_HEADROOM_BYTES)} kept free): push without staged",
                code=STAGING_DOES_NOT_FIT,
            )
        if spilled:
            self._host_fits(per_worker * spilled, f"pinned, for {spilled} worker(s) whose GPU has no room")
        current = self.fleet.update.current
        current.staging_bytes = max(current.staging_bytes, per_worker)

    @staticmethod
    def _host_fits(needed: int, what: str) -> None:
        available = host_memory_available()
        if needed > available - HOST_HEADROOM_BYTES:
            raise SyncError(
                409,
                f"a staged push needs {_gib(needed)} of host memory for its staging copies ({what}), but the host"
                f" has {_gib(available)} available (less {_gib(HOST_HEADROOM_BYTES)} kept free): push without"
                " staged",
                code=STAGING_DOES_NOT_FIT,
            )

    async def receive(
        self, records: list[EngineRecord], update_info: dict, meta: UpdateMetadata
    ) -> tuple[list[EngineReply], dict]:
        """Every engine receives a chunk into its staging copy, while it serves on."""
        update = self.fleet.update
        # An engine whose process was replaced since it staged the update's first chunks holds no
        # copy: it takes no more of the update (its peers' swap goes on, and it catches up after).
        records = [r for r in records if update.current.stagers.get(r.engine_id, r.pid) == r.pid]
        if not records:
            raise SyncError(409, "every engine restarted since the staged push began: start it again")
        self.fits(records, meta)
        update.stage(meta.names)
        update.current.copies_held = True
        nbytes = meta.total_bytes()
        workers = self.fleet.transport.workers_per_engine
        for record in records:
            held = (record.staging or {}).get("bytes", 0)
            expected = held + nbytes * workers[record.engine_id]
            record.staging = {"state": "receiving", "bytes": held, "bytes_expected": expected}
        # A GPU engine places its copy for the whole push at the first chunk.
        body = {"update_info": update_info, "update_nbytes": max(nbytes, update.current.staging_bytes)}
        query = {"timeout_s": self.fleet.timeout_s}
        timeout_s = self.fleet.timeout_s + 30
        replies = await gather_until_failure(
            [(r, call_engine(r, "/stage_weights", timeout_s=timeout_s, query=query, body=body)) for r in records]
        )
        for index, (record, reply) in enumerate(zip(records, replies)):
            record.staging = {"state": "staged", **_staged_copy(reply)} if reply.ok else None
            if reply.ok:
                update.current.stagers[record.engine_id] = record.pid
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

    def holders(self) -> tuple[list[EngineRecord], list[EngineRecord]]:
        """The engines whose process holds its staging copy of the update (they swap it in), and
        those of the fleet that hold none: restarted since they staged it, or restarting."""
        stagers = self.fleet.update.current.stagers
        members = self.fleet.registry.members()
        holding = [r for r in members if r.up and stagers.get(r.engine_id) == r.pid]
        return holding, [r for r in members if all(r is not h for h in holding)]

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
        installed = sorted({reply.body["installed"] for reply in replies if reply.ok and "installed" in reply.body})
        return replies, {"swap_seconds": round(time.monotonic() - started, 4), "installed": ", ".join(installed)}

    async def drop(self, records: list[EngineRecord]) -> list[EngineReply]:
        """Every engine throws its staging copy away (the update ended without its swap)."""
        replies = await self.fleet.call_all(records, "/drop_staged")
        for record in records:
            record.staging = None
        self.fleet.update.current.copies_held = False
        return replies
