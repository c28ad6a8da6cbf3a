"""Peer catch-up: an engine behind the fleet's weights copies them from a healthy peer engine, not
from the trainer or the disk, while the other engines serve on.

When: an engine process that comes up (a crash restart, an operator's restart, a retired engine
rejoining) while the fleet serves a pushed version loaded the checkpoint on disk; ``Bringup``
holds it out as stale and schedules a catch-up once it counts as up (``after_restart``), after
the weight update in progress if any (and again after a push that made it give way but did not
bring the engine in). An operator may ask for one for any stale engine: ``POST
/engines/{engine_id}/catch_up``.

How, on the one host every engine of a server shares:

1. The source: an engine that serves (up, not stale, its weights awake) the fleet's version, of the
   target's (tp, pp), the least loaded of them. None: the target stays stale until a push.
2. Export, off the fleet's lock: each of the source's workers writes the tensors it computes with
   (vLLM's own layout: fused, sharded, quantized as it holds them) into a shared-memory file of its
   own, ``/dev/shm/skyinfer-<token>-catchup-<id>-rank<r>``, and answers vLLM's checksums of them.
3. Import, under the fleet's lock, unless a weight update began meanwhile: pushes win (the push
   covers the engine) and a catch-up holds a push back for no longer than its import and its
   verification. Each of the
   target's workers checks the file against its own tensors (names, dtypes, shapes: else it
   touches nothing) and copies it in place; the engine's prefix cache is dropped.
4. Verification, under the lock: vLLM's checksums of the target must be the source's (and the
   fleet's, where the engines were seen to agree on some). Only then does it take the fleet's label
   and serve. Any failure leaves it stale, its reason saying which step failed.

The files go when the catch-up ends, however it ends; their names begin with this server's own
prefix, so a catch-up also removes what an earlier one could not (catch-ups run one at a time: a
model's copy in ``/dev/shm`` at most). ``GET /engines`` shows a catch-up under way in the target's
stale reason ("catching up with VERSION from engine M").
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING

from aiohttp import web

from ..errors import ApiError, json_response
from ..fleet.engine_calls import EngineReply, call_engine
from ..fleet.registry import EngineRegistry
from ..fleet.state import EngineRecord
from ..transfer.protocol import new_server_token, remove_segments, segment_prefix
from .phases import Phase
from .verify import differing

if TYPE_CHECKING:
    from .sync import WeightSync

log = logging.getLogger("skyinfer.catchup")

# While an engine that came back waits for the weight update in progress to end (which may bring it in).
_UPDATE_POLL_S = 0.5
# Catch-ups an engine that came back tries, each after a push that made the last one give way and
# did not bring the engine in (it was abandoned before any engine was touched, say).
_TRIES = 3


class CatchUpRefused(ApiError):
    """Nothing was done: the engine needs no catch-up, cannot have one now, or no peer can give it."""

    status = 409


class NoSource(CatchUpRefused):
    """No peer engine serves the fleet's weights at the target's size."""


class OutOfReach(CatchUpRefused):
    """The engines keep their weights where no copy from a peer reaches them."""


class PushArrived(CatchUpRefused):
    """A weight update began during the catch-up, which gave way to it."""


class CatchUpFailed(ApiError):
    """A step failed on an engine; the target stays stale."""

    status = 502


class _Abandoned(Exception):
    """Something that changes the fleet's weights happened during the catch-up: it gives way."""

    def __init__(self, why: str, pushed: bool = False):
        super().__init__(why)
        self.pushed = pushed


def restarted_reason(version: str) -> str:
    """Why a new process that loaded the checkpoint on disk is stale, before its catch-up."""
    return f"it restarted from the checkpoint on disk; the fleet serves {version}: push to bring it in"


def _pushed_reason(source: int) -> str:
    return f"a push arrived during its catch-up from engine {source}; the push covers it"


