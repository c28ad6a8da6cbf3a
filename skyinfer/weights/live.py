"""The live path of a weight update: the engines' live weights take the push, running engines
paused for it. In a session of calls, each chunk (``/update_weights``) lands between vLLM's start,
which the first chunk brings, and its finish (``/finish_weight_update``); a whole push made in one
call is one ``/push`` per engine (engine/weights.py). push.py keeps the fleet's account of both."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..engine_wire import PUSH_RECEIVE_FAILED
from ..fleet.engine_calls import EngineReply, call_engine, gather_until_failure
from ..fleet.state import EngineRecord
from ..transfer.protocol import UpdateMetadata
from ..wire import KvRule
from .fleet import Fleet
from .phases import Phase

__all__ = ("LivePath", "applied_by", "push_at_fault", "unplanned_by")


def unplanned_by(replies: list[EngineReply]) -> set[str]:
    """The tensors the engines' workers load by their loaders (no apply plan): a delta sends them whole."""
    return {
        name for rep in replies if isinstance(a := rep.body.get("applied"), dict) for name in a.get("unplanned", ())
    }


def applied_by(replies: list[EngineReply]) -> dict:
    """How the engines' workers applied a live push (receiving.py's ``LiveReceiver``): "in place" or
    "layerwise reload", the seconds the slowest spent loading and repacking in place, and how many
    tensors each applied by its plan (transfer/plans.py); nothing for a staged push, whose engines
    swap a copy in."""
    applied = [rep.body["applied"] for rep in replies if isinstance(rep.body.get("applied"), dict)]
    if not applied:
        return {}
    answer = {"applied": ", ".join(sorted({a["applied"] for a in applied}))}
    for seconds in ("load_s", "repack_s"):
        if any(seconds in a for a in applied):
            answer[seconds] = max(a.get(seconds, 0.0) for a in applied)
    if any("by_plan" in a for a in applied):
        # Tensors applied by their plans on the engine that applied fewest; plans the most recorded.
        answer["by_plan"] = min(a.get("by_plan", 0) for a in applied)
        answer["plans_recorded"] = max(a.get("plans_recorded", 0) for a in applied)
    return answer


class LivePath:
    """The engines' calls of the live path: a session's chunks and finish, or a whole push."""

    receive_step = "update_weights"
    apply_step = "finish_weight_update"

    def __init__(self, fleet: Fleet, begin: Callable[[list[EngineRecord]], Awaitable[None]]):
        self.fleet = fleet
        self._begin = begin

    def fits(self, records: list[EngineRecord], meta: UpdateMetadata | None) -> None:
        """The live weights take the bytes in place: nothing more to hold."""

    async def receive(
        self, records: list[EngineRecord], update_info: dict, meta: UpdateMetadata
    ) -> tuple[list[EngineReply], dict]:
        if self.fleet.update.phase is not Phase.RECEIVING:
            await self._begin(records)
        self.fleet.update.receive(meta.names)
        body = {"update_info": update_info}
        timeout_s = self.fleet.timeout_s
        replies = await gather_until_failure(
            [(r, call_engine(r, "/update_weights", timeout_s=timeout_s, body=body)) for r in records]
        )
        return replies, {"status": "updated", "engines": [rep.as_json() for rep in replies]}

    async def apply(self, records: list[EngineRecord], version: str, kv: KvRule) -> tuple[list[EngineReply], dict]:
        body = {"weight_version": version, "kv": kv}
        return await self.fleet.call_all(records, "/finish_weight_update", body=body), {}

    async def push(
        self, records: list[EngineRecord], update_info: dict, version: str, kv: KvRule, pausing: set[int]
    ) -> list[EngineReply]:
        """A whole push, one ``/push`` per engine: pausing it first if its id is in ``pausing``,
        then vLLM's start, the receive, vLLM's finish and ``version``. A collective with the
        trainer: one engine's failure cuts the others' calls short."""
        body = {"update_info": update_info, "weight_version": version, "kv": kv}
        timeout_s = self.fleet.timeout_s
        return await gather_until_failure(
            [
                (r, call_engine(r, "/push", timeout_s=timeout_s, body={**body, "pause": r.engine_id in pausing}))
                for r in records
            ]
        )


def push_at_fault(records: list[EngineRecord], replies: list[EngineReply]) -> list[EngineRecord]:
    """The engines that failed a whole push by themselves: one that failed at a step of its own
    (its pause, start or finish, as its error's code says); one that failed at the receive, when
    another engine did its part (else the trainer, or the group, failed them all)."""
    own, at_receive = [], []
    for record, reply in zip(records, replies):
        if reply.code == PUSH_RECEIVE_FAILED:
            at_receive.append(record)
        elif not reply.ok and not reply.cut_short:
            own.append(record)
    return own + at_receive if any(reply.ok for reply in replies) else own
