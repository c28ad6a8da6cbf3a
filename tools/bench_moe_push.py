#!/usr/bin/env python
"""Push time into a mixture-of-experts engine against a dense engine of the same bytes.

Two synthetic checkpoints with the demo model's tokenizer, every layer's MLP the same number of
parameters: a dense Qwen2 (intermediate 4096) and a Qwen3-MoE (8 experts of width 512, top 2), so
that the MoE model has 8x the MLP tensors, each 1/8 the size. One ``skyinfer serve`` of one engine
for each; a ``GlooTrainer`` push (as a trainer makes it: start, one broadcast per tensor, finish)
timed from its first HTTP call to the return of its last, into the dense server and into the MoE
server in turn, several alternating rounds. What the MoE push does beyond the dense one: more,
smaller broadcasts, and on CPU each MoE layer's experts padded and packed again (docs: guides/moe).

    .venv/bin/python tools/bench_moe_push.py --rounds 3
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model, build_demo_moe_model
from skyinfer.trainer import GlooTrainer

from benchlib import bench_parser, free_port, scratch_dir, start_skyinfer, stop, wait_servers, write_json

SHAPE = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64)
DENSE = dict(intermediate_size=4096)
MOE = dict(
    intermediate_size=4096, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=True
)
ENGINE_ARGS = ["--cpu-kvcache-gib", "1", "--max-model-len", "512", "--warm-spares", "0"]


def tensors_of(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def timed_push(trainer: GlooTrainer, tensors, version: str) -> float:
    started = time.perf_counter()
    trainer.push(tensors, version=version)
    return time.perf_counter() - started


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = p.parse_args()
    base = scratch_dir("bench-moe-")
    models = {
        "dense": build_demo_model(base / "dense", **SHAPE, **DENSE),
        "moe": build_demo_moe_model(base / "moe", "qwen3_moe", **SHAPE, **MOE),
    }
    tensors = {kind: tensors_of(path) for kind, path in models.items()}
    mib = {kind: sum(t.numel() * t.element_size() for _, t in ts) / 2**20 for kind, ts in tensors.items()}
    ports = {kind: free_port() for kind in models}
    procs = {
        kind: start_skyinfer(
            str(models[kind]), ports[kind], ENGINE_ARGS, dict(os.environ), log_name=f"bench-moe-{kind}.log"
        )
        for kind in models
    }
    urls = {kind: f"http://127.0.0.1:{port}" for kind, port in ports.items()}
    seconds: dict[str, list[float]] = {kind: [] for kind in models}
    try:
        asyncio.run(wait_servers([(urls[kind], procs[kind]) for kind in models], path="/ready"))
        trainers = {kind: GlooTrainer(urls[kind], timeout_s=300, delta=False) for kind in models}
        for trainer in trainers.values():
            trainer.init()
        for i in range(args.rounds):
            for kind in models:
                seconds[kind].append(timed_push(trainers[kind], tensors[kind], f"bench-{i}"))
        for trainer in trainers.values():
            trainer.close()
    finally:
        for proc in procs.values():
            stop(proc)
    print(f"{args.rounds} alternating rounds, one engine each, bf16 as written; median, then each round")
    print(f"{'':8s} {'tensors':>8s} {'MiB':>8s} {'seconds':>8s} {'MiB/s':>8s}")
    rows = []
    for kind in models:
        median = statistics.median(seconds[kind])
        rounds = " ".join(f"{s:.3f}" for s in seconds[kind])
        print(f"{kind:8s} {len(tensors[kind]):8d} {mib[kind]:8.0f} {median:8.3f} {mib[kind] / median:8.0f}   {rounds}")
        rows.append(
            {"model": kind, "tensors": len(tensors[kind]), "mib": mib[kind], "seconds": median, "rounds": seconds[kind]}
        )
    ratio = statistics.median(seconds["moe"]) / statistics.median(seconds["dense"])
    print(f"push time MoE / dense: {ratio:.3f} (bytes MoE / dense: {mib['moe'] / mib['dense']:.3f})")
    write_json(args, rows, ratio=ratio)


if __name__ == "__main__":
    main()
