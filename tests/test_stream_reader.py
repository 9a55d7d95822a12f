"""The callback stream reader (generation/stream_reader.py) against real sockets: a raw TCP server that sends
exact bytes (framing split at every boundary, early closes, stalls, errors) and a real aiohttp server."""

from __future__ import annotations

import asyncio
import socket
import time

import orjson
import pytest
from aiohttp import web

from belayer_plugin.generation.sglang_http import GenerateError, StreamBroken
from belayer_plugin.generation.stream_reader import read_stream, supported
from belayer_plugin.http_serve import start_app

CHUNKS = [orjson.dumps({"text": "a" * i, "output_ids": list(range(i)),
                        "meta_info": {"id": "r", "finish_reason": {"type": "length"} if i == 5 else None}})
          for i in range(1, 6)]
EVENTS = b"".join(b"data: " + c + b"\n\n" for c in CHUNKS) + b"data: [DONE]\n\n"


def _chunked(body: bytes, piece: int = 37, end: bool = True) -> bytes:
    out = b""
    for i in range(0, len(body), piece):
        part = body[i:i + piece]
        out += b"%x;ext=1\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n" if end else out


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def _raw_server(script, port: int = 0):
    """A TCP server (on `port`, 0: any) that runs `script(reader, writer)` per connection; returns (server, url,
    connections)."""
    conns: list[asyncio.StreamReader] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(reader)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0].split(b":")[1])
        await reader.readexactly(length)
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client went first (it stops at [DONE]); the test's loop may end before this handler
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", conns


async def _send_in_pieces(writer: asyncio.StreamWriter, data: bytes, size: int) -> None:
    for i in range(0, len(data), size):
        writer.write(data[i:i + size])
        await writer.drain()
        await asyncio.sleep(0)  # let each piece reach the reader as its own read where the kernel allows


async def _read(url: str, read_timeout: float = 5.0) -> list[tuple[bytes | None, bool]]:
    got: list[tuple[bytes | None, bool]] = []
    async with asyncio.timeout(20):
        await read_stream(url, {"input_ids": [1]}, 5.0, read_timeout, lambda n, d, _k: got.append((n, d)))
    return got


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8, 13, 64, 10_000])
async def test_a_chunked_stream_split_anywhere_yields_whole_events_and_ends_at_done(piece):
    async def script(_, writer):
        await _send_in_pieces(writer, HEAD + _chunked(EVENTS), piece)

    server, url, _ = await _raw_server(script)
    async with server:
        got = await _read(url)
    news = [n for n, _ in got if n is not None]
    assert news[-1] == CHUNKS[-1] and got[-1][1] and not any(d for _, d in got[:-1])
    assert all(n in CHUNKS for n in news)  # never a partial payload
    assert news == sorted(news, key=CHUNKS.index)  # in order
    if piece == 1:
        assert news == CHUNKS  # one byte at a time: every event seen


@pytest.mark.parametrize("framing", ["length", "close"])
async def test_a_sized_or_to_the_close_body_is_read_the_same(framing):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    head += (b"Content-Length: %d\r\n\r\n" % len(EVENTS)) if framing == "length" else b"Connection: close\r\n\r\n"

    async def script(_, writer):
        await _send_in_pieces(writer, head + EVENTS, 7)

    server, url, _ = await _raw_server(script)
    async with server:
        got = await _read(url)
    assert [n for n, _ in got if n is not None][-1] == CHUNKS[-1] and got[-1][1]


async def test_a_stream_cut_before_done_breaks_after_handing_over_every_event_it_held():
    async def script(_, writer):
        body = b"".join(b"data: " + c + b"\n\n" for c in CHUNKS[:3])
        writer.write(HEAD + _chunked(body, end=False))  # no last chunk: the engine died
        await writer.drain()

    server, url, _ = await _raw_server(script)
    got: list = []
    async with server:
        with pytest.raises(StreamBroken, match="without \\[DONE\\]"):
            async with asyncio.timeout(20):
                await read_stream(url, {}, 5.0, 5.0, lambda n, d, _k: got.append((n, d)))
    assert [n for n, _ in got if n is not None][-1] == CHUNKS[2]


