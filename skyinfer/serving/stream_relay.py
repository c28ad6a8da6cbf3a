"""Engines' answers relayed as the engine frames them.

An engine answers a streamed request with HTTP/1.1 chunked framing, one chunk per SSE event, and the
front answers its caller with the same framing: a chunk can go from the engine's socket to the
caller's as the same bytes, with no decoding, no Python object per event and no task woken per event.
The front therefore speaks HTTP/1.1 to its engines directly, and once a stream's head and first chunk
are in, the protocol's ``data_received`` writes each complete chunk straight to the caller's
transport. Only complete chunks are written, so a stream the engine breaks off can still be ended
with an error event of the front's own.

A caller may close its connection as soon as it has the stream's last event, before the end of the
chunked body (the openai SDK closes on reading ``data: [DONE]``): ``EngineAnswer.delivered`` says
whether it had the whole answer, so that such a request still counts as answered.

Every other answer is read whole, and its connection is kept open for the next request to that
engine (``EngineConnections``) where its body ended at its ``Content-Length`` (or it had none) and
the engine keeps the connection (a chunked answer's is closed); a stream's connection is closed at
its end, which is how an engine learns that a caller went away. No client library's per-request
machinery either: aiohttp's client cost about a third of the front's CPU per request.
"""

from __future__ import annotations

import asyncio
from collections import deque

from multidict import CIMultiDict

from ..engine_wire import CONTINUE_MARKER

# Caller's transport buffer at which the engine's connection stops being read (a slow caller),
# and at which reading goes on.
_PAUSE_AT_BYTES = 256 * 1024
_RESUME_AT_BYTES = 64 * 1024
_DRAIN_CHECK_S = 0.005
CONNECT_TIMEOUT_S = 10
# A kept connection idle longer than this is closed rather than used: an engine may close one it
# has kept idle a long time, and a request sent just then would look like the engine dying under it.
KEPT_IDLE_S = 15.0
# The event that ends an OpenAI stream, and the end of the chunk that carries it.
DONE_EVENT = b"data: [DONE]\n\n"
_DONE_CHUNK_END = DONE_EVENT + b"\r\n"


class EngineHangUp(Exception):
    """The engine's connection ended before its answer did."""


