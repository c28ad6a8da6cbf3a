#!/usr/bin/env python
"""LoRA: reloading an adapter and serving with it, skyinfer beside ``vllm serve``.

One engine each, on a core each, the demo model in float32 with the same LoRA
arguments; a real PEFT adapter (random A and B, every linear module). Printed,
median over ``--rounds``:

- time per in-place reload from a local path (skyinfer's ``/v1/load_lora_adapter``
  vs vLLM's own), and per push of the adapter's tensors over the transfer group
  (skyinfer), beside a raw gloo broadcast of the same bytes;
- what keeping stale prefix-cache blocks away costs: skyinfer loads every version
  from a path of its own (vLLM's cache keys include it: a salt). The alternative,
  resetting the prefix cache on every reload, costs the reset call plus a cold
  prefill for every cached prompt, the base model's included: timed on a long
  base-model prompt cached before the reload;
- serving throughput (output tokens per second) with the adapter vs the base model.

    .venv/bin/python tools/bench_lora.py --rounds 5
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import RawGloo

from skyinfer.demo_model import build_demo_model
from skyinfer.trainer import GlooTrainer
from skyinfer.transfer.packing import DEFAULT_BUFFER_SIZE_BYTES

from benchlib import (
    bench_parser,
    free_port,
    scratch_dir,
    start_reference,
    start_skyinfer,
    stop,
    wait_servers,
    write_json,
)

ADAPTER = "bench-lora"
LONG_PROMPT = " ".join(f"w{i % 50} gamma" for i in range(300))  # about 2,000 tokens


def make_adapters(model: str, root: Path, rank: int) -> list[Path]:
    """Two versions of one adapter (different weights), as peft saves them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(root / f"v{seed}")
        paths.append(root / f"v{seed}")
    return paths


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def path_reloads(url: str, paths: list[Path], rounds: int) -> list[float]:
    def reload(path: Path) -> None:
        body = {"lora_name": ADAPTER, "lora_path": str(path), "load_inplace": True}
        httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120).raise_for_status()

    reload(paths[1])  # loaded once before timing: every timed call replaces a loaded version
    return [timed(functools.partial(reload, paths[i % 2])) for i in range(rounds)]


def pushes(url: str, paths: list[Path], rounds: int) -> tuple[list[float], int]:
    from safetensors.torch import load_file

    adapters = []
    for path in paths:
        tensors = sorted(load_file(str(path / "adapter_model.safetensors")).items())
        adapters.append((tensors, json.loads((path / "adapter_config.json").read_text())))
    trainer = GlooTrainer(url, timeout_s=120)
    trainer.init()
    times = []
    for i in range(rounds):
        tensors, config = adapters[i % 2]
        times.append(timed(functools.partial(trainer.push_adapter, ADAPTER, tensors, config, f"push-{i}")))
    trainer.close()
    return times, sum(t.numel() * t.element_size() for _, t in adapters[0][0])


def base_prompt_latency(url: str, model: str, prompt: str = LONG_PROMPT) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    return timed(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status())


def reset_cost(url: str, model: str, paths: list[Path], rounds: int) -> dict[str, list[float]]:
    """A cached base prompt after a salted reload, and after a reload followed by a cache reset."""
    out = {"salted": [], "reset_call": [], "after_reset": []}
    for i in range(rounds):
        base_prompt_latency(url, model)  # cached
        path_reloads(url, paths[i % 2 :] + paths[: i % 2], 1)
        out["salted"].append(base_prompt_latency(url, model))
        out["reset_call"].append(timed(lambda: httpx.post(f"{url}/reset_prefix_cache", timeout=120).raise_for_status()))
        out["after_reset"].append(base_prompt_latency(url, model))
    return out


