#!/usr/bin/env python
"""Weight-push throughput: skyinfer against the same bytes moved by plain means.

skyinfer serves a synthetic Qwen2 of a few hundred MB (the demo model made wider and deeper). A
push is timed from the trainer's first HTTP call to the return of the last: checks, transfer,
loading into vLLM's model, finish. Figures are medians over alternating rounds.

``--transport gloo`` (engines on devices of their own): one engine per node, the transfer group
the trainer plus one worker per node, against a raw gloo broadcast of the same packed buffers
(the trainer's buckets, ``--buffer-size-mb``, its default 32) from a plain torch process to one
receiver per node. Also counted, from each node's own metrics: HTTP calls per push; and the same
push made by one ``/update_weights`` call (``one_call=True``), timed beside the three-call one in
each round, and (after the rounds) with one broadcast per tensor (``packed=False``). With ``--nodes 2`` each node is a separate
``skyinfer serve`` on a core of its own, joined into one group through ``MultiNodeClient``.

``--transport shm`` (colocated): one ``skyinfer serve --colocate`` with ``--engines`` engines,
pushed into by ``SharedMemoryTrainer`` in the colocated shape (engines asleep, weights awake; the
push alone is timed), against a plain memcpy of the same bytes into a buffer per engine (the
physical limit on one node), a raw gloo broadcast of them to one receiver per engine, and
skyinfer's own gloo push into the same engines started without ``--colocate`` (the same reload
into vLLM, another transport).

    .venv/bin/python tools/bench_weight_sync.py --pushes 3
    .venv/bin/python tools/bench_weight_sync.py --pushes 3 --nodes 2
    .venv/bin/python tools/bench_weight_sync.py --transport shm --pushes 5
    .venv/bin/python tools/bench_weight_sync.py --quantized --pushes 3
    .venv/bin/python tools/bench_weight_sync.py --delta --nodes 2 --pushes 3
    .venv/bin/python tools/bench_weight_sync.py --model demo --pushes 5   # a push's fixed cost

``--delta``: one AdamW step at a learning rate of 1e-6 over the bf16 weights, then, alternating,
the trainer's delta push of the step (only the elements it changed: ``GlooTrainer``'s default)
against a dense push of the same weights (``dense=True``, its way back); the fraction of elements
the step changed, the bytes the delta sent against those elements' int32 positions and values,
and the time ratio. ``--nodes 2`` across two servers, as above.

``--quantized``: the same model served twice, in bf16 and as int8 W8A8 (one engine each, each on a
core of its own), and a trainer holding the bf16 weights pushing to both in turn with gloo: to the
bf16 engine as they are, to the int8 engine quantized by ``skyinfer.transfer.quantize`` as it
pushes (the quantizing timed with the push). Bytes sent and seconds of each.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_int8_model, build_demo_model
from skyinfer.trainer import GlooTrainer, SharedMemoryTrainer
from skyinfer.transfer.delta import SentWeights
from skyinfer.transfer.packing import GLOO_BUCKET_BYTES, TensorMeta, pack, plan_chunks
from skyinfer.transfer.quantize import quantize_w8a8_int8

from benchlib import bench_parser, free_port, scratch_dir, start_skyinfer, stop, wait_servers, write_json

BENCH_MODEL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64)  # fmt: skip
# No warm spares: a spare builds its engine (20 CPU-s on the engine's core) while the pushes are timed.
ENGINE_ARGS = ["--cpu-kvcache-gib", "1", "--max-model-len", "512", "--warm-spares", "0"]
IDLE_S = 1.5


WEIGHT_ROUTES = ("/start_weight_update", "/update_weights", "/finish_weight_update")
# What /weight_info's last_push says of how the engines applied the push, and how its tensors came.
APPLIED_KEYS = ("applied", "load_s", "repack_s", "by_plan", "plans_recorded", "layout")


def weight_calls(urls: list[str]) -> int:
    """HTTP calls to the weight routes so far, over every node, as the nodes count them."""
    from prometheus_client.parser import text_string_to_metric_families

    calls = 0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
            if family.name == "skyinfer_requests":
                calls += sum(
                    s.value for s in family.samples if s.name.endswith("_total") and s.labels["route"] in WEIGHT_ROUTES
                )
    return int(calls)


def weights_of(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    return [(name, t.clone()) for name, t in sorted(tensors.items())]


class RawGloo:
    """A plain torch process broadcasting the same bytes, in the same chunks, to ``receivers`` others."""

    def __init__(self, tensors, buffer_size: int, receivers: int, pushes: int):
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        by_name = dict(tensors)
        self.chunks = [pack([by_name[m.name] for m in chunk]) for chunk in plan_chunks(metas, buffer_size)]
        port, world = free_port(), receivers + 1
        sizes = [c.numel() for c in self.chunks]
        self.procs = [
            mp.get_context("spawn").Process(target=_raw_receiver, args=(port, rank, world, sizes, pushes))
            for rank in range(1, world)
        ]
        for proc in self.procs:
            proc.start()
        store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timedelta(seconds=120))
        self.group = torch.distributed.ProcessGroupGloo(store, 0, world, timedelta(seconds=120))
        self.store = store

    def push(self) -> float:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        started = time.perf_counter()
        for chunk in self.chunks:
            self.group.broadcast([chunk], opts).wait()
        return time.perf_counter() - started

    def close(self) -> None:
        for proc in self.procs:
            proc.join()


def _raw_receiver(port: int, rank: int, world: int, chunk_sizes: list[int], pushes: int) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    group = torch.distributed.ProcessGroupGloo(store, rank, world, timedelta(seconds=120))
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(pushes):
        for size in chunk_sizes:
            group.broadcast([torch.empty(size, dtype=torch.uint8)], opts).wait()


class Memcpy:
    """The same bytes copied into one buffer per engine: allocated and touched beforehand (the
    engines' weights are), or fresh (the pages a new segment needs)."""

    def __init__(self, tensors, engines: int):
        self.sources = [t.reshape(-1).view(torch.uint8) for _, t in tensors]
        self.total = sum(s.numel() for s in self.sources)
        self.destinations = [torch.ones(self.total, dtype=torch.uint8) for _ in range(engines)]

    def _copy(self, destinations) -> float:
        started = time.perf_counter()
        for destination in destinations:
            offset = 0
            for source in self.sources:
                destination[offset : offset + source.numel()].copy_(source)
                offset += source.numel()
        return time.perf_counter() - started

    def push(self) -> float:
        return self._copy(self.destinations)

    def push_fresh(self) -> float:
        return self._copy([torch.empty(self.total, dtype=torch.uint8) for _ in self.destinations])


def timed_push(trainer, tensors, version: str, **how) -> float:
    started = time.perf_counter()
    trainer.push(tensors, version=version, **how)
    return time.perf_counter() - started


def median_row(label: str, seconds: list[float], mib: float, out: list[dict], step: str) -> str:
    """A printed row: the median, MiB/s, each round; added to ``out`` as a row for ``--json``."""
    s = statistics.median(seconds)
    out.append({"step": step, "what": label.strip(), "seconds": s, "mib_per_s": mib / s, "rounds": seconds})
    return f"{label:38s} {s:8.3f} {mib / s:8.0f}   {' '.join(f'{x:.3f}' for x in seconds)}"


def rl_loop_step(client, push=None) -> float:
    """One step of the RL loop's weight sync as examples/rl_loop.py makes it: pause (keep), the
    push if any, resume; its seconds."""
    started = time.perf_counter()
    client.pause(mode="keep")
    if push is not None:
        push()
    client.resume()
    return time.perf_counter() - started


def start_nodes(args, model_dir: Path) -> tuple[list[str], list]:
    """``args.nodes`` skyinfer servers of one engine each (each on a core of its own, for several):
    their URLs and processes."""
    cores = sorted(os.sched_getaffinity(0))
    ports = [free_port() for _ in range(args.nodes)]
    procs = [
        start_skyinfer(
            str(model_dir),
            port,
            ENGINE_ARGS,
            dict(os.environ),
            log_name=f"bench-skyinfer-{k}.log",
            cores={cores[k % len(cores)]} if args.nodes > 1 else None,
        )
        for k, port in enumerate(ports)
    ]
    return [f"http://127.0.0.1:{port}" for port in ports], procs


def optimizer_step(tensors: list[tuple[str, torch.Tensor]], lr: float = 1e-6) -> list[tuple[str, torch.Tensor]]:
    """The tensors after one AdamW step at ``lr`` (gradients drawn at random), in their own dtype."""
    params = [torch.nn.Parameter(t.clone()) for _, t in tensors]
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    torch.optim.AdamW(params, lr=lr).step()
    return [(name, p.detach()) for (name, _), p in zip(tensors, params)]


def bench_delta(args, model_dir: Path, tensors, mib: float, buffer_size: int) -> None:
    """After one AdamW step at 1e-6: the trainer's delta push of the step against a dense push of
    the same weights (its way back), alternating, into ``args.nodes`` nodes; the bytes each sent."""
    stepped = optimizer_step(tensors)
    elements = sum(t.numel() for _, t in tensors)
    changed = sum(
        int((a.view(-1).view(torch.int16) != b.view(-1).view(torch.int16)).sum())
        for (_, a), (_, b) in zip(tensors, stepped)
    )
    urls, procs = start_nodes(args, model_dir)
    delta_s, dense_s, sent = [], [], []
    try:
        asyncio.run(wait_servers(list(zip(urls, procs)), path="/ready"))
        trainer = GlooTrainer(urls if len(urls) > 1 else urls[0], timeout_s=300, buffer_size_bytes=buffer_size)
        trainer.init()
        trainer.push(tensors, "base", one_call=True)  # no base yet: whole
        for i in range(args.pushes):
            delta_s.append(timed_push(trainer, stepped, f"delta-{i}", one_call=True))
            last_push = httpx.get(f"{urls[0]}/weight_info", timeout=30).json()["last_push"]
            sent.append(last_push["bytes"])
            dense_s.append(timed_push(trainer, tensors, f"dense-{i}", one_call=True, dense=True))
        trainer.close()
        # The trainer's own share: comparing the step with what it last pushed.
        base = SentWeights()
        base.took(tensors, "base")
        started = time.perf_counter()
        base.diff(stepped)
        diff_s = time.perf_counter() - started
    finally:
        for proc in procs:
            stop(proc)
    ideal = changed * (4 + tensors[0][1].element_size())  # each changed element's int32 position and value
    print(f"{args.pushes} alternating rounds, {mib:.0f} MiB to {args.nodes} node(s); median, then each round")
    print(f"elements changed by one AdamW step at lr 1e-6: {changed} of {elements} ({changed / elements:.4%})")
    print(f"{'':38s} {'seconds':>8s} {'MiB/s':>8s}")
    rows: list[dict] = []
    print(median_row("dense push of the step's weights", dense_s, mib, rows, "dense"))
    print(median_row("delta push of the step", delta_s, mib, rows, "delta"))
    ratios = {
        "delta / dense time": statistics.median(delta_s) / statistics.median(dense_s),
        "delta bytes / changed positions and values": sent[-1]["sent"] / ideal,
        "delta bytes / dense bytes": sent[-1]["sent"] / sent[-1]["dense"],
        "changed elements / elements": changed / elements,
    }
    for name, value in ratios.items():
        print(f"ratio {name}: {value:.4f}")
    applied = {k: v for k, v in last_push.items() if k in APPLIED_KEYS}
    print(f"the last delta push: stages {last_push['stages']}, applied {applied}; the trainer's diff {diff_s:.3f} s")
    write_json(
        args, rows, mib=mib, tensors=len(tensors), ratios=ratios, bytes=sent[-1], changed_elements=changed,
        stages=last_push["stages"], applied=applied, trainer_diff_s=diff_s,
    )  # fmt: skip


def bench_gloo(args, model_dir: Path, tensors, mib: float, buffer_size: int) -> None:
    urls, procs = start_nodes(args, model_dir)
    raw = RawGloo(tensors, buffer_size, receivers=args.nodes, pushes=args.pushes)
    raw_s, sky_s, one_call_s, calls = [], [], [], []
    loop_alone_s, loop_push_s = [], []  # the RL loop's pause and resume, without and with a one-call push
    # Where each one-call push went, as the (first) front timed its stages (/weight_info's last_push).
    stages: dict[str, list[float]] = {}
    try:
        asyncio.run(wait_servers(list(zip(urls, procs)), path="/ready"))
        trainer = GlooTrainer(
            urls if len(urls) > 1 else urls[0], timeout_s=300, buffer_size_bytes=buffer_size, delta=False
        )
        trainer.init()
        for i in range(args.pushes):
            raw_s.append(raw.push())
            before = weight_calls(urls)
            sky_s.append(timed_push(trainer, tensors, f"bench-{i}"))
            calls.append(weight_calls(urls) - before)
            one_call_s.append(timed_push(trainer, tensors, f"bench-one-call-{i}", one_call=True))
            last_push = httpx.get(f"{urls[0]}/weight_info", timeout=30).json()["last_push"]
            for stage, seconds in last_push["stages"].items():
                stages.setdefault(stage, []).append(seconds)
            loop_alone_s.append(rl_loop_step(trainer.client))
            push = functools.partial(trainer.push, tensors, f"bench-loop-{i}", one_call=True)
            loop_push_s.append(rl_loop_step(trainer.client, push))
        applied = {k: v for k, v in last_push.items() if k in APPLIED_KEYS}
        trainer.close()
        # One broadcast (and one load) per tensor, in one call: what the trainer did before buckets.
        per_tensor = GlooTrainer(urls if len(urls) > 1 else urls[0], timeout_s=300, packed=False, delta=False)
        per_tensor.init()
        per_tensor_s = [
            timed_push(per_tensor, tensors, f"bench-per-tensor-{i}", one_call=True) for i in range(args.pushes)
        ]
        per_tensor.close()
    finally:
        raw.close()
        for proc in procs:
            stop(proc)
    print(
        f"{args.pushes} alternating rounds, {mib:.0f} MiB to {args.nodes} node(s), raw packed in "
        f"{buffer_size // 2**20} MiB buffers; median, then each round"
    )
    print(f"{'':38s} {'seconds':>8s} {'MiB/s':>8s}")
    rows: list[dict] = []
    print(median_row("raw gloo broadcast", raw_s, mib, rows, "raw"))
    print(median_row("skyinfer push (end to end)", sky_s, mib, rows, "skyinfer"))
    print(median_row("skyinfer push, one call", one_call_s, mib, rows, "one_call"))
    print(median_row("skyinfer push, per tensor, one call", per_tensor_s, mib, rows, "per_tensor"))
    print(median_row("RL loop: pause (keep), resume", loop_alone_s, mib, rows, "loop_alone"))
    print(median_row("RL loop: pause, one-call push, resume", loop_push_s, mib, rows, "loop_push"))
    ratios = {
        "skyinfer / raw throughput": statistics.median(raw_s) / statistics.median(sky_s),
        "one call / three calls time": statistics.median(one_call_s) / statistics.median(sky_s),
        "loop with push / loop alone time": statistics.median(loop_push_s) / statistics.median(loop_alone_s),
    }
    print(f"throughput ratio skyinfer / raw: {ratios['skyinfer / raw throughput']:.3f}")
    print(f"time ratio one call / three calls: {ratios['one call / three calls time']:.3f}")
    print(f"time ratio RL loop with the push / without: {ratios['loop with push / loop alone time']:.2f}")
    print(f"HTTP calls per push over all nodes: {calls} ({len(tensors)} tensors)")
    print(f"the last push, as the engines applied it: {applied}")
    one_call_stages = {stage: statistics.median(seconds) for stage, seconds in stages.items()}
    print(
        "the one-call push's stages at the front, medians: "
        + ", ".join(f"{s} {v:.4f} s" for s, v in one_call_stages.items())
    )
    write_json(
        args,
        rows,
        mib=mib,
        tensors=len(tensors),
        ratios=ratios,
        http_calls_per_push=calls,
        one_call_stages=one_call_stages,
        applied=applied,
    )


def bench_quantized(args, model_dir: Path, tensors, mib: float, buffer_size: int) -> None:
    int8_dir = build_demo_int8_model(scratch_dir("bench-int8-"), **BENCH_MODEL)
    ports = [free_port(), free_port()]
    procs = [
        start_skyinfer(
            str(model), port, ENGINE_ARGS, dict(os.environ), log_name=f"bench-skyinfer-{name}.log", cores={k}
        )
        for k, (name, model, port) in enumerate((("bf16", model_dir, ports[0]), ("int8", int8_dir, ports[1])))
    ]
    bf16_url, int8_url = (f"http://127.0.0.1:{port}" for port in ports)
    int8_mib = sum(t.nbytes for _, t in quantize_w8a8_int8(tensors)) / 2**20
    rows = {row: [] for row in ("bf16", "bf16_engine", "int8", "quantizing", "int8_engine")}

    def engine_update_s(url: str) -> float:
        return httpx.get(f"{url}/weight_info", timeout=30).json()["last_update_seconds"]

    try:
        asyncio.run(wait_servers(list(zip((bf16_url, int8_url), procs)), path="/ready"))
        to_bf16 = GlooTrainer(bf16_url, timeout_s=300, buffer_size_bytes=buffer_size, delta=False)
        to_int8 = GlooTrainer(int8_url, timeout_s=300, buffer_size_bytes=buffer_size, delta=False)
        to_bf16.init()
        to_int8.init()
        for i in range(args.pushes):
            # Each push starts on an idle machine (see bench_shm: vLLM's CPU workers busy-wait after a call).
            time.sleep(IDLE_S)
            rows["bf16"].append(timed_push(to_bf16, tensors, f"bench-{i}"))
            rows["bf16_engine"].append(engine_update_s(bf16_url))
            time.sleep(IDLE_S)
            started = time.perf_counter()
            quantized = quantize_w8a8_int8(tensors)
            rows["quantizing"].append(time.perf_counter() - started)
            to_int8.push(quantized, version=f"bench-{i}")
            rows["int8"].append(time.perf_counter() - started)
            rows["int8_engine"].append(engine_update_s(int8_url))
        to_bf16.close()
        to_int8.close()
    finally:
        for proc in procs:
            stop(proc)
    print(f"{args.pushes} alternating rounds, one engine each on a core of its own; median, then each round")
    print(f"{'':38s} {'seconds':>8s} {'MiB/s':>8s}")
    out: list[dict] = []
    print(median_row(f"bf16 push ({mib:.0f} MiB)", rows["bf16"], mib, out, "bf16"))
    print(median_row("  the engine's update", rows["bf16_engine"], mib, out, "bf16_engine"))
    print(median_row(f"int8 W8A8 push, quantized ({int8_mib:.0f} MiB)", rows["int8"], int8_mib, out, "int8"))
    print(median_row("  the trainer quantizing", rows["quantizing"], mib, out, "quantizing"))
    print(median_row("  the engine's update", rows["int8_engine"], int8_mib, out, "int8_engine"))
    ratio = statistics.median(rows["int8"]) / statistics.median(rows["bf16"])
    print(f"bytes int8 / bf16: {int8_mib / mib:.3f}; time int8 / bf16: {ratio:.3f}")
    write_json(args, out, mib=mib, ratios={"int8 / bf16 bytes": int8_mib / mib, "int8 / bf16 time": ratio})


def bench_shm(args, model_dir: Path, tensors, mib: float, buffer_size: int) -> None:
    ports = [free_port(), free_port()]
    colocated_url, separate_url = (f"http://127.0.0.1:{port}" for port in ports)
    procs = [
        start_skyinfer(
            str(model_dir),
            ports[0],
            ["--colocate", *ENGINE_ARGS],
            dict(os.environ),
            engines=args.engines,
            log_name="bench-skyinfer-colocated.log",
        ),
        # The same engines on devices of their own: the gloo transport, for the same bytes and the same reload.
        start_skyinfer(
            str(model_dir),
            ports[1],
            ENGINE_ARGS,
            dict(os.environ),
            engines=args.engines,
            log_name="bench-skyinfer-separate.log",
        ),
    ]
    memcpy = Memcpy(tensors, args.engines)
    raw = RawGloo(tensors, buffer_size, receivers=args.engines, pushes=args.pushes)
    rows: dict[str, list[float]] = {k: [] for k in ("memcpy", "memcpy_fresh", "raw", "shm", "receiving", "gloo")}
    stages: dict[str, list[float]] = {}  # the shared-memory push's, as the front timed them
    try:
        asyncio.run(wait_servers(list(zip((colocated_url, separate_url), procs)), path="/ready"))
        shm_trainer, gloo_trainer = (
            SharedMemoryTrainer(colocated_url, timeout_s=300),
            GlooTrainer(separate_url, timeout_s=300, delta=False),
        )
        shm_trainer.init()
        gloo_trainer.init()
        with httpx.Client(base_url=colocated_url, timeout=300) as http:
            for i in range(args.pushes):
                # Each timed step starts on an idle machine: after each call, the workers of vLLM's CPU
                # executor busy-wait 1 s for the next (shm_broadcast.SpinCondition), on these 2 cores.
                for row, step in (
                    ("memcpy", memcpy.push),
                    ("memcpy_fresh", memcpy.push_fresh),
                    ("raw", raw.push),
                    ("gloo", functools.partial(timed_push, gloo_trainer, tensors, f"bench-{i}")),
                ):
                    time.sleep(IDLE_S)
                    rows[row].append(step())
                # The colocated shape: engines asleep, their weights awake; the push alone is timed.
                for path, params in (("/sleep", {"level": "1"}), ("/wake_up", {"tags": "weights"})):
                    http.post(path, params=params).raise_for_status()
                time.sleep(IDLE_S)
                rows["shm"].append(timed_push(shm_trainer, tensors, f"bench-{i}"))
                info = http.get("/weight_info").json()
                rows["receiving"].append(info["last_update_seconds"])
                for stage, seconds in info["last_push"]["stages"].items():
                    stages.setdefault(stage, []).append(seconds)
                applied = {k: v for k, v in info["last_push"].items() if k in APPLIED_KEYS}
                http.post("/wake_up", params={"tags": "kv_cache"}).raise_for_status()
        shm_trainer.close()
        gloo_trainer.close()
    finally:
        raw.close()
        for proc in procs:
            stop(proc)
    print(
        f"{args.pushes} alternating rounds, {mib:.0f} MiB ({len(tensors)} tensors) into {args.engines} engine(s); "
        "median, then each round"
    )
    print(f"{'':38s} {'seconds':>8s} {'MiB/s':>8s}")
    out: list[dict] = []
    print(median_row(f"memcpy into {args.engines} buffer(s)", rows["memcpy"], mib, out, "memcpy"))
    print(median_row(f"memcpy into {args.engines} fresh buffer(s)", rows["memcpy_fresh"], mib, out, "memcpy_fresh"))
    print(median_row(f"raw gloo broadcast to {args.engines}", rows["raw"], mib, out, "raw"))
    print(median_row("skyinfer gloo push (separate)", rows["gloo"], mib, out, "gloo"))
    print(median_row("skyinfer shared-memory push (colocated)", rows["shm"], mib, out, "shm"))
    print(median_row("  of which the engines' receive", rows["receiving"], mib, out, "receiving"))
    shm = statistics.median(rows["shm"])
    ratios = {
        "shm / memcpy time": shm / statistics.median(rows["memcpy"]),
        "shm / memcpy into fresh pages time": shm / statistics.median(rows["memcpy_fresh"]),
        "raw gloo / shm time": statistics.median(rows["raw"]) / shm,
        "skyinfer gloo / shm time": statistics.median(rows["gloo"]) / shm,
    }
    shm_stages = {stage: statistics.median(seconds) for stage, seconds in stages.items()}
    print(
        "the shared-memory push's stages at the front, medians: "
        + ", ".join(f"{s} {v:.4f} s" for s, v in shm_stages.items())
    )
    print(f"the last push, as the engines applied it: {applied}")
    print(
        f"skyinfer shm / memcpy: {ratios['shm / memcpy time']:.2f}x the time "
        f"({ratios['shm / memcpy into fresh pages time']:.2f}x into fresh pages); faster than raw gloo "
        f"{ratios['raw gloo / shm time']:.2f}x, than skyinfer's gloo push {ratios['skyinfer gloo / shm time']:.2f}x"
    )
    write_json(args, out, mib=mib, tensors=len(tensors), ratios=ratios, stages=shm_stages, applied=applied)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--transport", choices=["gloo", "shm"], default="gloo")
    p.add_argument("--pushes", type=int, default=3, help="alternating rounds")
    p.add_argument("--buffer-size-mb", type=int, default=GLOO_BUCKET_BYTES // 2**20)
    p.add_argument("--nodes", type=int, default=1, help="gloo: skyinfer servers, one engine each, each on its own core")
    p.add_argument("--engines", type=int, default=2, help="shm: engines of the colocated server")
    p.add_argument("--quantized", action="store_true", help="a bf16 push beside an int8 W8A8 one (gloo)")
    p.add_argument("--delta", action="store_true", help="gloo: a delta push after one AdamW step against a dense one")
    p.add_argument(
        "--model",
        choices=["bench", "demo"],
        default="bench",
        help="bench: the model of a few hundred MB; demo: the demo model (about a MB: a push's fixed cost)",
    )
    args = p.parse_args()
    buffer_size = args.buffer_size_mb * 2**20
    model_dir = build_demo_model(scratch_dir("bench-weights-"), **(BENCH_MODEL if args.model == "bench" else {}))
    tensors = weights_of(model_dir)
    mib = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    print(f"model: {len(tensors)} tensors, {mib:.0f} MiB ({tensors[0][1].dtype})", file=sys.stderr)
    bench = (
        bench_quantized if args.quantized
        else bench_delta if args.delta
        else bench_shm if args.transport == "shm"
        else bench_gloo
    )  # fmt: skip
    bench(args, model_dir, tensors, mib, buffer_size)


if __name__ == "__main__":
    main()
