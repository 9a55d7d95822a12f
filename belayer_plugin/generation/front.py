"""The drop-in front: SGLang's /generate (streaming and not, same shapes) with token-level recovery.

A trainer that posts to the router URL (NeMo-RL does) points at this front instead; recovery is then
transparent and request ids are preserved. Binds loopback unless configured otherwise.

A request that fails answers with its status and `{"error": {"message", "code", "reason"}}`: `reason` is the
error's kind, e.g. fleet_below_floor (503), request_deadline (504), queue_full (503 with Retry-After). A
stream's headers go out with its first chunk (or heartbeat), so a request refused before it started gets its
status too; after that a failure is an SSE `data:` error chunk with no [DONE]. A stream silent for
recovery.heartbeat_s (e.g. while its request waits for an engine the fleet is bringing back) gets an SSE comment.

Owns: the /generate HTTP surface for trainers and its streaming chunks. Must not: choose engines or resume
requests itself (ResumableGenerator does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Callable, Optional

import orjson
from aiohttp import web

from belayer_plugin.generation.context_log import ContextLog, Segment
from belayer_plugin.detok import IncrementalText
from belayer_plugin.generation.resumable import RequestFailedError, ResumableGenerator
from belayer_plugin.http_serve import start_app

log = logging.getLogger("belayer.front")


class BadRequest(ValueError):
    pass


_HEARTBEAT = object()  # queue marker: the stream has been silent for recovery.heartbeat_s


def _error_body(e: RequestFailedError) -> dict:
    return {"error": {"message": str(e), "code": e.status, "reason": e.kind}}


def error_response(e: RequestFailedError) -> web.Response:
    """A failed request's HTTP answer: its status, a JSON body naming the reason, Retry-After where set."""
    headers = {"Retry-After": str(int(e.retry_after))} if e.retry_after else None
    return web.json_response(_error_body(e), status=e.status, headers=headers)


