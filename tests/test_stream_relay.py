"""The stream relay's HTTP/1.1 framing (skyinfer/serving/stream_relay.py) against an engine socket that
answers in arbitrary fragments: one byte at a time, chunks split mid size line, a hang-up mid-chunk.
(The relay with real engines, streams cut by killed engines and callers that go away included, is
exercised by the data-plane, disconnect and supervision modules.) Over fake engines: how a stream whose
caller closes its connection right after ``data: [DONE]``, as the openai SDK does, is counted."""

from __future__ import annotations

import asyncio

import fakes
import pytest
from fakes import FAKE_ENGINE, fake_fleet, until
from prometheus_client.parser import text_string_to_metric_families

from skyinfer.serving import stream_relay

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class Caller(asyncio.Transport):
    """The caller's side: what the relay writes to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


async def engine_answering(tmp_path, fragments: list[bytes], hang_up: bool = True) -> str:
    """A Unix socket that reads one request head and answers with ``fragments``, one write each."""
    path = str(tmp_path / "engine.sock")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for fragment in fragments:
            writer.write(fragment)
            await writer.drain()
            await asyncio.sleep(0.001)
        if hang_up:
            writer.close()

    server = await asyncio.start_unix_server(answer, path)
    asyncio.get_running_loop().call_later(30, server.close)
    return path


async def relayed(path: str) -> tuple[bytes | None, Caller, BaseException | None]:
    answer = await stream_relay.send(path, "POST", "/v1/completions", b"{}", {"Content-Type": "application/json"})
    try:
        head = await answer.head()
        assert head.status == 200 and head.event_stream
        first = await answer.first_chunk()
        caller = Caller()
        try:
            await asyncio.wait_for(answer.relay_to(caller), 10)
        except stream_relay.EngineHangUp as exc:
            return first, caller, exc
        return first, caller, None
    finally:
        answer.close()


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


@pytest.mark.parametrize("split", ["whole", "bytewise", "mid-size-line", "after-100-continue"])
async def test_chunks_are_relayed_as_framed_whatever_the_fragments(tmp_path, split):
    body = b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n"
    if split == "whole":
        fragments = [HEAD + body]
    elif split == "bytewise":
        fragments = bytewise(HEAD + body)
    elif split == "after-100-continue":  # an interim head first, as an engine answers Expect
        fragments = [b"HTTP/1.1 100 Continue\r\n\r\n", HEAD + body]
    else:  # every chunk's size line cut in two, head and first chunk in one write
        cuts = [HEAD + chunk(EVENTS[0])] + [piece for e in EVENTS[1:] for piece in (chunk(e)[:1], chunk(e)[1:])]
        fragments = [*cuts, b"0\r\n", b"\r\n"]
    first, caller, error = await relayed(await engine_answering(tmp_path, fragments, hang_up=False))
    assert error is None
    assert first == EVENTS[0]
    # Everything after the first chunk, framing included, up to (not with) the terminal chunk,
    # which the front's own end of stream writes.
    assert bytes(caller.written) == b"".join(chunk(e) for e in EVENTS[1:])


async def test_a_hang_up_mid_chunk_leaves_the_caller_at_a_chunk_boundary(tmp_path):
    cut = chunk(EVENTS[2])[:7]
    fragments = bytewise(HEAD + chunk(EVENTS[0]) + chunk(EVENTS[1]) + cut)
    first, caller, error = await relayed(await engine_answering(tmp_path, fragments))
    assert first == EVENTS[0]
    assert isinstance(error, stream_relay.EngineHangUp)
    # Only whole chunks went out: the front can append an error event of its own.
    assert bytes(caller.written) == chunk(EVENTS[1])


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_answer_that_is_not_a_stream_is_read_whole(tmp_path, framing):
    payload = b'{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}'
    if framing == "chunked":
        head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = chunk(payload[:10]) + chunk(payload[10:]) + b"0\r\n\r\n"
    else:
        head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(
            payload
        )
        body = payload
    path = await engine_answering(tmp_path, bytewise(head + body), hang_up=False)
    answer = await stream_relay.send(path, "POST", "/v1/completions", b"{}", {})
    try:
        head_seen = await answer.head()
        assert (head_seen.status, head_seen.event_stream) == (400, False)
        assert await asyncio.wait_for(answer.body(), 10) == payload
    finally:
        answer.close()


async def test_a_hang_up_before_the_head_is_an_engine_hang_up(tmp_path):
    answer = await stream_relay.send(
        await engine_answering(tmp_path, [HEAD[:20]]), "POST", "/v1/completions", b"{}", {}
    )
    try:
        with pytest.raises(stream_relay.EngineHangUp):
            await asyncio.wait_for(answer.head(), 10)
    finally:
        answer.close()


# The fake engine, ending each stream's chunked body a while after its [DONE] event (vLLM's server
# sends the two apart too): the caller's close then reaches the front before the end of the body.
LATE_END_ENGINE = f"""
import asyncio, runpy
from aiohttp import web

write_eof = web.StreamResponse.write_eof

async def late_write_eof(self, data=b""):
    if self.content_type == "text/event-stream":
        await asyncio.sleep({{delay_s}})
    await write_eof(self, data)

web.StreamResponse.write_eof = late_write_eof
runpy.run_path({FAKE_ENGINE!r}, run_name="__main__")
"""


async def _stream_then_hang_up(host: str, port: int, session: str) -> bytes:
    """A streamed chat request from a raw client that closes its connection as soon as it has read
    ``data: [DONE]``, as the openai SDK does; what it read."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"X-Session-ID: {session}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + body)
        read = b""
        while b"data: [DONE]\n\n" not in read:
            more = await asyncio.wait_for(reader.read(65536), 10)
            assert more, f"the stream ended before its [DONE]: {read!r}"
            read += more
        return read
    finally:
        writer.close()


@pytest.mark.parametrize("end_after_done_s", [0, 0.05], ids=["fake-engine", "end-of-body-late"])
async def test_a_stream_the_caller_closes_right_after_its_done_counts_as_200(
    aiohttp_client, demo_model, tmp_path, monkeypatch, end_after_done_s
):
    """The caller had every event: its request counts as a 200 from its engine, not as a 499 (client
    closed) with no engine, whether its close reaches the front before or after the engine's end of
    the chunked body (as it comes, a race; with the end late, every time)."""
    if end_after_done_s:
        late_end = tmp_path / "late_end_engine.py"
        late_end.write_text(LATE_END_ENGINE.format(delay_s=end_after_done_s))
        monkeypatch.setattr(fakes, "FAKE_ENGINE", str(late_end))
    _, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    host, port = client.server.host, client.server.port
    streams = 20
    for i in range(streams):
        read = await _stream_then_hang_up(host, port, f"hang-up-{i}")
        assert read.startswith(b"HTTP/1.1 200") and b"X-Skyinfer-Engine: " in read

    async def counted() -> dict[tuple[str, str], float] | None:
        text = await (await client.get("/metrics")).text()
        samples = {
            (s.labels["engine"], s.labels["status"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "skyinfer_requests"
            for s in family.samples
            if s.name == "skyinfer_requests_total" and s.labels["route"] == "/v1/chat/completions"
        }
        return samples if sum(samples.values()) >= streams else None

    samples = await until(counted, 10)
    assert {status for _, status in samples} == {"200"}, samples
    assert {engine for engine, _ in samples} <= {"0", "1"}, samples
    assert sum(samples.values()) == streams
