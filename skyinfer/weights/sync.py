"""The front's side of weight sync: rank layout, checks, and driving every engine at once.

Routes and bodies follow vLLM 0.32's server. Every step is a collective with
the trainer, so the front calls all engines concurrently and the trainer
broadcasts at the same time. Nothing touches an engine's weights before the
update's metadata has been checked: ``/start_weight_update`` only opens a
session here, and the engines start theirs when the first checked
``/update_weights`` arrives. An engine whose transfer fails mid-way holds
half-loaded weights; it is taken out of rotation and restarted, and serves
again only after a push brings it to the fleet's version.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..errors import ApiError, json_response, parse_json_object
from ..engine_calls import EngineReply, call_engine, failure, gather_until_failure
from ..metrics import ServiceMetrics
from ..state import EngineRecord, EngineRegistry
from ..wire import (
    Checksums,
    FinishRequest,
    GlooInitInfo,
    InitRequest,
    RelabelRequest,
    StartRequest,
    UpdateMetadata,
    UpdateRequest,
    WeightCheckRequest,
    WireModel,
)
from .checkpoint import CheckpointSpec
from .layout import LayoutError, RankLayout
from .verify import Verdict, judge

log = logging.getLogger("skyinfer.weights")


class SyncError(ApiError):
    """A weight-sync call refused or failed; ``engines``: each engine's own answer."""

    def __init__(self, status: int, message: str, engines: list[dict] | None = None):
        super().__init__(message, status=status, details=None if engines is None else {"engines": engines})


