#!/usr/bin/env python
"""What an engine crash costs an RL run: the callers' requests, and the weights.

Two engines serve the demo model (float32); a trainer (``GlooTrainer``, in this process) pushes a
modified checkpoint, so that the fleet serves a version the disk does not have. Rounds alternate:

* under load: 32 greedy requests (half streamed, completions, ``--max-tokens`` each) on engine 1,
  then its EngineCore SIGKILLed once every stream has events; per round, whether every request
  ended whole with no error event, the tokens engine 1 had generated that were kept (the
  continuation's ``tokens_kept``: before streams continued, a stream lost them with an error
  event, a request that was not streamed started over), and for the streams that went on, the
  longest gap the caller saw between two events beside the median gap of the round;
* at rest: the same kill with nothing in flight.

After each kill: seconds until engine 1 serves the pushed version again (``GET /engines``: ready,
at the fleet's version, with no push: peer catch-up), and until it is back at all.

    .venv/bin/python tools/bench_crash.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from skyinfer.demo_model import build_demo_model

from benchlib import bench_parser, free_port, scratch_dir, start_skyinfer, stop, wait_servers, write_json

PROMPT = "Reinforcement learning from verifiable rewards"
VERSION = "bench-crash"


def push(url: str, model: Path) -> None:
    from skyinfer.trainer import GlooTrainer

    from pushes import modified_weights

    trainer = GlooTrainer(url, delta=False)
    trainer.init()
    trainer.push(modified_weights(model, 7).items(), version=VERSION)


async def engines(http: aiohttp.ClientSession, url: str) -> list[dict]:
    async with http.get(f"{url}/engines") as r:
        return (await r.json())["engines"]


def engine_core(engine_pid: int) -> psutil.Process:
    (core,) = [p for p in psutil.Process(engine_pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]
    return core


async def sessions_on(http: aiohttp.ClientSession, url: str, model: str, engine: int, count: int) -> list[str]:
    found = []
    for i in range(1000):
        body = {"model": model, "prompt": "x", "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-ID": f"b{i}"}) as r:
            if r.headers["X-Skyinfer-Engine"] == str(engine):
                found.append(f"b{i}")
        if len(found) == count:
            return found
    raise RuntimeError("too few sessions on the engine")


async def one_request(http, url, model, session, stream, max_tokens, started) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "return_token_ids": True}  # fmt: skip
    result = {"tokens": 0, "errors": 0, "kept": None, "gaps": []}
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-ID": session}) as r:
        if not stream:
            answer = await r.json()
            result["tokens"] = len(answer["choices"][0]["token_ids"]) if r.status == 200 else 0
            result["errors"] = int(r.status != 200)
            return result
        last = None
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                result["gaps"].append((now - last, result["tokens"]))
            last = now
            event = orjson.loads(line[len(b"data: ") :])
            if "error" in event:
                result["errors"] += 1
                continue
            if "skyinfer_continued" in event:
                result["kept"] = event["skyinfer_continued"]["tokens_kept"]
                result["continued_at"] = result["tokens"]
            result["tokens"] += sum(len(c.get("token_ids") or []) for c in event["choices"])
            if result["tokens"] >= 8 and not result.get("counted"):
                result["counted"] = True
                started.release()
    return result


# The phases ``back`` times, seconds after the kill.
SEEN = ("dead", "restarting", "up", "serving")


async def back(http, url, killed_at: float, restarts_before: int) -> dict[str, float | None]:
    """Seconds from the kill until the front saw engine 1 dead, began its restart (a backoff
    after the death), had it up again (from the checkpoint on disk), and until it served the
    pushed version (after the catch-up from its peer)."""
    seen: dict[str, float | None] = dict.fromkeys(SEEN)
    while time.monotonic() - killed_at < 300:
        engine = (await engines(http, url))[1]
        now = time.monotonic() - killed_at
        if engine["state"] in ("dead", "restarting") and seen["dead"] is None:
            seen["dead"] = now
        if engine["state"] == "restarting" and seen["restarting"] is None:
            seen["restarting"] = now
        restarted = engine["restarts"] > restarts_before
        if restarted and engine["state"] in ("ready", "stale") and seen["up"] is None:
            seen["up"] = now
        if restarted and engine["state"] == "ready" and engine["weight_version"] == VERSION:
            seen["serving"] = now
            return seen
        await asyncio.sleep(0.05)
    return seen


async def one_round(http, url, model, loaded: bool, max_tokens: int, spares: bool) -> dict:
    # Each kill meets the fleet as a crash in a run would: every engine serving, and engine 1's
    # spare standing by (unless the server runs without spares).
    while [(e["state"], e["spare"]) for e in await engines(http, url)][1] != ("ready", "waiting" if spares else None):
        await asyncio.sleep(0.5)
    before = (await engines(http, url))[1]
    sessions = await sessions_on(http, url, model, 1, 32) if loaded else []
    started = asyncio.Semaphore(0)
    tasks = [asyncio.create_task(one_request(http, url, model, s, i % 2 == 0, max_tokens, started))
             for i, s in enumerate(sessions)]  # fmt: skip
    for _ in range(len(sessions) // 2):
        await asyncio.wait_for(started.acquire(), 120)
    engine_core(before["pid"]).send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    watching = asyncio.create_task(back(http, url, killed_at, before["restarts"]))
    results = await asyncio.gather(*tasks)
    done_s = time.monotonic() - killed_at
    out = await watching
    if loaded:
        gaps = [g for r in results for g, _ in r["gaps"]]
        breaks = [max(g for g, at in r["gaps"] if at == r["continued_at"]) for r in results if r.get("continued_at")]
        out |= {
            "whole": sum(r["tokens"] == max_tokens and not r["errors"] for r in results),
            "errors": sum(r["errors"] for r in results),
            "kept": sum(r["kept"] or 0 for r in results),
            "median_gap_ms": 1000 * statistics.median(gaps),
            "longest_break_ms": 1000 * max(breaks) if breaks else None,
            "done_s": done_s,
        }
    return out


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


async def run(url: str, model: str, rounds: int, max_tokens: int, spares: bool) -> list[dict]:
    """Each kill's figures, as printed; as rows (``--json``), one per kill."""
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for i in range(rounds):
            for loaded in (True, False):
                r = await one_round(http, url, model, loaded, max_tokens, spares)
                rows.append(
                    {"round": i + 1, "loaded": loaded, **{f"{k}_s" if k in SEEN else k: v for k, v in r.items()}}
                )
                line = (f"round {i + 1} {'under load' if loaded else 'at rest   '}: serving {VERSION} again"
                        f" {_s(r['serving'])} s after the kill (seen dead {_s(r['dead'])}, restart begun"
                        f" {_s(r['restarting'])}, up {_s(r['up'])}, caught up {_s(r['serving'])})")  # fmt: skip
                if loaded:
                    line += (f"; {r['whole']}/32 whole, {r['errors']} error events, {r['kept']} tokens kept;"
                             f" continued streams' longest break {r['longest_break_ms']:.0f} ms"
                             f" (median gap {r['median_gap_ms']:.1f} ms); all done {r['done_s']:.1f} s after the kill")  # fmt: skip
                print(line, flush=True)
    return rows


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `skyinfer serve` arguments")
    args = p.parse_args()
    model = build_demo_model(scratch_dir("bench-crash-") / "demo")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = [a for a in args.serve_args if a != "--"]
    proc = start_skyinfer(str(model), port, ["--dtype", "float32", "--health-interval", "1",
                          "--session-rebalance-factor", "0",
                          # Every round kills engine 1 again: no restart limit may retire it.
                          "--max-restarts", "100", *extra], dict(os.environ), engines=2,
                          log_name="bench-crash-skyinfer.log")  # fmt: skip
    try:
        asyncio.run(wait_servers([(url, proc)], path="/ready"))
        push(url, model)
        spares = not any(a == "--warm-spares" and b == "0" for a, b in itertools.pairwise(extra))
        rows = asyncio.run(run(url, str(model), args.rounds, args.max_tokens, spares))
    finally:
        stop(proc)
    write_json(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
