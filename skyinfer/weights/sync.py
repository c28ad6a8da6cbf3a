"""The front's side of weight sync: checks, the update's phases, and driving every engine at once.

Routes and bodies follow vLLM 0.32's server. Nothing touches an engine's weights before the
update's metadata has been checked: ``/start_weight_update`` only opens a session here, and the
engines start theirs when the first checked ``/update_weights`` arrives. For the group transports
(gloo, nccl) every step is a collective with the trainer, so the front calls all engines
concurrently while the trainer broadcasts.

An update starts only on engines that cannot schedule a request on half-loaded layers: paused,
or asleep with their weights awake (a colocated push). Engines that are running are paused
(``keep``) for the push and resumed after it, so requests sent meanwhile wait in vLLM and run on
the new weights. An update that fails or is abandoned ends on every engine without a restart:
vLLM's layerwise reload is closed (layers that received nothing keep their old tensors), the
requests held there are aborted, and the engines serve nothing (stale) until a push of the whole
checkpoint. Only an engine that cannot even end the update is restarted; one that fails
``--max-push-failures`` pushes in a row by itself is retired. The update's phases, and the refusal
of what an abandoned update's trainer sends after it, are ``phases.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..engine_calls import EngineReply, call_engine, failure, gather_until_failure
from ..errors import STAGING_DOES_NOT_FIT, TRANSFER_GROUP_GONE, ApiError, admin_json_body, json_response
from ..metrics import ServiceMetrics
from ..state import APPLY, PAUSE_FOR_PUSH, EngineRecord, EngineRegistry, push_verdict
from ..transfer.protocol import UpdateMetadata
from ..wire import (
    Checksums,
    FinishRequest,
    InitRequest,
    KvRule,
    PauseParams,
    RelabelRequest,
    StartRequest,
    UpdateRequest,
    WeightCheckRequest,
    WireModel,
    takes,
)
from .checkpoint import CheckpointSpec
from .phases import Phase, UpdateMachine
from .transports import FrontTransport, InitPlan

if TYPE_CHECKING:
    from ..control import ControlPlane
    from ..supervisor import Supervisor
from .verify import Verdict, judge

log = logging.getLogger("skyinfer.weights")

# How a push pauses engines that are running: requests in flight are held, and their KV kept.
_PAUSE_FOR_PUSH = PauseParams(mode="keep", clear_cache=False).to_query()
ABORTED = (
    "a weight update was aborted while it received: its layers are part new; push again, or POST"
    " /reload_weights for the checkpoint on disk"
)
# vLLM's label for the weights an engine loaded at start-up (what a restarted engine serves).
CHECKPOINT_VERSION = "default"
# Host memory a staged push leaves free beside its staging copies.
_STAGING_HEADROOM_BYTES = 1 << 30


def _version(weight_version: str | None) -> str:
    return weight_version if weight_version is not None else f"update-{int(time.time())}"


def _staged_copy(reply: EngineReply) -> dict:
    """What one engine's staging copy holds: bytes (all its workers), seconds, where."""
    return {key: reply.body[key] for key in ("bytes", "seconds", "place")}


def host_memory_available() -> int:
    """The kernel's estimate of the memory new allocations can take without swapping (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _partly_covered(version: str, missing: list[str]) -> str:
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    return (
        f"its weights were not the fleet's, and the push of {version} carried only part of the checkpoint"
        f" ({len(missing)} tensor(s) left out: {shown}): push all of them before it serves"
    )


class SyncError(ApiError):
    """A weight-sync call refused or failed; ``engines``: each engine's own answer."""

    def __init__(self, status: int, message: str, engines: list[dict] | None = None, code: str | None = None):
        super().__init__(message, status=status, details=None if engines is None else {"engines": engines}, code=code)


