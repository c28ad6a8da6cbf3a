#!/usr/bin/env python
"""Weight-push throughput: skyinfer against a raw gloo broadcast of the same bytes.

skyinfer serves a synthetic Qwen2 of a few hundred MB (the demo model made
wider and deeper) on one engine per node, so the transfer group is the
trainer plus one worker per node, as in the reference: plain torch
processes, the trainer broadcasting the same packed buffers (same chunking)
to one receiver per node over gloo. A push is timed from the trainer's first
HTTP call to the return of the last: checks, transfer, loading into vLLM's
model, finish. The figure is the ratio of bytes per second. Also counted,
from each node's own metrics: HTTP calls per push (one broadcast per tensor,
and packed into buffers).

With ``--nodes 2`` each node is a separate ``skyinfer serve`` on a core of
its own (as separate machines would be), joined into one group through
``MultiNodeClient``; the reference then broadcasts to two receivers.

    .venv/bin/python tools/bench_weight_sync.py --pushes 3
    .venv/bin/python tools/bench_weight_sync.py --pushes 3 --nodes 2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import free_port, start_skyinfer, stop, wait_servers  # noqa: E402

from skyinfer.demo_model import build_demo_model  # noqa: E402
from skyinfer.trainer import GlooTrainer  # noqa: E402
from skyinfer.transfer.packing import DEFAULT_BUFFER_SIZE_BYTES, TensorMeta, pack, plan_chunks  # noqa: E402

BENCH_MODEL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64)  # fmt: skip


WEIGHT_ROUTES = ("/start_weight_update", "/update_weights", "/finish_weight_update")


def weight_calls(urls: list[str]) -> int:
    """HTTP calls to the weight routes so far, over every node, as the nodes count them."""
    from prometheus_client.parser import text_string_to_metric_families

    calls = 0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
            if family.name == "skyinfer_requests":
                calls += sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels["route"] in WEIGHT_ROUTES)
    return int(calls)


def weights_of(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    return [(name, t.clone()) for name, t in sorted(tensors.items())]


def raw_receiver(port: int, rank: int, world: int, chunk_sizes: list[int], pushes: int) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    group = torch.distributed.ProcessGroupGloo(store, rank, world, timedelta(seconds=120))
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(pushes):
        for size in chunk_sizes:
            group.broadcast([torch.empty(size, dtype=torch.uint8)], opts).wait()


def raw_gloo(tensors, pushes: int, buffer_size: int, receivers: int) -> list[float]:
    """Seconds per push for the same bytes, same chunks, from one plain torch process to ``receivers``."""
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    by_name = dict(tensors)
    chunks = list(plan_chunks(metas, buffer_size))
    sizes = [sum(m.nbytes for m in c) for c in chunks]
    port, world = free_port(), receivers + 1
    procs = [
        mp.get_context("spawn").Process(target=raw_receiver, args=(port, rank, world, sizes, pushes))
        for rank in range(1, world)
    ]
    for proc in procs:
        proc.start()
    store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timedelta(seconds=120))
    group = torch.distributed.ProcessGroupGloo(store, 0, world, timedelta(seconds=120))
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    times = []
    for _ in range(pushes):
        started = time.perf_counter()
        for chunk in chunks:
            group.broadcast([pack([by_name[m.name] for m in chunk])], opts).wait()
        times.append(time.perf_counter() - started)
    for proc in procs:
        proc.join()
    return times


def skyinfer_pushes(urls: list[str], tensors, pushes: int, buffer_size: int, packed: bool) -> tuple[list[float], list[int]]:
    trainer = GlooTrainer(urls if len(urls) > 1 else urls[0], timeout_s=300, buffer_size_bytes=buffer_size, packed=packed)
    trainer.init()
    times, calls = [], []
    for i in range(pushes):
        before = weight_calls(urls)
        started = time.perf_counter()
        trainer.push(tensors, version=f"bench-{i}")
        times.append(time.perf_counter() - started)
        calls.append(weight_calls(urls) - before)
    trainer.close()
    return times, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--buffer-size-mb", type=int, default=DEFAULT_BUFFER_SIZE_BYTES // 2**20)
    p.add_argument("--nodes", type=int, default=1, help="skyinfer servers, one engine each, each on its own core")
    args = p.parse_args()
    buffer_size = args.buffer_size_mb * 2**20
    model_dir = build_demo_model(Path(tempfile.mkdtemp(prefix="bench-weights-")), **BENCH_MODEL)
    tensors = weights_of(model_dir)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"model: {len(tensors)} tensors, {total / 2**20:.0f} MiB ({tensors[0][1].dtype})", file=sys.stderr)

    raw = raw_gloo(tensors, args.pushes, buffer_size, receivers=args.nodes)
    cores = sorted(os.sched_getaffinity(0))
    ports = [free_port() for _ in range(args.nodes)]
    procs = [
        start_skyinfer(str(model_dir), port, ["--cpu-kvcache-gib", "1", "--max-model-len", "512"], dict(os.environ),
                       log_name=f"bench-skyinfer-{k}.log", cores={cores[k % len(cores)]} if args.nodes > 1 else None)
        for k, port in enumerate(ports)
    ]  # fmt: skip
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        asyncio.run(wait_servers(list(zip(urls, procs)), path="/ready"))
        sky, calls = skyinfer_pushes(urls, tensors, args.pushes, buffer_size, packed=False)
        # Packed: the tensors go in a few buffers, cut by vLLM's rule; same HTTP calls.
        packed, packed_calls = skyinfer_pushes(urls, tensors, 1, buffer_size, packed=True)
    finally:
        for proc in procs:
            stop(proc)

    raw_s, sky_s = statistics.median(raw), statistics.median(sky)
    print(f"{args.pushes} pushes of {total / 2**20:.0f} MiB to {args.nodes} node(s), "
          f"raw packed in {buffer_size // 2**20} MiB buffers, median")  # fmt: skip
    print(f"{'':28s} {'seconds':>8s} {'MiB/s':>8s}")
    print(f"{'raw gloo broadcast':28s} {raw_s:8.3f} {total / 2**20 / raw_s:8.0f}")
    print(f"{'skyinfer push (end to end)':28s} {sky_s:8.3f} {total / 2**20 / sky_s:8.0f}")
    print(f"{'skyinfer push, packed':28s} {packed[0]:8.3f} {total / 2**20 / packed[0]:8.0f}")
    print(f"throughput ratio skyinfer / raw: {raw_s / sky_s:.3f}")
    print(f"HTTP calls per push over all nodes: {calls} ({len(tensors)} tensors), packed {packed_calls}")


if __name__ == "__main__":
    main()
