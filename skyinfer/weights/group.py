"""The trainer's transfer group on the front's side: setting it up with every engine once the
trainer listens (``/init_weight_transfer``), an engine that restarts taking a colocated
transport's settings, and every engine leaving it."""

from __future__ import annotations

import asyncio
import logging

from ..fleet.engine_calls import EngineReply, call_engine
from ..fleet.state import EngineRecord
from .fleet import Fleet, SyncError
from .phases import Phase
from .push import Push
from .transports import FrontTransport, InitPlan

__all__ = ("TransferGroup",)

log = logging.getLogger("skyinfer.weights")


class TransferGroup:
    def __init__(self, fleet: Fleet, push: Push):
        self.fleet = fleet
        self.registry = fleet.registry
        self._push = push
        # The rendezvous an /init_weight_transfer waits for (its trainer listening): a newer init
        # supersedes it at once, since no engine has been asked anything yet.
        self._awaiting_trainer: asyncio.Task | None = None
        # Inits begun: the latest one's rendezvous is what the engines show.
        self._inits = 0
        # A colocated transport's init_info, which an engine that restarts takes too (no rendezvous).
        self._colocated_init: dict | None = None

    @property
    def transport(self) -> FrontTransport:
        return self.fleet.transport

    async def init(self, init_info: dict) -> dict:
        # Checked before waiting for the fleet: a bad body is refused at once.
        members = self.registry.members()
        plan = await self.transport.plan_init(init_info, self.fleet.workers(members))
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
            if self.fleet.update.phase is not Phase.IDLE:
                # A trainer that sets up a transfer is a new one: the update the old one left is
                # abandoned rather than waited out (engines that had begun it are held out as stale).
                log.warning(
                    "a trainer set up a transfer during an update (%s): that update is abandoned",
                    self.fleet.update.phase.value,
                )
                await self._push.end_abandoned("a trainer set up a new transfer")
            await self._push.ends_of_aborts()
            self.fleet.update.start_over()
            self.transport.update_ended()  # a trainer starting (again) makes its segment again
            records = self.fleet.engines()
            if records != members:  # an engine retired or rejoined meanwhile: its ranks move
                plan = await self.transport.plan_init(init_info, self.fleet.workers(records))
            # A transfer engine formed before is shut down first, even one whose group broke since:
            # an NCCL communicator left open would leak.
            await self.leave(records)
            for record in records:
                record.transfer_engine_open = True  # an init that fails may have built part of one
            self._show_rendezvous(records, "joining the trainer's group", plan)
            replies = await asyncio.gather(
                *(self._init_engine(r, info, plan.timeout_s) for r, info in zip(records, plan.engine_init_infos))
            )
            for record, reply in zip(records, replies):
                record.in_transfer_group = reply.ok
            self.fleet.group_timeout_s = plan.timeout_s
            self._colocated_init = None if self.transport.transport.group else plan.engine_init_infos[0]
            self.transport.update_ended()
        self.fleet.raise_if_failed("init_weight_transfer", replies)
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
        reply = await self._init_engine(record, self._colocated_init, self.fleet.timeout_s)
        if not reply.ok:
            raise RuntimeError(f"setting up the weight transfer failed: {reply.message}")
        record.in_transfer_group = True

    def members(self) -> list[EngineRecord]:
        """The engines, for a transfer outside a weight update (an adapter push): every one up
        and in the trainer's group."""
        self.fleet.refuse_unless(Phase.IDLE)
        if not self.transport.transport.group:
            raise SyncError(
                400,
                "adapter pushes travel over a transfer group; a colocated server loads adapters from a path"
                " (POST /v1/load_lora_adapter)",
            )
        return self.fleet.engines_in_group()

    def broken(self, reason: str) -> None:
        """A transfer that touched no weights failed: the group is gone, the engines serve on."""
        log.warning("weight-transfer group broken: %s; the trainer must POST /init_weight_transfer again", reason)
        self.fleet.metrics.push_failures.inc()
        self.fleet.leave_group()

    async def leave(self, records: list[EngineRecord]) -> list[EngineReply]:
        """Every engine that holds a transfer engine shuts it down, whether its group still stands
        or broke (an aborted push leaves the communicator in place)."""
        members = [r for r in records if r.up and r.transfer_engine_open]
        replies = await self.fleet.call_all(members, "/shutdown_weight_transfer_engine")
        for record, reply in zip(members, replies):
            record.transfer_engine_open = not reply.ok
        for record in records:
            record.in_transfer_group = False
        return replies

    async def shutdown(self) -> dict:
        """vLLM's ``/shutdown_weight_transfer_engine``: every engine leaves the trainer's group."""
        self.fleet.refuse_unless(Phase.IDLE, Phase.STARTED)
        async with self.registry.fleet_change():
            self.fleet.refuse_unless(Phase.IDLE, Phase.STARTED)
            if self.fleet.update.phase is Phase.STARTED:
                await self._push.end()
            await self._push.ends_of_aborts()
            self.fleet.update.start_over()
            replies = await self.leave(self.registry.records)
            self._colocated_init = None
            self.transport.update_ended()
        self.fleet.raise_if_failed("shutdown_weight_transfer_engine", replies)
        return {"status": "left", "engines": [rep.as_json() for rep in replies]}
