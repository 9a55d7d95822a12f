"""An async client for SGLang's native /generate API (the real server, the router, or the CPU engine).

A stream that ends without ``data: [DONE]`` or without a finish_reason is a failure, never a short
answer: when a worker is SIGKILLed mid-stream behind sglang-router the HTTP status was already 200 and
the stream simply stops.

Owns: the HTTP calls and their shapes. Must not: retry or decide anything about engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Callable, Optional, Union

import aiohttp
import httpx
import orjson


class GenerateError(RuntimeError):
    """A /generate call failed: connection refused, HTTP error, or a broken stream. `delivered` is False when
    no connection was made, so the engine never saw the request (no evidence against the request itself)."""

    def __init__(self, url: str, reason: str, status: Optional[int] = None, retriable: bool = True,
                 delivered: bool = True):
        self.url, self.reason, self.status, self.retriable = url, reason, status, retriable
        self.delivered = delivered
        super().__init__(f"{url}: {reason}" + (f" (HTTP {status})" if status else ""))


class StreamBroken(GenerateError):
    """The SSE stream ended before the request finished."""


def _http_error(url: str, status: int, body: str) -> GenerateError:
    # 4xx means the request itself is bad: resending it elsewhere would fail the same way.
    return GenerateError(url, body[:500], status, retriable=status >= 500)


async def generate(client: httpx.AsyncClient, url: str, payload: dict, timeout: float) -> dict:
    """POSTs a non-streaming /generate and returns SGLang's response object."""
    body = {**payload, "stream": False}
    try:
        resp = await client.post(f"{url}/generate", json=body, timeout=timeout)
    except httpx.HTTPError as e:
        raise GenerateError(url, f"{type(e).__name__}: {e}", delivered=not isinstance(e, httpx.ConnectError)) from e
    if resp.status_code != 200:
        raise _http_error(url, resp.status_code, resp.text)
    try:
        return resp.json()
    except json.JSONDecodeError as e:
        raise GenerateError(url, f"invalid JSON response: {e}") from e


async def generate_stream(client: Union[httpx.AsyncClient, aiohttp.ClientSession], url: str, payload: dict,
                          timeout: float, read_timeout: Optional[float] = None) -> AsyncIterator[dict]:
    """POSTs a streaming /generate and yields SGLang's cumulative chunks; raises StreamBroken on an early end.

    `read_timeout` bounds the wait for each chunk (a stalled engine), `timeout` the connection set-up.
    """
    last: Optional[dict] = None
    events = stream_events(client, url, payload, timeout, read_timeout)
    async with contextlib.aclosing(events):  # an early return releases the connection at once
        async for newest, done, _ in events:
            if newest is not None:
                last = parse_chunk(url, newest)
                yield last
            if done:
                if last is None or not (last.get("meta_info") or {}).get("finish_reason"):
                    raise StreamBroken(url, "stream ended with [DONE] but no finish_reason")
                return


def parse_chunk(url: str, data: bytes) -> dict:
    """One SSE `data:` payload as SGLang's chunk dict; raises StreamBroken (invalid) or GenerateError (error chunk)."""
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise StreamBroken(url, f"invalid SSE chunk: {e}") from e
    if not isinstance(chunk, dict):
        raise StreamBroken(url, f"invalid SSE chunk: {data[:80]!r}")
    if "error" in chunk and "output_ids" not in chunk:
        raise GenerateError(url, f"error chunk: {chunk['error']}")
    return chunk


async def stream_events(client: Union[httpx.AsyncClient, aiohttp.ClientSession], url: str, payload: dict,
                        timeout: float, read_timeout: Optional[float] = None
                        ) -> AsyncIterator[tuple[Optional[bytes], bool, int]]:
    """POSTs a streaming /generate and yields, for each block read, (the newest complete `data:` payload in it,
    unparsed, or None; whether `[DONE]` came; how many payloads the block completed); it stops after `[DONE]`
    and raises StreamBroken on an end without it.

    SGLang's chunks are cumulative, so a reader parses only the payload it needs: a client that only wants
    the final state and a resumable cut point parses one chunk per request, not one per token.
    An aiohttp session is the fast path (its C parser costs a fraction of httpx's per-chunk work, which was
    most of the front's CPU at one chunk per token); an httpx client works the same way.
    """
    body = {**payload, "stream": True}
    rt = read_timeout if read_timeout is not None else timeout
    if isinstance(client, aiohttp.ClientSession):
        blocks = _aiohttp_blocks(client, url, body, timeout, rt)
    else:
        blocks = _httpx_blocks(client, url, body, timeout, rt)
    tail = b""
    async with contextlib.aclosing(blocks):
        async for block in blocks:
            newest, done, tail, n = newest_event(tail + block if tail else block)
            yield newest, done, n
            if done:
                return
    raise StreamBroken(url, "stream ended without [DONE]")