@pytest.mark.parametrize("framing", ["chunked", "length"])
async def test_a_non_200_answer_is_an_http_error_with_its_message_and_4xx_is_not_retriable(framing):
    msg = b'{"error": {"message": "bad sampling_params"}}'
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
    data = head + (b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(msg, 9) if framing == "chunked"
                   else b"Content-Length: %d\r\n\r\n" % len(msg) + msg)

    async def script(reader, writer):
        await _send_in_pieces(writer, data, 11)
        await reader.read()  # hold the connection open: the answer's own framing must end it

    server, url, _ = await _raw_server(script)
    async with server:
        with pytest.raises(GenerateError) as e:
            await _read(url)
    assert e.value.status == 400 and not e.value.retriable and "bad sampling_params" in e.value.reason
    assert not isinstance(e.value, StreamBroken)


async def test_a_stall_after_the_head_breaks_within_the_read_timeout_with_a_named_reason():
    async def script(reader, writer):
        writer.write(HEAD + _chunked(b"data: " + CHUNKS[0] + b"\n\n", end=False))
        await writer.drain()
        await reader.read()  # then nothing, until the client goes

    server, url, _ = await _raw_server(script)
    got: list = []
    t0 = time.monotonic()
    async with server:
        with pytest.raises(StreamBroken, match="read timeout"):
            async with asyncio.timeout(20):
                await read_stream(url, {}, 5.0, 0.5, lambda n, d, _k: got.append((n, d)))
    assert 0.4 <= time.monotonic() - t0 < 5
    assert got == [(CHUNKS[0], False)]


async def test_cancelling_the_reader_closes_the_connection_so_the_engine_sees_the_client_go():
    closed = asyncio.Event()

    async def script(reader, writer):
        writer.write(HEAD + _chunked(b"data: " + CHUNKS[0] + b"\n\n", end=False))
        await writer.drain()
        await reader.read()  # returns at the client's close
        closed.set()

    server, url, _ = await _raw_server(script)
    first = asyncio.Event()
    async with server:
        task = asyncio.create_task(read_stream(url, {}, 5.0, 30.0, lambda n, d, _k: first.set()))
        await asyncio.wait_for(first.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 10)


async def test_an_error_raised_by_the_callback_is_raised_as_it_is_not_as_an_engine_failure():
    async def script(reader, writer):
        writer.write(HEAD + _chunked(EVENTS))
        await writer.drain()
        await reader.read()

    server, url, _ = await _raw_server(script)

    def boom(n, d, k):
        raise KeyError("the caller's bug")

    async with server:
        with pytest.raises(KeyError):
            async with asyncio.timeout(20):
                await read_stream(url, {}, 5.0, 5.0, boom)


@pytest.mark.parametrize("data", [
    b"SMTP ready\r\n\r\n",
    HEAD + b"zz\r\ndata\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
])
async def test_a_malformed_response_is_a_broken_stream_not_a_crash(data):
    async def script(reader, writer):
        writer.write(data)
        await writer.drain()
        await reader.read()

    server, url, _ = await _raw_server(script)
    async with server:
        with pytest.raises(StreamBroken):
            await _read(url)


async def test_a_refused_connection_is_a_broken_stream():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(StreamBroken, match="cannot connect"):
            await _read(f"http://127.0.0.1:{port}")


