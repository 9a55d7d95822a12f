"""The stream path's own parts against a real local HTTP server: the read watchdog and chunk forwarding."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from belayer_plugin.generation.front import forwarded
from belayer_plugin.generation.sglang_http import StreamBroken, stream_events
from belayer_plugin.http_serve import start_app

CHUNK = {"text": "a", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": None}}
FINAL = {"text": "ab", "output_ids": [5, 6], "meta_info": {"id": "r", "finish_reason": {"type": "length"}}}


async def _server(gate: asyncio.Event):
    """An SSE /generate that sends one chunk, waits for `gate`, then sends the final chunk and [DONE]."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(CHUNK) + b"\n\n")
        await asyncio.wait_for(gate.wait(), 30)
        await resp.write(b"data: " + orjson.dumps(FINAL) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", handler)
    return await start_app(app, "127.0.0.1", 0)


async def test_a_stream_with_no_data_within_the_read_timeout_breaks_with_a_named_reason():
    gate = asyncio.Event()  # never set: the engine stalls after its first chunk
    runner, url = await _server(gate)
    try:
        async with aiohttp.ClientSession() as s:
            got = []
            t0 = time.monotonic()
            with pytest.raises(StreamBroken, match="read timeout"):
                async for newest, done, _ in stream_events(s, url, {"input_ids": [1]}, 5.0, read_timeout=0.5):
                    got.append((newest, done))
            took = time.monotonic() - t0
        assert got == [(orjson.dumps(CHUNK), False)]
        assert 0.4 <= took < 5, took  # the read timeout, not the 5 s connect timeout nor a hang
    finally:
        gate.set()
        await runner.cleanup()


async def test_time_the_reader_spends_on_a_chunk_does_not_count_as_the_engine_stalling():
    gate = asyncio.Event()
    runner, url = await _server(gate)
    try:
        async with aiohttp.ClientSession() as s:
            got = []
            async for newest, done, _ in stream_events(s, url, {"input_ids": [1]}, 5.0, read_timeout=0.5):
                got.append((newest, done))
                if len(got) == 1:
                    # The consumer is busy for longer than the read timeout (the engine has nothing to send
                    # until it is done): the stream must stay up.
                    await asyncio.sleep(1.2)
                    gate.set()
        assert got == [(orjson.dumps(CHUNK), False), (orjson.dumps(FINAL), True)]
    finally:
        gate.set()
        await runner.cleanup()


TAG = orjson.dumps({"engine": "engine-0", "attempt": 1})


@pytest.mark.parametrize("chunk", [
    CHUNK,
    # text that holds the key's bytes, escaped: must not be where the tag goes
    {"text": 'x"meta_info":{"finish_reason":null}', "output_ids": [1, 2], "meta_info": {"finish_reason": None, "k": 1}},
    {"meta_info": {"finish_reason": None}, "text": "", "output_ids": []},
])
def test_a_forwarded_chunk_is_the_engine_chunk_plus_the_belayer_tag(chunk):
    out = orjson.loads(forwarded(orjson.dumps(chunk), TAG))
    expect = {**chunk, "meta_info": {**chunk["meta_info"], "belayer": {"engine": "engine-0", "attempt": 1}}}
    assert out == expect


@pytest.mark.parametrize("raw", [
    orjson.dumps(FINAL),  # the engine's last chunk: the front sends its own final chunk after it
    b'{"text": "a", "output_ids": [5], "meta_info": {"finish_reason": null}}',  # another encoder's spacing
    b'{"text": "a", "output_ids": [5], "meta_info": {}}',
])
def test_a_chunk_that_cannot_be_spliced_is_rewritten_with_no_finish_reason(raw):
    out = orjson.loads(forwarded(raw, TAG))
    assert out["meta_info"]["finish_reason"] is None
    assert out["meta_info"]["belayer"] == {"engine": "engine-0", "attempt": 1}
    assert out["output_ids"] == orjson.loads(raw)["output_ids"]
