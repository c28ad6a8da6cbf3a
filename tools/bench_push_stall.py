#!/usr/bin/env python
"""What a push costs the callers: the longest stall of any stream while a trainer pushes.

One skyinfer engine serves a model; ``--streams`` streamed completions decode while a trainer
(``GlooTrainer``, in a process of its own, as a training script is) pushes the whole checkpoint. Per push, the longest gap between two events of any stream that overlaps the
push, beside the median gap between events outside pushes (the decode step the callers see).
Three ways to push, in alternating order each round:

* ``pausing``: today's push: the engine paused (keep) for the whole transfer, KV recomputed;
* ``staged``: received into a staging copy while the engine generates, paused for the swap only,
  KV recomputed (the exact rule);
* ``staged-keep``: the same, the running requests going on over the KV they have.

Also per round: the same push with nothing running (the transfer and load alone). Printed: p50
and p99 over pushes of the longest stall, as milliseconds and as a multiple of the median gap,
and the push call's time beside the pausing push's.

    .venv/bin/python tools/bench_push_stall.py --model-gb 1 --rounds 3
    .venv/bin/python tools/bench_push_stall.py --model-gb 0 --streams 16   # the demo model
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model

from benchlib import bench_parser, free_port, start_skyinfer, stop, wait_servers, write_json

# Wider than the demo model, as deep as needed for ``--model-gb`` (bf16, head_dim 64 as the demo).
_WIDE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, head_dim=64)
_LAYER_PARAMS = 2048 * 2048 * 2 + 2048 * 256 * 2 + 3 * 2048 * 5632
# Events of a stream closer than this came in one read from the socket.
_SAME_READ_S = 0.0005
MODES = {"pausing": {}, "staged": {"staged": True}, "staged-keep": {"staged": True, "kv": "keep"}}


def build_model(base: Path, model_gb: float) -> Path:
    if model_gb <= 0:
        return build_demo_model(base / "demo")
    layers = max(1, math.ceil(model_gb * 1e9 / 2 / _LAYER_PARAMS))
    return build_demo_model(base / f"wide-{layers}", num_hidden_layers=layers, **_WIDE)


def checkpoint_tensors(model: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The model's own tensors, slightly changed (a training step's worth), as a trainer holds them."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for path in sorted(model.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 1e-3
            tensors.append((name, (tensor.float() + noise).to(tensor.dtype)))
    return tensors


def trainer_loop(url: str, model: str, commands) -> None:
    """The trainer's process: set up the transfer once, then one push per command, answering its time."""
    from skyinfer.trainer import GlooTrainer

    tensors = [checkpoint_tensors(Path(model), seed) for seed in (1, 2)]
    trainer = GlooTrainer(url, timeout_s=600, delta=False)
    trainer.init()
    commands.send("ready")
    while (command := commands.recv()) is not None:
        which, version, options = command
        started = time.monotonic()
        trainer.push(tensors[which], version, **options)
        commands.send(time.monotonic() - started)
    trainer.close()


class Trainer:
    """The trainer process, driven from here."""

    def __init__(self, url: str, model: Path):
        context = multiprocessing.get_context("spawn")
        self._commands, theirs = context.Pipe()
        self.process = context.Process(target=trainer_loop, args=(url, str(model), theirs), daemon=True)
        self.process.start()
        assert self._commands.recv() == "ready"

    def push(self, which: int, version: str, **options) -> float:
        self._commands.send((which, version, options))
        return self._commands.recv()

    def close(self) -> None:
        self._commands.send(None)
        self.process.join(60)


