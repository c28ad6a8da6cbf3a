"""The real `openai` SDK, sync and async, against two real vLLM engines."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from support import both_fronts, engine_of

# Against one front process, then against front workers.
server = both_fronts("one_front_server", "_workers_process")


MAX_TOKENS = 16


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def detokenize(server, model: str, token_ids: list[int]) -> str:
    r = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": token_ids}, timeout=30)
    r.raise_for_status()
    return r.json()["prompt"]


def test_chat_non_streaming_with_logprobs_and_token_ids(client, server, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name,
        messages=[{"role": "user", "content": "Tell me about reinforcement learning."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert engine_of(raw) in (0, 1)
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS
    assert isinstance(choice.message.content, str) and choice.message.content
    entries = choice.logprobs.content
    assert len(entries) == MAX_TOKENS
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
        assert entry.logprob <= 0
    token_ids = choice.token_ids
    assert len(token_ids) == MAX_TOKENS
    assert detokenize(server, model_name, token_ids) == choice.message.content
    # The prompt went through the demo model's chat template.
    prompt_text = detokenize(server, model_name, completion.prompt_token_ids)
    assert prompt_text.startswith("<|im_start|>user\nTell me about reinforcement learning.<|im_end|>")
    assert prompt_text.endswith("<|im_start|>assistant\n")


def test_chat_stream_equals_non_stream_on_same_engine(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Write one line of Python."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Session-ID": "stream-vs-nonstream-chat"},
    )
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    whole = raw.parse().choices[0].message.content
    raw_stream = client.chat.completions.with_raw_response.create(stream=True, **kwargs)
    assert engine_of(raw_stream) == engine_of(raw)
    pieces = []
    finish = None
    for chunk in raw_stream.parse():
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in pieces if p]) > 1, "the answer should arrive in several chunks"
    assert "".join(pieces) == whole
    assert finish == "length"


def test_completion_stream_equals_non_stream_with_logprobs(client, server, model_name):
    kwargs = dict(
        model=model_name,
        prompt="The trainer pushes new weights",
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers={"X-Session-ID": "stream-vs-nonstream-completion"},
    )
    raw = client.completions.with_raw_response.create(**kwargs)
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == MAX_TOKENS
    assert all(len(top) <= 2 and top for top in choice.logprobs.top_logprobs)
    assert len(choice.token_ids) == MAX_TOKENS
    assert detokenize(server, model_name, choice.token_ids) == choice.text

    raw_stream = client.completions.with_raw_response.create(stream=True, **kwargs)
    assert engine_of(raw_stream) == engine_of(raw)
    text, token_ids, logprobs = "", [], []
    for chunk in raw_stream.parse():
        c = chunk.choices[0]
        text += c.text
        token_ids += c.token_ids or []
        logprobs += c.logprobs.token_logprobs if c.logprobs else []
    assert text == choice.text
    assert token_ids == choice.token_ids
    # Same engine, same request: logprobs agree up to CPU bf16 noise.
    assert logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=0.02)


async def test_async_client_concurrent_chat_and_completions(aclient, model_name):
    async def chat(i: int):
        stream = await aclient.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage

    async def complete(i: int):
        return await aclient.completions.create(
            model=model_name, prompt=f"prompt {i}", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )

    results = await asyncio.gather(*(chat(i) for i in range(6)), *(complete(i) for i in range(6)))
    for text, usage in results[:6]:
        assert text
        assert usage.completion_tokens == 8
    for completion in results[6:]:
        assert completion.usage.completion_tokens == 8
        assert completion.choices[0].finish_reason == "length"
    await aclient.close()


async def test_async_stream_equals_non_stream(aclient, model_name):
    headers = {"X-Session-ID": "async-stream-vs-nonstream"}
    kwargs = dict(model=model_name, prompt="Hello, world!", max_tokens=MAX_TOKENS, temperature=0)
    whole = (await aclient.completions.create(extra_headers=headers, **kwargs)).choices[0].text
    stream = await aclient.completions.create(stream=True, extra_headers=headers, **kwargs)
    streamed = "".join([chunk.choices[0].text async for chunk in stream])
    assert streamed == whole
    await aclient.close()


def test_models_route_lists_the_served_model(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
