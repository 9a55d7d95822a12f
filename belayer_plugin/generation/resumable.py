"""Resumable generation: a request survives the death of the engine serving it, token for token.

Tokens are committed as they arrive (every SSE chunk in stream mode; every `chunk_tokens` tokens in
chunked mode, for backends reached by RPC rather than HTTP). When the engine fails (broken stream,
refused connection, 5xx, no token within the stall timeout) the request goes on from prompt + committed
ids on another healthy engine, with max_new_tokens reduced and stop conditions kept; the failed engine is
reported to the fleet at once. After `max_attempts` the request alone fails, with a typed error.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Protocol

import httpx

from belayer_plugin.config import RecoveryConfig
from belayer_plugin.events import EventLog
from belayer_plugin.generation.context_log import ContextLog, Segment
from belayer_plugin.generation.sglang_http import GenerateError, generate, generate_stream


class RequestFailedError(RuntimeError):
    """One request could not be completed within its attempt budget (other requests are unaffected)."""

    def __init__(self, rid: str, reason: str, log: Optional[ContextLog] = None, status: int = 502):
        self.rid, self.reason, self.log, self.status = rid, reason, log, status
        tail = f" after {len(log.segments)} attempt(s), {log.committed} token(s) committed" if log else ""
        super().__init__(f"request {rid}: {reason}{tail}")


@dataclass(frozen=True)
class Target:
    engine: str
    url: str


class Selector(Protocol):
    """Chooses engines for requests and hears about their failures."""

    async def pick(self, exclude: set[str], timeout: float) -> Target: ...
    def release(self, target: Target) -> None: ...
    async def failed(self, target: Target, reason: str) -> None: ...


class FleetSelector:
    """Least-loaded HEALTHY engine of a FleetManager; failures are reported to its health machine."""

    def __init__(self, fleet: Any):
        self.fleet = fleet

    async def pick(self, exclude: set[str], timeout: float) -> Target:
        from belayer_plugin.fleet.manager import NoHealthyEngineError

        deadline = time.monotonic() + timeout
        while True:
            try:
                slot = self.fleet.pick_engine_excluding_urls(exclude)
                slot.inflight += 1
                return Target(slot.slot_id, slot.info.url)
            except NoHealthyEngineError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await self.fleet.wait_changed(left)  # woken by the next health transition

    def release(self, target: Target) -> None:
        slot = self.fleet.slots.get(target.engine)
        if slot is not None and slot.info is not None and slot.info.url == target.url and slot.inflight > 0:
            slot.inflight -= 1

    async def failed(self, target: Target, reason: str) -> None:
        from belayer_plugin.fleet.health import Signal

        await self.fleet.report(target.engine, Signal.REQUEST_FAILED, reason, url=target.url)


class StaticSelector:
    """A fixed list of engine URLs (no fleet): least in-flight first."""

    def __init__(self, urls: list[str]):
        self.inflight = {u: 0 for u in urls}

    async def pick(self, exclude: set[str], timeout: float) -> Target:
        cands = [u for u in self.inflight if u not in exclude] or list(self.inflight)
        url = min(cands, key=lambda u: self.inflight[u])
        self.inflight[url] += 1
        return Target(url, url)

    def release(self, target: Target) -> None:
        self.inflight[target.url] = max(0, self.inflight.get(target.url, 1) - 1)

    async def failed(self, target: Target, reason: str) -> None:
        return None


ProgressFn = Callable[[ContextLog, Segment], Optional[Awaitable[None]]]
# Chunked mode's one call to an engine: (engine url, SGLang /generate body, timeout) -> SGLang-shaped response.
# Raises GenerateError (retriable: go on elsewhere). The default is HTTP /generate; trainer hooks plug in
# their own (e.g. a Ray actor RPC) and keep the resume loop here.
Transport = Callable[[str, dict, float], Awaitable[dict]]


class ResumableGenerator:
    """Runs SGLang-style /generate requests with token-level recovery."""

    def __init__(self, selector: Selector, cfg: RecoveryConfig, events: Optional[EventLog] = None,
                 client: Optional[httpx.AsyncClient] = None, transport: Optional[Transport] = None):
        if transport is not None and cfg.mode != "chunked":
            raise ValueError("a custom transport needs recovery.mode=chunked (stream mode is HTTP SSE only)")
        self.selector = selector
        self.cfg = cfg
        self.transport = transport
        self.events = events or EventLog()
        self.client = client or httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))
        # Called on every commit of every request (metrics, chaos triggers at a token position).
        self.observers: list[ProgressFn] = []

    async def generate(self, rid: str, input_ids: list[int], sampling_params: dict, return_logprob: bool = False,
                       on_progress: Optional[ProgressFn] = None) -> tuple[ContextLog, dict]:
        """Runs one request to completion; returns its context log and the final SGLang-style response."""
        sp = dict(sampling_params or {})
        max_new = sp.get("max_new_tokens", 128)
        log = ContextLog(rid, list(input_ids), int(max_new), want_logprobs=return_logprob)
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                await self._run(log, sp, on_progress)
        except TimeoutError:
            raise RequestFailedError(rid, f"not finished within recovery.request_timeout_s="
                                          f"{self.cfg.request_timeout_s:g} s", log, status=504) from None
        return log, self.response(log, return_logprob)

    async def _run(self, log: ContextLog, sp: dict, on_progress: Optional[ProgressFn]) -> None:
        exclude: set[str] = set()
        failures = 0
        while True:
            if log.remaining == 0 and log.max_new_tokens > 0:
                log.finish_reason = {"type": "length", "length": log.max_new_tokens}
                return
            try:
                target = await self.selector.pick(exclude, self.cfg.stall_timeout_s)
            except Exception as e:
                raise RequestFailedError(log.rid, f"no healthy engine: {e}", log, status=503) from e
            seed = sp.get("seed", sp.get("sampling_seed"))
            # A resumed sampled segment gets a seed derived from the position, so reruns are reproducible.
            seg_seed = None if seed is None else int(seed) + log.committed
            seg = log.begin(target.engine, target.url, seg_seed)
            try:
                fr = await self._segment(log, seg, sp, seg_seed, on_progress)
                seg.outcome = "finished"
                if fr is not None:
                    if fr.get("type") == "length":
                        fr = {"type": "length", "length": log.max_new_tokens}
                    log.finish_reason = fr
                    return
            except GenerateError as e:
                seg.outcome = f"failed: {e.reason[:200]}"
                if not e.retriable:
                    raise RequestFailedError(log.rid, f"rejected by {target.url}: {e.reason}", log,
                                             status=e.status or 400) from e
                failures += 1
                exclude = {target.url}
                await self.selector.failed(target, e.reason[:200])
                self.events.emit("recovery", log.rid, "request_failed_on_engine", e.reason[:200], level="warning",
                                 engine=target.engine, committed=log.committed, attempt=failures)
                if failures >= self.cfg.max_attempts:
                    raise RequestFailedError(log.rid, f"failed on {failures} engine(s); last: {e.reason[:200]}",
                                             log) from e
                self.events.emit("recovery", log.rid, "resumed", f"from token {log.committed}",
                                 committed=log.committed, failed_engine=target.engine)
            finally:
                self.selector.release(target)

    def _body(self, log: ContextLog, sp: dict, seed: Optional[int], n: int, attempt: int) -> dict:
        params = dict(sp)
        params["max_new_tokens"] = n
        if "min_new_tokens" in params and params["min_new_tokens"]:
            params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - log.committed)
        # Keep the caller's name for the seed: SGLang calls it sampling_seed and refuses `seed`.
        key = "sampling_seed" if "sampling_seed" in sp else "seed"
        params.pop("sampling_seed", None)
        params.pop("seed", None)
        if seed is not None:
            params[key] = seed
        rid = log.rid if attempt == 0 else f"{log.rid}.r{attempt}"
        return {"input_ids": log.resume_input_ids(), "sampling_params": params, "rid": rid,
                # Logprobs only when asked: cumulative stream chunks make them cost O(n^2) bytes.
                "return_logprob": log.want_logprobs}

    async def _segment(self, log: ContextLog, seg: Segment, sp: dict, seed: Optional[int],
                       on_progress: Optional[ProgressFn]) -> Optional[dict]:
        """Runs one segment on seg's engine; returns the finish reason, or raises GenerateError."""
        attempt = len(log.segments) - 1
        if self.cfg.mode == "stream":
            body = self._body(log, sp, seed, log.remaining, attempt)
            async for chunk in generate_stream(self.client, seg.url, body, timeout=self.cfg.stall_timeout_s,
                                               read_timeout=self.cfg.stall_timeout_s):
                meta = chunk.get("meta_info", {})
                if log.commit(seg, chunk.get("output_ids", []), meta.get("output_token_logprobs"),
                              meta.get("weight_version")):
                    await self._progress(on_progress, log, seg)
                fr = meta.get("finish_reason")
                if fr:
                    return _checked(fr, seg)
            raise GenerateError(seg.url, "stream ended without a finish reason")
        # chunked: commit every chunk_tokens tokens
        while True:
            n = min(self.cfg.chunk_tokens, log.remaining)
            body = self._body(log, sp, None if seed is None else seed + (log.committed - seg.start), n, attempt)
            if self.transport is not None:
                out = await self.transport(seg.url, body, self.cfg.stall_timeout_s)
            else:
                out = await generate(self.client, seg.url, body, timeout=self.cfg.stall_timeout_s)
            meta = out.get("meta_info", {})
            got = log.append(seg, out.get("output_ids", []), meta.get("output_token_logprobs"),
                             meta.get("weight_version"))
            await self._progress(on_progress, log, seg)
            fr = _checked(meta.get("finish_reason") or {}, seg)
            if fr.get("type") != "length" or log.remaining == 0:
                return fr
            if got == 0:
                raise GenerateError(seg.url, "engine returned no tokens for a chunk")

    async def _progress(self, fn: Optional[ProgressFn], log: ContextLog, seg: Segment) -> None:
        for obs in self.observers:
            await _call_one(obs, log, seg)
        await _call_one(fn, log, seg)

    @staticmethod
    def response(log: ContextLog, return_logprob: bool, text: Optional[str] = None) -> dict:
        """The SGLang-shaped response of a finished request."""
        meta: dict[str, Any] = {
            "id": log.rid,
            "finish_reason": log.finish_reason,
            "prompt_tokens": len(log.prompt_ids),
            "completion_tokens": log.committed,
            "cached_tokens": 0,
            "weight_version": log.segments[-1].weight_version if log.segments else "",
            "belayer": log.summary(),
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(log.logprobs, log.output_ids)]
        out = {"output_ids": list(log.output_ids), "meta_info": meta}
        if text is not None:
            out["text"] = text
        return out


def _checked(fr: dict, seg: Segment) -> dict:
    if fr.get("type") == "abort":  # the engine dropped it (pause, shutdown): go on elsewhere
        raise GenerateError(seg.url, f"aborted by the engine: {fr.get('message', '')}")
    return fr


async def _call_one(fn: Optional[ProgressFn], log: ContextLog, seg: Segment) -> None:
    if fn is not None:
        r = fn(log, seg)
        if inspect.isawaitable(r):
            await r