def _validate(body: Any, tokenizer: Callable[[str], list[int]]) -> tuple[str, list[int], dict, bool, bool]:
    """Returns (rid, input_ids, sampling_params, stream, return_logprob) or raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("exactly one of text or input_ids is required")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest("text must be a string (batched requests are not supported by the front)")
        ids = tokenizer(text)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest("input_ids must be a non-empty list of integers (batched requests are not supported)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    mnt = sp.get("max_new_tokens", 128)
    if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer >= 0, got {mnt!r}")
    sp = {**sp, "max_new_tokens": mnt}
    for key in ("stream", "return_logprob"):
        if not isinstance(body.get(key, False), bool):
            raise BadRequest(f"{key} must be true or false")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    return rid, ids, sp, bool(body.get("stream", False)), bool(body.get("return_logprob", False))


def forwarded(raw: bytes, tag: bytes) -> bytes:
    """An engine's intermediate chunk as the front sends it: with `meta_info.belayer` = tag and no finish reason.

    The common case costs a byte search, not a parse and a re-encode: in JSON, `"meta_info":{` with bare
    quotes can only be a key (quotes inside strings are escaped), so the tag is spliced in after it.
    """
    i = raw.find(b'"meta_info":{') + 13
    if i >= 13 and raw[i:i + 1] != b"}" and b'"finish_reason":null' in raw:
        return raw[:i] + b'"belayer":' + tag + b"," + raw[i:]
    chunk = orjson.loads(raw)  # another encoder's spacing, or the engine's last chunk before [DONE]
    meta = chunk.setdefault("meta_info", {})
    meta["finish_reason"] = None
    meta["belayer"] = orjson.loads(tag)
    return orjson.dumps(chunk)


class GenerationFront:
    """An aiohttp server in front of a ResumableGenerator."""

    def __init__(self, gen: ResumableGenerator, tokenizer_path: str, host: str = "127.0.0.1", port: int = 0,
                 info_url: Optional[Callable[[], Optional[str]]] = None):
        self.gen = gen
        self.host, self.port = host, port
        self.tokenizer_path = tokenizer_path
        self.info_url = info_url  # an engine to answer /get_model_info for
        self._tok: Any = None
        self._runner: Optional[web.AppRunner] = None
        self.url = ""

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self._tok

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "body is not valid JSON", "code": 400}}, status=400)
        try:
            rid, ids, sp, stream, rl = _validate(body, self._encode)
        except BadRequest as e:
            return web.json_response({"error": {"message": str(e), "code": 400}}, status=400)
        if not stream:
            try:
                clog, _ = await self.gen.generate(rid, ids, sp, rl)
            except RequestFailedError as e:
                return error_response(e)
            return web.json_response(self.gen.response(clog, rl, self._text(clog.output_ids)))

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        heartbeat_s = self.gen.cfg.heartbeat_s
        last = loop.time()  # when the client was last sent something
        timer: Optional[asyncio.TimerHandle] = None

        def beat() -> None:  # one timer per stream, re-armed from the last write: nothing per token
            nonlocal timer
            due = last + heartbeat_s - loop.time()
            if due <= 1e-3:
                if queue.empty():
                    queue.put_nowait(_HEARTBEAT)
                due = heartbeat_s
            timer = loop.call_later(due, beat)

        async def send(data: bytes) -> None:
            nonlocal last
            if not resp.prepared:  # the headers go out with the first chunk (or heartbeat)
                await resp.prepare(request)
            await resp.write(data)
            last = loop.time()

        def progress(clog: ContextLog, seg: Segment) -> None:
            queue.put_nowait((clog, seg))

        tag = b""  # meta_info.belayer of the forwarded chunks (they come from the request's first segment only)

        def chunk(raw: bytes, clog: ContextLog, seg: Segment) -> None:
            nonlocal tag
            tag = tag or orjson.dumps({"engine": seg.engine, "attempt": len(clog.segments)})
            queue.put_nowait((raw, tag))

        task = asyncio.create_task(self.gen.generate(rid, ids, sp, rl, on_progress=progress, on_chunk=chunk))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        timer = loop.call_later(heartbeat_s, beat)
        text = IncrementalText(self.tokenizer)  # over all committed ids: a resume does not split the text
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if not queue.empty():
                    continue  # a slow reader gets the newest cumulative state, not a backlog
                if item is _HEARTBEAT:  # a comment: SSE clients skip it, connections and proxies stay open
                    await send(b": waiting for an engine\n\n" if rid in self.gen.waiting
                               else b": waiting for tokens\n\n")
                    continue
                if isinstance(item[0], bytes):  # the engine's own chunk: nothing resumed yet
                    await send(b"data: " + forwarded(*item) + b"\n\n")
                    continue
                clog, seg = item
                out = self.gen.response(clog, rl, text.update(clog.output_ids))
                out["meta_info"]["finish_reason"] = None
                out["meta_info"]["belayer"] = {"engine": seg.engine, "attempt": len(clog.segments)}
                await send(b"data: " + orjson.dumps(out) + b"\n\n")
            try:
                clog, _ = task.result()
            except RequestFailedError as e:
                if not resp.prepared:  # nothing sent yet: the failure's own status (and Retry-After)
                    return error_response(e)
                # No [DONE]: a client must never mistake a failed request for a short answer.
                await send(b"data: " + orjson.dumps(_error_body(e)) + b"\n\n")
                return resp
            # The final chunk is one full decode: exactly the text a non-streaming request gets.
            final = self.gen.response(clog, rl, self._text(clog.output_ids))
            await send(b"data: " + orjson.dumps(final) + b"\n\n")
            await send(b"data: [DONE]\n\n")
            return resp
        finally:
            if timer is not None:
                timer.cancel()
            if not task.done():  # the client went away
                task.cancel()

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _health_generate(self, _: web.Request) -> web.Response:
        try:
            await self.gen.generate(f"health-{uuid.uuid4().hex}", [0], {"max_new_tokens": 1, "temperature": 0.0})
        except RequestFailedError as e:
            return web.json_response({"error": {"message": str(e)}}, status=503)
        return web.Response(text="ok")

    async def _passthrough(self, request: web.Request) -> web.Response:
        url = self.info_url() if self.info_url else None
        if not url:
            return web.json_response({"error": {"message": "no engine available"}}, status=503)
        r = await self.gen.client.get(f"{url}{request.path}", timeout=10.0)
        return web.Response(body=r.content, status=r.status_code, content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health_generate)
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            app.router.add_get(path, self._passthrough)
        return app

    async def start(self) -> str:
        """Starts serving; returns the front's URL."""
        # Load the tokenizer now, off the loop: loading it lazily stalled every stream of the first request.
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.tokenizer)
        self._runner, self.url = await start_app(self.app(), self.host, self.port)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