async def throughput(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> float:
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(i: int) -> int:
            body = {
                "model": model,
                "prompt": f"request {i}: " + " ".join(f"w{j}" for j in range(40)),
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            async with limit, http.post(f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                return (await r.json())["usage"]["completion_tokens"]

        await one(-1)  # warm
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        return tokens / (time.perf_counter() - started)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    root = scratch_dir("bench-lora-")
    model = str(build_demo_model(root / "model"))
    paths = make_adapters(model, root, args.rank)
    engine_args = [
        "--dtype",
        "float32",
        "--enable-lora",
        "--max-lora-rank",
        str(args.rank),
        "--max-loras",
        "2",
        "--max-model-len",
        "4096",
    ]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cores = sorted(os.sched_getaffinity(0))
    sky_port, ref_port = free_port(), free_port()
    sky_url, ref_url = f"http://127.0.0.1:{sky_port}", f"http://127.0.0.1:{ref_port}"
    procs = [
        start_skyinfer(model, sky_port, engine_args, env, log_name="bench-lora-skyinfer.log", cores={cores[0]}),
        start_reference(model, ref_port, engine_args, env, log_name="bench-lora-vllm.log", cores={cores[-1]}),
    ]
    try:
        asyncio.run(wait_servers([(sky_url, procs[0]), (ref_url, procs[1])]))
        sky_reload = path_reloads(sky_url, paths, args.rounds)
        ref_reload = path_reloads(ref_url, paths, args.rounds)
        push, nbytes = pushes(sky_url, paths, args.rounds)
        from safetensors.torch import load_file

        gloo = RawGloo(
            sorted(load_file(str(paths[0] / "adapter_model.safetensors")).items()),
            DEFAULT_BUFFER_SIZE_BYTES,
            receivers=1,
            pushes=args.rounds,
        )
        raw = [gloo.push() for _ in range(args.rounds)]
        gloo.close()
        costs = reset_cost(sky_url, model, paths, args.rounds)
        # The long prompt, never seen before: a cold prefill, for scale.
        costs["cold"] = [base_prompt_latency(sky_url, model, "never seen " + LONG_PROMPT)]
        serving = {}
        for name, url in (("skyinfer", sky_url), ("vllm serve", ref_url)):
            path_reloads(url, paths, 1)
            for served in (model, ADAPTER):
                serving[name, served] = asyncio.run(
                    throughput(url, served, args.requests, args.concurrency, args.max_tokens)
                )
    finally:
        for proc in procs:
            stop(proc)

    med = statistics.median
    print(
        f"adapter: rank {args.rank}, every linear module, {nbytes / 2**20:.2f} MiB; {args.rounds} rounds, median seconds"
    )
    print(f"{'in-place reload from a local path, skyinfer':46s} {med(sky_reload):8.3f}")
    print(f"{'in-place reload from a local path, vllm serve':46s} {med(ref_reload):8.3f}")
    print(f"{'push over the transfer group, skyinfer':46s} {med(push):8.3f}")
    print(f"{'raw gloo broadcast of the same bytes':46s} {med(raw):8.3f}")
    print(
        f"ratios: skyinfer / vllm serve path reload {med(sky_reload) / med(ref_reload):.2f}; "
        f"push / skyinfer path reload {med(push) / med(sky_reload):.2f}"
    )
    print("stale-cache protection, a cached base prompt of ~2,000 tokens (1 output token) after a reload:")
    print(f"{'  salted (skyinfer: a path per version)':46s} {med(costs['salted']):8.3f}")
    print(f"{'  reset: the reset call':46s} {med(costs['reset_call']):8.3f}")
    print(f"{'  reset: the prompt after it':46s} {med(costs['after_reset']):8.3f}")
    print(f"{'  the prompt cold, for scale':46s} {costs['cold'][0]:8.3f}")
    print(f"  reset / salt: {(med(costs['reset_call']) + med(costs['after_reset'])) / med(costs['salted']):.1f}x")
    print(
        f"serving: {args.requests} requests, {args.concurrency} at a time, {args.max_tokens} tokens each, output tok/s"
    )
    for name in ("skyinfer", "vllm serve"):
        base, lora = serving[name, model], serving[name, ADAPTER]
        print(f"{name:12s} base {base:8.0f}  adapter {lora:8.0f}  adapter / base {lora / base:.2f}")
    print(
        f"skyinfer / vllm serve with the adapter: {serving['skyinfer', ADAPTER] / serving['vllm serve', ADAPTER]:.2f}"
    )
    reset = med(costs["reset_call"]) + med(costs["after_reset"])
    rows = [
        {"what": "reload from a local path, skyinfer", "seconds": med(sky_reload)},
        {"what": "reload from a local path, vllm serve", "seconds": med(ref_reload)},
        {"what": "push over the transfer group, skyinfer", "seconds": med(push)},
        {"what": "raw gloo broadcast of the same bytes", "seconds": med(raw)},
        {"what": "cached prompt after a salted reload", "seconds": med(costs["salted"])},
        {"what": "the reset call", "seconds": med(costs["reset_call"])},
        {"what": "cached prompt after a reset", "seconds": med(costs["after_reset"])},
        {"what": "the prompt cold", "seconds": costs["cold"][0]},
        *(
            {
                "what": f"serving, {name}",
                "base_tok_per_s": serving[name, model],
                "adapter_tok_per_s": serving[name, ADAPTER],
            }
            for name in ("skyinfer", "vllm serve")
        ),
    ]
    write_json(args, rows, adapter_mib=nbytes / 2**20, ratios={"reset / salt": reset / med(costs["salted"])})


if __name__ == "__main__":
    main()