# vLLM's CPU kernels for quantized layers (int8 W8A8: oneDNN) pack the weights into themselves and
# drop the parameters: what a peer can export is the rest, and would serve old weights under the new label.
_PACKED_IN_KERNEL = (
    "its model is quantized on CPU, whose int8 kernels keep the weights in a form of their own (inside"
    " vLLM's oneDNN handlers; packed for SGLang's AMX kernel on cores with AMX), which a copy of a peer's"
    " parameters is not known to carry"
)


def _no_source(record: EngineRecord, version: str) -> str:
    return f"no healthy engine holds {version} (of its size, {record.parallel}) to catch up from"


class CatchUp:
    def __init__(self, registry: EngineRegistry, sync: WeightSync, timeout_s: float):
        self.registry = registry
        self.sync = sync
        self.timeout_s = timeout_s
        # Every catch-up file of this server begins so (and nobody else's).
        self.prefix = segment_prefix(new_server_token()) + "catchup-"
        # One copy of a model in /dev/shm at a time.
        self._one_at_a_time = asyncio.Lock()
        # Engines with a catch-up asked for or under way: their source, once chosen.
        self._catching_up: dict[int, int | None] = {}
        # Catch-ups scheduled by bring-up: the loop holds tasks only weakly.
        self._scheduled: set[asyncio.Task] = set()

    # -- when ----------------------------------------------------------------------------------
    def after_restart(self, record: EngineRecord) -> None:
        """An engine is behind the fleet's weights, under the fleet's lock: a new process joined
        (bringup.py), or a staged swap left it behind (push.py). Catch it up beside the caller,
        once no weight update is in progress."""
        task = asyncio.create_task(self._after_restart(record, record.pid))
        self._scheduled.add(task)
        task.add_done_callback(self._scheduled.discard)

    async def _after_restart(self, record: EngineRecord, pid: int | None) -> None:
        for _ in range(_TRIES):
            # A push under way covers the engine, or leaves it as it is: look again once it is over.
            while self.sync.update.phase is not Phase.IDLE:
                await asyncio.sleep(_UPDATE_POLL_S)
            if record.pid != pid or not record.up or record.stale is None:
                return  # gone since, or a push brought it in
            try:
                await self.catch_up(record)
                return
            except PushArrived as exc:
                log.info("%s: once that push is over, it looks again", exc)
                continue
            except NoSource as exc:
                self._only_a_push(record, _no_source(record, self.registry.fleet_weight_version), exc)
            except OutOfReach as exc:
                self._only_a_push(record, _PACKED_IN_KERNEL, exc)
            except ApiError as exc:
                log.warning("%s", exc)
            return

    def _only_a_push(self, record: EngineRecord, why: str, exc: CatchUpRefused) -> None:
        """No peer can give it the fleet's weights (``why``): only a push brings it in; its reason says so."""
        fleet = self.registry.fleet_weight_version
        if fleet is not None and record.up and record.stale == restarted_reason(fleet):
            self.registry.set_stale(record, f"it restarted from the checkpoint on disk; {why}: push to bring it in")
        log.warning("%s", exc)

    # -- who ---------------------------------------------------------------------------------
    def _refusal(self, record: EngineRecord) -> str | None:
        """Why ``record`` cannot catch up now, or None."""
        if not record.up:
            return f"it is {record.state.value}"
        if record.stale is None:
            return "it is not stale: it serves the fleet's weights"
        if self.sync.update.phase is not Phase.IDLE:
            return f"a weight update is in progress ({self.sync.update.phase.value}); it brings the engine in"
        if record.mid_update:
            return "it is receiving a weight update"
        if not record.residency.weights_awake:
            return "its weights are asleep; POST /wake_up?tags=weights first"
        return None

    def _sources(self, record: EngineRecord) -> list[EngineRecord]:
        """The engines ``record`` may copy from, least loaded first."""
        fleet = self.registry.fleet_weight_version
        return sorted(
            (
                r
                for r in self.registry.serving()
                if r is not record
                and r.parallel == record.parallel
                and not r.mid_update
                and r.residency.weights_awake
                # Before any push, every engine that serves holds the checkpoint on disk.
                and (fleet is None or r.weight_version == fleet)
            ),
            key=lambda r: (r.in_flight_count, r.engine_id),
        )

    # -- how -----------------------------------------------------------------------------------
    async def catch_up(self, record: EngineRecord) -> dict:
        """Copy the fleet's weights into stale ``record`` from a peer and verify them; what was done.
        Raises CatchUpRefused (nothing was done) or CatchUpFailed (it stays stale)."""
        if record.engine_id in self._catching_up:
            source = self._catching_up[record.engine_id]
            self._refuse_if(record, "it is already catching up" + ("" if source is None else f" from engine {source}"))
        self._refuse_if(record, self._refusal(record))
        if record.devices.kind == "cpu" and self.sync.quantization() is not None:
            raise OutOfReach(f"engine {record.engine_id} cannot catch up: {_PACKED_IN_KERNEL}; a push brings it in")
        self._catching_up[record.engine_id] = None
        try:
            async with self._one_at_a_time:
                self._refuse_if(record, self._refusal(record))  # things moved while it waited
                sources = self._sources(record)
                if not sources:
                    version = self.registry.fleet_weight_version or "the checkpoint on disk"
                    raise NoSource(f"engine {record.engine_id} cannot catch up: {_no_source(record, version)}")
                self._catching_up[record.engine_id] = sources[0].engine_id
                return await self._copy(record, sources[0])
        finally:
            del self._catching_up[record.engine_id]

    @staticmethod
    def _refuse_if(record: EngineRecord, refusal: str | None) -> None:
        if refusal is not None:
            raise CatchUpRefused(f"engine {record.engine_id} cannot catch up: {refusal}")

    async def _copy(self, record: EngineRecord, source: EngineRecord) -> dict:
        fleet = self.registry.fleet_weight_version
        label = source.weight_version
        began, pid, source_pid = self.sync.updates_begun, record.pid, source.pid
        catching_up = f"catching up with {label} from engine {source.engine_id}"
        self.registry.set_stale(record, catching_up)
        files = f"{self.prefix}{secrets.token_hex(6)}-"
        started = time.monotonic()
        log.info("engine %d: %s", record.engine_id, catching_up)

        def ours() -> bool:
            """The catch-up still owns the engine's state: same process, still stale for it."""
            return record.pid == pid and record.up and record.stale == catching_up

        def still(step: str) -> None:
            """Give way to whatever changed the fleet's weights (or the engines) since it began."""
            if self.sync.updates_begun != began or self.sync.update.phase is not Phase.IDLE:
                raise _Abandoned(_pushed_reason(source.engine_id), pushed=True)
            if not ours():
                raise _Abandoned(f"engine {record.engine_id} changed during its catch-up ({record.state.value})")
            if self.registry.fleet_weight_version != fleet:
                raise _StepFailed(step, f"the fleet's weights became {self.registry.fleet_weight_version}")
            if source.pid != source_pid or not source.serves or source.weight_version != label:
                raise _StepFailed(step, f"engine {source.engine_id} stopped serving {label} ({source.state.value})")
            if not source.residency.weights_awake:
                # Its weights may have been released while it wrote them (a sleep: GPU memory).
                raise _StepFailed(step, f"engine {source.engine_id} put its weights to sleep")
            if not record.residency.weights_awake or record.mid_update:
                raise _StepFailed(step, f"engine {record.engine_id} put its weights to sleep")

        try:
            remove_segments(self.prefix)  # what an earlier catch-up could not remove
            exported = await self._call(source, "/export_weights", "exporting its weights", {"prefix": files})
            still("exporting its weights")
            expected = exported.body["checksums"]
            agreed = self.sync.agreed_checksums()
            if agreed is not None and (off := differing(expected, agreed)):
                raise _StepFailed("exporting its weights", f"they differ from the fleet's in {len(off)} tensor(s)")
            async with self.registry.lock:
                # A push that began while the files were written has the fleet's lock first, or
                # changed what it checks here: the catch-up then gives way.
                still("importing")
                imported = await self._call(record, "/import_weights", "importing them", {"prefix": files})
                held = await self._call(record, "/weight_checker", "checking them", {"action": "checksum"})
                off = differing(held.body["checksums"], expected)
                if off:
                    shown = ", ".join(off[:3]) + (", ..." if len(off) > 3 else "")
                    raise _StepFailed(
                        "verifying them",
                        f"its weights differ from engine {source.engine_id}'s in {len(off)} tensor(s) after"
                        f" the import ({shown})",
                    )
                await self._call(record, "/update_weight_version", "taking their label", {"new_version": label})
                if not ours():
                    raise _Abandoned(f"engine {record.engine_id} changed during its catch-up ({record.state.value})")
                record.weight_version = label
                record.delta_base = None  # its workers hold no base for a delta: its next push comes whole
                self.registry.set_stale(record, None)
        except _Abandoned as exc:
            if ours():
                self.registry.set_stale(record, str(exc))
            log.warning("engine %d: catch-up from engine %d abandoned: %s", record.engine_id, source.engine_id, exc)
            refused = PushArrived if exc.pushed else CatchUpRefused
            raise refused(f"engine {record.engine_id}'s catch-up was abandoned: {exc}") from None
        except _StepFailed as exc:
            reason = f"catch-up from engine {source.engine_id} failed at {exc}; push to bring it in"
            if ours():
                self.registry.set_stale(record, reason)
            log.error("engine %d: %s", record.engine_id, reason)
            raise CatchUpFailed(f"engine {record.engine_id}: {reason}") from None
        finally:
            if removed := remove_segments(files):
                log.debug("removed catch-up files %s", removed)
        seconds = time.monotonic() - started
        log.info(
            "engine %d caught up with %s from engine %d in %.2f s (%d tensors, %.0f MB)",
            record.engine_id,
            label,
            source.engine_id,
            seconds,
            imported.body["tensors"],
            exported.body["bytes"] / 1e6,
        )
        return {"engine": record.engine_id, "source": source.engine_id, "weight_version": label, "seconds": seconds}

    async def _call(self, record: EngineRecord, path: str, step: str, body: dict) -> EngineReply:
        reply = await call_engine(record, path, timeout_s=self.timeout_s, body=body)
        if not reply.ok:
            raise _StepFailed(step, f"engine {record.engine_id}: {reply.message}")
        return reply

    def close(self) -> None:
        """The service stops: catch-ups end, and their files go."""
        for task in self._scheduled:
            task.cancel()
        remove_segments(self.prefix)