async def _check_trainer_address(info: GlooInitInfo) -> None:
    """A trainer address that does not resolve is a 400 now, not a rendezvous timeout later."""
    try:
        await asyncio.get_running_loop().getaddrinfo(info.master_address, info.master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise SyncError(400, f"init_info master_address {info.master_address!r} does not resolve: {exc}") from None


# vLLM's ipc backend's init_info is {"packed": ...} alone (no rendezvous).
IPC_REFUSAL = (
    "init_info has no master_address: this is vLLM's ipc backend, which skyinfer does not serve. Its "
    "updates carry CUDA IPC handles pickled into the HTTP body (ipc_handles_pickled), and skyinfer never "
    "unpickles what comes from the network; push over nccl (GPU) or skyinfer's gloo backend instead"
)


class Phase(enum.Enum):
    """Where the fleet is in a weight update; a group may be formed or not in any of them."""

    IDLE = "idle"
    # /start_weight_update seen, its metadata checked; no engine touched yet.
    STARTED = "started"
    # Engines are between vLLM's start and finish: their weights are part new.
    RECEIVING = "receiving"


class WeightSync:
    def __init__(
        self,
        registry: EngineRegistry,
        workers_per_engine: int,
        model: str,
        timeout_s: float,
        restart: Callable[[EngineRecord, str], None],
        metrics: ServiceMetrics,
    ):
        self.registry = registry
        self.metrics = metrics
        # When the push now in progress began (its first transfer call).
        self._push_started: float | None = None
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s
        self._restart = restart
        self._spec = CheckpointSpec.read(model)
        self.phase = Phase.IDLE
        # A trainer silent this long between calls of an update has gone: the
        # update is aborted (the group's own timeout, from its init_info).
        self._silence_limit_s = timeout_s
        self._silence_timer: asyncio.TimerHandle | None = None
        self.last_update_s: float | None = None
        # The checksums every engine held under a label, once a check saw them agree.
        self._agreed: tuple[str, Checksums] | None = None

    @property
    def worker_count(self) -> int:
        """The inference side of the group (vLLM's ``/get_world_size``): every engine's workers."""
        return self.workers_per_engine * len(self.registry.records)

    def _engines(self) -> list[EngineRecord]:
        """Every engine takes part in every transfer: the trainer's group spans them all."""
        down = [r for r in self.registry.records if not r.up]
        if down:
            raise SyncError(
                409,
                "weight transfer needs every engine: "
                + ", ".join(f"engine {r.engine_id} is {r.state.value}" for r in down)
                + "; retry once it is up (GET /engines)",
            )
        return self.registry.records

    # -- the update's phases ---------------------------------------------------
    def _enter(self, phase: Phase, *, awaiting_trainer: bool = True) -> None:
        """Move to ``phase``; outside IDLE, and unless a call is under way, the trainer's next
        call is due within the silence limit."""
        self._call_started()
        if phase is not self.phase:
            log.info("weight update: %s -> %s", self.phase.value, phase.value)
        self.phase = phase
        if phase is not Phase.IDLE and awaiting_trainer:
            self._silence_timer = asyncio.get_running_loop().call_later(self._silence_limit_s, self._trainer_silent)

    def _call_started(self) -> None:
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None

    def _trainer_silent(self) -> None:
        self._silence_timer = None
        reason = f"the trainer sent nothing for {self._silence_limit_s:.0f}s during a weight update ({self.phase.value})"
        log.error("%s: aborting it", reason)
        if self.phase is Phase.RECEIVING:
            self._abandon(reason)
        self._enter(Phase.IDLE)

    def _refuse_unless(self, *phases: Phase) -> None:
        if self.phase not in phases:
            hint = {
                Phase.IDLE: "no weight update is in progress; POST /start_weight_update or /update_weights first",
                Phase.STARTED: "a weight update is started; POST /update_weights next",
                Phase.RECEIVING: "a weight update is in progress; POST /finish_weight_update first",
            }[self.phase]
            raise SyncError(409, f"{hint} (an update the trainer leaves for {self._silence_limit_s:.0f}s is aborted)")

    # -- init ----------------------------------------------------------------
    async def init(self, init_info: dict) -> dict:
        if init_info.keys() <= {"packed"}:
            raise SyncError(400, IPC_REFUSAL)
        info = GlooInitInfo.parse(init_info, ("init_info",))
        try:
            layout = RankLayout.build(
                info.rank_offset, info.world_size, (self.workers_per_engine,) * len(self.registry.records)
            )
        except LayoutError as exc:
            raise SyncError(400, str(exc)) from None
        timeout_s = self.timeout_s if info.timeout_s is None else info.timeout_s
        await _check_trainer_address(info)
        if self.phase is Phase.STARTED:
            # A new group means a new trainer; the old one's update had not touched any engine.
            log.warning("a trainer formed a new group during a started update: that update is dropped")
            self._enter(Phase.IDLE)
        self._refuse_unless(Phase.IDLE)
        async with self.registry.lock:
            records = self._engines()
            replies = await asyncio.gather(
                *(
                    call_engine(
                        r,
                        "/init_weight_transfer",
                        timeout_s=timeout_s + 30,
                        query={"timeout_s": str(timeout_s)},
                        body={"init_info": {**init_info, "rank_offset": layout.rank_offset(i)}},
                    )
                    for i, r in enumerate(records)
                )
            )
            for record, reply in zip(records, replies):
                record.in_transfer_group = reply.ok
            self._silence_limit_s = timeout_s
        self._raise_if_failed("init_weight_transfer", replies)
        return {"status": "joined", "world_size": info.world_size, "rank_offsets": [layout.rank_offset(i) for i in range(len(records))]}

    # -- one update ------------------------------------------------------------
    def check_metadata(self, update_info: dict) -> UpdateMetadata:
        """Refuse (400) metadata that is malformed or does not fit the served checkpoint, before any byte moves."""
        meta = UpdateMetadata.parse(update_info, ("update_info",))
        dtypes = {r.model_dtype for r in self.registry.records if r.model_dtype}
        if self._spec is not None and dtypes:
            try:
                self._spec.check(meta, dtypes.pop())
            except ValueError as exc:
                raise SyncError(400, f"update_info rejected before any transfer: {exc}") from None
        return meta

    def _check_group(self, records: list[EngineRecord]) -> None:
        missing = [r.engine_id for r in records if not r.in_transfer_group]
        if missing:
            raise SyncError(409, f"engines {missing} are not in the trainer's group; POST /init_weight_transfer first")

    def transfer_members(self) -> list[EngineRecord]:
        """The engines, for a transfer outside a weight update (an adapter push): every one up
        and in the trainer's group."""
        self._refuse_unless(Phase.IDLE)
        records = self._engines()
        self._check_group(records)
        return records

    def group_broken(self, reason: str) -> None:
        """A transfer that touched no weights failed: the group is gone, the engines serve on."""
        log.warning("weight-transfer group broken: %s; the trainer must POST /init_weight_transfer again", reason)
        self.metrics.push_failures.inc()
        for record in self.registry.records:
            record.in_transfer_group = False

    def start(self, update_info: dict | None) -> dict:
        self._refuse_unless(Phase.IDLE)
        self._check_group(self._engines())
        if update_info is not None:
            self.check_metadata(update_info)
        self._push_started = time.monotonic()
        self._enter(Phase.STARTED)
        return {"status": "started"}

    async def update(self, update_info: dict, weight_version: str | None) -> dict:
        """Check, then receive on every engine. Without an open session: start and finish too."""
        self.check_metadata(update_info)
        one_shot = self.phase is Phase.IDLE
        async with self.registry.lock:
            records = self._engines()
            self._check_group(records)
            started = time.monotonic()
            if self._push_started is None:
                self._push_started = started
            engines_started = self.phase is Phase.RECEIVING
            self._enter(Phase.RECEIVING, awaiting_trainer=False)  # from the first byte on, weights are part new
            replies = await gather_until_failure([(r, self._receive(r, update_info, engines_started)) for r in records])
            self._settle("update_weights", replies, Phase.RECEIVING)
            self.last_update_s = time.monotonic() - started
        if one_shot:
            return await self.finish(weight_version)
        return {"status": "updated", "engines": [rep.as_json() for rep in replies]}

    async def _receive(self, record: EngineRecord, update_info: dict, engines_started: bool) -> EngineReply:
        if not engines_started:
            reply = await call_engine(record, "/start_weight_update", timeout_s=self.timeout_s)
            if not reply.ok:
                return reply
        return await call_engine(record, "/update_weights", timeout_s=self.timeout_s, body={"update_info": update_info})

    async def finish(self, weight_version: str | None, verify: bool = False, expected: Checksums | None = None) -> dict:
        """Every engine finishes; with ``verify``, each is then held to ``expected`` (or to the
        others): one that differs is held out as stale and the call fails."""
        self._refuse_unless(Phase.RECEIVING)
        version = weight_version if weight_version is not None else f"update-{int(time.time())}"
        async with self.registry.lock:
            records = self._engines()
            self._call_started()
            replies = await asyncio.gather(
                *(
                    call_engine(r, "/finish_weight_update", timeout_s=self.timeout_s, body={"weight_version": version})
                    for r in records
                )
            )
            self._settle("finish_weight_update", replies, Phase.IDLE)
            self.registry.fleet_weight_version = version
            if self._push_started is not None:
                self.metrics.push_seconds.observe(time.monotonic() - self._push_started)
                self._push_started = None
            for record in records:
                record.weight_version = version
                if record.up:
                    self.registry.set_conditions(record, stale=False)
            self._agreed = None
            if verify:
                verdict, checked = await self._verify(records, expected)
                self._raise_unless_verified(verdict, checked)
        log.info("weight version %s on %d engine(s)%s", version, len(records), ", verified" if verify else "")
        answer = {"status": "finished", "weight_version": version, "engines": [rep.as_json() for rep in replies]}
        return {**answer, "verified": True} if verify else answer

    def _settle(self, step: str, replies: list[EngineReply], next_phase: Phase) -> None:
        """Move on after a transfer step, or abort the whole update if any engine failed it."""
        failed = failure(step, replies)
        if failed is not None:
            self._abandon(failed[1])
            self._enter(Phase.IDLE)
            raise SyncError(*failed, [rep.as_json() for rep in replies])
        self._enter(next_phase)

    def _abandon(self, reason: str) -> None:
        """Every engine that took part may hold part-new weights: all are restarted and serve
        nothing (stale) until the next push. The group is broken for everyone."""
        self.metrics.push_failures.inc()
        self._push_started = None
        for record in self.registry.records:
            record.in_transfer_group = False
            if record.up:
                # A restart takes half a minute: it runs beside this call, which reports the failure now.
                self._restart(record, f"weight update aborted: {reason}")

    def _raise_if_failed(self, step: str, replies: list[EngineReply]) -> None:
        failed = failure(step, replies)
        if failed is not None:
            raise SyncError(*failed, [rep.as_json() for rep in replies])

    # -- relabelling -------------------------------------------------------------
    async def relabel(self, new_version: str) -> dict:
        """vLLM's ``/update_weight_version`` for the fleet. Stale engines hold other weights than
        the fleet's, so they keep their own label (and stay stale); an engine that fails to take
        the new one is held out as stale too, so that no answer carries a label its weights lack."""
        self._refuse_unless(Phase.IDLE)
        async with self.registry.lock:
            current = [r for r in self._engines() if not r.stale]
            replies = await asyncio.gather(
                *(call_engine(r, "/update_weight_version", timeout_s=self.timeout_s, body={"new_version": new_version})
                  for r in current)  # fmt: skip
            )
            for record, reply in zip(current, replies):
                if reply.ok:
                    record.weight_version = new_version
                elif record.up:
                    self.registry.set_conditions(record, stale=True)
            if (known := self._known()) is not None:
                self._agreed = (new_version, known)
            self.registry.fleet_weight_version = new_version
        self._raise_if_failed("update_weight_version", replies)
        return {"status": "relabelled", "weight_version": new_version, "engines": [rep.as_json() for rep in replies]}

    # -- verifying -----------------------------------------------------------------
    async def _weight_checker(self, records: list[EngineRecord], action: str) -> list[EngineReply]:
        return await asyncio.gather(
            *(call_engine(r, "/weight_checker", timeout_s=self.timeout_s, body={"action": action}) for r in records)
        )

    async def _judge(self, records: list[EngineRecord], reference: Checksums | None) -> tuple[Verdict, list[dict]]:
        """Every engine's checksums against ``reference`` (None: the majority's); each engine's result."""
        replies = await self._weight_checker(records, "checksum")
        verdict = judge({rep.engine_id: rep.body["checksums"] for rep in replies if rep.ok}, reference)
        checked = [
            {"engine": rep.engine_id, "status": rep.status, "result": verdict.engine_result(rep.engine_id)} if rep.ok
            else rep.as_json()
            for rep in replies
        ]  # fmt: skip
        return verdict, checked

    async def _verify(self, records: list[EngineRecord], expected: Checksums | None) -> tuple[Verdict, list[dict]]:
        """Hold each engine to ``expected``, or to what the fleet agreed on under its label; one
        that differs is held out (stale) until the next push. Called with the registry lock held."""
        verdict, checked = await self._judge(records, expected or self._known())
        for record in records:
            if record.engine_id in verdict.disagreeing and record.up:
                self.registry.set_conditions(record, stale=True)
        if verdict.reference is not None and len(verdict.disagreeing) < len(verdict.differing):
            self._agreed = (self.registry.fleet_weight_version, verdict.reference)
        return verdict, checked

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
            for engine, names in verdict.differing.items() if names
        ]  # fmt: skip
        problems += [f"engine {engine} could not be checked" for engine in unchecked]
        basis = "" if verdict.reference is not None else " (the engines split evenly: none can be trusted)"
        raise SyncError(
            502,
            "weights differ between engines after the push: " + "; ".join(problems) + basis
            + f"; held out until the next push: {verdict.disagreeing}",
            checked,
        )

    async def check_weights(self, request: WeightCheckRequest) -> dict:
        """vLLM's ``/weight_checker`` for the fleet. ``checksum`` holds out an engine that differs
        from the fleet; ``compare`` only reports; ``reset`` zeroes weights, so those engines serve
        nothing until the next push."""
        self._refuse_unless(Phase.IDLE, Phase.STARTED)
        async with self.registry.lock:
            if request.action == "reset":
                return await self._reset_weights()
            current = [r for r in self.registry.up() if not r.stale]
            if request.action == "checksum":
                verdict, checked = await self._verify(current, None)
                agree = not verdict.disagreeing and all(c["status"] == 200 for c in checked)
                return {"checksums": verdict.reference or {}, "agree": agree, "weight_version": self.registry.fleet_weight_version,
                        "held_out": verdict.disagreeing, "engines": checked}  # fmt: skip
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
                self.registry.set_conditions(record, stale=True)
        self._raise_if_failed("weight_checker reset", replies)
        return {"status": "reset", "held_out": [r.engine_id for r in records], "engines": [rep.as_json() for rep in replies]}

    # -- leaving the group -------------------------------------------------------
    async def shutdown(self) -> dict:
        """vLLM's ``/shutdown_weight_transfer_engine``: every engine leaves the trainer's group."""
        self._refuse_unless(Phase.IDLE, Phase.STARTED)
        self._enter(Phase.IDLE)
        async with self.registry.lock:
            members = [r for r in self.registry.up() if r.in_transfer_group]
            replies = await asyncio.gather(
                *(call_engine(r, "/shutdown_weight_transfer_engine", timeout_s=self.timeout_s) for r in members)
            )
            for record in self.registry.records:
                record.in_transfer_group = False
        self._raise_if_failed("shutdown_weight_transfer_engine", replies)
        return {"status": "left", "engines": [rep.as_json() for rep in replies]}

    def info(self) -> dict:
        return {
            "weight_version": self.registry.fleet_weight_version,
            "update_in_progress": self.phase is not Phase.IDLE,
            "update_phase": self.phase.value,
            "last_update_seconds": self.last_update_s,
            # LoRA adapters: name -> the version the fleet serves it at.
            "adapters": {name: adapter.version for name, adapter in self.registry.fleet_adapters.items()},
            "engines": [
                {"engine": r.engine_id, "weight_version": r.weight_version, "state": r.state.value,
                 "in_transfer_group": r.in_transfer_group, "adapters": dict(r.adapters)}  # fmt: skip
                for r in self.registry.records
            ],
        }


