"""Belayer's CPU engine: an HTTP server speaking the subset of SGLang's native API that trainers use.

It serves a small causal LM on the CPU: a Qwen2 checkpoint through native_lm's plain-torch forward (no
transformers import), any other through transformers. Requests are decoded together, interleaved one
token each per scheduler step, so a long request never blocks a short one. Model compute runs in one
worker thread; the asyncio loop stays free for health checks and new requests.

Run: ``python -m belayer_plugin.engines.cpu_server --model-path DIR --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import gc
import json
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import orjson
from aiohttp import web

from belayer_plugin.detok import IncrementalText
from belayer_plugin.lean_imports import skip_unused_imports

log = logging.getLogger("belayer.cpu_engine")

VERSION = "belayer-cpu-engine-0.1"
SERVED_LEDGER = 4096  # requests the /get_server_info ledger keeps (belayer_requests)
_POISON_TOKEN_ID = -1  # test-only chaos switch (--chaos-poison-token-id); -1: off
_PREFILL_MS_PER_1K = 0.0  # test-only chaos switch (--chaos-prefill-ms-per-1k-tokens): a slow prefill; 0: off
# Test-only chaos switch (--chaos-step-ms-per-request, --chaos-step-free-requests): a saturated engine, whose
# decode step grows by this many ms per running request beyond the free ones (a GPU past its memory-bound
# batch size); 0: off
_STEP_MS_PER_REQUEST, _STEP_FREE_REQUESTS = 0.0, 0

# Sampling parameters SGLang accepts that this engine honours, and those it accepts but ignores because
# they have no effect on the tiny model's single-sequence decoding (rejecting them would break trainers).
_SAMPLING_USED = {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "sampling_seed",
                  "stop_token_ids", "ignore_eos", "stop", "min_new_tokens", "stream_interval"}
_SAMPLING_IGNORED = {"n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                     "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                     "regex", "json_schema", "ebnf", "custom_params", "logit_bias"}
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


class BadRequest(ValueError):
    """A malformed /generate body; answered with HTTP 400 and this message."""


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stream_interval: int = 1  # streaming: a chunk every this many tokens (SGLang's per-request setting)


def _as_int(name: str, v: Any, lo: int, hi: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"sampling_params.{name} must be an integer >= {lo}, got {v!r}")
    if v > hi:  # torch takes 64-bit ints: a larger one must be a 400, not a crash of the decode loop
        raise BadRequest(f"sampling_params.{name} must be <= {hi}, got {v!r}")
    return v


def _as_float(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"sampling_params.{name} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def parse_sampling(raw: Any) -> Sampling:
    """Validates SGLang-style sampling_params; raises BadRequest naming every unknown key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(raw) - _SAMPLING_USED - _SAMPLING_IGNORED)
    if unknown:
        raise BadRequest(f"unknown sampling_params: {', '.join(unknown)}")
    s = Sampling()
    if raw.get("max_new_tokens") is not None:
        s.max_new_tokens = _as_int("max_new_tokens", raw["max_new_tokens"], 0)
    if raw.get("min_new_tokens") is not None:
        s.min_new_tokens = _as_int("min_new_tokens", raw["min_new_tokens"], 0)
    if raw.get("stream_interval") is not None:
        s.stream_interval = _as_int("stream_interval", raw["stream_interval"], 1)
    if raw.get("temperature") is not None:
        s.temperature = _as_float("temperature", raw["temperature"], 0.0, 100.0)
    if raw.get("top_p") is not None:
        s.top_p = _as_float("top_p", raw["top_p"], 1e-9, 1.0)
    if raw.get("top_k") is not None:
        s.top_k = raw["top_k"] if raw["top_k"] == -1 else _as_int("top_k", raw["top_k"], 1)
    seed = raw.get("seed", raw.get("sampling_seed"))
    if seed is not None:
        s.seed = _as_int("seed", seed, 0, 2**62)  # + the token position must stay a 64-bit seed
    ids = raw.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
    s.stop_token_ids = list(ids)
    stop = raw.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest("sampling_params.stop must be a string or a list of non-empty strings")
    s.stop = stop
    if "ignore_eos" in raw:
        if not isinstance(raw["ignore_eos"], bool):
            raise BadRequest("sampling_params.ignore_eos must be true or false")
        s.ignore_eos = raw["ignore_eos"]
    return s


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: Sampling
    return_logprob: bool
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once finish_reason is
    # Called on the event loop after each token that does not finish the request (a streamed request's
    # writer); the final state is the handler's to send.
    on_token: Optional[Callable[["Request"], None]] = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cache: Any = None
    generator: Any = None
    finish_reason: Optional[dict] = None
    created: float = field(default_factory=time.time)
    weight_version: str = ""
    detok: Optional[IncrementalText] = None  # the streamed text, decoded incrementally


