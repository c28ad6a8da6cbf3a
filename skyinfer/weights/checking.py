"""Holding engines to one set of weights: vLLM's weight checker over the fleet, the checksums
the fleet agreed on under its label, and relabelling the weights without a transfer."""

from __future__ import annotations

from ..fleet.engine_calls import EngineReply
from ..fleet.state import EngineRecord
from ..wire import Checksums, WeightCheckRequest
from .fleet import Fleet, SyncError
from .phases import Phase
from .verify import Verdict, judge

__all__ = ("WeightChecks",)


class WeightChecks:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.registry = fleet.registry
        # The checksums held under a label, once a check saw engines agree on them (any engine
        # that differed was held out).
        self._agreed: tuple[str, Checksums] | None = None

    def forget(self) -> None:
        """New weights: what the engines agreed on before says nothing about them."""
        self._agreed = None

    def agreed(self) -> Checksums | None:
        """The checksums the engines were seen to agree on under the fleet's label, if any."""
        if self._agreed is not None and self._agreed[0] == self.registry.fleet_weight_version:
            return self._agreed[1]
        return None

    async def _weight_checker(self, records: list[EngineRecord], action: str) -> list[EngineReply]:
        return await self.fleet.call_all(records, "/weight_checker", body={"action": action})

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

    async def verify(self, records: list[EngineRecord], expected: Checksums | None) -> tuple[Verdict, list[dict]]:
        """Hold each engine to ``expected``, or to what the fleet agreed on under its label; one
        that differs is held out (stale) until the next push. Called with the registry lock held."""
        verdict, checked = await self._judge(records, expected or self.agreed())
        for record in records:
            if record.engine_id in verdict.disagreeing and record.up:
                differing = len(verdict.differing[record.engine_id])
                self.registry.set_stale(
                    record, f"its weights differ from the fleet's in {differing} tensor(s) (weight_checker)"
                )
        if verdict.reference is not None and len(verdict.disagreeing) < len(verdict.differing):
            self._agreed = (self.registry.fleet_weight_version, verdict.reference)
        return verdict, checked

    @staticmethod
    def raise_unless_verified(verdict: Verdict, checked: list[dict]) -> None:
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

    async def check(self, request: WeightCheckRequest) -> dict:
        """vLLM's ``/weight_checker`` for the fleet. ``checksum`` holds out an engine that differs
        from the fleet; ``compare`` only reports; ``reset`` zeroes weights, so those engines serve
        nothing until the next push."""
        self.fleet.refuse_unless(Phase.IDLE, Phase.STARTED)
        async with self.registry.fleet_change():
            self.fleet.refuse_unless(Phase.IDLE, Phase.STARTED)
            if request.action == "reset":
                return await self._reset()
            current = [r for r in self.registry.up() if r.stale is None]
            if request.action == "checksum":
                verdict, checked = await self.verify(current, None)
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

    async def _reset(self) -> dict:
        records = self.registry.up()
        replies = await self._weight_checker(records, "reset")
        # A failed reset may have zeroed part of the weights: those engines are held out too.
        for record in records:
            if record.up:
                self.registry.set_stale(record, "its weights were zeroed (weight_checker reset): push before it serves")
        self.fleet.raise_if_failed("weight_checker reset", replies)
        return {
            "status": "reset",
            "held_out": [r.engine_id for r in records],
            "engines": [rep.as_json() for rep in replies],
        }

    async def relabel(self, new_version: str) -> dict:
        """vLLM's ``/update_weight_version`` for the fleet. Stale engines hold other weights than
        the fleet's, so they keep their own label (and stay stale); an engine that fails to take
        the new one is held out as stale too, so that no answer carries a label its weights lack."""
        self.fleet.refuse_unless(Phase.IDLE)
        async with self.registry.fleet_change():
            self.fleet.refuse_unless(Phase.IDLE)
            current = [r for r in self.fleet.engines() if r.stale is None]
            replies = await self.fleet.call_all(current, "/update_weight_version", body={"new_version": new_version})
            for record, reply in zip(current, replies):
                if reply.ok:
                    record.weight_version = new_version
                elif record.up:
                    self.registry.set_stale(record, f"it could not take the fleet's new label {new_version!r}")
            if (known := self.agreed()) is not None:
                self._agreed = (new_version, known)
            self.registry.fleet_weight_version = new_version
        self.fleet.raise_if_failed("update_weight_version", replies)
        return {"status": "relabelled", "weight_version": new_version, "engines": [rep.as_json() for rep in replies]}
