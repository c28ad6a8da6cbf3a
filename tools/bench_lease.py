#!/usr/bin/env python
"""In-process cost of the front's own work per request, with no network and no engine: the lease
(``LocalLeases.lease``: the pick, the engine's connection hold, its counters) and ``forward``'s
reads of a body (the session, the prompt group, the model), over a registry of two engines that
serve. Best of ``--rounds`` runs of ``--requests`` each, in µs per request.

    .venv/bin/python tools/bench_lease.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.devices import plan_engine_devices
from skyinfer.fleet.registry import EngineRegistry
from skyinfer.fleet.state import EngineRecord, Lifecycle
from skyinfer.serving import proxy
from skyinfer.serving.leasing import Ask, LocalLeases

from benchlib import bench_parser, write_json

# bench_front.py's plain request.
BODY = b'{"model": "bench-front-model", "prompt": "' + b"tell me something about the weather in a few words " * 4
BODY += b'", "max_tokens": 16}'


class _OpenClient:
    closed = False


async def _lease(leases: LocalLeases, n: int) -> None:
    for _ in range(n):
        async with leases.lease(Ask(), ()):
            pass


async def _reads(_leases: LocalLeases, n: int) -> None:
    for _ in range(n):
        body, session = proxy._front_fields(BODY)
        group = proxy.prompt_group(body, 1024, "/v1/completions")
        Ask(session_id=session, group=group, model=proxy.requested_model(body))


async def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    plans = plan_engine_devices("cpu", [1, 1], 1)
    records = [EngineRecord(engine_id=i, devices=plans[i], socket_path=f"/nonexistent/{i}") for i in range(2)]
    for record in records:
        record.lifecycle, record.client = Lifecycle.UP, _OpenClient()
    leases = LocalLeases(EngineRegistry(records))
    rows = []
    for name, work in (("lease", _lease), ("reads of the body", _reads)):
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            await work(leases, args.requests)
            times.append(1e6 * (time.perf_counter() - started) / args.requests)
        print(f"{name}: {min(times):.2f} µs per request (best of {args.rounds}; worst {max(times):.2f})")
        rows.append({"what": name, "best_us": min(times), "worst_us": max(times)})
    write_json(args, rows)


if __name__ == "__main__":
    asyncio.run(main())
