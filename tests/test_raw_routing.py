"""What the front routes by, read off a request's bytes with no JSON parse (proxy.requested_model,
proxy.prompt_group), and the engine connections kept between answers read whole (stream_relay)."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from skyinfer.serving import stream_relay
from skyinfer.serving.proxy import prompt_group, requested_model


@pytest.mark.parametrize(
    "body, model",
    [
        (b'{"model": "lora-a", "prompt": "x"}', "lora-a"),
        (b'{"messages": [{"role": "user", "content": "x"}], "model":"lora-a"}', "lora-a"),
        # A string that says "model" is no member; nor is a name that ends with an escaped quote.
        (b'{"prompt": "the \\"model\\": \\"lora-b\\" said", "model": "lora-a"}', "lora-a"),
        (b'{"a\\"model": "lora-b", "model": "lora-a"}', "lora-a"),
        # A nested "model" whose value is no string (a tool's schema): the body is parsed.
        (b'{"tools": [{"properties": {"model": {"type": "string"}}}], "model": "lora-a"}', "lora-a"),
        # Escapes in the name: parsed.
        (b'{"model": "caf\\u00e9"}', "caf\u00e9"),
        (b'{"model": 5}', None),
        (b'{"prompt": "x"}', None),
        (b"not json", None),
    ],
)
def test_the_model_is_read_off_the_bytes(body, model):
    assert requested_model(body) == model


def test_a_prompt_group_is_the_prompts_start_whatever_comes_around_it():
    prompt = "p" * 40
    key = prompt_group(orjson.dumps({"model": "m", "prompt": prompt + "A", "seed": 1}), 30)
    assert key is not None
    # Other fields, before or after, and the prompt's end past the prefix: the same group.
    assert prompt_group(orjson.dumps({"seed": 2, "prompt": prompt + "B", "model": "m"}), 30) == key
    assert prompt_group(orjson.dumps({"prompt": "q" + prompt}), 30) != key
    # A prompt shorter than the prefix ends where its value does, brackets and quotes in its strings
    # notwithstanding.
    messages = [{"role": "user", "content": 'a "quoted" ] } [ text\\'}]
    chat = prompt_group(json.dumps({"messages": messages, "n": 1}).encode(), 1024, "/v1/chat/completions")
    assert chat == prompt_group(json.dumps({"messages": messages, "seed": 3}).encode(), 1024, "/v1/chat/completions")
    other = [{"role": "user", "content": 'a "quoted" ] } [ text!'}]
    assert chat != prompt_group(json.dumps({"messages": other}).encode(), 1024, "/v1/chat/completions")
    # Token ids: the list, not what follows it.
    ids = prompt_group(b'{"token_ids": [1, 2, 3], "sampling_params": {"seed": 1}}', 1024, "/inference/v1/generate")
    assert ids == prompt_group(b'{"token_ids": [1, 2, 3]}', 1024, "/inference/v1/generate")
    assert ids != prompt_group(b'{"token_ids": [1, 2, 4]}', 1024, "/inference/v1/generate")


def test_a_prompt_group_comes_from_the_routes_own_prompt():
    # On chat, the messages; a "prompt" elsewhere in the body (a tool's parameter, say) is not it.
    body = b'{"tools": [{"properties": {"prompt": "x"}}], "messages": [{"role": "user", "content": "hi"}]}'
    same = b'{"tools": [{"properties": {"prompt": "y"}}], "messages": [{"role": "user", "content": "hi"}]}'
    assert prompt_group(body, 1024, "/v1/chat/completions") == prompt_group(same, 1024, "/v1/chat/completions")
    # No prompt, a null one, or one cut off: no group, or a group of what there is.
    assert prompt_group(b'{"model": "m"}', 1024, "/v1/completions") is None
    assert prompt_group(b'{"prompt": null}', 1024, "/v1/completions") is None
    assert prompt_group(b'{"prompt": "unterminated', 1024, "/v1/completions") is not None


async def _engine_counting_connections(tmp_path, answers: list[bytes]) -> tuple[str, list[int]]:
    """A Unix socket answering each request with the next of ``answers``; how many requests each
    connection carried."""
    path = str(tmp_path / "engine.sock")
    per_connection: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        per_connection.append(0)
        mine = len(per_connection) - 1
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            await reader.readexactly(length)
            per_connection[mine] += 1
            writer.write(answers.pop(0))
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, path)
    asyncio.get_running_loop().call_later(30, server.close)
    return path, per_connection


def _json_answer(payload: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Type: application/json", b"Content-Length: %d" % len(payload), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + payload


async def _ask(connections: stream_relay.EngineConnections, path: str) -> bytes:
    answer = await connections.send(path, "POST", "/v1/completions", b"{}", {})
    try:
        await asyncio.wait_for(answer.head(), 10)
        return await asyncio.wait_for(answer.body(), 10)
    finally:
        answer.finish()


async def test_answers_read_whole_keep_their_connection_for_the_next_request(tmp_path):
    answers = [_json_answer(b'{"n": %d}' % i) for i in range(3)] + [_json_answer(b'{"n": 3}', b"Connection: close")]
    path, per_connection = await _engine_counting_connections(tmp_path, answers)
    connections = stream_relay.EngineConnections()
    try:
        assert [await _ask(connections, path) for _ in range(4)] == [b'{"n": %d}' % i for i in range(4)]
        assert per_connection == [4]
        # The engine said it closes that one: the next request opens another.
        answers.append(_json_answer(b'{"n": 4}'))
        assert await _ask(connections, path) == b'{"n": 4}'
        assert per_connection == [4, 1]
    finally:
        connections.close()


async def test_a_stream_or_an_answer_cut_short_does_not_keep_its_connection(tmp_path):
    stream = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    stream += b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    path, per_connection = await _engine_counting_connections(tmp_path, [stream, _json_answer(b"{}")])
    connections = stream_relay.EngineConnections()
    try:
        answer = await connections.send(path, "POST", "/v1/completions", b"{}", {})
        assert (await asyncio.wait_for(answer.head(), 10)).event_stream
        assert await asyncio.wait_for(answer.first_chunk(), 10) == b"data: [DONE]\n\n"
        answer.finish()
        assert await _ask(connections, path) == b"{}"
        assert per_connection == [1, 1]
    finally:
        connections.close()
