"""A verl 0.9.1 LLM server client with token-level resume on RayActorError.

`BelayerLLMServerClient` subclasses verl's `LLMServerClient` (use it through
`LLMServerManager.get_client(client_cls=BelayerLLMServerClient)` or a custom agent loop manager). With
`belayer.use_fault_tolerance=true` each `generate` runs through Belayer's ResumableGenerator in chunked mode:
tokens are committed every `recovery.chunk_tokens`; when the server dies (RayActorError, a failed RPC, no
answer within `recovery.stall_timeout_s`) the request goes on from prompt + committed ids on another server
of the load balancer, with the failed one reported (and evicted if its actor is gone). Off: verl's own path.

The transport is one Ray RPC per chunk: Belayer engine actors are called through their `/generate` route;
any other server actor through verl's server-actor signature `generate(request_id, prompt_ids,
sampling_params)` with `max_tokens` set to the chunk.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from dataclasses import replace
from typing import Any, Optional

import ray
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from belayer_plugin.events import EventLog
from belayer_plugin.generation.resumable import ResumableGenerator, Target
from belayer_plugin.generation.sglang_http import GenerateError
from belayer_plugin.hooks._config import belayer_section

_rid: contextvars.ContextVar[str] = contextvars.ContextVar("belayer_verl_rid", default="")

# verl sampling params passed on to the engine (verl names -> SGLang names where they differ)
_PASS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "seed", "stop_token_ids", "ignore_eos",
         "min_new_tokens", "frequency_penalty", "presence_penalty")


class BalancerSelector:
    """ResumableGenerator's Selector over a verl load balancer actor (server id = engine = url)."""

    def __init__(self, balancer: Any):
        self.balancer = balancer
        self.handles: dict[str, Any] = {}

    async def pick(self, exclude: set[str], timeout: float) -> Target:
        rid = _rid.get() or uuid.uuid4().hex
        try:
            sid, handle = await self.balancer.acquire_server.remote(request_id=rid, exclude=sorted(exclude),
                                                                    wait_s=timeout)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.as_instanceof_cause(), TypeError):
                raise RuntimeError("BelayerLLMServerClient needs Belayer's balancer: set "
                                   "actor_rollout_ref.rollout.router_config_path to recipes/verl/router.yaml") from e
            raise
        self.handles[sid] = handle
        return Target(sid, sid)

    def release(self, target: Target) -> None:
        self.balancer.release_server.remote(server_id=target.engine)  # fire and forget, as verl does

    async def failed(self, target: Target, reason: str) -> None:
        await self.balancer.report_failure.remote(target.engine, reason)