class WeightSync:
    def __init__(
        self,
        registry: EngineRegistry,
        transport: FrontTransport,
        model: str,
        timeout_s: float,
        supervisor: Supervisor,
        control: ControlPlane,
        metrics: ServiceMetrics,
        max_push_failures: int,
    ):
        self.registry = registry
        self.transport = transport
        self.metrics = metrics
        # When the push now in progress began (its first transfer call).
        self._push_started: float | None = None
        self.timeout_s = timeout_s
        self._supervisor = supervisor
        self._control = control
        self._max_push_failures = max_push_failures
        self._spec = CheckpointSpec.read(model)
        self.update = UpdateMachine(metrics.set_update_phase)
        # The rendezvous an /init_weight_transfer waits for (its trainer listening): a newer init
        # supersedes it at once, since no engine has been asked anything yet.
        self._awaiting_trainer: asyncio.Task | None = None
        # Inits begun: the latest one's rendezvous is what the engines show.
        self._inits = 0
        # Engines this update paused itself (they were running): resumed when it ends.
        self._paused_for_push: list[EngineRecord] = []
        # A trainer silent this long between calls of an update has gone: the
        # update is aborted (the group's own timeout, from its init_info).
        self._silence_limit_s = timeout_s
        self._silence_timer: asyncio.TimerHandle | None = None
        self.last_update_s: float | None = None
        # A colocated transport's init_info, which an engine that restarts takes too (no rendezvous).
        self._colocated_init: dict | None = None
        # The checksums every engine held under a label, once a check saw them agree.
        self._agreed: tuple[str, Checksums] | None = None
        # An update the silence timer is ending.
        self._abandoning: asyncio.Task | None = None
        # Whether the open update is staged (its chunks go into staging copies; its finish swaps them in).
        self._staged = False
        # Updates that began touching engines (or a reload): a peer catch-up that sees this move
        # while it copies gives way to the push (catchup.py).
        self.updates_begun = 0

    @property
    def worker_count(self) -> int:
        """The inference side of the group (vLLM's ``/get_world_size``): the fleet's workers (a
        retired engine is out of it)."""
        return sum(self._workers(self.registry.members()))

    def _workers(self, records: list[EngineRecord]) -> tuple[int, ...]:
        return tuple(self.transport.workers_per_engine[r.engine_id] for r in records)

    def _engines(self) -> list[EngineRecord]:
        """Every engine of the fleet takes part in every transfer: the trainer's group spans them all."""
        members = self.registry.members()
        down = [r for r in members if not r.up]
        if down or not members:
            raise SyncError(
                409,
                "weight transfer needs every engine of the fleet: "
                + (", ".join(f"engine {r.engine_id} is {r.state.value}" for r in down) or "every engine is retired")
                + "; retry once it is up (GET /engines)",
            )
        return members

    # -- the update's phases -------------------------------------------------------------
    def trainer_arrived(self) -> None:
        """The trainer's silence (and the timer that would end the update) is over."""
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None

    def await_trainer(self) -> None:
        """A trainer's call is over: during an update, its next one is due within the silence limit."""
        self.trainer_arrived()
        if self.update.phase is not Phase.IDLE:
            self._silence_timer = asyncio.get_running_loop().call_later(self._silence_limit_s, self._trainer_silent)

    def _trainer_silent(self) -> None:
        self._silence_timer = None
        reason = (
            f"the trainer sent nothing for {self._silence_limit_s:.0f}s during a weight update"
            f" ({self.update.phase.value})"
        )
        log.error("%s: aborting it", reason)
        # Kept: the loop holds tasks only weakly.
        self._abandoning = asyncio.create_task(self._abandon(self.update.phase, reason))

    async def _abandon(self, phase: Phase, reason: str) -> None:
        async with self.registry.fleet_change():
            if self.update.phase is not phase or self._silence_timer is not None:
                return  # the trainer came back meanwhile, or the update ended
            await self._end_abandoned(reason)

    async def _end_abandoned(self, reason: str) -> None:
        """The server ends the update its trainer left: engines that began it abort it."""
        if self.update.phase is Phase.RECEIVING:
            await self._abort(reason)
            return
        if self.update.phase is Phase.STAGING:
            await self._drop_staged(self.registry.members())  # the live weights were never touched
        await self._end(abandoned_because=reason)  # no engine had begun it

    def _refuse_unless(self, *phases: Phase) -> None:
        self.update.refuse_unless(*phases, silence_limit_s=self._silence_limit_s)

    # -- init ------------------------------------------------------------------------------
    async def init(self, init_info: dict) -> dict:
        # Checked before waiting for the fleet: a bad body is refused at once.
        members = self.registry.members()
        plan = await self.transport.plan_init(init_info, self._workers(members))
        self._inits += 1
        this_init = self._inits
        try:
            return await self._init(init_info, members, plan)
        finally:
            if self._inits == this_init:  # a newer init shows its own rendezvous
                for record in self.registry.records:
                    record.rendezvous = None

    async def _init(self, init_info: dict, members: list[EngineRecord], plan: InitPlan) -> dict:
        # Until the trainer listens, no engine is asked anything: an init naming the wrong address,
        # or a trainer loading its model first, costs the engines nothing, and a newer init
        # (the trainer started over) supersedes this one at once.
        self._show_rendezvous(members, "waiting for the trainer", plan)
        await self._trainer_listening(plan)
        async with self.registry.fleet_change():
            if self.update.phase is not Phase.IDLE:
                # A trainer that sets up a transfer is a new one: the update the old one left is
                # abandoned rather than waited out (engines that had begun it are held out as stale).
                log.warning(
                    "a trainer set up a transfer during an update (%s): that update is abandoned",
                    self.update.phase.value,
                )
                await self._end_abandoned("a trainer set up a new transfer")
            self.update.start_over()
            records = self._engines()
            if records != members:  # an engine retired or rejoined meanwhile: its ranks move
                plan = await self.transport.plan_init(init_info, self._workers(records))
            # A transfer engine formed before is shut down first, even one whose group broke since:
            # vLLM's nccl backend would leak its communicator.
            await self._leave(records)
            for record in records:
                record.transfer_engine_open = True  # an init that fails may have built part of one
            self._show_rendezvous(records, "joining the trainer's group", plan)
            replies = await asyncio.gather(
                *(self._init_engine(r, info, plan.timeout_s) for r, info in zip(records, plan.engine_init_infos))
            )
            for record, reply in zip(records, replies):
                record.in_transfer_group = reply.ok
            self._silence_limit_s = plan.timeout_s
            self._colocated_init = None if self.transport.transport.group else plan.engine_init_infos[0]
            self.transport.update_ended()
        self._raise_if_failed("init_weight_transfer", replies)
        return {"status": "joined" if self.transport.transport.group else "ready", **plan.answer}

    @staticmethod
    def _show_rendezvous(records: list[EngineRecord], doing: str, plan: InitPlan) -> None:
        where = "" if plan.trainer_address is None else " at {}:{}".format(*plan.trainer_address)
        for record in records:
            record.rendezvous = doing + where

    async def _trainer_listening(self, plan: InitPlan) -> None:
        if self._awaiting_trainer is not None:
            self._awaiting_trainer.cancel()
        waiting = self._awaiting_trainer = asyncio.ensure_future(self.transport.trainer_listening(plan))
        try:
            await asyncio.wait({waiting})
        finally:
            if self._awaiting_trainer is waiting:
                self._awaiting_trainer = None
            waiting.cancel()  # this call itself was cancelled
        if waiting.cancelled():
            raise SyncError(409, "a newer /init_weight_transfer superseded this one before its trainer was reached")
        waiting.result()

    @staticmethod
    async def _init_engine(record: EngineRecord, init_info: dict, timeout_s: float) -> EngineReply:
        return await call_engine(
            record,
            "/init_weight_transfer",
            timeout_s=timeout_s + 30,
            query={"timeout_s": str(timeout_s)},
            body={"init_info": init_info},
        )

    async def rejoin(self, record: EngineRecord) -> None:
        """An engine process being brought up takes a colocated transport's settings (there is no
        group to join), so that the next push reaches it like the others (bringup.py)."""
        if self._colocated_init is None:
            return
        reply = await self._init_engine(record, self._colocated_init, self.timeout_s)
        if not reply.ok:
            raise RuntimeError(f"setting up the weight transfer failed: {reply.message}")
        record.in_transfer_group = True

    # -- one update ------------------------------------------------------------------------
    def check_metadata(self, update_info: dict, *, carries_data: bool = True) -> UpdateMetadata:
        """Refuse (400) metadata that is malformed or does not fit the served checkpoint, before any byte moves."""
        meta = self.transport.parse_update(update_info, carries_data=carries_data)
        if self._spec is not None:
            try:
                self._spec.check(meta)
            except ValueError as exc:
                raise SyncError(400, f"update_info rejected before any transfer: {exc}") from None
        return meta

    def _check_group(self, records: list[EngineRecord]) -> None:
        missing = [r.engine_id for r in records if not r.in_transfer_group]
        if missing:
            raise SyncError(
                409,
                f"engines {missing} are not in the trainer's group; POST /init_weight_transfer first",
                code=TRANSFER_GROUP_GONE,
            )

    def transfer_members(self) -> list[EngineRecord]:
        """The engines, for a transfer outside a weight update (an adapter push): every one up
        and in the trainer's group."""
        self._refuse_unless(Phase.IDLE)
        if not self.transport.transport.group:
            raise SyncError(
                400,
                "adapter pushes travel over a transfer group; a colocated server loads adapters from a path"
                " (POST /v1/load_lora_adapter)",
            )
        records = self._engines()
        self._check_group(records)
        return records

    def group_broken(self, reason: str) -> None:
        """A transfer that touched no weights failed: the group is gone, the engines serve on."""
        log.warning("weight-transfer group broken: %s; the trainer must POST /init_weight_transfer again", reason)
        self.metrics.push_failures.inc()
        for record in self.registry.records:
            record.in_transfer_group = False

    def start(self, update_info: dict | None, staged: bool = False) -> dict:
        self._refuse_unless(Phase.IDLE)
        records = self._engines()
        self._check_group(records)
        if update_info is not None:
            meta = self.check_metadata(update_info, carries_data=False)
            if staged:
                self._refuse_unless_staging_fits(records, meta.total_bytes())
        self._push_started = time.monotonic()
        self.update.open()
        self._staged = staged
        return {"status": "started", "staged": staged}

    async def _receive_staged(
        self,
        records: list[EngineRecord],
        update_info: dict,
        meta: UpdateMetadata,
        one_shot: bool,
        weight_version: str | None,
        kv: KvRule,
    ) -> dict:
        """A chunk of a staged update: every engine receives it into its staging copy while it
        serves on (a one-call push is then swapped in at once). Called with the registry's lock held."""
        nbytes = meta.total_bytes()
        if one_shot:
            self._refuse_unless_staging_fits(records, nbytes)
        self.update.stage(meta.names)
        staged = await self._stage(records, update_info, nbytes)
        if not one_shot:
            return {"status": "staged", **staged}
        answer = await self._swap_staged(records, _version(weight_version), False, None, kv)
        return {**answer, "staged": staged}

    async def _swap_staged(
        self, records: list[EngineRecord], version: str, verify: bool, expected: Checksums | None, kv: KvRule
    ) -> dict:
        """Swap every engine's staging copy into its live weights, each stopping for the swap alone,
        and finish at ``version``: all engines at the same boundary. A failure from here on is a failed
        push's (``_settle``). Called with the registry's lock held."""
        swap_started = time.monotonic()
        swapped = False
        try:
            refused = [(r, v) for r in records if (v := push_verdict(r)) not in (APPLY, PAUSE_FOR_PUSH)]
            if refused:
                reason = "cannot swap the staged push in: " + "; ".join(
                    f"engine {r.engine_id}: {v}" for r, v in refused
                )
                await self._end(abandoned_because=reason)  # no live weight was touched
                raise SyncError(409, reason)
            self.updates_begun += 1
            for record in records:
                record.receiving = True  # from here on, its weights may be part new
            self.update.step(Phase.RECEIVING)
            # One call per engine: the swap, the new version and the KV rule, handled by its EngineCore
            # between two steps (engine/weights.py swap_staged).
            body = {"weight_version": version, "kv": kv}
            replies = await asyncio.gather(
                *(call_engine(r, "/swap_staged", timeout_s=self.timeout_s, body=body) for r in records)
            )
            await self._settle("swapping in the staged push", records, replies)
            swapped = True
            answer = await self._finished(records, version, verify, expected, kv, replies)
        finally:
            if not swapped:  # no staging copy outlives the update (a swap leaves none)
                await self._drop_staged(records)
            for record in records:
                record.staging = None
        self.last_update_s = time.monotonic() - swap_started
        return {**answer, "swap_seconds": round(self.last_update_s, 4)}

    def _refuse_unless_staging_fits(self, records: list[EngineRecord], nbytes: int) -> None:
        """On CPU every worker keeps a whole copy of the push in host memory until the swap."""
        if self.registry.records[0].devices.kind != "cpu":
            return  # a GPU worker stages in device memory, or in pinned host memory if it has no room
        workers = sum(self._workers(records))
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

    async def _stage(self, records: list[EngineRecord], update_info: dict, nbytes: int) -> dict:
        """Every engine receives a chunk into its staging copy, while it serves on."""
        for record in records:
            expected = nbytes * self.transport.workers_per_engine[record.engine_id]
            held = (record.staging or {}).get("bytes", 0)
            record.staging = {"state": "receiving", "bytes": held, "bytes_expected": held + expected}
        body = {"update_info": update_info, "update_nbytes": nbytes}
        query = {"timeout_s": self.timeout_s}
        replies = await gather_until_failure(
            [
                (r, call_engine(r, "/stage_weights", timeout_s=self.timeout_s + 30, query=query, body=body))
                for r in records
            ]
        )
        for index, (record, reply) in enumerate(zip(records, replies)):
            record.staging = {"state": "staged", **_staged_copy(reply)} if reply.ok else None
            expected = len(self.update.received) * self.transport.workers_per_engine[record.engine_id]
            if reply.ok and reply.body["tensors"] != expected:
                # Never swap in a copy that lacks a tensor: the layers it misses would serve part new.
                error = f"engine holds {reply.body['tensors']} staged tensors, expected {expected}"
                replies[index] = EngineReply(record.engine_id, 500, {"error": error})
        failed = failure("staging the push", replies)
        if failed is not None:
            reason = failed[1]
            await self._drop_staged(records)
            if self.transport.transport.group:
                self.group_broken(reason)
            else:
                self.metrics.push_failures.inc()
            self._push_started = None
            log.error("staged push dropped: %s; the engines serve their weights as before", reason)
            await self._end(abandoned_because=reason)
            raise SyncError(*failed, [rep.as_json() for rep in replies])
        copies = [_staged_copy(reply) for reply in replies]
        return {
            "bytes": sum(c["bytes"] for c in copies),
            "seconds": max(c["seconds"] for c in copies),
            "place": copies[0]["place"],
        }

    async def _drop_staged(self, records: list[EngineRecord]) -> None:
        """Every engine throws its staging copy away; one that cannot is restarted (a copy left
        behind holds a push's bytes for ever)."""
        replies = await asyncio.gather(*(call_engine(r, "/drop_staged", timeout_s=self.timeout_s) for r in records))
        for record, reply in zip(records, replies):
            record.staging = None
            if not reply.ok and record.up:
                self._supervisor.restart_in_background(
                    record, f"it could not drop a staged push's copy: {reply.message}"
                )

    async def receive(
        self, update_info: dict, weight_version: str | None, kv: KvRule = "recompute", staged: bool = False
    ) -> dict:
        """Check, then receive on every engine (into staging copies, for a staged update). Without
        an open session: start and finish too."""
        meta = self.check_metadata(update_info)
        try:
            # A chunk of an update the server abandoned is no update of its own.
            self.update.refuse_if_abandoned()
            one_shot = self.update.phase is Phase.IDLE
            if not one_shot and (kv != "recompute" or staged):
                raise SyncError(
                    400,
                    "kv and staged belong to a one-call push: for an open update, staged goes to its"
                    " /start_weight_update and kv to its /finish_weight_update",
                )
            async with self.registry.fleet_change():
                self.update.refuse_if_abandoned()
                self._refuse_unless(Phase.IDLE, Phase.STARTED, Phase.STAGING, Phase.RECEIVING)
                records = self._engines()
                self._check_group(records)
                started = time.monotonic()
                if self._push_started is None:
                    self._push_started = started
                if one_shot:
                    self._staged = staged
                if self._staged:
                    return await self._receive_staged(records, update_info, meta, one_shot, weight_version, kv)
                if self.update.phase is not Phase.RECEIVING:
                    await self._begin(records)
                self.update.receive(meta.names)
                replies = await gather_until_failure(
                    [
                        (
                            r,
                            call_engine(
                                r, "/update_weights", timeout_s=self.timeout_s, body={"update_info": update_info}
                            ),
                        )
                        for r in records
                    ]
                )
                await self._settle("update_weights", records, replies, collective=True)
                self.last_update_s = time.monotonic() - started
        finally:
            self.transport.update_sent(meta)
        if one_shot:
            return await self.finish(weight_version, kv=kv)
        return {"status": "updated", "engines": [rep.as_json() for rep in replies]}

    async def _begin(self, records: list[EngineRecord]) -> None:
        """Open the update on every engine: engines that are running are paused for it first;
        one whose weights are asleep refuses it (nothing is touched)."""
        self.updates_begun += 1
        verdicts = [(r, push_verdict(r)) for r in records]
        refused = [(r, v) for r, v in verdicts if v not in (APPLY, PAUSE_FOR_PUSH)]
        if refused:
            raise SyncError(
                409, "cannot start a weight update: " + "; ".join(f"engine {r.engine_id}: {v}" for r, v in refused)
            )
        running = [r for r, v in verdicts if v == PAUSE_FOR_PUSH]
        paused = await asyncio.gather(
            *(call_engine(r, "/pause", timeout_s=self.timeout_s, query=_PAUSE_FOR_PUSH) for r in running)
        )
        for record, reply in zip(running, paused):
            if reply.ok:
                self.registry.record_call(record, "pause")
            elif record.up:
                # It may have paused all the same: asked, so that the update's end resumes it if so.
                await self._control.reread(record, "pause")
            if record.paused:
                self._paused_for_push.append(record)
        self.update.step(Phase.RECEIVING)  # from here on, weights may be part new
        await self._settle("pausing engines for the push", running, paused)
        replies = await asyncio.gather(
            *(call_engine(r, "/start_weight_update", timeout_s=self.timeout_s) for r in records)
        )
        for record, reply in zip(records, replies):
            record.receiving = reply.ok or reply.status >= 500  # one that did not answer may have started
        await self._settle("start_weight_update", records, replies)

    async def finish(
        self,
        weight_version: str | None,
        verify: bool = False,
        expected: Checksums | None = None,
        kv: KvRule = "recompute",
    ) -> dict:
        """Every engine finishes (a staged update: swaps its staging copy in first); with
        ``verify``, each is then held to ``expected`` (or to the others): one that differs is held
        out as stale and the call fails."""
        self._refuse_unless(Phase.RECEIVING, Phase.STAGING)
        async with self.registry.fleet_change():
            self._refuse_unless(Phase.RECEIVING, Phase.STAGING)
            if self.update.phase is Phase.STAGING:
                return await self._swap_staged(self._engines(), _version(weight_version), verify, expected, kv)
            return await self._finish(self._engines(), _version(weight_version), verify, expected, kv)

    async def _finish(
        self,
        records: list[EngineRecord],
        version: str,
        verify: bool,
        expected: Checksums | None,
        kv: KvRule = "recompute",
    ) -> dict:
        """Finish the update on every engine. Called with the registry's lock held."""
        body = {"weight_version": version, "kv": kv}
        replies = await asyncio.gather(
            *(call_engine(r, "/finish_weight_update", timeout_s=self.timeout_s, body=body) for r in records)
        )
        await self._settle("finish_weight_update", records, replies)
        return await self._finished(records, version, verify, expected, kv, replies)

    async def _finished(
        self,
        records: list[EngineRecord],
        version: str,
        verify: bool,
        expected: Checksums | None,
        kv: KvRule,
        replies: list[EngineReply],
    ) -> dict:
        """Every engine serves ``version`` now: the fleet's account of it, and the update's end."""
        self.registry.fleet_weight_version = version
        if self._push_started is not None:
            self.metrics.push_seconds.observe(time.monotonic() - self._push_started)
            self._push_started = None
        missing = self._spec.missing(self.update.received) if self._spec is not None else []
        for record in records:
            record.weight_version = version
            record.receiving = False
            record.push_failures = 0
            if not record.up or record.stale is None:
                continue
            if missing:
                # Its weights were not the fleet's before (discarded by a sleep, mixed by an abort,
                # another version): only a push of every tensor makes them so.
                self.registry.set_stale(record, _partly_covered(version, missing))
            else:
                self.registry.set_stale(record, None)
        self._agreed = None
        try:
            if verify:
                verdict, checked = await self._verify(records, expected)
                self._raise_unless_verified(verdict, checked)
        finally:
            await self._end()
        log.info("weight version %s on %d engine(s)%s", version, len(records), ", verified" if verify else "")
        answer = {
            "status": "finished",
            "weight_version": version,
            "kv": kv,
            "engines": [rep.as_json() for rep in replies],
        }
        return {**answer, "verified": True} if verify else answer

    async def reload(self) -> dict:
        """Every engine of the fleet loads the checkpoint on disk again, in place, as a push would
        (engines that run are paused for it; no restart): for stale engines whose trainer is not
        coming back. The fleet then serves the checkpoint under vLLM's own label for it."""
        self._refuse_unless(Phase.IDLE)
        async with self.registry.fleet_change():
            self._refuse_unless(Phase.IDLE)
            self.update.start_over()
            records = self._engines()
            self._push_started = time.monotonic()
            await self._begin(records)
            self.update.receive(self._spec.names if self._spec is not None else ())
            replies = await asyncio.gather(
                *(call_engine(r, "/load_checkpoint", timeout_s=self.timeout_s) for r in records)
            )
            await self._settle("loading the checkpoint", records, replies)
            return await self._finish(records, CHECKPOINT_VERSION, verify=False, expected=None)

    async def _settle(
        self, step: str, records: list[EngineRecord], replies: list[EngineReply], collective: bool = False
    ) -> None:
        """Go on after a step, or abort the whole update if any engine failed it; an engine that
        fails pushes by itself ``--max-push-failures`` times in a row is retired."""
        failed = failure(step, replies)
        if failed is None:
            return
        at_fault = self._at_fault(records, replies, collective)
        for record in at_fault:
            record.push_failures += 1
        await self._abort(failed[1])
        for record in at_fault:
            if record.push_failures >= self._max_push_failures and record.up:
                self._supervisor.retire(
                    record,
                    f"it failed {record.push_failures} pushes in a row (--max-push-failures"
                    f" {self._max_push_failures}), the last at {step}",
                )
        raise SyncError(*failed, [rep.as_json() for rep in replies])

    @staticmethod
    def _at_fault(records: list[EngineRecord], replies: list[EngineReply], collective: bool) -> list[EngineRecord]:
        """The engines that failed a step by themselves. A step of the engine's own (pause, start,
        finish) is its own failure; one of a collective with the trainer is, when another engine
        did its part (else the trainer, or the group, failed them all)."""
        if collective and not any(reply.ok for reply in replies):
            return []
        return [record for record, reply in zip(records, replies) if not reply.ok and not reply.cut_short]

    async def _abort(self, reason: str) -> None:
        """End the update on every engine that may have begun it: each keeps its process and serves
        nothing (stale) until the next push; one that cannot even end it is restarted. Called with
        the registry's lock held."""
        self.metrics.push_failures.inc()
        self._push_started = None
        began = [r for r in self.registry.records if r.receiving]
        for record in began:
            if record.up:
                self.registry.set_stale(record, ABORTED)  # out of routing now, not once it answers
        # An engine still inside a broken collective answers once the group's own timeout ends it.
        timeout_s = self._silence_limit_s + 30 if self.transport.transport.group else self.timeout_s
        replies = await asyncio.gather(*(call_engine(r, "/abort_weight_update", timeout_s=timeout_s) for r in began))
        for record, reply in zip(began, replies):
            record.receiving = False
            if not record.up:
                continue
            if not reply.ok:
                self._supervisor.restart_in_background(
                    record, f"a weight update was aborted ({reason}) and the engine could not end it: {reply.message}"
                )
        if self.transport.transport.group:
            # Whatever broke the update broke the collective: the trainer must form a new group.
            for record in self.registry.records:
                record.in_transfer_group = False
        log.error("weight update aborted: %s; %d engine(s) held out until the next push", reason, len(began))
        await self._end(abandoned_because=reason)

    async def _end(self, abandoned_because: str | None = None) -> None:
        """An update is over, however: engines it paused run again, its segments go.
        ``abandoned_because``: the server ended it, not its trainer (its later calls are refused)."""
        self.trainer_arrived()
        self.update.end(abandoned_because)
        self._staged = False
        paused, self._paused_for_push = self._paused_for_push, []
        resumable = [r for r in paused if r.up and r.residency.paused and not r.residency.sleeping and not r.receiving]
        if not self.registry.intent.paused:
            replies = await asyncio.gather(*(call_engine(r, "/resume", timeout_s=self.timeout_s) for r in resumable))
            for record, reply in zip(resumable, replies):
                if reply.ok and record.up:
                    self.registry.record_call(record, "resume")
                elif record.up:
                    await self._still_paused(record, reply.message)
        if removed := self.transport.update_ended():
            log.info("removed %d shared-memory segment(s) the trainer left", len(removed))

    async def _still_paused(self, record: EngineRecord, why: str) -> None:
        """A resume after the push failed: if vLLM still holds the engine paused, the requests routed
        to it would wait for ever; it is restarted (they move to another engine)."""
        log.warning("engine %d: resuming after the push failed: %s", record.engine_id, why)
        await self._control.reread(record, "resume")
        if record.up and record.residency.paused:
            self._supervisor.restart_in_background(record, f"it could not be resumed after a push: {why}")

    def _raise_if_failed(self, step: str, replies: list[EngineReply]) -> None:
        failed = failure(step, replies)
        if failed is not None:
            raise SyncError(*failed, [rep.as_json() for rep in replies])

    # -- relabelling -------------------------------------------------------------------
    async def relabel(self, new_version: str) -> dict:
        """vLLM's ``/update_weight_version`` for the fleet. Stale engines hold other weights than
        the fleet's, so they keep their own label (and stay stale); an engine that fails to take
        the new one is held out as stale too, so that no answer carries a label its weights lack."""
        self._refuse_unless(Phase.IDLE)
        async with self.registry.fleet_change():
            current = [r for r in self._engines() if r.stale is None]
            replies = await asyncio.gather(
                *(
                    call_engine(
                        r, "/update_weight_version", timeout_s=self.timeout_s, body={"new_version": new_version}
                    )
                    for r in current
                )
            )
            for record, reply in zip(current, replies):
                if reply.ok:
                    record.weight_version = new_version
                elif record.up:
                    self.registry.set_stale(record, f"it could not take the fleet's new label {new_version!r}")
            if (known := self._known()) is not None:
                self._agreed = (new_version, known)
            self.registry.fleet_weight_version = new_version
        self._raise_if_failed("update_weight_version", replies)
        return {"status": "relabelled", "weight_version": new_version, "engines": [rep.as_json() for rep in replies]}

    # -- verifying ----------------------------------------------------------------------
    async def _weight_checker(self, records: list[EngineRecord], action: str) -> list[EngineReply]:
        return await asyncio.gather(
            *(call_engine(r, "/weight_checker", timeout_s=self.timeout_s, body={"action": action}) for r in records)
        )

    async def _judge(self, records: list[EngineRecord], reference: Checksums | None) -> tuple[Verdict, list[dict]]:
        """Every engine's checksums against ``reference`` (None: the majority's); each engine's result."""
        replies = await self._weight_checker(records, "checksum")
        verdict = judge({rep.engine_id: rep.body["checksums"] for rep in replies if rep.ok}, reference)
        checked = [
            {"engine": rep.engine_id, "status": rep.status, "result": verdict.engine_result(rep.engine_id)}
            if rep.ok
            else rep.as_json()
            for rep in replies
        ]
        return verdict, checked

    async def _verify(self, records: list[EngineRecord], expected: Checksums | None) -> tuple[Verdict, list[dict]]:
        """Hold each engine to ``expected``, or to what the fleet agreed on under its label; one
        that differs is held out (stale) until the next push. Called with the registry lock held."""
        verdict, checked = await self._judge(records, expected or self._known())
        for record in records:
            if record.engine_id in verdict.disagreeing and record.up:
                differing = len(verdict.differing[record.engine_id])
                self.registry.set_stale(
                    record, f"its weights differ from the fleet's in {differing} tensor(s) (weight_checker)"
                )
        if verdict.reference is not None and len(verdict.disagreeing) < len(verdict.differing):
            self._agreed = (self.registry.fleet_weight_version, verdict.reference)
        return verdict, checked

    def agreed_checksums(self) -> Checksums | None:
        """The checksums the engines were seen to agree on under the fleet's label, if any."""
        return self._known()

    def _known(self) -> Checksums | None:
        if self._agreed is not None and self._agreed[0] == self.registry.fleet_weight_version:
            return self._agreed[1]
        return None

    def _raise_unless_verified(self, verdict: Verdict, checked: list[dict]) -> None:
        unchecked = [c["engine"] for c in checked if c["status"] != 200]
        if not verdict.disagreeing and not unchecked:
            return
        problems = [
            f"engine {engine} differs in {len(names)} tensor(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for engine, names in verdict.differing.items()
            if names
        ]
        problems += [f"engine {engine} could not be checked" for engine in unchecked]
        basis = "" if verdict.reference is not None else " (the engines split evenly: none can be trusted)"
        raise SyncError(
            502,
            "weights differ between engines after the push: "
            + "; ".join(problems)
            + basis
            + f"; held out until the next push: {verdict.disagreeing}",
            checked,
        )

    async def check_weights(self, request: WeightCheckRequest) -> dict:
        """vLLM's ``/weight_checker`` for the fleet. ``checksum`` holds out an engine that differs
        from the fleet; ``compare`` only reports; ``reset`` zeroes weights, so those engines serve
        nothing until the next push."""
        self._refuse_unless(Phase.IDLE, Phase.STARTED)
        async with self.registry.fleet_change():
            if request.action == "reset":
                return await self._reset_weights()
            current = [r for r in self.registry.up() if r.stale is None]
            if request.action == "checksum":
                verdict, checked = await self._verify(current, None)
                agree = not verdict.disagreeing and all(c["status"] == 200 for c in checked)
                return {
                    "checksums": verdict.reference or {},
                    "agree": agree,
                    "weight_version": self.registry.fleet_weight_version,
                    "held_out": verdict.disagreeing,
                    "engines": checked,
                }
            # compare: against the caller's baseline, nobody held out.
            verdict, checked = await self._judge(current, request.baseline)
        mismatches = sorted({name for names in verdict.differing.values() for name in names})
        match = not verdict.disagreeing and all(c["status"] == 200 for c in checked)
        return {"match": match, "mismatches": mismatches, "engines": checked}

    async def _reset_weights(self) -> dict:
        records = self.registry.up()
        replies = await self._weight_checker(records, "reset")
        # A failed reset may have zeroed part of the weights: those engines are held out too.
        for record in records:
            if record.up:
                self.registry.set_stale(record, "its weights were zeroed (weight_checker reset): push before it serves")
        self._raise_if_failed("weight_checker reset", replies)
        return {
            "status": "reset",
            "held_out": [r.engine_id for r in records],
            "engines": [rep.as_json() for rep in replies],
        }

    # -- leaving the group -----------------------------------------------------------------
    async def _leave(self, records: list[EngineRecord]) -> list[EngineReply]:
        """Every engine that holds a transfer engine shuts it down, whether its group still stands
        or broke (an aborted push leaves the communicator in place)."""
        members = [r for r in records if r.up and r.transfer_engine_open]
        replies = await asyncio.gather(
            *(call_engine(r, "/shutdown_weight_transfer_engine", timeout_s=self.timeout_s) for r in members)
        )
        for record, reply in zip(members, replies):
            record.transfer_engine_open = not reply.ok
        for record in records:
            record.in_transfer_group = False
        return replies

    async def shutdown(self) -> dict:
        """vLLM's ``/shutdown_weight_transfer_engine``: every engine leaves the trainer's group."""
        self._refuse_unless(Phase.IDLE, Phase.STARTED)
        async with self.registry.fleet_change():
            self._refuse_unless(Phase.IDLE, Phase.STARTED)
            if self.update.phase is Phase.STARTED:
                await self._end()
            self.update.start_over()
            replies = await self._leave(self.registry.records)
            self._colocated_init = None
            self.transport.update_ended()
        self._raise_if_failed("shutdown_weight_transfer_engine", replies)
        return {"status": "left", "engines": [rep.as_json() for rep in replies]}

    def info(self) -> dict:
        return {
            "weight_version": self.registry.fleet_weight_version,
            "transport": self.transport.transport.name,
            "update_in_progress": self.update.phase is not Phase.IDLE,
            **self.update.describe(),
            "last_update_seconds": self.last_update_s,
            # LoRA adapters: name -> the version the fleet serves it at.
            "adapters": {name: adapter.version for name, adapter in self.registry.fleet_adapters.items()},
            "engines": [
                {
                    "engine": r.engine_id,
                    "weight_version": r.weight_version,
                    "state": r.state.value,
                    "stale_reason": r.stale,
                    "receiving": r.receiving,
                    "in_transfer_group": r.in_transfer_group,
                    "rendezvous": r.rendezvous,
                    "push_failures": r.push_failures,
                    "adapters": dict(r.adapters),
                }
                for r in self.registry.records
            ],
        }


