"""A multi-turn agent on skyinfer through the ``openai`` SDK, keeping exact token ids.

Every turn of one episode carries the same ``X-Session-ID``, so skyinfer
sends the whole conversation to one engine, whose prefix cache already holds
the earlier turns. Each turn asks vLLM for ``return_token_ids``: the ids the
engine actually saw as the prompt and the ids it sampled. A trainer needs
those, not a re-tokenization of the text (detokenizing and tokenizing again
does not give back the sampled ids in general).

    python examples/agent.py --url http://127.0.0.1:8000 --turns 3 --out episode.json

The agent's "environment" is a toy: it answers each reply with an
observation. What matters here is the plumbing a harness needs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import uuid

import openai


def run_episode(client: openai.OpenAI, model: str, session_id: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [
        {"role": "system", "content": "You are an agent. Act, then read the observation."},
        {"role": "user", "content": "Task: find the answer in three steps."},
    ]
    records = []
    for turn in range(turns):
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,
            logprobs=True,
            extra_headers={"X-Session-ID": session_id},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        reply = raw.parse()
        choice = reply.choices[0]
        records.append(
            {
                "turn": turn,
                "engine": int(raw.headers["X-Skyinfer-Engine"]),
                "weight_version": raw.headers["X-Weight-Version"],
                "messages": [dict(m) for m in messages],
                # Exactly what the policy saw and what it sampled, with the logprob of each sampled token.
                "prompt_token_ids": reply.prompt_token_ids,
                "completion_token_ids": choice.token_ids,
                "completion_logprobs": [t.logprob for t in choice.logprobs.content],
                "content": choice.message.content,
            }
        )
        messages.append({"role": "assistant", "content": choice.message.content})
        messages.append({"role": "user", "content": f"Observation {turn}: nothing found yet; continue."})
    return records


def check(records: list[dict]) -> None:
    engines = {r["engine"] for r in records}
    assert len(engines) == 1, f"one session must stay on one engine; it used {engines}"
    for r in records:
        assert len(r["completion_token_ids"]) == len(r["completion_logprobs"]) > 0
    for earlier, later in itertools.pairwise(records):
        # The conversation grows: each prompt holds more than the one before plus its reply.
        assert len(later["prompt_token_ids"]) > len(earlier["prompt_token_ids"]) + len(earlier["completion_token_ids"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="skyinfer server")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--session-id", default=None, help="default: a fresh one")
    p.add_argument("--out", help="write the episode (token ids per turn) as JSON here")
    args = p.parse_args()

    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=2)
    model = client.models.list().data[0].id
    session_id = args.session_id or f"episode-{uuid.uuid4().hex[:8]}"
    records = run_episode(client, model, session_id, args.turns, args.max_tokens)
    check(records)
    for r in records:
        print(
            f"turn {r['turn']}: engine {r['engine']}, prompt {len(r['prompt_token_ids'])} tokens, "
            f"sampled {len(r['completion_token_ids'])} tokens"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"session_id": session_id, "turns": records}, f, indent=1)
    print(f"episode {session_id}: {len(records)} turns on engine {records[0]['engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