async def _httpx_blocks(client: httpx.AsyncClient, url: str, body: dict, timeout: float,
                        read_timeout: float) -> AsyncIterator[bytes]:
    try:
        async with client.stream("POST", f"{url}/generate", json=body,
                                 timeout=httpx.Timeout(timeout, read=read_timeout)) as resp:
            if resp.status_code != 200:
                raise _http_error(url, resp.status_code, (await resp.aread()).decode(errors="replace"))
            async for block in resp.aiter_bytes():
                yield block
    except httpx.HTTPError as e:
        raise StreamBroken(url, f"{type(e).__name__}: {e}", delivered=not isinstance(e, httpx.ConnectError)) from e


class _Stalled(Exception):
    """No data came within the read timeout (set on the stream by its watchdog)."""


class _ReadWatchdog:
    """Bounds each wait for data with one timer per read timeout, not one per chunk: aiohttp's sock_read
    re-arms a timer on every chunk received, a cost paid per token at one chunk per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float, on_stall: Callable[[], None]):
        self.loop, self.read_timeout, self.on_stall = loop, read_timeout, on_stall
        self.waiting_since: Optional[float] = None  # set while a read waits; None while the consumer works
        self._handle = loop.call_later(read_timeout, self._check)

    def _check(self) -> None:
        since = self.waiting_since
        left = self.read_timeout if since is None else since + self.read_timeout - self.loop.time()
        if left <= 0:
            self.on_stall()
            return
        self._handle = self.loop.call_later(left, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


async def _aiohttp_blocks(session: aiohttp.ClientSession, url: str, body: dict, timeout: float,
                          read_timeout: float) -> AsyncIterator[bytes]:
    # No total limit: the caller's request timeout covers the whole request. Each wait for data is bounded
    # by the watchdog (a stalled engine), which counts only time spent waiting, not the consumer's.
    to = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout)
    loop = asyncio.get_running_loop()
    try:
        async with session.post(f"{url}/generate", data=orjson.dumps(body), timeout=to,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                raise _http_error(url, resp.status, (await resp.read()).decode(errors="replace"))
            content = resp.content
            watch = _ReadWatchdog(loop, read_timeout, lambda: content.set_exception(_Stalled()))
            try:
                while True:
                    watch.waiting_since = loop.time()
                    block = await content.readany()
                    watch.waiting_since = None
                    if not block:
                        return
                    yield block
            finally:
                watch.cancel()
    except _Stalled:
        raise StreamBroken(url, f"no data within the read timeout ({read_timeout:g} s)") from None
    except (aiohttp.ClientError, TimeoutError) as e:
        raise StreamBroken(url, f"{type(e).__name__}: {e}",
                           delivered=not isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))) from e


def newest_event(buf: bytes) -> tuple[Optional[bytes], bool, bytes, int]:
    """(the last complete `data:` payload in buf, whether `[DONE]` came, the incomplete rest of buf, how many
    complete payloads other than `[DONE]` buf held).

    SGLang's stream chunks are cumulative (each carries every id so far), so of the chunks that arrived
    together only the newest needs parsing: a reader that falls behind parses less, not a growing backlog.
    The count tells token progress how many chunk intervals a coalesced read spans (fleet/progress.py).
    """
    end = buf.rfind(b"\n")
    if end < 0:
        return None, False, buf, 0
    newest, done, n = None, False, 0
    for line in buf[:end].split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
            elif not done:
                newest = data
                n += 1
    return newest, done, buf[end + 1:], n


async def get_json(client: httpx.AsyncClient, url: str, path: str, timeout: float) -> Any:
    """GETs `url + path` and returns the decoded JSON; raises GenerateError otherwise."""
    try:
        resp = await client.get(f"{url}{path}", timeout=timeout)
    except httpx.HTTPError as e:
        raise GenerateError(url, f"{type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise _http_error(url, resp.status_code, resp.text)
    return resp.json()