WEIGHT_SYNC = web.AppKey("weight_sync", WeightSync)


def _sync_route(request_type: type[WireModel], handler: Callable[[WeightSync, Any], Awaitable[dict]]):
    async def call(sync: WeightSync, body: Any) -> dict:
        # The trainer is here: no silence while its call runs, or waits for the registry's lock.
        sync.trainer_arrived()
        try:
            return await handler(sync, body)
        finally:
            sync.await_trainer()

    @takes(request_type)
    async def route(request: web.Request) -> web.Response:
        body = request_type.parse(await admin_json_body(request) or {})
        # A trainer that dies mid-call does not cut the bookkeeping short (ending the update on
        # engines whose transfer broke): admin calls run to their end (abandoning.py).
        return json_response(await call(request.app[WEIGHT_SYNC], body))

    route.__doc__ = handler.__doc__
    return route


async def _init(sync: WeightSync, body: InitRequest) -> dict:
    """Set up the transfer with every engine of the fleet: the group's rendezvous (gloo, NCCL;
    the front gives each engine its ranks), or a colocated transport's settings.

    If its caller leaves: until its trainer listens at ``master_address:master_port`` no engine
    is asked anything, and the next init supersedes it at once; once the engines were asked, the
    rendezvous runs to its end or to the group's timeout. A 504 after the timeout says the trainer
    never listened (a wrong address costs the engines nothing)."""
    return await sync.init(body.init_info)


