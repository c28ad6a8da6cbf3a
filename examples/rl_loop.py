"""A few iterations of a GRPO-style loop against skyinfer, on CPU, end to end.

Per iteration: rollouts (a group of samples per prompt, each with its own
session id) through ``skyinfer.client``; toy rewards; group-normalized
advantages; a real ``torch`` optimizer step on a ``transformers`` copy of the
policy; then the new weights go into every engine, in one of the two shapes
of an RL step:

- separate devices (default): pause (keep), push over the weight-transfer
  group, resume. A few long "straggler" rollouts are in flight across each
  pause; they finish after resume, their tokens split between the two versions.
- colocated (``--colocate``, against ``skyinfer serve --colocate``): the
  engines sleep while the trainer trains, wake their weights, take the push
  from the trainer's memory (shared memory on CPU), wake their KV cache, and
  serve again.

Rollouts of the next iteration must carry the new weight version.

    skyinfer serve --engines 2 &                      # the demo model
    python examples/rl_loop.py --url http://127.0.0.1:8000 --iterations 3
    skyinfer serve --engines 2 --colocate &
    python examples/rl_loop.py --url http://127.0.0.1:8000 --iterations 3 --colocate

The reward is a toy (the share of sampled token ids below half the
vocabulary), so the policy visibly moves in a few steps on the random demo
model. Prints per-iteration timings and, last, a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from skyinfer.client import AsyncClient
from skyinfer.trainer import GlooTrainer, SharedMemoryTrainer

PROMPTS = ["Solve: 2 + 3 =", "Write a haiku about gradients", "The capital of France is", "def fibonacci(n):"]


def reward(token_ids: list[int], vocab_size: int) -> float:
    return sum(t < vocab_size // 2 for t in token_ids) / max(1, len(token_ids))


def sequence_logprob(policy, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = policy(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion_ids)[:, None]).sum()


async def rollouts(
    client: AsyncClient, prompt_ids: list[list[int]], group: int, max_tokens: int, it: int
) -> list[dict]:
    async def one(p: int, g: int) -> dict:
        out = await client.generate(
            prompt_ids[p],
            {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True},
            session_id=f"iter{it}-prompt{p}-sample{g}",
        )
        choice = out["choices"][0]
        return {
            "prompt": p,
            "token_ids": choice["token_ids"],
            "versions": {s["version"] for s in choice["weight_versions"]},
        }

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
    loss = -sum(
        a * sequence_logprob(policy, prompt_ids[s["prompt"]], s["token_ids"]) for a, s in zip(advantages, samples)
    )
    loss = loss / len(samples)
    loss.backward()
    optimizer.step()
    return rewards.mean().item(), loss.item()


@dataclasses.dataclass
class Loop:
    args: argparse.Namespace
    client: AsyncClient
    trainer: GlooTrainer | SharedMemoryTrainer
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    prompt_ids: list[list[int]]
    vocab_size: int
    served_dtype: torch.dtype

    def train(self, samples: list[dict]) -> tuple[float, float]:
        return train_step(self.policy, self.optimizer, self.prompt_ids, samples, self.vocab_size)

    def push(self, version: str) -> None:
        weights = [
            (n, t.detach().to(self.served_dtype)) for n, t in self.policy.state_dict().items() if n != "lm_head.weight"
        ]
        # One call: the server starts, receives and finishes the update itself, one call per engine.
        self.trainer.push(weights, version, one_call=True)

    async def separate_step(self, samples: list[dict], it: int, new_version: str) -> tuple[float, float, dict]:
        """Train beside the engines; pause (keep) with stragglers in flight, push, resume."""
        started = time.perf_counter()
        mean_reward, loss = await asyncio.to_thread(self.train, samples)
        trained = time.perf_counter()
        stragglers = [
            asyncio.create_task(
                self.client.generate(
                    self.prompt_ids[0],
                    {"max_tokens": self.args.straggler_tokens, "ignore_eos": True},
                    session_id=f"straggler-{it}-{i}",
                )
            )
            for i in range(2)
        ]
        await asyncio.sleep(0.1)  # let them start
        t2 = time.perf_counter()
        await self.client.pause(mode="keep")  # in-flight requests are held, not dropped
        t3 = time.perf_counter()
        await asyncio.to_thread(self.push, new_version)
        t4 = time.perf_counter()
        await self.client.resume()
        t5 = time.perf_counter()
        for out in await asyncio.gather(*stragglers):
            choice = out["choices"][0]
            assert len(choice["token_ids"]) == self.args.straggler_tokens, "a held request lost tokens"
            assert choice["weight_versions"][-1]["version"] == new_version
        return mean_reward, loss, {"train": trained - started, "pause": t3 - t2, "push": t4 - t3, "resume": t5 - t4}

    async def colocated_step(self, samples: list[dict], it: int, new_version: str) -> tuple[float, float, dict]:
        """Sleep the engines while the trainer trains; wake their weights, push, wake their KV cache."""
        started = time.perf_counter()
        await self.client.sleep(level=self.args.sleep_level)  # the engines give their memory to the trainer
        slept = time.perf_counter()
        mean_reward, loss = await asyncio.to_thread(self.train, samples)
        trained = time.perf_counter()
        await self.client.wake_up(tags=["weights"])
        await asyncio.to_thread(self.push, new_version)
        pushed = time.perf_counter()
        await self.client.wake_up(tags=["kv_cache"])  # fully awake: the engines serve again
        woken = time.perf_counter()
        timings = {
            "sleep": slept - started,
            "train": trained - slept,
            "wake+push": pushed - trained,
            "wake_kv": woken - pushed,
        }
        return mean_reward, loss, timings


async def run(args) -> dict:
    client = AsyncClient(args.url, api_key=args.api_key, admin_key=args.admin_key)
    models = await client.models()
    model_dir = models[0].get("root") or models[0]["id"]
    served_dtype = getattr(torch, (await client.engines())[0]["model_dtype"])
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    admin_key = args.admin_key or args.api_key
    # Colocated: the engines map the trainer's memory. Else rank 0 of a group with every engine's workers.
    trainer = (SharedMemoryTrainer if args.colocate else GlooTrainer)(args.url, admin_key=admin_key)
    await asyncio.to_thread(trainer.init)
    loop = Loop(
        args,
        client,
        trainer,
        policy,
        torch.optim.Adam(policy.parameters(), lr=args.lr),
        [await client.tokenize(p) for p in PROMPTS[: args.prompts]],
        policy.config.vocab_size,
        served_dtype,
    )
    step = loop.colocated_step if args.colocate else loop.separate_step
    version = (await client.weight_info())["weight_version"] or "as-loaded"
    summary = {"iterations": [], "versions_seen": []}
    for it in range(args.iterations):
        started = time.perf_counter()
        samples = await rollouts(client, loop.prompt_ids, args.group, args.max_tokens, it)
        seen = set().union(*(s["versions"] for s in samples))
        # Every rollout of this iteration ran on the weights pushed last.
        assert it == 0 or seen == {version}, f"iteration {it}: rollouts on {seen}, expected {version}"
        rolled_out = time.perf_counter()
        version = f"step-{it + 1}"
        mean_reward, loss, timings = await step(samples, it, version)
        timings = {"rollout": rolled_out - started, **timings}
        print(
            f"iter {it}: reward {mean_reward:.3f} loss {loss:+.4f} | "
            + " ".join(f"{k} {v * 1000:.0f}ms" for k, v in timings.items()),
            flush=True,
        )
        summary["iterations"].append({"reward": mean_reward, "loss": loss, "seconds": timings})
        summary["versions_seen"].append(sorted(seen))

    final = await rollouts(client, loop.prompt_ids, 1, args.max_tokens, args.iterations)
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
    p.add_argument("--colocate", action="store_true", help="the server runs with --colocate: sleep, train, wake, push")
    p.add_argument(
        "--sleep-level",
        type=int,
        default=2,
        choices=[1, 2],
        help="colocated: 2 discards the engines' weights while they sleep (the push brings them back)",
    )
    args = p.parse_args()
    summary = asyncio.run(run(args))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
