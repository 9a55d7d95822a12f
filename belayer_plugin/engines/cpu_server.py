"""Belayer's CPU engine: an HTTP server speaking the subset of SGLang's native API that trainers use.

It serves a small causal LM on the CPU: a Qwen2 checkpoint through native_lm's plain-torch forward (no
transformers import), any other through transformers. Requests are decoded together, interleaved one
token each per scheduler step, so a long request never blocks a short one. Model compute runs in one
worker thread; the asyncio loop stays free for health checks and new requests.

Run: ``python -m belayer_plugin.engines.cpu_server --model-path DIR --port P``.

Owns: the HTTP surface (routes, request bodies, responses and stream chunks, CPU weight buckets) and the
process's arguments. Must not: hold model or scheduler state (engines/cpu_engine.py does; its Engine is
re-exported here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any, Optional

import orjson
from aiohttp import web

from belayer_plugin.engines import cpu_engine, cpu_openai
from belayer_plugin.engines.cpu_engine import BadRequest, Engine, Request, Sampling, parse_sampling
from belayer_plugin.lean_imports import skip_unused_imports

__all__ = ["BadRequest", "ChunkWriter", "Engine", "Request", "Sampling", "build_app", "decode_cpu_bucket",
           "encode_cpu_bucket", "main", "parse_sampling"]

log = logging.getLogger("belayer.cpu_engine")

VERSION = "belayer-cpu-engine-0.1"

# Top-level /generate fields SGLang accepts (those this engine does not use are accepted and ignored).
_TOP_LEVEL = {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
              "top_logprobs_num", "rid", "return_text_in_logprobs", "lora_path", "session_params",
              "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
              "data_parallel_rank", "modalities", "log_metrics", "extra_key", "model", "background",
              "no_logs", "priority", "routed_dp_rank", "conversation_id", "label", "custom_labels"}
# Fields the real router always sends (re-serialised with defaults): accepted while falsy, refused with a
# reason when a client actually asks for a feature this engine does not have.
_UNSUPPORTED_WHEN_SET = {"return_hidden_states", "return_entropy", "return_bytes", "return_routed_experts",
                         "image_data", "video_data", "audio_data", "input_embeds", "token_ids_logprob"}

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


def _response(eng: Engine, req: Request, text: Optional[str] = None) -> dict:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version,
        "e2e_latency": time.time() - req.created,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
    if text is None:  # the final answer: one full decode, exactly what a non-streaming request gets
        text = eng.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


class ChunkWriter:
    """A streamed request's intermediate chunks, written to its socket by the scheduler as tokens come.

    SGLang's chunks are cumulative: each carries all ids (and logprobs) so far. The ids and logprobs are
    serialized once each and the chunk is assembled from those bytes, and it is written from the scheduler
    without waking the request's handler: a token's chunk costs a write, not a task switch, a list rebuild
    and an aiohttp write (each token must reach the kernel before the next step: a SIGKILL loses what is
    still in the process, and token recovery resumes from what the client received).
    """

    __slots__ = ("eng", "transport", "framed", "ids", "lps", "n", "sent")

    def __init__(self, eng: "Engine", transport: Any, framed: bool = True):
        self.eng, self.transport, self.framed = eng, transport, framed
        self.ids, self.lps = bytearray(), bytearray()  # serialized output_ids / logprob triples, comma-joined
        self.n = 0  # ids serialized
        self.sent = 0  # ids in the last chunk sent

    def token(self, req: Request) -> None:
        # As SGLang: the first token at once, then whenever stream_interval tokens are unsent.
        if self.sent and len(req.output_ids) - self.sent < req.sampling.stream_interval:
            return
        t = self.transport
        if t is None or t.is_closing():  # the client went away: stop decoding for it
            self.eng.abort(req.rid)
            return
        if t.get_write_buffer_size():
            return  # the reader is behind: it gets the newest state in a later chunk, not a backlog
        data = b"data: " + self.chunk(req) + b"\n\n"
        # in aiohttp's framing (chunked transfer encoding) when it uses one; the final chunk and the
        # terminator are aiohttp's own writes, after these
        t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.framed else data)
        self.sent = len(req.output_ids)

    def chunk(self, req: Request) -> bytes:
        """The intermediate chunk of `req` now: `_response(eng, req, text=<streamed text>)` as JSON."""
        ids, lps = req.output_ids, req.logprobs
        for i in range(self.n, len(ids)):
            sep = b"," if i else b""
            self.ids += sep + b"%d" % ids[i]
            if req.return_logprob:
                self.lps += sep + orjson.dumps([lps[i], ids[i], None])
        self.n = len(ids)
        meta = orjson.dumps({"id": req.rid, "finish_reason": None, "prompt_tokens": len(req.prompt_ids),
                             "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": req.weight_version,
                             "e2e_latency": time.time() - req.created})
        if req.return_logprob:
            meta = meta[:-1] + b',"output_token_logprobs":[' + self.lps + b"]}"
        return (b'{"text":' + orjson.dumps(self.eng.stream_text(req)) + b',"output_ids":[' + self.ids
                + b'],"meta_info":' + meta + b"}")


def _parse_generate(eng: Engine, body: Any) -> Request:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(body) - _TOP_LEVEL - _UNSUPPORTED_WHEN_SET)
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}")
    unsupported = sorted(k for k in _UNSUPPORTED_WHEN_SET if body.get(k))
    if unsupported:
        raise BadRequest(f"not supported by the CPU engine: {', '.join(unsupported)}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("exactly one of text or input_ids is required")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest("text must be a string (batched requests are not supported)")
        ids = eng.tokenizer(text)["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest("input_ids must be a non-empty list of integers (batched requests are not supported)")
    vocab = eng.model.config.vocab_size if eng.model is not None else None
    if vocab is not None and any(i < 0 or i >= vocab for i in ids):
        raise BadRequest(f"input_ids out of range [0, {vocab})")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    rl = body.get("return_logprob", False)
    if not isinstance(rl, bool):
        raise BadRequest("return_logprob must be true or false")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("stream must be true or false")
    sampling = parse_sampling(body.get("sampling_params"))
    ctx = getattr(eng.model.config, "max_position_embeddings", None) if eng.model is not None else None
    if ctx and len(ids) + sampling.max_new_tokens > ctx:  # SGLang refuses these too; never decode forever
        raise BadRequest(f"prompt ({len(ids)} tokens) + sampling_params.max_new_tokens "
                         f"({sampling.max_new_tokens}) exceeds the model's context length {ctx}")
    return Request(rid=rid, prompt_ids=list(ids), sampling=sampling, return_logprob=rl,
                   weight_version=eng.weight_version)


def _bad(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": msg, "code": status}}, status=status)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("body is not valid JSON")


def encode_cpu_bucket(flattened_tensor: Any, metadata: list[dict]) -> str:
    """One `serialized_named_tensors` entry for a CPU engine: a flattened bucket (uint8 tensor plus name, shape,
    dtype and byte range per tensor) as base64 of torch.save; replaces SGLang's CUDA IPC handles on CPU."""
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"flattened_tensor": flattened_tensor.contiguous().cpu(), "metadata": metadata}, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_cpu_bucket(entry: Any) -> dict[str, Any]:
    """{name: tensor} from encode_cpu_bucket's string; BadRequest when malformed (loaded with weights_only)."""
    import base64
    import binascii
    import io
    import pickle

    import torch

    if not isinstance(entry, str):
        raise BadRequest("serialized_named_tensors entries must be strings")
    try:
        obj = torch.load(io.BytesIO(base64.b64decode(entry, validate=True)), weights_only=True)
        flat, out = obj["flattened_tensor"], {}
        for m in obj["metadata"]:
            dtype = getattr(torch, m["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype {m['dtype']!r}")
            out[m["name"]] = flat[m["start_idx"]:m["end_idx"]].view(dtype).reshape(m["shape"]).clone()
        return out
    except (binascii.Error, pickle.UnpicklingError, KeyError, TypeError, ValueError, RuntimeError, AttributeError,
            EOFError) as e:
        raise BadRequest(f"serialized_named_tensors: not a CPU weight bucket ({type(e).__name__}: {e})"[:300])


def build_app(eng: Engine, server_args: dict) -> web.Application:
    """The aiohttp application serving `eng` over SGLang's native routes."""
    routes = web.RouteTableDef()

    @routes.post("/generate")
    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            if eng.released or eng.model is None:
                return _bad("engine memory is released; call /resume_memory_occupation", 503)
            req = _parse_generate(eng, body)
            if req.sampling.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
                return web.json_response(_response(eng, req))
            eng.submit(req)
        except BadRequest as e:
            return _bad(str(e))
        try:
            if not body.get("stream"):
                await req.done.wait()
                return web.json_response(_response(eng, req))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if req.finish_reason is None:
                # HTTP/1.1 responses of unknown length are chunk-framed by aiohttp; an HTTP/1.0 one is raw bytes
                # up to the close
                req.on_token = ChunkWriter(eng, request.transport, framed=request.version >= (1, 1)).token
            await req.done.wait()
            await resp.write(b"data: " + orjson.dumps(_response(eng, req)) + b"\n\ndata: [DONE]\n\n")
            return resp
        finally:
            if req.finish_reason is None:  # the client went away: stop decoding for it
                eng.abort(req.rid)

    @routes.get("/health")
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok") if eng.model is not None or eng.released else _bad("loading", 503)

    @routes.get("/health_generate")
    async def health_generate(_: web.Request) -> web.Response:
        # Goes through the scheduler: a wedged decode loop fails this even though /health answers.
        if eng.released or eng.model is None:
            return _bad("engine memory is released", 503)
        req = Request(rid=f"health-{uuid.uuid4().hex}", prompt_ids=[eng.eos_id or 0],
                      sampling=Sampling(max_new_tokens=1, temperature=0.0), return_logprob=False)
        eng.submit(req)
        try:
            await req.done.wait()
        finally:
            if req.finish_reason is None:  # the prober went away: its request must not stay on the engine
                eng.abort(req.rid)
        return web.Response(text="ok")

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": eng.model_path, "tokenizer_path": eng.model_path,
                                  "is_generation": True, "weight_version": eng.weight_version,
                                  "has_image_understanding": False, "has_audio_understanding": False})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({**server_args, "version": VERSION, "weight_version": eng.weight_version,
                                  "pid": os.getpid(), "memory_released": eng.released, "paused": eng.paused,
                                  "num_running": len(eng.running), "num_pending": len(eng.pending),
                                  "running_rids": [r.rid for r in eng.running + eng.pending],
                                  "belayer_counters": dict(eng.counters),
                                  "belayer_requests": dict(eng.served),
                                  "model_impl": "native" if eng.native else "transformers",
                                  "internal_states": [{"weight_version": eng.weight_version}]})

    for path in ("/get_model_info", "/model_info"):
        routes.get(path)(model_info)
    for path in ("/get_server_info", "/server_info"):
        routes.get(path)(server_info)

    @routes.get("/get_weight_version")
    async def weight_version(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": eng.weight_version})

    @routes.post("/flush_cache")
    @routes.get("/flush_cache")
    async def flush_cache(_: web.Request) -> web.Response:
        if eng.running or eng.pending:
            return web.Response(text="Cache not flushed: requests are running", status=400)
        return web.Response(text="Cache flushed.")

    @routes.post("/update_weights_from_disk")
    async def update_weights(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
                raise BadRequest("model_path (string) is required")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest("weight_version must be a string")
        except BadRequest as e:
            return _bad(str(e))
        if "weights" in eng.released_tags or eng.model is None:  # the KV cache may stay released (SGLang too)
            return _bad("engine weights are released; resume them before updating weights", 409)
        try:
            await eng.update_weights(body["model_path"], version)
        except (OSError, ValueError) as e:
            return web.json_response({"success": False, "message": f"failed to load weights: {e}"}, status=400)
        return web.json_response({"success": True, "message": "weights updated", "num_paused_requests": 0,
                                  "weight_version": eng.weight_version})

    @routes.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: web.Request) -> web.Response:
        # SGLang's route and fields (NeMo-RL's refit posts here with weight_version). On a GPU the entries are
        # CUDA IPC handles; this CPU engine takes the CPU payload of decode_cpu_bucket instead.
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("serialized_named_tensors"), list) \
                    or not body["serialized_named_tensors"]:
                raise BadRequest("serialized_named_tensors (non-empty list) is required")
            if body.get("load_format") != "flattened_bucket":
                raise BadRequest(f"load_format: only flattened_bucket is supported, got {body.get('load_format')!r}")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest("weight_version must be a string")
            named: dict[str, Any] = {}
            for entry in body["serialized_named_tensors"]:
                named.update(decode_cpu_bucket(entry))
        except BadRequest as e:
            return _bad(str(e))
        if "weights" in eng.released_tags or eng.model is None:  # the KV cache may stay released (SGLang too)
            return _bad("engine weights are released; resume them before updating weights", 409)
        try:
            await eng.update_weights_from_tensors(named, version)
        except (ValueError, RuntimeError) as e:
            return web.json_response({"success": False, "message": f"failed to load weights: {e}"}, status=400)
        return web.json_response({"success": True, "message": "weights updated", "weight_version": eng.weight_version})

    @routes.post("/update_weight_version")
    async def update_weight_version(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
                raise BadRequest("new_version (string) is required")
        except BadRequest as e:
            return _bad(str(e))
        eng.weight_version = body["new_version"]
        return web.json_response({"success": True, "weight_version": eng.weight_version})

    async def _tags(request: web.Request) -> set[str]:
        body = await _json_body(request) if request.can_read_body else {}
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is None or tags == []:
            return set(MEMORY_TAGS)  # SGLang: no tags means all of them
        if not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS):
            raise BadRequest(f"tags must be a list drawn from {list(MEMORY_TAGS)}")
        return set(tags)

    @routes.post("/release_memory_occupation")
    async def release(request: web.Request) -> web.Response:
        try:
            tags = await _tags(request)
        except BadRequest as e:
            return _bad(str(e))
        if (eng.running or eng.pending) and not eng.paused:
            # SGLang 0.5.x asserts its scheduler is idle here (a paused one may hold retracted requests) and the
            # server dies: refused and counted, so tests catch a caller that would crash a real server.
            eng.counters["release_not_idle"] += 1
            return _bad(f"{len(eng.running) + len(eng.pending)} request(s) on the engine: release_memory_occupation "
                        "should be called only when the server is idle (SGLang's scheduler asserts on this)", 409)
        eng.released_tags |= tags
        await eng.release_memory()
        return web.json_response({"success": True})

    @routes.post("/resume_memory_occupation")
    async def resume(request: web.Request) -> web.Response:
        try:
            tags = await _tags(request)
        except BadRequest as e:
            return _bad(str(e))
        if not tags <= eng.released_tags:
            # SGLang 0.5.23's scheduler dies on this (KeyError in offload_tags.remove): refused and counted
            # here, so tests on this engine catch a caller that would crash a real SGLang server.
            eng.counters["resume_not_released"] += 1
            return _bad(f"tags {sorted(tags - eng.released_tags)} are not released "
                        f"(released: {sorted(eng.released_tags)}); SGLang's scheduler dies on this")
        eng.released_tags -= tags
        if "weights" not in eng.released_tags:
            await eng.resume_memory()  # weights resident again (a refit may load new ones before the KV cache)
        eng.released = bool(eng.released_tags)  # generation waits for every tag, as on SGLang
        return web.json_response({"success": True})

    @routes.post("/pause_generation")
    async def pause(_: web.Request) -> web.Response:
        eng.paused = True
        return web.json_response({"success": True})

    @routes.post("/continue_generation")
    async def cont(_: web.Request) -> web.Response:
        eng.paused = False
        eng._wake.set()
        return web.json_response({"success": True})

    @routes.post("/abort_request")
    async def abort(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("body must be an object")
        except BadRequest as e:
            return _bad(str(e))
        if body.get("abort_all"):
            n = eng.abort(None)
        elif isinstance(body.get("rid"), str):
            n = eng.abort(body["rid"])
        else:
            return _bad("rid (string) or abort_all: true is required")
        return web.json_response({"success": True, "aborted": n})

    @routes.post("/v1/chat/completions")
    async def chat(request: web.Request) -> web.Response:
        if eng.released or eng.model is None:  # as /generate answers, whatever the body
            return _bad("engine memory is released; call /resume_memory_occupation", 503)
        try:
            req = _parse_generate(eng, cpu_openai.generate_body(await _json_body(request)))
        except (BadRequest, ValueError) as e:
            return cpu_openai.bad_request(str(e))
        if req.sampling.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            return web.json_response(cpu_openai.chat_response(eng.model_path, _response(eng, req)))
        eng.submit(req)
        try:
            await req.done.wait()
        finally:
            if req.finish_reason is None:  # the client went away: stop decoding for it
                eng.abort(req.rid)
        return web.json_response(cpu_openai.chat_response(eng.model_path, _response(eng, req)))

    @routes.get("/v1/models")
    async def models(_: web.Request) -> web.Response:
        return web.json_response(cpu_openai.models_response(eng.model_path))

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes(routes)
    return app


def main(argv: Optional[list[str]] = None) -> None:
    """Parses arguments, loads the model and serves until terminated."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--step-delay-ms", type=float, default=0.0, help="emulated extra latency per decode step")
    p.add_argument("--model-impl", choices=("auto", "native", "transformers"),
                   default=os.environ.get("BELAYER_CPU_MODEL_IMPL", "auto"),
                   help="native: Belayer's plain-torch Qwen2 forward (no transformers import); auto: native "
                        "when the checkpoint is a plain Qwen2 with tokenizer.json, else transformers")
    # Test-only (chaos): the fleet sets the variable only with chaos.enabled and chaos.poison_token_id >= 0.
    p.add_argument("--chaos-poison-token-id", type=int,
                   default=int(os.environ.get("BELAYER_CHAOS_POISON_TOKEN_ID", "-1")),
                   help="test only: SIGKILL this server when a prompt holds this token id (-1: off)")
    # Test-only (chaos): a prefill lasting this many ms per 1000 prompt tokens (hang detection's long-prefill test).
    p.add_argument("--chaos-prefill-ms-per-1k-tokens", type=float,
                   default=float(os.environ.get("BELAYER_CHAOS_PREFILL_MS_PER_1K", "0")),
                   help="test only: every prefill sleeps this long per 1000 prompt tokens (0: off)")
    # Test-only (chaos): a saturated engine (hang detection's no-false-alarm test under load).
    p.add_argument("--chaos-step-ms-per-request", type=float,
                   default=float(os.environ.get("BELAYER_CHAOS_STEP_MS_PER_REQUEST", "0")),
                   help="test only: each decode step takes this many ms more per running request beyond "
                        "--chaos-step-free-requests (0: off)")
    p.add_argument("--chaos-step-free-requests", type=int,
                   default=int(os.environ.get("BELAYER_CHAOS_STEP_FREE_REQUESTS", "0")))
    args = p.parse_args(argv)
    skip_unused_imports()
    cpu_engine.configure_chaos(args.chaos_poison_token_id, args.chaos_prefill_ms_per_1k_tokens,
                               args.chaos_step_ms_per_request, args.chaos_step_free_requests)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def serve() -> None:
        eng = Engine(args.model_path, args.weight_version, args.max_running_requests, args.torch_threads,
                     args.step_delay_ms / 1000.0, args.model_impl)
        await eng.load()
        app = build_app(eng, {"model_path": args.model_path, "host": args.host, "port": args.port,
                              "max_running_requests": args.max_running_requests, "device": "cpu"})
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("serving %s on http://%s:%d (pid %d)", args.model_path, args.host, args.port, os.getpid())
        await eng.run()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