class Engine:
    """The model and the interleaved-decoding scheduler; owns all torch state."""

    def __init__(self, model_path: str, weight_version: str, max_running: int, torch_threads: int,
                 step_delay_s: float = 0.0, model_impl: str = "auto"):
        import torch

        from belayer_plugin.engines import native_lm

        torch.set_num_threads(torch_threads)
        if model_impl not in ("auto", "native", "transformers"):
            raise ValueError(f"model_impl must be auto, native or transformers, not {model_impl!r}")
        why_not = native_lm.usable(model_path) if model_impl != "transformers" else "asked for transformers"
        if model_impl == "native" and why_not is not None:
            raise ValueError(f"--model-impl native cannot serve {model_path}: {why_not}")
        # Chosen once: later weight loads (refits) must keep the parameter names and the numerics.
        self.native = why_not is None
        if not self.native and model_impl == "auto":
            log.info("serving %s with transformers: %s", model_path, why_not)
        self.model_path = model_path
        self.weights_path = model_path
        self.weight_version = weight_version
        self.max_running = max_running
        self.step_delay_s = step_delay_s
        self.model: Any = None
        self.tokenizer: Any = None
        self.released = False
        self.released_tags: set[str] = set()  # SGLang's offload tags held released (MEMORY_TAGS)
        self.paused = False
        # Tensors a trainer streamed in (/update_weights_from_tensor), applied over weights_path whenever the
        # model is (re)loaded: they survive a memory release like SGLang's cpu_weight_backup.
        self.streamed: dict[str, Any] = {}
        self.pending: list[Request] = []
        self.running: list[Request] = []
        self.by_rid: dict[str, Request] = {}
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "health_tokens": 0, "aborted": 0,
                         "weight_updates": 0, "steps": 0, "resume_not_released": 0}
        # The engine's own ledger of what it served, per request id (the newest SERVED_LEDGER): the prompt it
        # was given and the tokens it generated. A chaos check reads it as evidence Belayer did not write
        # (a resumed request's continuation arrived with its committed tokens in the prompt; chaos/check.py).
        self.served: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self._wake = asyncio.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="belayer-model")
        self._lock = asyncio.Lock()  # held by the scheduler step and by weight/memory changes

    async def load(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load_sync, self.weights_path)

    def _load_sync(self, path: str) -> None:
        from belayer_plugin.engines import shared_weights

        if self.native:
            # No transformers import at all: ~3.5 s of CPU less at every engine start (native_lm's docstring).
            from belayer_plugin.engines import native_lm
            from belayer_plugin.engines.light_tokenizer import LightTokenizer

            if self.tokenizer is None:
                self.tokenizer = LightTokenizer(self.model_path)
            if shared_weights.is_shared(path):
                model = shared_weights.load_native_model(path)  # mapped from the holder's shared memory
            else:
                model = native_lm.from_pretrained(path)
        else:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            if self.tokenizer is None:
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            if shared_weights.is_shared(path):
                model = shared_weights.load_model(path)  # mapped from the holder's shared memory, not copied
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if self.streamed:
            # assign: new tensors replace the parameters (shared-memory weights of other engines stay untouched)
            model.load_state_dict(self.streamed, strict=False, assign=True)
        model.eval()
        self.model = model

    @property
    def eos_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id

    def stream_text(self, req: Request) -> str:
        """The request's text so far, decoding only the ids added since the last call (not all of them)."""
        if req.detok is None:
            req.detok = IncrementalText(self.tokenizer)
        return req.detok.update(req.output_ids)

    def submit(self, req: Request) -> None:
        if req.rid in self.by_rid:
            raise BadRequest(f"request id {req.rid!r} is already running")
        self.by_rid[req.rid] = req
        self.pending.append(req)
        self.counters["requests"] += 1
        self._wake.set()

    def abort(self, rid: Optional[str]) -> int:
        """Finishes the named request (all requests when rid is None) with finish_reason abort."""
        victims = [r for r in self.pending + self.running if rid is None or r.rid == rid]
        for r in victims:
            self._finish(r, {"type": "abort", "message": "aborted"})
        self.counters["aborted"] += len(victims)
        return len(victims)

    def _finish(self, req: Request, reason: dict) -> None:
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        req.cache = None
        if req in self.pending:
            self.pending.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.by_rid.pop(req.rid, None)
        if not req.rid.startswith("health-"):
            # A request id served again (a chunked continuation) keeps its first prompt; tokens add up.
            prev = self.served.pop(req.rid, None) or {"prompt_tokens": len(req.prompt_ids), "generated_tokens": 0,
                                                      "calls": 0}
            prev["generated_tokens"] += len(req.output_ids)
            prev["calls"] += 1
            prev["finish"] = (req.finish_reason or {}).get("type")
            self.served[req.rid] = prev
            while len(self.served) > SERVED_LEDGER:
                self.served.popitem(last=False)
        req.done.set()

    async def run(self) -> None:
        """The scheduler loop: admit, then one token for every running request, repeat."""
        loop = asyncio.get_running_loop()
        while True:
            if (not self.pending and not self.running) or self.paused or self.released:
                self._wake.clear()
                await self._wake.wait()
                continue
            while self.pending and len(self.running) < self.max_running:
                self.running.append(self.pending.pop(0))
            batch = list(self.running)
            async with self._lock:
                if self.released or self.model is None:
                    continue
                results = await loop.run_in_executor(self._pool, self._step, batch)
            self.counters["steps"] += 1
            delay = self.step_delay_s
            if _STEP_MS_PER_REQUEST > 0:  # chaos only: a saturated engine's step time grows with its batch
                delay += max(0, len(batch) - _STEP_FREE_REQUESTS) * _STEP_MS_PER_REQUEST / 1000.0
            if delay:
                # Emulates a real model's per-step latency (the tiny model decodes a token in ~0.5 ms, far
                # faster than any GPU engine), so fault timing and client overhead are representative.
                await asyncio.sleep(delay)
            for req, tok, lp in results:
                if req.finish_reason is not None:  # aborted while the step ran
                    continue
                self._emit(req, tok, lp)

    def _step(self, batch: list[Request]) -> list[tuple[Request, int, float]]:
        import torch

        out = []
        with torch.no_grad():
            for req in batch:
                if req.cache is None and _POISON_TOKEN_ID >= 0 and _POISON_TOKEN_ID in req.prompt_ids:
                    # Chaos only: a deterministic poison request takes the whole server down.
                    os.kill(os.getpid(), signal.SIGKILL)
                if req.cache is None:  # prefill: prompt (+ already generated ids, none here)
                    ids = torch.tensor([req.prompt_ids + req.output_ids])
                    self.counters["prompt_tokens"] += ids.shape[1]
                    if _PREFILL_MS_PER_1K > 0:
                        # Chaos only: a real model's long prefill, holding the whole batch's next step.
                        time.sleep(ids.shape[1] * _PREFILL_MS_PER_1K / 1e6)
                else:
                    ids = torch.tensor([[req.output_ids[-1]]])
                res = self.model(input_ids=ids, past_key_values=req.cache, use_cache=True)
                req.cache = res.past_key_values
                logits = res.logits[0, -1].float()
                tok, lp = self._sample(req, logits)
                out.append((req, tok, lp))
        return out

    def _sample(self, req: Request, logits: Any) -> tuple[int, float]:
        import torch

        s = req.sampling
        logprobs = torch.log_softmax(logits, dim=-1)
        if len(req.output_ids) < s.min_new_tokens and self.eos_id is not None and not s.ignore_eos:
            logits = logits.clone()
            logits[self.eos_id] = float("-inf")
        if s.temperature == 0.0:
            tok = int(torch.argmax(logits))
        else:
            scaled = logits / s.temperature
            if s.top_k > 0:
                kth = torch.topk(scaled, min(s.top_k, scaled.numel())).values[-1]
                scaled = torch.where(scaled < kth, torch.full_like(scaled, float("-inf")), scaled)
            probs = torch.softmax(scaled, dim=-1)
            if s.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, 0) - sp < s.top_p
                mask = torch.zeros_like(probs, dtype=torch.bool)
                mask[si[keep]] = True
                probs = torch.where(mask, probs, torch.zeros_like(probs))
                probs = probs / probs.sum()
            if req.generator is None:
                req.generator = torch.Generator()
                if s.seed is None:
                    req.generator.manual_seed(int.from_bytes(os.urandom(4), "little"))
            if s.seed is not None:
                # Token i is drawn with seed + i: a request resumed from prompt + k tokens with seed + k
                # samples exactly the tokens the uninterrupted request would have.
                req.generator.manual_seed(s.seed + len(req.output_ids))
            tok = int(torch.multinomial(probs, 1, generator=req.generator))
        return tok, float(logprobs[tok])

    def _emit(self, req: Request, tok: int, lp: float) -> None:
        req.output_ids.append(tok)
        req.logprobs.append(lp)
        # Health probes are counted apart so tests can account for every token a request cost.
        self.counters["health_tokens" if req.rid.startswith("health-") else "generated_tokens"] += 1
        s = req.sampling
        reason = None
        if tok in s.stop_token_ids:
            reason = {"type": "stop", "matched": tok}
        elif not s.ignore_eos and tok == self.eos_id and len(req.output_ids) > s.min_new_tokens:
            reason = {"type": "stop", "matched": tok}
        elif s.stop:
            text = self.tokenizer.decode(req.output_ids)
            hit = next((x for x in s.stop if x in text), None)
            if hit is not None:
                reason = {"type": "stop", "matched": hit}
        if reason is None and len(req.output_ids) >= s.max_new_tokens:
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is not None:
            self._finish(req, reason)
        elif req.on_token is not None:
            req.on_token(req)

    async def update_weights(self, path: str, version: Optional[str]) -> None:
        async with self._lock:
            self.streamed = {}
            await asyncio.get_running_loop().run_in_executor(self._pool, self._load_sync, path)
            self.weights_path = path
            if version is not None:
                self.weight_version = version
            # Running requests keep their ids but their KV caches came from the old weights.
            for r in self.running:
                r.cache = None
            self.counters["weight_updates"] += 1

    async def update_weights_from_tensors(self, named: dict[str, Any], version: Optional[str]) -> None:
        """Replaces the named parameters (shapes checked first: a bad bucket changes nothing)."""
        async with self._lock:
            own = self.model.state_dict()
            bad = [n for n, t in named.items() if n not in own or tuple(own[n].shape) != tuple(t.shape)]
            if bad:
                raise ValueError(f"unknown parameter or wrong shape: {bad[:5]}")

            def apply() -> None:
                self.model.load_state_dict(named, strict=False, assign=True)

            await asyncio.get_running_loop().run_in_executor(self._pool, apply)
            self.streamed.update(named)
            if version is not None:
                self.weight_version = version
            for r in self.running:
                r.cache = None
            self.counters["weight_updates"] += 1

    async def release_memory(self) -> None:
        async with self._lock:
            self.released = True
            self.model = None
            for r in self.running:
                r.cache = None
            if not self.native:
                # transformers' modules hold reference cycles; the native model and its caches are freed by
                # reference counting alone, and a full collection of this process (torch's ~10^5 objects) costs
                # ~30 ms of CPU: every engine is released at every training step.
                gc.collect()

    async def resume_memory(self) -> None:
        async with self._lock:
            if self.model is None:
                await asyncio.get_running_loop().run_in_executor(self._pool, self._load_sync, self.weights_path)
            self.released = False
        self._wake.set()


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
        await req.done.wait()
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
    global _POISON_TOKEN_ID, _PREFILL_MS_PER_1K, _STEP_MS_PER_REQUEST, _STEP_FREE_REQUESTS
    _POISON_TOKEN_ID = args.chaos_poison_token_id
    _PREFILL_MS_PER_1K = args.chaos_prefill_ms_per_1k_tokens
    _STEP_MS_PER_REQUEST, _STEP_FREE_REQUESTS = args.chaos_step_ms_per_request, args.chaos_step_free_requests
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