async def test_a_real_aiohttp_server_stream_is_read_to_its_done_and_gets_the_posted_body():
    seen_bodies = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen_bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in CHUNKS:
            await resp.write(b"data: " + c + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner, url = await start_app(app, "127.0.0.1", 0)
    try:
        got: list = []
        async with asyncio.timeout(20):
            await read_stream(url, {"input_ids": [1, 2]}, 5.0, 5.0, lambda n, d, _k: got.append((n, d)))
        assert [n for n, _ in got if n is not None][-1] == CHUNKS[-1] and got[-1][1]
        assert seen_bodies == [{"input_ids": [1, 2], "stream": True}]
    finally:
        await runner.cleanup()


def test_only_plain_http_urls_are_read_here():
    assert supported("http://127.0.0.1:30000") and supported("http://[::1]:8000")
    assert not supported("https://engine:30000") and not supported("unix:///x") and not supported("nonsense")


def _cumulative(n: int) -> list[bytes]:
    return [orjson.dumps({"text": "a" * i, "output_ids": list(range(i)), "meta_info": {
        "finish_reason": {"type": "length"} if i == n else None}}) for i in range(1, n + 1)]


@pytest.mark.parametrize("window", [0.0, 0.1])
async def test_a_coalescing_window_reads_the_newest_of_several_chunks_instead_of_each(window):
    chunks = _cumulative(60)

    async def script(reader, writer):
        writer.write(HEAD)
        for c in chunks:
            writer.write(_chunked(b"data: " + c + b"\n\n", 10_000, end=False))
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(_chunked(b"data: [DONE]\n\n"))
        await writer.drain()
        await reader.read()

    server, url, _ = await _raw_server(script)
    got: list = []
    async with server:
        async with asyncio.timeout(20):
            await read_stream(url, {}, 5.0, 5.0, lambda n, d, k: got.append((n, d, k)), coalesce_s=window)
    news = [n for n, _, _ in got if n is not None]
    assert news[-1] == chunks[-1] and got[-1][1]
    # each read says how many chunks it held (token progress divides a read's wait by it): none lost
    assert sum(k for _, _, k in got) == len(chunks), [k for _, _, k in got]
    if window:
        # ~0.3 s of chunks in 0.1 s windows (the first read comes at once): a handful of reads, not 60
        assert len(got) <= 12, len(got)
    else:
        assert len(got) >= 30, len(got)


@pytest.mark.parametrize("close", ["fin", "rst"])
async def test_an_engine_that_dies_within_a_window_is_seen_at_once_and_every_chunk_it_sent_is_kept(close):
    chunks = _cumulative(20)

    async def script(reader, writer):
        writer.write(HEAD)
        for c in chunks[:10]:
            writer.write(_chunked(b"data: " + c + b"\n\n", 10_000, end=False))
            await writer.drain()
            await asyncio.sleep(0.002)
        if close == "rst":  # a close that resets the connection (SO_LINGER 0)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            writer.transport.abort()
        # "fin": the handler returns and closes, as a SIGKILLed engine's kernel does

    server, url, _ = await _raw_server(script)
    got: list = []
    t0 = time.monotonic()
    async with server:
        with pytest.raises(StreamBroken):
            async with asyncio.timeout(20):
                await read_stream(url, {}, 5.0, 5.0, lambda n, d, _k: got.append((n, d)), coalesce_s=2.0)
    assert time.monotonic() - t0 < 1.5  # not held until the 2 s window ends
    assert [n for n, _ in got if n is not None][-1] == chunks[9]


class _Sequence:
    """A selector that hands out the given URLs in order (one per attempt), recording what it was told to
    exclude; with `honour_exclude`, an excluded URL is not handed out (a fleet with no other engine: the pick
    fails)."""

    def __init__(self, urls: list[str], honour_exclude: bool = False):
        self.urls, self.failures, self.excludes, self.honour = list(urls), [], [], honour_exclude

    async def pick(self, exclude, timeout):
        from belayer_plugin.generation.resumable import Target
        self.excludes.append(set(exclude))
        if self.honour and self.urls[0] in exclude:
            raise RuntimeError(f"no serving engine outside {sorted(exclude)}")
        url = self.urls.pop(0)
        return Target(url, url)

    def release(self, target):
        pass

    async def failed(self, target, reason):
        self.failures.append(reason)


async def _serve_ids(n: int, port: int = 0):
    """An engine that streams ids 0..n-1 as cumulative chunks and finishes."""
    chunks = _cumulative(n)

    async def serve(_, writer):
        writer.write(HEAD + _chunked(b"".join(b"data: " + c + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"))
        await writer.drain()

    return await _raw_server(serve, port)


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connection is refused, as on an engine already dead
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("delivered", [False, True])
async def test_only_an_engine_that_took_the_request_and_died_without_a_token_is_poison_evidence(delivered):
    """CI saw an innocent request quarantined: its retries landed on engines another request had just killed
    and were refused. A refused connection says nothing about the request; a death after it was sent does."""
    from belayer_plugin.generation.resumable import RequestPoisonedError, ResumableGenerator
    from tests.conftest import belayer_cfg

    async def take_and_die(_, writer):
        writer.write(HEAD)
        await writer.drain()  # the request was read; the engine dies before its first token

    good, good_url, _ = await _serve_ids(5)
    bad, bad_url, bad_conns = await _raw_server(take_and_die)
    recovery = belayer_cfg("belayer.recovery.poison_max_deaths=2", "belayer.recovery.max_attempts=4").recovery
    first = [bad_url, bad_url] if delivered else [_closed_port_url(), _closed_port_url()]
    sel = _Sequence(first + [good_url])
    gen = ResumableGenerator(sel, recovery)
    async with good, bad:
        async with asyncio.timeout(20):
            if delivered:
                with pytest.raises(RequestPoisonedError):
                    await gen.generate("r", [1, 2], {"max_new_tokens": 5, "temperature": 0.0})
                assert len(bad_conns) == 2
            else:
                _, resp = await gen.generate("r", [1, 2], {"max_new_tokens": 5, "temperature": 0.0})
                assert resp["output_ids"] == list(range(5))
    assert len(sel.failures) == 2  # either way both engines were reported to the fleet


async def test_refused_connections_spend_no_attempt_and_the_refusing_engines_stay_excluded():
    """CI saw an innocent request fail 'after 4 attempts', all of them refused connections to engines a poison
    request had just killed and the fleet had not yet marked: it bounced between them in milliseconds. A refusal
    spends no attempt, and the URL stays excluded until an attempt is delivered."""
    from belayer_plugin.generation.resumable import ResumableGenerator
    from tests.conftest import belayer_cfg

    good, good_url, conns = await _serve_ids(5)
    dead = [_closed_port_url() for _ in range(5)]
    sel = _Sequence(dead + [good_url])
    gen = ResumableGenerator(sel, belayer_cfg("belayer.recovery.max_attempts=2").recovery)
    async with good:
        async with asyncio.timeout(20):
            _, resp = await gen.generate("r", [1, 2], {"max_new_tokens": 5, "temperature": 0.0})
    assert resp["output_ids"] == list(range(5)) and len(conns) == 1
    assert len(sel.failures) == 5  # each dead engine still reported to the fleet
    assert [len(x) for x in sel.excludes] == [0, 1, 2, 3, 4, 5]
    assert sel.excludes[-1] == set(dead)


async def test_a_request_refused_everywhere_fails_bounded_with_a_503():
    from belayer_plugin.generation.resumable import RequestFailedError, ResumableGenerator
    from tests.conftest import belayer_cfg

    sel = _Sequence([_closed_port_url() for _ in range(100)])
    gen = ResumableGenerator(sel, belayer_cfg("belayer.recovery.max_attempts=2").recovery)
    with pytest.raises(RequestFailedError) as ei:
        async with asyncio.timeout(20):
            await gen.generate("r", [1, 2], {"max_new_tokens": 5, "temperature": 0.0})
    assert ei.value.status == 503 and "refused by 8 engine(s)" in str(ei.value)
    assert len(sel.failures) == 8


async def test_an_engine_back_at_a_refused_url_is_picked_again_when_nothing_else_serves():
    """Ports are chosen afresh per start, but a replacement may get a refused URL back: when excluding the
    refused URLs leaves nothing to pick, the request asks once more without them instead of failing."""
    from belayer_plugin.generation.resumable import ResumableGenerator
    from tests.conftest import belayer_cfg

    url = _closed_port_url()

    class _Back(_Sequence):
        async def failed(self, target, reason):
            await super().failed(target, reason)
            # the engine comes back at the same port once its death is reported
            self.server, _, _ = await _serve_ids(5, int(url.rsplit(":", 1)[1]))

    sel = _Back([url, url, url], honour_exclude=True)
    gen = ResumableGenerator(sel, belayer_cfg("belayer.recovery.max_attempts=2").recovery)
    try:
        async with asyncio.timeout(20):
            _, resp = await gen.generate("r", [1, 2], {"max_new_tokens": 5, "temperature": 0.0})
    finally:
        if hasattr(sel, "server"):
            sel.server.close()
            await sel.server.wait_closed()
    assert resp["output_ids"] == list(range(5))
    assert sel.excludes == [set(), {url}, set()]
