"""Belayer's CPU engine, the model side: a small causal LM and its interleaved-decoding scheduler.

A Qwen2 checkpoint runs through native_lm's plain-torch forward (no transformers import), any other through
transformers. Requests are decoded together, interleaved one token each per scheduler step, so a long request
never blocks a short one. Model compute runs in one worker thread; the asyncio loop stays free.

Owns: all torch state, sampling (SGLang's sampling_params, validated), the request queue and the ledger of
what it served, weight loads and memory release. Must not: speak HTTP or parse request bodies beyond
sampling_params (engines/cpu_server.py does), or import aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from belayer_plugin.detok import IncrementalText

log = logging.getLogger("belayer.cpu_engine")

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
                         "weight_updates": 0, "steps": 0, "resume_not_released": 0,
                         "release_not_idle": 0}
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


def configure_chaos(poison_token_id: int = -1, prefill_ms_per_1k: float = 0.0, step_ms_per_request: float = 0.0,
                    step_free_requests: int = 0) -> None:
    """Sets the test-only chaos switches (the server's --chaos-* flags); the defaults are off."""
    global _POISON_TOKEN_ID, _PREFILL_MS_PER_1K, _STEP_MS_PER_REQUEST, _STEP_FREE_REQUESTS
    _POISON_TOKEN_ID = poison_token_id
    _PREFILL_MS_PER_1K = prefill_ms_per_1k
    _STEP_MS_PER_REQUEST, _STEP_FREE_REQUESTS = step_ms_per_request, step_free_requests