class _Head:
    __slots__ = ("headers", "status")

    def __init__(self, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.headers = headers

    @property
    def event_stream(self) -> bool:
        return self.headers.get("Content-Type", "").startswith("text/event-stream")

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower()


def _parse_head(raw: bytes) -> _Head:
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    return _Head(int(status_line.split(" ", 2)[1]), headers)


def _chunk_at(buffer: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """The chunk whose size line starts at ``pos``: where its payload starts and how long it is
    (chunk extensions after ``;`` ignored); None while its size line is not whole in ``buffer``."""
    line_end = buffer.find(b"\r\n", pos)
    if line_end < 0:
        return None
    return line_end + 2, int(bytes(buffer[pos:line_end]).split(b";", 1)[0], 16)


def _complete_chunks(buffer: bytes | bytearray) -> tuple[int, int, bool]:
    """Where the complete chunks at the start of ``buffer`` end; the end of the next chunk when its
    size line is in but not all of it (0: not known yet); whether the terminal chunk was reached.
    A continuation record (engine/continuation.py) ends the chunks to pass on as the terminal one
    does: it is at ``pos`` when the third value is true and a chunk of non-zero size starts there."""
    pos = 0
    while True:
        if (chunk := _chunk_at(buffer, pos)) is None:
            return pos, 0, False
        start, size = chunk
        if size == 0:
            return pos, 0, True
        chunk_end = start + size + 2
        if buffer.startswith(CONTINUE_MARKER, start):
            return pos, chunk_end, chunk_end <= len(buffer)
        if chunk_end > len(buffer):
            return pos, chunk_end, False
        pos = chunk_end


def _continuation_at(buffer: bytes | bytearray, pos: int) -> bytes | None:
    """The record of the continuation chunk at ``pos`` (JSON), if one is there."""
    chunk = _chunk_at(buffer, pos)
    if chunk is None or not chunk[1] or not buffer.startswith(CONTINUE_MARKER, chunk[0]):
        return None
    start, size = chunk
    return bytes(buffer[start + len(CONTINUE_MARKER) : start + size]).strip()


def _chunk_payloads(framed: bytes | bytearray) -> bytes:
    """The payload of complete chunks (every size line whole), framing removed."""
    parts, pos = [], 0
    while pos < len(framed):
        start, size = _chunk_at(framed, pos)
        parts.append(framed[start : start + size])
        pos = start + size + 2
    return b"".join(parts)


class EngineAnswer(asyncio.Protocol):
    """One request to an engine and its answer as it arrives, on a connection opened for it or kept
    from an earlier answer (``kept``: where the connection goes back to once this answer is read whole)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, kept: EngineConnections | None = None, socket_path: str = ""
    ) -> None:
        self._loop = loop
        self._kept = kept
        self._socket_path = socket_path
        self.transport: asyncio.Transport | None = None
        # Answers to HEAD carry a head only.
        self._bodiless = False
        # The body was read whole, to its Content-Length: the connection may carry another request.
        self._reusable = False
        self._buffer = bytearray()
        self._head: asyncio.Future[_Head] = loop.create_future()
        self._parsed: _Head | None = None
        # What the handler waits for after the head: a body, the first chunk, the stream's end.
        self._waiter: asyncio.Future | None = None
        self._want = None  # "body", "first" or "end"
        self._caller: asyncio.Transport | None = None
        # The end of the first incomplete chunk in the buffer, once known: no scan before it is in.
        self._need = 0
        self._terminal = False
        self._lost = False
        # Whether the caller had the whole answer: its [DONE] event written to the caller's
        # transport, or every chunk up to the stream's end (none dropped for a caller gone).
        self.delivered = False
        self._dropped = False
        # The engine died mid-stream and says how another engine can go on (engine/continuation.py):
        # its record, in place of the stream's end.
        self.continuation: bytes | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._terminal:
            return  # what follows the terminal chunk (an empty trailer)
        if self._caller is not None and not self._buffer:
            # The common case while relaying: whole chunks, passed on without a copy.
            end, need, self._terminal = _complete_chunks(data)
            if end:
                self._pass_on(data if end == len(data) else data[:end])
            if self._terminal:
                self.continuation = _continuation_at(data, end)
                self._ended()
            elif end < len(data):
                self._buffer += data[end:]
                self._need = need - end if need else 0
            return
        self._buffer += data
        while not self._head.done():
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = _parse_head(bytes(self._buffer[:head_end]))
            del self._buffer[: head_end + 4]
            if head.status >= 200:  # 1xx heads (100 Continue) come before the answer's own
                self._parsed = head
                self._head.set_result(head)
        self._progress()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._settle_lost(exc)

    # -- what the handler asks -------------------------------------------------------------------

    async def head(self) -> _Head:
        return await self._head

    async def body(self) -> bytes:
        """The whole body of an answer that is not relayed."""
        return await self._wait_for("body")

    async def first_chunk(self) -> bytes | None:
        """The payload of the stream's first chunk (None: the stream ended empty), taken out of the
        buffer: the caller's answer starts with it, headers and all."""
        return await self._wait_for("first")

    async def relay_to(self, caller: asyncio.Transport) -> None:
        """Pass every further chunk to ``caller`` as it arrives; return at the stream's end."""
        self._caller = caller
        return await self._wait_for("end")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def finish(self) -> None:
        """Done with the answer: its connection is kept for the next request if the answer was read
        whole and the engine keeps it open; else closed (an engine still generating a stream sees the
        close and aborts it)."""
        keeps = self._reusable and "close" not in self._parsed.headers.get("Connection", "").lower()
        if keeps and self._kept is not None and not self.transport.is_closing():
            self._kept.keep(self._socket_path, self.transport)
        else:
            self.close()

    def send_request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        self._bodiless = method == "HEAD"
        lines = [f"{method} {path} HTTP/1.1", "Host: engine", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body)

    # -- inside ----------------------------------------------------------------------------------

    def _wait_for(self, want: str) -> asyncio.Future:
        self._want = want
        waiter = self._waiter = self._loop.create_future()
        self._progress()
        if self._lost and not waiter.done():
            self._settle_lost(None)
        return waiter

    def _settle_lost(self, exc: Exception | None) -> None:
        """The connection is gone: what the handler waits for is all there is, or it never comes."""
        if not self._head.done():
            self._head.set_exception(EngineHangUp(f"the engine closed the connection before answering ({exc!r})"))
        head = self._parsed
        if self._want == "body" and head is not None and not head.chunked and "Content-Length" not in head.headers:
            self._settle(bytes(self._buffer))  # a body that ends with the connection
            return
        self._settle(EngineHangUp(f"the engine closed the connection mid-answer ({exc!r})"))

    def _settle(self, result) -> None:
        waiter, self._waiter, self._want = self._waiter, None, None
        if waiter is None or waiter.done():
            return
        if isinstance(result, BaseException):
            waiter.set_exception(result)
        else:
            waiter.set_result(result)

    def _progress(self) -> None:
        """Give the handler what it waits for, if the buffer holds it."""
        if self._waiter is None or self._parsed is None or len(self._buffer) < self._need:
            return
        if self._want == "body":
            self._progress_body()
            return
        end, self._need, self._terminal = _complete_chunks(self._buffer)
        if self._want == "first":
            if self._terminal and not end:
                self.continuation = _continuation_at(self._buffer, 0)
                self._settle(None)
            elif end:
                start, size = _chunk_at(self._buffer, 0)
                first = bytes(self._buffer[start : start + size])
                del self._buffer[: start + size + 2]
                self._need = 0
                self._settle(first)
            return
        if end:
            self._pass_on(bytes(self._buffer[:end]))
            del self._buffer[:end]
            self._need = max(0, self._need - end) if self._need else 0
        if self._terminal:
            self.continuation = _continuation_at(self._buffer, 0)
            self._ended()

    def _ended(self) -> None:
        """The terminal chunk is in: every chunk before it went to the caller, unless it had gone."""
        self.delivered = self.delivered or (not self._dropped and self.continuation is None)
        self._settle(None)

    def _progress_body(self) -> None:
        head = self._parsed
        if self._bodiless or head.status in (204, 304):
            self._reusable = not self._buffer
            self._settle(b"")
        elif head.chunked:
            end, self._need, terminal = _complete_chunks(self._buffer)
            if terminal:
                # A stream read whole (for an HTTP/1.0 caller) can end in a dying engine's record too.
                self.continuation = _continuation_at(self._buffer, end)
                self._settle(_chunk_payloads(self._buffer[:end]))
        elif "Content-Length" in head.headers:
            length = int(head.headers["Content-Length"])
            if len(self._buffer) >= length:
                self._reusable = len(self._buffer) == length
                self._settle(bytes(self._buffer[:length]))

    def _pass_on(self, framed: bytes) -> None:
        caller = self._caller
        if caller.is_closing():
            # The caller is gone: so is this request (aiohttp cancels its handler, which closes us).
            self._dropped = True
            self.transport.close()
            return
        caller.write(framed)
        if framed.endswith(_DONE_CHUNK_END):
            self.delivered = True
        if caller.get_write_buffer_size() > _PAUSE_AT_BYTES:
            self.transport.pause_reading()
            self._loop.call_later(_DRAIN_CHECK_S, self._resume_when_drained)

    def _resume_when_drained(self) -> None:
        if self._caller is None or self._caller.is_closing() or self.transport.is_closing():
            return
        if self._caller.get_write_buffer_size() > _RESUME_AT_BYTES:
            self._loop.call_later(_DRAIN_CHECK_S, self._resume_when_drained)
        else:
            self.transport.resume_reading()


async def send(
    socket_path: str,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    kept: EngineConnections | None = None,
) -> EngineAnswer:
    """Open a connection to the engine at ``socket_path`` and send one request on it; ``OSError``
    (or ``TimeoutError``) when no connection could be opened, nothing having been sent."""
    loop = asyncio.get_running_loop()
    _, answer = await asyncio.wait_for(
        loop.create_unix_connection(lambda: EngineAnswer(loop, kept, socket_path), socket_path), CONNECT_TIMEOUT_S
    )
    answer.send_request(method, path, body, headers)
    return answer


class EngineConnections:
    """Connections to engines kept open after an answer read whole, by engine socket, most recently
    used first: a request takes one if there is one, else opens one."""

    def __init__(self) -> None:
        # socket path -> (connection, idle since), the most recently kept last.
        self._idle: dict[str, deque[tuple[asyncio.Transport, float]]] = {}

    async def send(
        self, socket_path: str, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> EngineAnswer:
        """``send``, on a kept connection to the engine if one is open."""
        loop = asyncio.get_running_loop()
        idle = self._idle.get(socket_path)
        while idle:
            transport, since = idle.pop()
            if transport.is_closing():
                continue
            if loop.time() - since > KEPT_IDLE_S:
                transport.close()
                continue
            answer = EngineAnswer(loop, self, socket_path)
            transport.set_protocol(answer)
            answer.connection_made(transport)
            answer.send_request(method, path, body, headers)
            return answer
        return await send(socket_path, method, path, body, headers, kept=self)

    def keep(self, socket_path: str, transport: asyncio.Transport) -> None:
        idle = self._idle.setdefault(socket_path, deque())
        now = asyncio.get_running_loop().time()
        # The least recently used are taken last: drop those closed meanwhile (an engine that
        # restarted) or idle too long, so that a burst's connections do not stay for ever.
        while idle and (idle[0][0].is_closing() or now - idle[0][1] > KEPT_IDLE_S):
            idle.popleft()[0].close()
        idle.append((transport, now))

    def close(self) -> None:
        for idle in self._idle.values():
            for transport, _ in idle:
                transport.close()
        self._idle.clear()
