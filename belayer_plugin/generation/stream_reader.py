"""A streaming /generate read by callbacks from the socket, with no task woken per chunk.

At one chunk per token the reader's cost per chunk is a cost per token. The aiohttp path
(`sglang_http.stream_events`) wakes the reading task for every chunk and passes it up through three async
generators; a reader that only keeps the newest cumulative chunk (`ResumableGenerator`'s lazy mode) needs
none of that. Here an `asyncio.Protocol` decodes the HTTP/1.1 response in `data_received`, finds the newest
complete SSE `data:` payload of each read and hands it to a plain callback; the awaiting task wakes once,
when the stream ends. One connection per stream (`Connection: close`): its set-up is paid once per
segment, not per token.

With a coalescing window the socket is not even read per chunk: its SO_RCVLOWAT is raised so that the kernel
reports it readable only once `_COALESCE_LOWAT` bytes wait, and a timer lowers it to 1 every window, which
makes the kernel report whatever came (lowering the mark signals readiness at once). Chunks are cumulative,
so a read holding several keeps the newest; an engine's close (a kill) is reported at once whatever the mark,
and the tokens already in the kernel's buffer are read before it: none is lost.

Owns: parsing a streamed HTTP/1.1 response in the socket's callbacks. Must not: commit tokens or choose
engines.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable, Optional

import orjson
from yarl import URL

from belayer_plugin.generation.sglang_http import GenerateError, StreamBroken, _http_error, newest_event

# (the newest complete `data:` payload of a read, unparsed, or None; whether `[DONE]` came; how many payloads
# the read completed)
OnData = Callable[[Optional[bytes], bool, int], None]

_MAX_HEAD = 64 * 1024  # a response head longer than this is not an engine's
_MAX_ERROR_BODY = 64 * 1024  # what is kept of a non-200 answer's body (its message)
# Coalescing: this much waiting makes a read before the window ends (the kernel's receive buffer grows to hold
# it, so the engine is never throttled by a reader waiting for its timer).
_COALESCE_LOWAT = 64 * 1024


def supported(url: str) -> bool:
    """Whether `url` can be read here (plain http; https streams go through aiohttp)."""
    try:
        u = URL(url)
    except (TypeError, ValueError):
        return False
    return u.scheme == "http" and bool(u.host)


class _Response(asyncio.Protocol):
    """One HTTP/1.1 response to a streaming POST: status, headers, then a chunked, sized or to-the-close body."""

    def __init__(self, url: str, request: bytes, on_data: OnData, read_timeout: float,
                 done: asyncio.Future, coalesce_s: float = 0.0):
        self.url, self.request, self.on_data, self.read_timeout, self.done = url, request, on_data, read_timeout, done
        self.coalesce_s = coalesce_s
        self.sock: Optional[socket.socket] = None  # set while coalescing
        self.lowered = False  # the mark is down to 1: the next read restores it and re-arms the window
        self.window: Optional[asyncio.TimerHandle] = None
        self.loop = done.get_loop()
        self.transport: Optional[asyncio.Transport] = None
        self.head = bytearray()
        self.status: Optional[int] = None
        self.chunked = False
        self.left: Optional[int] = None  # sized body: bytes still to come; chunked: of the current chunk
        self.raw = b""  # chunked framing not yet decoded (a size line or a chunk's CRLF split across reads)
        self.trailer = False  # chunked: past the last chunk, reading trailers
        self.tail = b""  # body bytes after the last complete SSE line
        self.error_body = bytearray()
        self.complete = False  # the whole message arrived
        self.last_data = self.loop.time()
        self.watch: Optional[asyncio.TimerHandle] = None

    # ------------------------------------------------------------ transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)
        if self.coalesce_s > 0:
            # The head is read at once (the mark stays 1 until the first read after it, which arms the window).
            sock = transport.get_extra_info("socket")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except (OSError, AttributeError):
                return  # not a socket that takes a mark: read per chunk
            self.sock, self.lowered = sock, True

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        self.last_data = self.loop.time()
        if self.sock is not None and self.lowered and self.status is not None:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, _COALESCE_LOWAT)
                self.lowered = False
                self.window = self.loop.call_later(self.coalesce_s, self._lower)
            except OSError:
                self.sock = None
        try:
            if self.status is None:
                data = self._head(data)
                if self.status is None or not data and not self.complete:
                    return
            body = self._body(data)
            if self.status == 200:
                if body:
                    self._events(body)
            else:
                self.error_body += body[:_MAX_ERROR_BODY - len(self.error_body)]
                if self.complete:
                    self._fail(_http_error(self.url, self.status, self.error_body.decode(errors="replace")))
        except GenerateError as e:
            self._fail(e)
        except (ValueError, IndexError) as e:  # a malformed frame (the parsers' own checks raise StreamBroken)
            self._fail(StreamBroken(self.url, f"malformed response: {type(e).__name__}: {e}"))
        else:
            if self.complete and not self.done.done():
                self._fail(StreamBroken(self.url, "stream ended without [DONE]"))

    def eof_received(self) -> Optional[bool]:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._stop_timers()
        if self.done.done():
            return
        if self.status is not None and self.status != 200 and not self.chunked and self.left is None:
            # a non-200 answer whose body ran to the close
            self._fail(_http_error(self.url, self.status, self.error_body.decode(errors="replace")))
        elif self.status is None:
            self._fail(StreamBroken(self.url, "connection closed before the response" + (f": {exc}" if exc else "")))
        else:
            self._fail(StreamBroken(self.url, "stream ended without [DONE]" + (f" ({exc})" if exc else "")))

    # ------------------------------------------------------------ parsing
    def _head(self, data: bytes) -> bytes:
        """Takes the status line and headers; returns the body bytes that came with them."""
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > _MAX_HEAD:
                raise StreamBroken(self.url, "response head too long")
            return b""
        lines = bytes(self.head[:end]).split(b"\r\n")
        rest = bytes(self.head[end + 4:])
        self.head = bytearray()
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise StreamBroken(self.url, f"not an HTTP/1.x response: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self.chunked = True
        elif b"content-length" in headers:
            try:
                self.left = int(headers[b"content-length"])
            except ValueError:
                raise StreamBroken(self.url, "invalid Content-Length") from None
            if self.left < 0:
                raise StreamBroken(self.url, "invalid Content-Length")
            self.complete = self.left == 0
        self.status = status
        if status == 200:
            # Stalls are counted from the head on: before it the caller's request timeout bounds the wait,
            # as before (a long prefill may hold the first chunk but not the head).
            self.watch = self.loop.call_later(self.read_timeout, self._check_stall)
        return rest

    def _body(self, data: bytes) -> bytes:
        """Decodes the body framing of `data`; returns its payload bytes."""
        if not self.chunked:
            if self.left is None:
                return data  # to the close
            data = data[:self.left]
            self.left -= len(data)
            self.complete = self.left == 0
            return data
        buf = self.raw + data if self.raw else data
        self.raw = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n and not self.complete:
            if self.trailer:
                # trailers (none from an engine), then an empty line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    self.raw = buf[pos:]
                    break
                if eol == pos:
                    self.complete = True
                pos = eol + 2
            elif self.left is None:  # a chunk-size line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 1024:
                        raise StreamBroken(self.url, "invalid chunk size line")
                    self.raw = buf[pos:]
                    break
                try:
                    size = int(buf[pos:eol].split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise StreamBroken(self.url, f"invalid chunk size {buf[pos:eol][:40]!r}") from None
                pos = eol + 2
                if size == 0:
                    self.trailer = True
                else:
                    self.left = size + 2  # the chunk's data and its CRLF
            else:
                take = min(self.left, n - pos)
                data_left = self.left - 2  # bytes of data (not CRLF) still to come in this chunk
                if data_left > 0:
                    out.append(buf[pos:pos + min(take, data_left)])
                self.left -= take
                pos += take
                if self.left == 0:
                    self.left = None
        return b"".join(out) if len(out) != 1 else out[0]

    def _events(self, body: bytes) -> None:
        newest, done, self.tail, n = newest_event(self.tail + body if self.tail else body)
        if newest is not None or done:
            try:
                self.on_data(newest, done, n)
            except Exception as e:  # noqa: BLE001 - the caller's own error, not the engine's: raised as it is
                self._fail(e)
                return
        if done and not self.done.done():
            self.done.set_result(None)

    def _lower(self) -> None:
        """The window is over: whatever waits is read now (and the next read restores the mark)."""
        self.window = None
        if self.sock is not None and not self.done.done():
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                self.lowered = True
            except OSError:
                self.sock = None

    # ------------------------------------------------------------ ends
    def _stop_timers(self) -> None:
        for h in (self.watch, self.window):
            if h is not None:
                h.cancel()

    def _check_stall(self) -> None:
        left = self.last_data + self.read_timeout - self.loop.time()
        if left <= 0:
            self._fail(StreamBroken(self.url, f"no data within the read timeout ({self.read_timeout:g} s)"))
            return
        self.watch = self.loop.call_later(left, self._check_stall)

    def _fail(self, err: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(err)
        if self.transport is not None:
            self.transport.abort()


async def read_stream(url: str, payload: dict, timeout: float, read_timeout: float, on_data: OnData,
                      coalesce_s: float = 0.0) -> None:
    """POSTs a streaming /generate to `url` (an http base URL) and calls `on_data(newest, done, n)` from each read
    that completes an SSE event; returns after `[DONE]`. With `coalesce_s` > 0 the socket is read at most that
    often (or when 64 KiB wait), so `on_data` sees the newest of several chunks. Raises StreamBroken on an end without it, a stall of
    `read_timeout` seconds or a failed connection (within `timeout`), GenerateError for a non-200 answer, and
    closes the connection on any exit, cancellation included (the engine then aborts the request)."""
    u = URL(f"{url}/generate")
    body = orjson.dumps({**payload, "stream": True})
    host = u.raw_host or ""
    host_header = (f"[{host}]" if ":" in host else host) + (f":{u.port}" if u.explicit_port else "")
    request = (f"POST {u.raw_path_qs} HTTP/1.1\r\nHost: {host_header}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode("latin-1") + body
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    proto = _Response(url, request, on_data, read_timeout, done, coalesce_s)
    try:
        async with asyncio.timeout(timeout):
            await loop.create_connection(lambda: proto, host, u.port)
    except (OSError, TimeoutError) as e:
        raise StreamBroken(url, f"cannot connect: {type(e).__name__}: {e}", delivered=False) from e
    try:
        await done
    finally:
        proto._stop_timers()
        if proto.transport is not None:
            if done.done() and not done.cancelled() and done.exception() is None:
                proto.transport.close()
            else:
                proto.transport.abort()  # failed or cancelled: the engine sees the client gone at once
