"""A plain /generate client through sglang-router: what a trainer does without Belayer.

One non-streaming POST per request to the router, no retry, no token commits, no engine choice: the
baseline that the failure-free overhead is measured against (bench/overhead.py), and what the reference
loop uses when `use_fault_tolerance` is false and no chaos needs to watch tokens. Its result has the
shape of ResumableGenerator.generate's (a one-segment log and SGLang's response), so callers need no branch.

Owns: the no-Belayer baseline client. Must not: retry or commit tokens.
"""

from __future__ import annotations

from typing import Any

import httpx

from belayer_plugin.generation.context_log import ContextLog
from belayer_plugin.generation.resumable import RequestFailedError
from belayer_plugin.generation.sglang_http import GenerateError, generate


class PlainGenerator:
    """Sends each request once to `url` (the router) and returns what came back."""

    def __init__(self, url: str, request_timeout_s: float, client: httpx.AsyncClient | None = None):
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.client = client or httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))
        self.observers: list[Any] = []  # never called: a plain client sees no tokens before the end

    async def generate(self, rid: str, input_ids: list[int], sampling_params: dict,
                       return_logprob: bool = False) -> tuple[ContextLog, dict]:
        """Runs one request; raises RequestFailedError when the router or its engine fails it."""
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                   "return_logprob": return_logprob, "rid": rid}
        log = ContextLog(rid, list(input_ids), int((sampling_params or {}).get("max_new_tokens", 128)),
                         want_logprobs=return_logprob)
        try:
            resp = await generate(self.client, self.url, payload, self.request_timeout_s)
        except GenerateError as e:
            raise RequestFailedError(rid, f"plain client, no retry: {e}", log, status=e.status or 502) from e
        seg = log.begin("router", self.url, None)
        log.output_ids = list(resp.get("output_ids") or [])
        seg.end, seg.outcome = log.committed, "finished"
        log.finish_reason = (resp.get("meta_info") or {}).get("finish_reason")
        return log, resp

    async def aclose(self) -> None:
        await self.client.aclose()