async def _start(sync: WeightSync, body: StartRequest) -> dict:
    """Open an update; ``update_info``, if given, is checked against the checkpoint (nothing is
    touched yet).

    If its caller leaves: the update stays open; a trainer silent for the group's timeout has gone,
    and the update is abandoned (its later calls are refused with ``update_abandoned``)."""
    return sync.start(body.update_info, body.staged)


async def _update(sync: WeightSync, body: UpdateRequest) -> dict:
    """Every engine receives the tensors ``update_info`` names while the trainer sends them;
    without an open update, start and finish too (``weight_version`` labels it). A staged update
    (``staged`` here for a one-call push, else at its ``/start_weight_update``) is received into
    staging copies while the engines generate, which stop only for the swap at its finish; ``kv``
    says whether running requests recompute their KV (exact) or keep it.

    If its caller leaves: the engines' side runs to its end (a broken transfer is aborted on every
    engine, which serve nothing until a push of the whole checkpoint). A chunk of an update the
    server abandoned is a 409 ``update_abandoned``, never an update of its own."""
    return await sync.receive(body.update_info, body.weight_version, body.kv, body.staged)


async def _finish(sync: WeightSync, body: FinishRequest) -> dict:
    """Every engine serves the new weights under ``weight_version``; ``verify`` (or
    ``expected_checksums``) holds each to the others' weights.

    If its caller leaves: the finish still lands; ``GET /weight_info`` shows the version served."""
    return await sync.finish(body.weight_version, body.verifies, body.expected_checksums, body.kv)


