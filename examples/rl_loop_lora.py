"""The RL loop with a LoRA policy: a PEFT adapter trained on top of the served base model.

Per iteration: rollouts through the adapter (each request's ``model`` is the
adapter's name, each sample its own session id); toy rewards; group-normalized
advantages; a real ``torch`` optimizer step on the adapter's parameters only
(``peft``); then pause (keep), push the adapter's tensors and PEFT config into
every engine over the weight-transfer group (no disk shared with the server),
resume. Rollouts of the next iteration must carry the new adapter version in
``X-Weight-Version``; the base model keeps serving its own weights throughout.

    skyinfer serve --engines 2 --enable-lora --max-lora-rank 8 &      # the demo model
    python examples/rl_loop_lora.py --url http://127.0.0.1:8000 --iterations 3

Prints per-iteration timings and, last, a JSON summary.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from rl_loop import PROMPTS, loop_arguments, train_step
from transformers import AutoModelForCausalLM

from skyinfer.client import AsyncClient
from skyinfer.trainer import GlooTrainer


async def rollouts(
    http: aiohttp.ClientSession, url: str, adapter: str, prompt_ids, group: int, max_tokens: int, it: int
):
    async def one(p: int, g: int) -> dict:
        body = {
            "model": adapter,
            "prompt": prompt_ids[p],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-ID": f"lora-{it}-{p}-{g}"}) as r:
            r.raise_for_status()
            out = await r.json()
            return {"prompt": p, "token_ids": out["choices"][0]["token_ids"], "version": r.headers["X-Weight-Version"]}

    return await asyncio.gather(*(one(p, g) for p in range(len(prompt_ids)) for g in range(group)))


async def run(args) -> dict:
    client = AsyncClient(args.url, api_key=args.api_key, admin_key=args.admin_key)
    models = await client.models()
    model_dir = models[0].get("root") or models[0]["id"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab_size = base.config.vocab_size
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", lora_dropout=0.0)
    policy = get_peft_model(base, config)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=args.lr)
    prompt_ids = [await client.tokenize(p) for p in PROMPTS[: args.prompts]]

    trainer = GlooTrainer(args.url, admin_key=args.admin_key or args.api_key)
    await asyncio.to_thread(trainer.init)

    async def push(version: str) -> None:
        await asyncio.to_thread(
            trainer.push_adapter, args.adapter, get_peft_model_state_dict(policy).items(), config, version
        )

    # The adapter as initialized (PEFT's B is zero: the base model's behaviour) serves the first rollouts.
    version = f"{args.adapter}-step-0"
    await push(version)
    summary = {"iterations": [], "versions_seen": []}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as http:
        for it in range(args.iterations):
            t0 = time.perf_counter()
            samples = await rollouts(http, args.url, args.adapter, prompt_ids, args.group, args.max_tokens, it)
            seen = {s["version"] for s in samples}
            assert seen == {version}, f"iteration {it}: rollouts on {seen}, expected {version}"
            t1 = time.perf_counter()
            mean_reward, loss = await asyncio.to_thread(train_step, policy, optimizer, prompt_ids, samples, vocab_size)
            t2 = time.perf_counter()
            await client.pause(mode="keep")
            version = f"{args.adapter}-step-{it + 1}"
            await push(version)
            await client.resume()
            t3 = time.perf_counter()
            timings = {"rollout": t1 - t0, "train": t2 - t1, "pause+push+resume": t3 - t2}
            print(
                f"iter {it}: reward {mean_reward:.3f} loss {loss:+.4f} | "
                + " ".join(f"{k} {v * 1000:.0f}ms" for k, v in timings.items()),
                flush=True,
            )
            summary["iterations"].append({"reward": mean_reward, "loss": loss, "seconds": timings})
            summary["versions_seen"].append(sorted(seen))
        final = await rollouts(http, args.url, args.adapter, prompt_ids, 1, args.max_tokens, args.iterations)
    assert {s["version"] for s in final} == {version}
    summary["final_version"] = version
    summary["base_version"] = (await client.weight_info())["weight_version"]
    trainer.close()
    await client.aclose()
    return summary


def main() -> int:
    p = loop_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--adapter", default="rl-policy", help="the name the adapter is served as")
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
