"""A few iterations of a GRPO-style loop against skyinfer, on CPU, end to end.

Per iteration: rollouts (a group of samples per prompt, each with its own
session id) through ``skyinfer.client``; toy rewards; group-normalized
advantages; a real ``torch`` optimizer step on a ``transformers`` copy of the
policy; then pause (keep), push the new weights into every engine over the
weight-transfer group, resume. Rollouts of the next iteration must carry the
new weight version. A few long "straggler" rollouts are in flight across each
pause; they finish after resume, their tokens split between the two versions.

    skyinfer serve --engines 2 &                      # the demo model
    python examples/rl_loop.py --url http://127.0.0.1:8000 --iterations 3

The reward is a toy (the share of sampled token ids below half the
vocabulary), so the policy visibly moves in a few steps on the random demo
model. Prints per-iteration timings and, last, a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from skyinfer.client import AsyncClient
from skyinfer.trainer import GlooTrainer

PROMPTS = ["Solve: 2 + 3 =", "Write a haiku about gradients", "The capital of France is", "def fibonacci(n):"]


def reward(token_ids: list[int], vocab_size: int) -> float:
    return sum(t < vocab_size // 2 for t in token_ids) / max(1, len(token_ids))


def sequence_logprob(policy, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = policy(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion_ids)[:, None]).sum()


async def rollouts(client: AsyncClient, prompt_ids: list[list[int]], group: int, max_tokens: int, it: int) -> list[dict]:
    async def one(p: int, g: int) -> dict:
        out = await client.generate(
            prompt_ids[p], {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True},
            session_id=f"iter{it}-prompt{p}-sample{g}",
        )  # fmt: skip
        choice = out["choices"][0]
        return {"prompt": p, "token_ids": choice["token_ids"], "versions": {s["version"] for s in choice["weight_versions"]}}

    return await asyncio.gather(*(one(p, g) for p in range(len(prompt_ids)) for g in range(group)))


def train_step(policy, optimizer, prompt_ids, samples, vocab_size: int) -> tuple[float, float]:
    rewards = torch.tensor([reward(s["token_ids"], vocab_size) for s in samples])
    groups = torch.tensor([s["prompt"] for s in samples])
    advantages = torch.zeros_like(rewards)
    for p in groups.unique():
        mask = groups == p
        r = rewards[mask]
        advantages[mask] = (r - r.mean()) / (r.std() + 1e-4)
    optimizer.zero_grad()
    loss = -sum(a * sequence_logprob(policy, prompt_ids[s["prompt"]], s["token_ids"]) for a, s in zip(advantages, samples))
    loss = loss / len(samples)
    loss.backward()
    optimizer.step()
    return rewards.mean().item(), loss.item()


async def run(args) -> dict:
    client = AsyncClient(args.url, api_key=args.api_key, admin_key=args.admin_key)
    models = await client.models()
    model_dir = models[0].get("root") or models[0]["id"]
    served_dtype = getattr(torch, (await client.engines())[0]["model_dtype"])
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab_size = policy.config.vocab_size
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    prompt_ids = [await client.tokenize(p) for p in PROMPTS[: args.prompts]]

    # The trainer's side of the weight-transfer group: rank 0, every engine's workers after it.
    trainer = GlooTrainer(args.url, admin_key=args.admin_key or args.api_key)
    await asyncio.to_thread(trainer.init)
    version = (await client.weight_info())["weight_version"] or "as-loaded"
    summary = {"iterations": [], "versions_seen": []}
    for it in range(args.iterations):
        t0 = time.perf_counter()
        samples = await rollouts(client, prompt_ids, args.group, args.max_tokens, it)
        seen = set().union(*(s["versions"] for s in samples))
        # Every rollout of this iteration ran on the weights pushed last.
        assert it == 0 or seen == {version}, f"iteration {it}: rollouts on {seen}, expected {version}"
        t1 = time.perf_counter()
        mean_reward, loss = await asyncio.to_thread(train_step, policy, optimizer, prompt_ids, samples, vocab_size)
        trained = time.perf_counter()

        stragglers = [
            asyncio.create_task(client.generate(prompt_ids[0], {"max_tokens": args.straggler_tokens, "ignore_eos": True},
                                                session_id=f"straggler-{it}-{i}"))  # fmt: skip
            for i in range(2)
        ]
        await asyncio.sleep(0.1)  # let them start
        t2 = time.perf_counter()
        await client.pause(mode="keep")  # in-flight requests are held, not dropped
        t3 = time.perf_counter()
        new_version = f"step-{it + 1}"
        weights = [(n, t.detach().to(served_dtype)) for n, t in policy.state_dict().items() if n != "lm_head.weight"]
        await asyncio.to_thread(trainer.push, weights, new_version)
        t4 = time.perf_counter()
        await client.resume()
        t5 = time.perf_counter()
        finished = await asyncio.gather(*stragglers)
        for out in finished:
            choice = out["choices"][0]
            assert len(choice["token_ids"]) == args.straggler_tokens, "a held request lost tokens"
            assert choice["weight_versions"][-1]["version"] == new_version
        version = new_version
        timings = {"rollout": t1 - t0, "train": trained - t1, "pause": t3 - t2, "push": t4 - t3, "resume": t5 - t4}
        print(f"iter {it}: reward {mean_reward:.3f} loss {loss:+.4f} | "
              + " ".join(f"{k} {v * 1000:.0f}ms" for k, v in timings.items()), flush=True)  # fmt: skip
        summary["iterations"].append({"reward": mean_reward, "loss": loss, "seconds": timings})
        summary["versions_seen"].append(sorted(seen))

    final = await rollouts(client, prompt_ids, 1, args.max_tokens, args.iterations)
    assert set().union(*(s["versions"] for s in final)) == {version}
    summary["final_version"] = version
    trainer.close()
    await client.aclose()
    return summary


def loop_arguments(description: str) -> argparse.ArgumentParser:
    """The options every variant of the loop takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--admin-key")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    return p


def main() -> int:
    p = loop_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--straggler-tokens", type=int, default=1024)
    args = p.parse_args()
    summary = asyncio.run(run(args))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