class BelayerLLMServerClient(LLMServerClient):
    def __init__(self, config: Any, load_balancer_handle: Any = None, events: Optional[EventLog] = None,
                 **kwargs: Any):
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        section = config.get("belayer") if hasattr(config, "get") else None
        self.belayer = belayer_section(section)
        self._kwargs = kwargs
        self._build(events)

    def _build(self, events: Optional[EventLog]) -> None:
        rec = replace(self.belayer.recovery, mode="chunked")  # RPC backends commit per chunk
        self.selector = BalancerSelector(self._load_balancer)
        self.generator = ResumableGenerator(self.selector, rec, events, transport=self._transport)

    def __reduce__(self):
        # verl ships the client to every AgentLoopWorker actor: send config and balancer handle, rebuild there
        # (the HTTP client, event log and observers are per process).
        return (_rebuild, (type(self), self.config, self._load_balancer, self._kwargs))

    @property
    def observers(self) -> list:
        """Called on every commit (metrics, chaos triggers at a token position)."""
        return self.generator.observers

    def _response_length(self) -> Optional[int]:
        rollout = getattr(getattr(self.config, "actor_rollout_ref", None), "rollout", None)
        n = getattr(rollout, "response_length", None)
        return n if isinstance(n, int) and n > 0 else None

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict[str, Any]] = None,
                       **kwargs: Any) -> TokenOutput:
        multimodal = any(x is not None for x in (image_data, video_data, audio_data, kwargs.get("mm_processor_output")))
        if not self.belayer.use_fault_tolerance or multimodal:  # token resume covers text prompts only
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                          image_data=image_data, video_data=video_data, audio_data=audio_data,
                                          mm_processor_kwargs=mm_processor_kwargs, **kwargs)
        sp = {k: v for k, v in sampling_params.items() if k in _PASS and v is not None}
        if sp.get("top_k") == -1:
            sp.pop("top_k")
        limit = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens")) or self._response_length()
        sp["max_new_tokens"] = int(limit) if limit else 128
        want_lp = bool(sampling_params.get("logprobs"))
        token = _rid.set(str(request_id))
        try:
            log, _ = await self.generator.generate(f"{request_id}-{uuid.uuid4().hex[:8]}", list(prompt_ids), sp,
                                                   return_logprob=want_lp)
        finally:
            _rid.reset(token)
        fr = (log.finish_reason or {}).get("type")
        return TokenOutput(token_ids=list(log.output_ids), log_probs=list(log.logprobs) if want_lp else None,
                           stop_reason="length" if fr == "length" else "completed", num_preempted=0,
                           extra_fields={"belayer": log.summary(), "global_steps": None,
                                         "min_global_steps": None, "max_global_steps": None})

    async def _transport(self, server_id: str, body: dict, timeout: float) -> dict:
        """One chunk on `server_id` through Ray; any failure of the server is a retriable GenerateError."""
        handle = self.selector.handles[server_id]
        t0 = time.monotonic()
        try:
            if _is_belayer_engine(handle):
                sp = body["sampling_params"]
                if "seed" in sp:  # SGLang names it sampling_seed and refuses `seed` (Belayer's CPU engine takes both)
                    body = {**body, "sampling_params": {**{k: v for k, v in sp.items() if k != "seed"},
                                                        "sampling_seed": sp["seed"]}}
                r = await asyncio.wait_for(handle.call.remote("POST", "/generate", body, timeout), timeout + 5)
                if r["status"] != 200:
                    raise GenerateError(server_id, str(r["body"])[:500], r["status"], retriable=r["status"] >= 500)
                return r["body"]
            sp = dict(body["sampling_params"])
            n = sp.pop("max_new_tokens")
            sp.update(max_tokens=n, logprobs=body.get("return_logprob", False))
            out = await asyncio.wait_for(handle.generate.remote(request_id=body["rid"], prompt_ids=body["input_ids"],
                                                                sampling_params=sp), timeout + 5)
            return _sglang_shaped(out, n)
        except GenerateError:
            raise
        except ray.exceptions.RayActorError as e:  # the server actor died or is unreachable
            raise GenerateError(server_id, f"{type(e).__name__}: {e}"[:300]) from e
        except ray.exceptions.RayTaskError as e:  # the call failed inside a live actor (e.g. engine gone)
            raise GenerateError(server_id, f"{type(e.as_instanceof_cause()).__name__}: {e}"[:300]) from e
        except asyncio.TimeoutError as e:
            raise GenerateError(server_id, f"no answer within {time.monotonic() - t0:.1f} s") from e


def _rebuild(cls: type, config: Any, balancer: Any, kwargs: dict) -> "BelayerLLMServerClient":
    return cls(config, balancer, **kwargs)


def _is_belayer_engine(handle: Any) -> bool:
    try:  # Ray actor handles expose their methods as attributes
        handle.call  # noqa: B018
        handle.weight_version  # noqa: B018
        return True
    except AttributeError:
        return False


def _sglang_shaped(out: Any, n: int) -> dict:
    """verl's TokenOutput (or its dict form) as the SGLang-shaped chunk ResumableGenerator commits."""
    if not isinstance(out, dict):
        out = out.model_dump() if hasattr(out, "model_dump") else dict(out.__dict__)
    ids = list(out.get("token_ids") or [])
    reason = out.get("stop_reason")
    if reason in ("aborted", "abort"):
        fr = {"type": "abort", "message": "aborted by the server"}
    elif reason == "length" or (reason not in ("stop", "completed") and len(ids) >= n):
        fr = {"type": "length", "length": n}
    else:
        fr = {"type": "stop"}
    lps = out.get("log_probs")
    meta = {"finish_reason": fr, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)] if lps else None,
            "weight_version": str((out.get("extra_fields") or {}).get("global_steps") or "")}
    return {"output_ids": ids, "meta_info": meta}