class _StepFailed(Exception):
    def __init__(self, step: str, why: str):
        super().__init__(f"{step}: {why}")


CATCH_UP = web.AppKey("catch_up", CatchUp)


async def _catch_up_engine(request: web.Request) -> web.Response:
    """``POST /engines/{engine_id}/catch_up``: a stale engine copies the fleet's weights from a
    healthy peer engine of its size, verified by vLLM's checksums before it serves again. 409 when
    it is not stale, a weight update is in progress, no peer holds the fleet's weights, or no copy
    reaches them (a quantized model on CPU: its kernels hold the weights); 502 when
    a step failed (the engine stays stale, its reason saying which).

    If its caller leaves: the catch-up runs to its end; ``GET /engines`` shows where it stands."""
    catch_up = request.app[CATCH_UP]
    records = catch_up.registry.records
    engine_id = request.match_info["engine_id"]
    if not engine_id.isdigit() or int(engine_id) >= len(records):
        raise ApiError(f"no engine {engine_id!r}: engines are 0 to {len(records) - 1}", status=404, param="engine_id")
    return json_response(await catch_up.catch_up(records[int(engine_id)]))


def add_catch_up_routes(app: web.Application) -> None:
    app.router.add_post("/engines/{engine_id}/catch_up", _catch_up_engine)
