"""Every choice of an OpenAI stream ends with a finish reason.

vLLM 0.32's chat and completion stream generators skip an output that has no
tokens yet, even a finished one: a request aborted before its first token
(``/pause?mode=abort`` of requests a keep-pause held, ``/abort_requests``)
ends its stream with no finish reason, which clients read as a stream cut
short. Non-streaming answers and the token route say ``abort``; so does this,
for the choices that ended silently, just before the usage chunk or
``[DONE]``. Frames are only scanned: vLLM writes JSON without spaces, so a
finish reason shows as ``"finish_reason":"`` and a final usage chunk as
``"choices":[]`` (neither can occur inside a JSON string).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson

_DONE = "data: [DONE]"


def choice_count(request: Any) -> int:
    """How many choices a chat or completion request streams: ``n`` per prompt."""
    prompt = getattr(request, "prompt", None)
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return (request.n or 1) * prompts


def _final_chunk(first: dict, index: int) -> str:
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": "abort"}
    if first["object"] == "chat.completion.chunk":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    chunk = {key: first[key] for key in ("id", "object", "created", "model")} | {"choices": [choice]}
    return f"data: {orjson.dumps(chunk).decode()}\n\n"


async def with_finish_reasons(
    frames: AsyncGenerator[str, None],
    choices: int,
    fallback_head: Callable[[], dict],
    finished_before: frozenset[int] = frozenset(),
) -> AsyncGenerator[str, None]:
    """``frames`` as they come, plus an ``abort`` chunk for each choice that ended without a
    reason. ``fallback_head()`` (id, object, created, model) serves when no chunk came to copy
    (called then only: a new id costs a uuid4, a few percent of the engine process's CPU on a stream);
    ``finished_before``: choices whose reason the caller had before (from an engine that died)."""
    first: str | None = None
    finished: set[int] = set(finished_before)
    settled = False
    try:
        async for frame in frames:
            if not settled:
                if frame.startswith(_DONE) or '"choices":[]' in frame:
                    settled = True
                    first = first or (frame if frame.startswith("data: {") else None)
                    head = orjson.loads(first[len("data: ") :]) if first else fallback_head()
                    for index in sorted(set(range(choices)) - finished):
                        yield _final_chunk(head, index)
                elif frame.startswith('data: {"error"'):
                    settled = True  # the stream says why it ended
                elif frame.startswith("data: {"):
                    first = first or frame
                    if '"finish_reason":"' in frame:
                        chunk = orjson.loads(frame[len("data: ") :])
                        finished.update(c["index"] for c in chunk["choices"] if c.get("finish_reason"))
            yield frame
    finally:
        await frames.aclose()
