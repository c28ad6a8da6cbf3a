"""One turn of verifiers' ``TrainClient`` (the client prime-rl trains with) against a server,
in its own interpreter: verifiers 0.4 and its ``renderers`` live in .venv-verifiers (tools/bootstrap),
apart from the test environment, whose openai and mcp versions differ.

    .venv-verifiers/bin/python tests/verifiers_client.py URL MODEL_DIR

Prints the turn's token ids, logprobs and text as JSON; exits non-zero with the client's error.
"""

import asyncio
import json
import os
import sys

from renderers.configs import DefaultRendererConfig
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.types import SamplingConfig


async def main(url: str, model_dir: str) -> None:
    os.environ.setdefault("SKYINFER_KEY", "none")
    config = TrainClientConfig(
        base_url=f"{url}/v1",
        api_key_var="SKYINFER_KEY",
        renderer=DefaultRendererConfig(),
        renderer_model_name=model_dir,
    )
    client = TrainClient(config)
    try:
        body = {"model": model_dir, "messages": [{"role": "user", "content": "The quick brown fox"}]}
        response = await client.get_response(
            ChatDialect(), body, SamplingConfig(temperature=0.0, max_tokens=8), session_id="verifiers-turn"
        )
    finally:
        await client.close()
    tokens = response.tokens
    print(
        json.dumps(
            {
                "prompt_ids": tokens.prompt_ids,
                "completion_ids": tokens.completion_ids,
                "completion_logprobs": tokens.completion_logprobs,
                "content": response.message.content,
                "finish_reason": response.finish_reason,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
