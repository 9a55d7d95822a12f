"""An async client for SGLang's native /generate API (the real server, the router, or the CPU engine).

A stream that ends without ``data: [DONE]`` or without a finish_reason is a failure, never a short
answer: when a worker is SIGKILLed mid-stream behind sglang-router the HTTP status was already 200 and
the stream simply stops.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Optional, Union

import aiohttp
import httpx
import orjson


class GenerateError(RuntimeError):
    """A /generate call failed: connection refused, HTTP error, or a broken stream."""

    def __init__(self, url: str, reason: str, status: Optional[int] = None, retriable: bool = True):
        self.url, self.reason, self.status, self.retriable = url, reason, status, retriable
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
        raise GenerateError(url, f"{type(e).__name__}: {e}") from e
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
    An aiohttp session is the fast path (its C parser costs a fraction of httpx's per-chunk work, which was
    most of the front's CPU at one chunk per token); an httpx client works the same way.
    """
    body = {**payload, "stream": True}
    rt = read_timeout if read_timeout is not None else timeout
    if isinstance(client, aiohttp.ClientSession):
        blocks = _aiohttp_blocks(client, url, body, timeout, rt)
    else:
        blocks = _httpx_blocks(client, url, body, timeout, rt)
    last: Optional[dict] = None
    tail = b""
    async with contextlib.aclosing(blocks):  # an early return releases the connection at once
        async for block in blocks:
            newest, done, tail = newest_event(tail + block)
            if newest is not None:
                try:
                    last = orjson.loads(newest)
                except orjson.JSONDecodeError as e:
                    raise StreamBroken(url, f"invalid SSE chunk: {e}") from e
                if not isinstance(last, dict):
                    raise StreamBroken(url, f"invalid SSE chunk: {newest[:80]!r}")
                if "error" in last and "output_ids" not in last:
                    raise GenerateError(url, f"error chunk: {last['error']}")
                yield last
            if done:
                if last is None or not (last.get("meta_info") or {}).get("finish_reason"):
                    raise StreamBroken(url, "stream ended with [DONE] but no finish_reason")
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
        raise StreamBroken(url, f"{type(e).__name__}: {e}") from e


async def _aiohttp_blocks(session: aiohttp.ClientSession, url: str, body: dict, timeout: float,
                          read_timeout: float) -> AsyncIterator[bytes]:
    # sock_read bounds each wait for data (a stalled engine), as httpx's read timeout does; no total limit:
    # the caller's request timeout covers the whole request.
    to = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout, sock_read=read_timeout)
    try:
        async with session.post(f"{url}/generate", data=orjson.dumps(body), timeout=to,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                raise _http_error(url, resp.status, (await resp.read()).decode(errors="replace"))
            async for block in resp.content.iter_any():
                yield block
    except (aiohttp.ClientError, TimeoutError) as e:
        raise StreamBroken(url, f"{type(e).__name__}: {e}") from e


def newest_event(buf: bytes) -> tuple[Optional[bytes], bool, bytes]:
    """(the last complete `data:` payload in buf, whether `[DONE]` came, the incomplete rest of buf).

    SGLang's stream chunks are cumulative (each carries every id so far), so of the chunks that arrived
    together only the newest needs parsing: a reader that falls behind parses less, not a growing backlog.
    """
    end = buf.rfind(b"\n")
    if end < 0:
        return None, False, buf
    newest, done = None, False
    for line in buf[:end].split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
            elif not done:
                newest = data
    return newest, done, buf[end + 1:]


async def get_json(client: httpx.AsyncClient, url: str, path: str, timeout: float) -> Any:
    """GETs `url + path` and returns the decoded JSON; raises GenerateError otherwise."""
    try:
        resp = await client.get(f"{url}{path}", timeout=timeout)
    except httpx.HTTPError as e:
        raise GenerateError(url, f"{type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise _http_error(url, resp.status_code, resp.text)
    return resp.json()
