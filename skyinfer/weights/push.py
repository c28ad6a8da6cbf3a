"""One weight update, from its first call to its end, on one of two paths chosen when it opens:
the live path (live.py: running engines paused, the push taken into their live weights) or the
staged path (staged.py). Both fail the same way: the update ends on every engine, without a
restart where the engine can end it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs

from ..fleet.engine_calls import EngineReply, call_engine, failure
from ..fleet.state import PAUSE_FOR_PUSH, EngineRecord, push_verdict
from ..transfer.protocol import UpdateMetadata
from ..wire import Checksums, KvRule, PauseParams
from .checking import WeightChecks
from .fleet import Fleet, SyncError, unpushable
from .live import LivePath, applied_by, push_at_fault, unplanned_by
from .phases import OpenUpdate, Phase
from .staged import StagedPath

if TYPE_CHECKING:
    from ..admin.control import ControlPlane
    from ..fleet.supervisor import Supervisor

__all__ = ("ABORTED", "CHECKPOINT_VERSION", "Push")

log = logging.getLogger("skyinfer.weights")

# How a push pauses engines that are running: requests in flight are held, and their KV kept.
_PAUSE_FOR_PUSH = PauseParams(mode="keep", clear_cache=False).to_query()
ABORTED = (
    "a weight update was aborted while it received: its layers are part new; push again, or POST"
    " /reload_weights for the checkpoint on disk"
)
# How long an aborted update waits for engines to end it: one outside any collective answers at
# once; one inside the trainer's broken collective ends it beside the fleet (``Push._abort``).
_ABORT_ANSWER_S = 10.0
# vLLM's label for the weights an engine loaded at start-up (what a restarted engine serves).
CHECKPOINT_VERSION = "default"


@attrs.define(eq=False)
class _LateAbort:
    """An engine's answer to an aborted update's end, still awaited after the update ended."""

    record: EngineRecord
    # The process that began the update: a new one has nothing to end.
    pid: int | None
    call: asyncio.Future
    reason: str
    # The push paused it: resumed once it has ended the update.
    resume: bool
    # Awaits ``call`` (the loop holds tasks only weakly).
    task: asyncio.Task | None = None


def _version(weight_version: str | None) -> str:
    return weight_version if weight_version is not None else f"update-{int(time.time())}"


def _not_covered(version: str, missing: list[str] | None) -> str | None:
    """Why an engine whose weights were not the fleet's stays stale after the push of ``version``
    (``missing``: the checkpoint's tensors it left out; None: the checkpoint's names are unknown),
    or None: the push replaced every weight."""
    if missing is None:
        return (
            f"its weights were not the fleet's, and the checkpoint's tensor names are unknown here (--model"
            f" is neither a local directory nor in the local Hugging Face cache), so the push of {version}"
            " cannot be shown to cover every weight: POST /engines/{id}/catch_up, or /reload_weights"
        )
    if not missing:
        return None
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    return (
        f"its weights were not the fleet's, and the push of {version} carried only part of the checkpoint"
        f" ({len(missing)} tensor(s) left out: {shown}): push all of them before it serves"
    )


class Push:
    def __init__(
        self, fleet: Fleet, checks: WeightChecks, supervisor: Supervisor, control: ControlPlane, max_failures: int
    ):
        self.fleet = fleet
        self.update = fleet.update
        self.registry = fleet.registry
        self._checks = checks
        self._supervisor = supervisor
        self._control = control
        self._max_failures = max_failures
        self.live = LivePath(fleet, self._begin)
        self.staged = StagedPath(fleet)
        self.last_update_s: float | None = None
        # The last push that finished: its version, its seconds and each stage's (``timed``).
        self.last_push: dict | None = None
        # How the last staged push went into the engines' live weights (``/weight_info``).
        self.last_staged_swap: dict | None = None
        # Updates that began touching engines (or a reload): a peer catch-up that sees this move
        # while it copies gives way to the push (catchup.py).
        self.updates_begun = 0
        # Schedules a peer catch-up for an engine a staged swap left behind (catchup.py, set by the app).
        self.catch_up_later: Callable[[EngineRecord], None] | None = None
        # Engines ending an aborted update after it ended (``_abort``), by engine id.
        self._ending: dict[int, _LateAbort] = {}

    def _path(self) -> LivePath | StagedPath:
        return self.staged if self.update.current.staged else self.live

    @contextlib.contextmanager
    def timed(self, stage: str, update: OpenUpdate | None = None) -> Iterator[None]:
        """Adds the block's seconds to the open update's ``stage`` (``/weight_info``'s ``last_push``):
        where a push's time went, as the front sees it, each stage's own (a stage inside another
        counts for itself only). Stages: ``pause`` (running engines paused
        for it), ``start`` (vLLM's update opened), ``receive`` (the bytes moved and loaded, or
        staged), ``finish`` (vLLM's finish, or the staged swap), ``verify``, ``resume``. A one-call
        live push's first four are its slowest engine's own account (``_push_in_one_call``)."""
        update = update or self.update.current
        started, outer_nested = time.monotonic(), update.nested_s
        if update.first_stage_at is None:
            update.first_stage_at = started
        update.nested_s = 0.0
        try:
            yield
        finally:
            seconds = time.monotonic() - started
            update.stages[stage] = update.stages.get(stage, 0.0) + seconds - update.nested_s
            update.nested_s = outer_nested + seconds

    def start(self, update_info: dict | None, staged: bool = False) -> dict:
        self.fleet.refuse_unless(Phase.IDLE)
        records = self.fleet.engines_in_group()
        meta = None if update_info is None else self.fleet.check_metadata(update_info, carries_data=False)
        if meta is not None:
            self.fleet.check_whole_update(meta.names)
        (self.staged if staged else self.live).fits(records, meta)
        self.update.open(staged)
        return {"status": "started", "staged": staged}

    def _refusal_of_receive(self, meta: UpdateMetadata, kv: KvRule, staged: bool) -> list[EngineRecord]:
        """Raise what a receive of ``meta`` is refused for, before any engine is asked; the engines
        it would go to."""
        # A chunk of an update the server abandoned is no update of its own.
        self.update.refuse_if_abandoned()
        self.fleet.refuse_unless(Phase.IDLE, Phase.STARTED, Phase.STAGING, Phase.RECEIVING)
        one_shot = self.update.phase is Phase.IDLE
        if not one_shot and (kv != "recompute" or staged):
            raise SyncError(
                400,
                "kv and staged belong to a one-call push: for an open update, staged goes to its"
                " /start_weight_update and kv to its /finish_weight_update",
            )
        records = self.fleet.engines_in_group()
        self.fleet.refuse_delta_unless_every_engine_takes_it(meta, records, staged or self.update.current.staged)
        if one_shot:
            self.fleet.check_whole_update(meta.names)
            (self.staged if staged else self.live).fits(records, meta)
            if not staged and (reason := unpushable(records)) is not None:
                raise SyncError(409, f"cannot start a weight update: {reason}")
        return records

    async def check_receive(self, update_info: dict, kv: KvRule = "recompute", staged: bool = False) -> dict:
        """What a receive of ``update_info`` would be refused for (raised), with nothing moved."""
        meta = self.fleet.check_metadata(update_info)
        async with self.registry.fleet_change():
            records = self._refusal_of_receive(meta, kv, staged)
        return {"status": "checked", "engines": [r.engine_id for r in records]}

    async def receive(
        self, update_info: dict, weight_version: str | None, kv: KvRule = "recompute", staged: bool = False
    ) -> dict:
        """Check, then receive on every engine (into staging copies, for a staged update). Without
        an open update: start and finish too, in one hold of the fleet."""
        meta = self.fleet.check_metadata(update_info)
        try:
            async with self.registry.fleet_change():
                one_shot = self.update.phase is Phase.IDLE
                records = self._refusal_of_receive(meta, kv, staged)
                forwarded = self.fleet.transport.for_engines(update_info, meta, records)
                self.update.current.receiving(update_info, meta)
                if one_shot and not staged:
                    return await self._push_in_one_call(records, forwarded, meta, _version(weight_version), kv)
                if one_shot:
                    self.update.current.staged = staged
                path = self._path()
                started = time.monotonic()
                with self.timed("receive"):
                    replies, answer = await path.receive(records, forwarded, meta)
                await self._settle(path.receive_step, records, replies, collective=True)
                self.fleet.transport.engines_took(meta, records)
                if path is self.live:
                    self.last_update_s = time.monotonic() - started
                if not one_shot:
                    return answer
                finished = await self._finish(records, _version(weight_version), False, None, kv)
                if path is self.staged:
                    finished["staged"] = {key: answer[key] for key in ("bytes", "seconds", "place")}
                return finished
        finally:
            self.fleet.transport.update_sent(meta)

    async def finish(
        self,
        weight_version: str | None,
        verify: bool = False,
        expected: Checksums | None = None,
        kv: KvRule = "recompute",
    ) -> dict:
        """Every engine takes the update (a staged one: swaps its staging copy in); with ``verify``,
        each is then held to ``expected`` (or to the others): one that differs is held out as stale
        and the call fails."""
        self.fleet.refuse_unless(Phase.RECEIVING, Phase.STAGING)
        async with self.registry.fleet_change():
            self.fleet.refuse_unless(Phase.RECEIVING, Phase.STAGING)
            # A staged update swaps on the engines that hold its copies (``_finish``), whoever is down.
            records = self.fleet.engines() if self.update.phase is Phase.RECEIVING else []
            return await self._finish(records, _version(weight_version), verify, expected, kv)

    async def reload(self) -> dict:
        """Every engine of the fleet loads the checkpoint on disk again, in place, as a push would
        (engines that run are paused for it; no restart): for stale engines whose trainer is not
        coming back. The fleet then serves the checkpoint under vLLM's own label for it."""
        self.fleet.refuse_unless(Phase.IDLE)
        async with self.registry.fleet_change():
            self.fleet.refuse_unless(Phase.IDLE)
            self.update.start_over()
            records = self.fleet.engines()
            await self._begin(records)
            self.update.receive(())
            self.update.current.whole_checkpoint = True
            with self.timed("receive"):
                replies = await self.fleet.call_all(records, "/load_checkpoint")
            await self._settle("loading the checkpoint", records, replies)
            return await self._finish(records, CHECKPOINT_VERSION, verify=False, expected=None)

    async def _push_in_one_call(
        self, records: list[EngineRecord], update_info: dict, meta: UpdateMetadata, version: str, kv: KvRule
    ) -> dict:
        """A one-call live push: one call per engine (engine/weights.py ``push``) pauses it if it
        runs, starts, receives, finishes and labels the push; the front resumes the engines it
        paused once all have it (``end``), so that none serves the push unless every one took it.
        Its stages in ``last_push`` are the slowest engine's account of its own (``resume``: the
        front's). Called with the registry's lock held."""
        self.updates_begun += 1
        pausing = {r.engine_id for r in records if push_verdict(r) == PAUSE_FOR_PUSH}
        for record in records:
            record.mid_update = True  # its call may begin the update, whatever it answers
        self.update.step(Phase.RECEIVING)  # from here on, weights may be part new
        self.update.receive(meta.names)
        started = time.monotonic()
        replies = await self.live.push(records, update_info, version, kv, pausing)
        self.last_update_s = time.monotonic() - started
        for record, reply in zip(records, replies):
            if record.engine_id not in pausing:
                continue
            if reply.ok:
                self.registry.record_call(record, "pause")
            elif record.up:
                await self._control.reread(record, "pause")  # it may have paused before it failed
            if record.paused:
                self.update.current.paused_for_push.append(record)
        await self._settle("push", records, replies, at_fault=push_at_fault(records, replies))
        self.fleet.transport.engines_took(meta, records)
        slowest = max((rep.body["stages"] for rep in replies), key=lambda stages: sum(stages.values()))
        self.update.current.stages.update(slowest)
        return await self._finished(records, replies, version, verify=False, expected=None, kv=kv)

    async def _begin(self, records: list[EngineRecord]) -> None:
        """Open the update on every engine's live weights: engines that are running are paused for
        it first; one whose weights are asleep refuses it (nothing is touched)."""
        self.updates_begun += 1
        if (reason := unpushable(records)) is not None:
            raise SyncError(409, f"cannot start a weight update: {reason}")
        running = [r for r in records if push_verdict(r) == PAUSE_FOR_PUSH]
        with self.timed("pause"):
            paused = await self.fleet.call_all(running, "/pause", query=_PAUSE_FOR_PUSH)
        for record, reply in zip(running, paused):
            if reply.ok:
                self.registry.record_call(record, "pause")
            elif record.up:
                # It may have paused all the same: asked, so that the update's end resumes it if so.
                await self._control.reread(record, "pause")
            if record.paused:
                self.update.current.paused_for_push.append(record)
        self.update.step(Phase.RECEIVING)  # from here on, weights may be part new
        await self._settle("pausing engines for the push", running, paused)
        with self.timed("start"):
            replies = await self.fleet.call_all(records, "/start_weight_update")
        for record, reply in zip(records, replies):
            record.mid_update = reply.ok or reply.status >= 500  # one that did not answer may have started
        await self._settle("start_weight_update", records, replies)

    async def _finish(
        self,
        records: list[EngineRecord],
        version: str,
        verify: bool,
        expected: Checksums | None,
        kv: KvRule = "recompute",
    ) -> dict:
        """Every engine takes the update and serves ``version``: the fleet's account of it, and the
        update's end. Called with the registry's lock held."""
        path = self._path()
        left_behind: list[EngineRecord] = []
        if self.update.phase is Phase.STAGING:
            records, left_behind = self.staged.holders()
            if not records:
                reason = "no engine holds the staged push any more: each restarted since it staged it"
                await self.end_abandoned(reason)
                raise SyncError(409, f"{reason}; push again")
            if (reason := unpushable(records)) is not None:
                reason = f"cannot swap the staged push in: {reason}"
                await self.end_abandoned(reason)  # no live weight was touched
                raise SyncError(409, reason)
            try:
                # Its chunks were checked one by one; a layer is whole or not only once all came.
                why = "the staged push was not swapped in, and every engine serves its weights as before"
                self.fleet.check_whole_update(self.update.received, why)
            except SyncError as exc:
                await self.end_abandoned(str(exc))  # its copies dropped, no live weight touched
                raise
            self.updates_begun += 1
        with self.timed("finish"):
            replies, extras = await path.apply(records, version, kv)
        await self._settle(path.apply_step, records, replies)
        if path is self.staged:
            self.last_update_s = extras["swap_seconds"]
            self.last_staged_swap = {"seconds": extras["swap_seconds"], "installed": extras["installed"]}
        return await self._finished(records, replies, version, verify, expected, kv, extras, left_behind)

    async def _finished(
        self,
        records: list[EngineRecord],
        replies: list[EngineReply],
        version: str,
        verify: bool,
        expected: Checksums | None,
        kv: KvRule,
        extras: dict | None = None,
        left_behind: list[EngineRecord] | None = None,
    ) -> dict:
        """Every engine of ``records`` took the update and serves ``version`` (``replies``: their
        answers): the fleet's account of it, its check if asked, and the update's end. Called with
        the registry's lock held."""
        self.registry.fleet_weight_version = version
        self.fleet.metrics.push_seconds.observe(time.monotonic() - self.update.current.started_at)
        self.fleet.metrics.push_bytes.labels("sent").inc(self.update.current.bytes_sent)
        self.fleet.metrics.push_bytes.labels("dense").inc(self.update.current.bytes_dense)
        missing = [] if self.update.current.whole_checkpoint else self.fleet.missing(self.update.received)
        for record, reply in zip(records, replies, strict=True):
            record.weight_version = version
            record.mid_update = False
            record.push_failures = 0
            applied = reply.body.get("applied")
            record.delta_base = version if isinstance(applied, dict) and applied.get("base") is True else None
            if not record.up or record.stale is None:
                continue
            # Its weights were not the fleet's before (discarded by a sleep, mixed by an abort,
            # another version): only a push of every tensor makes them so.
            self.registry.set_stale(record, _not_covered(version, missing))
        self._leave_behind(left_behind or [], version)
        self._checks.forget()
        current = self.update.current
        try:
            if verify:
                with self.timed("verify"):
                    checked = await self._checks.verify(records, expected)
                self._checks.raise_unless_verified(*checked)
        finally:
            await self.end(finished=True)
            self.last_push = {
                "weight_version": version,
                "seconds": round(time.monotonic() - min(current.started_at, current.first_stage_at), 6),
                "stages": {stage: round(seconds, 6) for stage, seconds in current.stages.items()},
                **applied_by(replies),
                **current.account(),
            }
            self.fleet.unplanned |= unplanned_by(replies)
        log.info("weight version %s on %d engine(s)%s", version, len(records), ", verified" if verify else "")
        answer = {
            "status": "finished",
            "weight_version": version,
            "kv": kv,
            "engines": [rep.as_json() for rep in replies],
            **(extras or {}),
        }
        return {**answer, "verified": True} if verify else answer

    def _leave_behind(self, records: list[EngineRecord], version: str) -> None:
        """Engines that lost their staging copy (a new process since they staged it) serve the old
        weights: held out, each catches up with ``version`` from a peer. One still coming up finds
        itself behind the fleet when it joins (bringup.py), and catches up then."""
        for record in records:
            if not record.up:
                continue
            log.warning("engine %d: its process restarted since it staged %s: it catches up", record.engine_id, version)
            self.registry.set_stale(
                record, f"it restarted while the staged push of {version} was received, and holds no copy of it"
            )
            if self.catch_up_later is not None:
                self.catch_up_later(record)

    async def _settle(
        self,
        step: str,
        records: list[EngineRecord],
        replies: list[EngineReply],
        collective: bool = False,
        at_fault: list[EngineRecord] | None = None,
    ) -> None:
        """Go on after a step, or abort the whole update if any engine failed it; an engine that
        fails pushes by itself ``--max-push-failures`` times in a row is retired (``at_fault``: the
        engines that failed by themselves, where the step's own rule does not say)."""
        failed = failure(step, replies)
        if failed is None:
            return
        if at_fault is None:
            at_fault = self._at_fault(records, replies, collective)
        for record in at_fault:
            record.push_failures += 1
        await self._abort(failed[1])
        for record in at_fault:
            if record.push_failures >= self._max_failures and record.up:
                self._supervisor.retire(
                    record,
                    f"it failed {record.push_failures} pushes in a row (--max-push-failures"
                    f" {self._max_failures}), the last at {step}",
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

    async def end_abandoned(self, reason: str) -> None:
        """The server ends an update its trainer left, or that cannot go on: engines that began it
        abort it; if none had, the update ends without touching their weights."""
        if self.update.phase is Phase.RECEIVING:
            await self._abort(reason)
        else:
            await self.end(abandoned_because=reason)

    async def _abort(self, reason: str) -> None:
        """End the update on every engine that may have begun it: each keeps its process and serves
        nothing (stale) until the next push; one that cannot even end it is restarted. Called with
        the registry's lock held, it waits at most ``_ABORT_ANSWER_S`` for the engines' answers
        before the update's end (``end``: resumes, dropped copies): an engine whose
        workers are inside the trainer's broken collective answers only once the group's own timeout
        ends it (a hung trainer holds it open), and waiting for it would keep a crashed engine's
        replacement out of the fleet for as long; such an engine ends its part beside the fleet,
        shown ``receiving``, and a new transfer group waits for it (``ends_of_aborts``)."""
        self.fleet.metrics.push_failures.inc()
        began = [r for r in self.registry.records if r.mid_update]
        for record in began:
            if record.up:
                self.registry.set_stale(record, ABORTED)  # out of routing now, not once it answers
        group = self.fleet.transport.transport.group
        timeout_s = self.fleet.group_timeout_s + 30 if group else self.fleet.timeout_s
        calls = {
            record: asyncio.ensure_future(call_engine(record, "/abort_weight_update", timeout_s=timeout_s))
            for record in began
        }
        if calls:
            await asyncio.wait(calls.values(), timeout=_ABORT_ANSWER_S)
        late = 0
        for record, call in calls.items():
            if call.done():
                self._ended(record, call.result(), reason)
            else:
                late += 1
                paused_for_push = record in self.update.current.paused_for_push
                ending = _LateAbort(record, record.pid, call, reason, paused_for_push)
                ending.task = asyncio.create_task(self._end_late(ending))
                self._ending[record.engine_id] = ending
        if group:
            self.fleet.leave_group()
        log.error(
            "weight update aborted: %s; %d engine(s) held out until the next push%s",
            reason,
            len(began),
            f", {late} still ending it inside the broken transfer" if late else "",
        )
        await self.end(abandoned_because=reason)

    def _ended(self, record: EngineRecord, reply: EngineReply, reason: str) -> None:
        """An engine answered the abort: its update is over; one that could not end it is restarted."""
        record.mid_update = False
        if record.up and not reply.ok:
            self._supervisor.restart_in_background(
                record, f"a weight update was aborted ({reason}) and the engine could not end it: {reply.message}"
            )

    async def _end_late(self, ending: _LateAbort) -> None:
        await asyncio.wait({ending.call})
        async with self.registry.fleet_change():
            await self._ended_late(ending)

    async def _ended_late(self, ending: _LateAbort) -> None:
        """An engine answered the abort after the update ended: as ``_ended``, under the fleet's
        lock (once: by ``_end_late`` or ``ends_of_aborts``); resumed as the update's end would
        have (``end``), if the push paused it."""
        if self._ending.get(ending.record.engine_id) is not ending:
            return
        del self._ending[ending.record.engine_id]
        record = ending.record
        if record.pid != ending.pid or not record.mid_update:
            return  # a new process since, which began no update
        reply = ending.call.result()
        self._ended(record, reply, ending.reason)
        if reply.ok:
            log.info("engine %d: ended the aborted update", record.engine_id)
        if ending.resume and record.up:
            await self._resume([record])

    async def ends_of_aborts(self) -> None:
        """Once every engine still ending an aborted update has answered (each within its call's
        timeout): a new transfer group needs their workers out of the old one. Called with the
        registry's lock held."""
        if not self._ending:
            return
        log.info("waiting for %d engine(s) to end an aborted update", len(self._ending))
        endings = list(self._ending.values())
        await asyncio.wait({ending.call for ending in endings})
        for ending in endings:
            await self._ended_late(ending)

    async def end(self, abandoned_because: str | None = None, finished: bool = False) -> None:
        """An update is over, however: staging copies it left go, engines it paused run again, its
        segments go (but the one its trainer reuses, once it ``finished``). ``abandoned_because``: the
        server ended it, not its trainer (its later calls are refused)."""
        current = self.update.current
        if current.copies_held:
            await self._drop_copies(self.registry.members())
        self.update.end(abandoned_because)
        with self.timed("resume", current):  # the update is over: its own record, not the next one's
            await self._resume(current.paused_for_push)
        if removed := self.fleet.transport.update_ended(finished):
            log.info("removed %d shared-memory segment(s) the trainer left", len(removed))

    async def _resume(self, paused_for_push: list[EngineRecord]) -> None:
        """Engines a push paused run again, unless the fleet is paused (or the engine asleep, or
        still inside an update: ``_end_late`` resumes it once it has ended)."""
        if self.registry.intent.paused:
            return
        resumable = [
            r for r in paused_for_push if r.up and r.residency.paused and not r.residency.sleeping and not r.mid_update
        ]
        replies = await self.fleet.call_all(resumable, "/resume")
        for record, reply in zip(resumable, replies):
            if reply.ok and record.up:
                self.registry.record_call(record, "resume")
            elif record.up:
                await self._still_paused(record, reply.message)

    async def _drop_copies(self, records: list[EngineRecord]) -> None:
        """Every engine throws its staging copy away; one that cannot is restarted (a copy left
        behind holds a push's bytes for ever)."""
        replies = await self.staged.drop(records)
        for record, reply in zip(records, replies):
            if not reply.ok and record.up:
                self._supervisor.restart_in_background(
                    record, f"it could not drop a staged push's copy: {reply.message}"
                )

    async def _still_paused(self, record: EngineRecord, why: str) -> None:
        """A resume after the push failed: if vLLM still holds the engine paused, the requests routed
        to it would wait for ever; it is restarted (those whose caller has nothing yet may move
        to another engine: proxy.py)."""
        log.warning("engine %d: resuming after the push failed: %s", record.engine_id, why)
        await self._control.reread(record, "resume")
        if record.up and record.residency.paused:
            self._supervisor.restart_in_background(record, f"it could not be resumed after a push: {why}")