WEIGHT_SYNC = web.AppKey("weight_sync", WeightSync)


def _sync_route(request_type: type[WireModel], handler: Callable[[WeightSync, Any], Awaitable[dict]]):
    async def route(request: web.Request) -> web.Response:
        raw = await request.read()
        body = request_type.parse(parse_json_object(raw) if raw else {})
        # Shielded: a trainer that dies mid-call must not cancel the
        # bookkeeping (restarting engines whose transfer broke).
        return json_response(await asyncio.shield(handler(request.app[WEIGHT_SYNC], body)))

    return route


async def _init(sync: WeightSync, body: InitRequest) -> dict:
    return await sync.init(body.init_info)


async def _start(sync: WeightSync, body: StartRequest) -> dict:
    return sync.start(body.update_info)


async def _update(sync: WeightSync, body: UpdateRequest) -> dict:
    return await sync.update(body.update_info, body.weight_version)


async def _finish(sync: WeightSync, body: FinishRequest) -> dict:
    return await sync.finish(body.weight_version, body.verifies, body.expected_checksums)


async def _relabel(sync: WeightSync, body: RelabelRequest) -> dict:
    return await sync.relabel(body.new_version)


async def _check_weights(sync: WeightSync, body: WeightCheckRequest) -> dict:
    return await sync.check_weights(body)


async def _shutdown(sync: WeightSync, body: WireModel) -> dict:
    return await sync.shutdown()


async def _world_size(request: web.Request) -> web.Response:
    return json_response({"world_size": request.app[WEIGHT_SYNC].worker_count})


async def _weight_info(request: web.Request) -> web.Response:
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
    app.router.add_post("/weight_checker", _sync_route(WeightCheckRequest, _check_weights))
    app.router.add_get("/weight_info", _weight_info)