async def _relabel(sync: WeightSync, body: RelabelRequest) -> dict:
    """Give the weights the fleet serves a new label, without a transfer.

    If its caller leaves: the label still changes."""
    return await sync.relabel(body.new_version)


async def _check_weights(sync: WeightSync, body: WeightCheckRequest) -> dict:
    """vLLM's weight checker over the fleet: ``checksum`` (an engine that differs is held out),
    ``compare`` with a ``baseline``, or ``reset`` (zeroes the weights)."""
    return await sync.check_weights(body)


async def _reload(sync: WeightSync, body: WireModel) -> dict:
    """Every engine loads the checkpoint on disk again, in place (no restart).

    If its caller leaves: the load still runs to its end, as a push would."""
    return await sync.reload()


async def _shutdown(sync: WeightSync, body: WireModel) -> dict:
    """Every engine leaves the trainer's group.

    If its caller leaves: every engine still leaves it."""
    return await sync.shutdown()


async def _world_size(request: web.Request) -> web.Response:
    """The inference side of the transfer group: the fleet's workers (vLLM's answer)."""
    return json_response({"world_size": request.app[WEIGHT_SYNC].worker_count})


async def _weight_info(request: web.Request) -> web.Response:
    """The fleet's weight version, the update's phase, and each engine's version, state and group."""
    return json_response(request.app[WEIGHT_SYNC].info())


def add_weight_routes(app: web.Application) -> None:
    app.router.add_get("/get_world_size", _world_size)
    for path in ("/init_weight_transfer", "/init_weight_transfer_engine"):
        app.router.add_post(path, _sync_route(InitRequest, _init))
    app.router.add_post("/start_weight_update", _sync_route(StartRequest, _start))
    app.router.add_post("/update_weights", _sync_route(UpdateRequest, _update))
    app.router.add_post("/finish_weight_update", _sync_route(FinishRequest, _finish))
    app.router.add_post("/shutdown_weight_transfer_engine", _sync_route(WireModel, _shutdown))
    app.router.add_post("/update_weight_version", _sync_route(RelabelRequest, _relabel))
    app.router.add_post("/reload_weights", _sync_route(WireModel, _reload))
    app.router.add_post("/weight_checker", _sync_route(WeightCheckRequest, _check_weights))
    app.router.add_get("/weight_info", _weight_info)