class Streams:
    """``n`` streamed completions, each event's arrival time kept."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, n: int, max_tokens: int):
        self.arrivals: list[list[float]] = [[] for _ in range(n)]
        body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.tasks = [asyncio.create_task(self._one(http, url, {**body, "prompt": f"stream {i}"}, i)) for i in range(n)]

    async def _one(self, http, url: str, body: dict, i: int) -> None:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"stream {i}: {r.status} {await r.text()}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    self.arrivals[i].append(time.monotonic())

    async def started(self, events: int = 3) -> None:
        while min(len(a) for a in self.arrivals) < events:
            await asyncio.sleep(0.01)

    def gaps(self) -> list[tuple[float, float]]:
        """Between events of a stream that came in different reads (events read together are one step's)."""
        return [(a, b) for times in self.arrivals for a, b in itertools.pairwise(times) if b - a > _SAME_READ_S]


def stall(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest gap between two events of a stream that overlaps [start, end]."""
    return max((b - a for a, b in gaps if b >= start and a <= end), default=0.0)


def outside(gaps: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[float]:
    return [b - a for a, b in gaps if all(b < s or a > e for s, e in windows)]


async def one_round(url: str, model: str, trainer: Trainer, args, order: list[str], round_no: int) -> dict:
    results: dict[str, dict] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        for mode in order:
            streams = Streams(http, url, model, args.streams, args.max_tokens)
            await streams.started()
            await asyncio.sleep(args.settle_s)
            start = time.monotonic()
            version = f"r{round_no}-{mode}"
            await asyncio.to_thread(trainer.push, round_no % 2, version, **MODES[mode])
            end = time.monotonic()
            await asyncio.gather(*streams.tasks)
            gaps = streams.gaps()
            results[mode] = {"push_s": end - start, "stall_s": stall(gaps, start, end),
                             "median_gap_s": statistics.median(outside(gaps, [(start, end)]))}  # fmt: skip
            print(f"round {round_no} {mode:12} {orjson.dumps(results[mode]).decode()}", flush=True)
        start = time.monotonic()
        await asyncio.to_thread(trainer.push, (round_no + 1) % 2, f"r{round_no}-rest")
        results["at rest"] = {"push_s": time.monotonic() - start}
        print(f"round {round_no} {'at rest':12} {orjson.dumps(results['at rest']).decode()}", flush=True)
    return results


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--model-gb", type=float, default=1.0, help="a synthetic model of at least this size; 0: the demo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--settle-s", type=float, default=1.0, help="decoding before the push begins")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.model_gb)
        nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"model {model.name}: {nbytes / 1e9:.2f} GB", flush=True)
        port = free_port()
        server = start_skyinfer(str(model), port, ["--warm-spares", "0"], dict(os.environ))
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(wait_servers([(url, server)]))
            trainer = Trainer(url, model)
            rounds = []
            for round_no in range(args.rounds):
                order = list(MODES) if round_no % 2 == 0 else list(reversed(MODES))
                rounds.append(asyncio.run(one_round(url, str(model), trainer, args, order, round_no)))
            trainer.close()
        finally:
            stop(server)
    write_json(args, report(rounds), model_gb=round(nbytes / 1e9, 2))
    return 0


def report(rounds: list[dict]) -> list[dict]:
    """The medians printed; as rows (``--json``), one per mode and one for the push at rest."""
    pausing = statistics.median(r["pausing"]["push_s"] for r in rounds)
    at_rest = statistics.median(r["at rest"]["push_s"] for r in rounds)
    rows = []
    print(f"\npush at rest (transfer and load alone): median {at_rest * 1e3:.0f} ms")
    print(f"{'mode':12} {'stall p50':>10} {'stall p99':>10} {'median gap':>11} {'x gap p50':>10} {'x gap max':>10}"
          f" {'push p50':>9} {'push / pausing':>15}")  # fmt: skip
    for mode in MODES:
        stalls = [r[mode]["stall_s"] for r in rounds]
        ratios = [r[mode]["stall_s"] / r[mode]["median_gap_s"] for r in rounds]
        gap = statistics.median(r[mode]["median_gap_s"] for r in rounds)
        push = statistics.median(r[mode]["push_s"] for r in rounds)
        p99 = statistics.quantiles(stalls, n=100)[98] if len(stalls) > 1 else stalls[0]
        print(f"{mode:12} {statistics.median(stalls) * 1e3:8.0f}ms {p99 * 1e3:8.0f}ms {gap * 1e3:9.1f}ms"
              f" {statistics.median(ratios):9.1f}x {max(ratios):9.1f}x {push * 1e3:7.0f}ms {push / pausing:14.2f}x")  # fmt: skip
        rows.append({"mode": mode, "stall_p50_ms": statistics.median(stalls) * 1e3, "stall_p99_ms": p99 * 1e3,
                     "median_gap_ms": gap * 1e3, "stall_x_gap": statistics.median(ratios),
                     "stall_x_gap_max": max(ratios), "push_ms": push * 1e3, "push_x_pausing": push / pausing})  # fmt: skip
    print("\nstall: the longest gap between two events of any stream overlapping the push")
    print("median gap: between events of the same streams outside the push")
    return [*rows, {"mode": "at rest", "push_ms": at_rest * 1e3}]


if __name__ == "__main__":
    sys.exit(main())
