"""Whether each engine holds the weights its label says, judged from vLLM's per-tensor checksums.

An engine is held to a reference: the checksums the trainer says it expects,
else those the fleet agreed on under its current label, else those more
than half the engines hold. When no checksums are held by more than half the
engines there is no reference, and none of them can be trusted.
"""

from __future__ import annotations

from collections import Counter

import attrs

from ..wire import Checksums


def differing(checksums: Checksums, reference: Checksums) -> list[str]:
    """The tensors whose digests differ, or that one side lacks."""
    return sorted(k for k in checksums.keys() | reference.keys() if checksums.get(k) != reference.get(k))


def _majority(held: list[Checksums]) -> Checksums | None:
    counts = Counter(tuple(sorted(c.items())) for c in held)
    if not counts:
        return None
    most, count = counts.most_common(1)[0]
    return dict(most) if 2 * count > len(held) else None


@attrs.frozen
class Verdict:
    reference: Checksums | None
    # Each checked engine's tensors that differ from the reference ([]: it matches).
    differing: dict[int, list[str]]

    @property
    def disagreeing(self) -> list[int]:
        return [engine for engine, names in self.differing.items() if names]

    def engine_result(self, engine: int) -> dict:
        names = self.differing[engine]
        return {"match": not names, "mismatches": names}


def judge(held: dict[int, Checksums], reference: Checksums | None) -> Verdict:
    """Compare every engine's checksums with ``reference``, or with the majority's if it is None."""
    reference = reference if reference is not None else _majority(list(held.values()))
    if reference is None:
        split = sorted({k for c in held.values() for k in c if len({h.get(k) for h in held.values()}) > 1})
        return Verdict(None, {engine: split for engine in held})
    return Verdict(reference, {engine: differing(c, reference) for engine, c in held.items()})
