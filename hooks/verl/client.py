"""A verl 0.9.1 LLM server client with token-level resume on RayActorError.

`BelayerLLMServerClient` subclasses verl's `LLMServerClient`. Belayer's agent loop managers
(`hooks/verl/manager.py`, named by `rollout.agent.agent_loop_manager_class`) put it in place of the client the
trainer built, so no trainer code changes; `LLMServerManager.get_client(client_cls=...)` works as well. With
`belayer.use_fault_tolerance=true` each `generate` runs through Belayer's ResumableGenerator in chunked mode:
tokens are committed every `recovery.chunk_tokens`; when the server dies (RayActorError, a failed RPC, no
answer within `recovery.stall_timeout_s`) the request goes on from prompt + committed ids on another server
of the load balancer, with the failed one reported (and evicted if its actor is gone). Off: verl's own path.

The transport is one Ray RPC per chunk: Belayer engine actors are called through their `/generate` route;
any other server actor through verl's server-actor signature `generate(request_id, prompt_ids,
sampling_params)` with `max_tokens` set to the chunk.

What the server really served is reported back as verl reads it: `extra_fields` `global_steps` /
`min_global_steps` / `max_global_steps` from the chunks' own `global_steps` (a resumed trajectory that spans two
weight versions has min < max), `num_cached_tokens` of the first prefill, `routed_experts` of every token, and
`belayer` (segments, and the token spans each version produced). Every output of this client carries the same
keys, so verl's `DataProto.concat` of worker batches never sees a key in some samples only.

Server contracts: verl's vLLM server answers `stop_reason="completed"` for both a stop and the length limit,
so a chunk that used its whole budget without ending on a stop token counts as cut by length (the request goes
on); SGLang's server reports `stop` / `length` / `abort` itself. In async trainer modes (the trainer built
verl's `FullyAsyncLLMServerClient`), an abort from a weight sync is not a failure: the committed tokens are
kept and the aborted chunk goes again on the same server once it resumes generation (bounded by
`recovery.request_timeout_s`), as verl's own client waits and continues.

Owns: token-level resume inside verl's client. Must not: restart servers.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import ray
from verl.utils.rollout_trace import rollout_trace_op
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from belayer_plugin.events import EventLog
from belayer_plugin.generation.resumable import RequestFailedError, ResumableGenerator, Target
from belayer_plugin.generation.sglang_http import GenerateError
from belayer_plugin.hooks._config import belayer_section

_log = logging.getLogger("belayer.hooks.verl")

_rid: contextvars.ContextVar[str] = contextvars.ContextVar("belayer_verl_rid", default="")


@dataclass
class Served:
    """What the servers of one request really served, chunk by chunk (filled by the transport)."""

    spans: list[list] = field(default_factory=list)  # [first token, end token, global steps] per version run
    num_cached_tokens: Optional[int] = None  # of the first prefill
    cached_seen: bool = False
    routed_experts: Any = None  # prompt + response rows, as verl's FullyAsyncLLMServerClient keeps them
    aborts: int = 0  # weight-sync aborts waited out (async modes)
    prompt_len: int = 0
    # the servers' own preemption counts, summed over the chunks; None while no server reported one (verl's
    # "not available" is -1, which is what the request then reports)
    num_preempted: Optional[int] = None

    def add(self, start: int, n: int, steps: Optional[int]) -> None:
        if n <= 0:
            return
        if self.spans and self.spans[-1][2] == steps and self.spans[-1][1] == start:
            self.spans[-1][1] = start + n
        else:
            self.spans.append([start, start + n, steps])

    def steps(self) -> tuple[Optional[int], Optional[int], Optional[int]]:
        """(global_steps of the last chunk, min, max) over the versions that produced tokens."""
        known = [s[2] for s in self.spans if s[2] is not None]
        if not known:
            return None, None, None
        return known[-1], min(known), max(known)


_served: contextvars.ContextVar[Optional[Served]] = contextvars.ContextVar("belayer_verl_served", default=None)

# verl sampling params passed on to the engine (verl names -> SGLang names where they differ)
_PASS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "seed", "stop_token_ids", "ignore_eos",
         "min_new_tokens", "frequency_penalty", "presence_penalty")


# verl's LLMServerClient.generate without its rollout_trace_op wrapper: Belayer's generate is traced itself, and
# a request that takes verl's path must not appear twice in the trace
_VERLS_GENERATE = getattr(LLMServerClient.generate, "__wrapped__", LLMServerClient.generate)


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
                 partial_rollout: bool = False, **kwargs: Any):
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        section = config.get("belayer") if hasattr(config, "get") else None
        self.belayer = belayer_section(section)
        # async trainer modes: a weight-sync abort means "wait and go on", as in FullyAsyncLLMServerClient
        self.partial_rollout = bool(partial_rollout)
        self._kwargs = kwargs
        self._eos: Optional[frozenset] = None
        self._build(events)

    def _build(self, events: Optional[EventLog]) -> None:
        rec = replace(self.belayer.recovery, mode="chunked")  # RPC backends commit per chunk
        self.selector = BalancerSelector(self._load_balancer)
        self.generator = ResumableGenerator(self.selector, rec, events, transport=self._transport)

    def __reduce__(self):
        # verl ships the client to every AgentLoopWorker actor: send config and balancer handle, rebuild there
        # (the HTTP client, event log and observers are per process).
        return (_rebuild, (type(self), self.config, self._load_balancer, self.partial_rollout, self._kwargs))

    @property
    def observers(self) -> list:
        """Called on every commit (metrics, chaos triggers at a token position)."""
        return self.generator.observers

    def _response_length(self) -> Optional[int]:
        rollout = getattr(getattr(self.config, "actor_rollout_ref", None), "rollout", None)
        n = getattr(rollout, "response_length", None)
        return n if isinstance(n, int) and n > 0 else None

    def _model_dirs(self) -> list[str]:
        """Local directories that hold the model's files: `model.local_path`, `model.path`, and for a remote path
        (hdfs://...) verl's own local copy (`copy_to_local`, the copy verl's agent loop worker already made)."""
        model = getattr(getattr(self.config, "actor_rollout_ref", None), "model", None)
        dirs: list[str] = []
        for key in ("local_path", "path", "tokenizer_path"):
            v = model.get(key) if hasattr(model, "get") else getattr(model, key, None)
            if isinstance(v, str) and v and v not in dirs:
                dirs.append(v)
        local: list[str] = []
        for d in dirs:
            if "://" in d:
                try:
                    from verl.utils.fs import copy_to_local

                    d = copy_to_local(d, use_shm=bool(model.get("use_shm", False)) if hasattr(model, "get") else False)
                except Exception:  # noqa: BLE001  (no copy: the other candidates decide)
                    continue
            local.append(d)
        return local

    def _eos_ids(self) -> frozenset:
        """The model's end-of-sequence ids, read once per process from the first source that names them: the
        generation config, the model config, then the tokenizer (local files only: never a hub download on the
        request path). With none, a stop that lands exactly on a chunk boundary of a vLLM-contract server would
        read as a length cut: that is said once, loudly."""
        if self._eos is None:
            ids: set[int] = set()
            for d in self._model_dirs():
                for read in (_eos_from_generation_config, _eos_from_model_config, _eos_from_tokenizer):
                    try:
                        ids.update(read(d))
                    except Exception:  # noqa: BLE001  (that source is absent or unreadable: try the next)
                        continue
                    if ids:
                        break
                if ids:
                    break
            if not ids:
                _log.warning("belayer: no end-of-sequence id found for the model (%s): a stop that ends exactly on a "
                             "chunk boundary of a vLLM server reads as a length cut", self._model_dirs())
            self._eos = frozenset(int(i) for i in ids)
        return self._eos

    def _context_room(self, input_len: int) -> Optional[int]:
        """How many tokens the server may still generate after `input_len` tokens (None: no limit known), as
        verl's servers compute it: vLLM `max_model_len - len`, SGLang `max_model_len - len - 1`."""
        rollout = getattr(getattr(self.config, "actor_rollout_ref", None), "rollout", None)
        limit = rollout.get("max_model_len") if hasattr(rollout, "get") else getattr(rollout, "max_model_len", None)
        if not isinstance(limit, int) or limit <= 0:
            return None
        name = rollout.get("name") if hasattr(rollout, "get") else getattr(rollout, "name", "")
        return limit - input_len - (1 if name == "sglang" else 0)

    @rollout_trace_op  # verl's rollout tracing (weave / mlflow / trackio) as on verl's client: one span a request
    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict[str, Any]] = None,
                       **kwargs: Any) -> TokenOutput:
        multimodal = any(x is not None for x in (image_data, video_data, audio_data, kwargs.get("mm_processor_output")))
        if not self.belayer.use_fault_tolerance or multimodal:  # token resume covers text prompts only
            out = await _VERLS_GENERATE(self, request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                        image_data=image_data, video_data=video_data, audio_data=audio_data,
                                        mm_processor_kwargs=mm_processor_kwargs, **kwargs)
            if self.belayer.use_fault_tolerance:  # same keys as every other output of this client
                out.extra_fields.setdefault("num_cached_tokens", None)
                out.extra_fields.setdefault("belayer", None)
            return out
        sp = {k: v for k, v in sampling_params.items() if k in _PASS and v is not None}
        if sp.get("top_k") == -1:
            sp.pop("top_k")
        limit = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens")) or self._response_length()
        sp["max_new_tokens"] = int(limit) if limit else 128
        want_lp = bool(sampling_params.get("logprobs"))
        served = Served(prompt_len=len(prompt_ids))
        token, stoken = _rid.set(str(request_id)), _served.set(served)
        try:
            log, _ = await self.generator.generate(f"{request_id}-{uuid.uuid4().hex[:8]}", list(prompt_ids), sp,
                                                   return_logprob=want_lp)
        except RequestFailedError:
            await self.report_metrics({"requests_failed": 1})
            raise
        finally:
            _rid.reset(token)
            _served.reset(stoken)
        resumed = log.summary()["resumed_from"]
        if resumed:  # awaited, so the step's take (after the rollout returns) sees it
            await self.report_metrics({"requests_resumed": len(resumed), "tokens_saved": sum(resumed)})
        fr = (log.finish_reason or {}).get("type")
        steps, lo, hi = served.steps()
        summary = {**log.summary(), "global_steps_spans": [list(s) for s in served.spans],
                   "weight_sync_aborts": served.aborts}
        return TokenOutput(token_ids=list(log.output_ids), log_probs=list(log.logprobs) if want_lp else None,
                           routed_experts=served.routed_experts,
                           stop_reason="length" if fr == "length" else "completed",
                           num_preempted=-1 if served.num_preempted is None else served.num_preempted,
                           extra_fields={"global_steps": steps, "min_global_steps": lo, "max_global_steps": hi,
                                         "num_cached_tokens": served.num_cached_tokens, "belayer": summary})

    async def report_metrics(self, counts: dict[str, float]) -> None:
        """Adds recovery counts (StepMetrics names) to this step's, held by Belayer's balancer actor (the
        agent loop manager takes them per step); never fails the request it describes."""
        try:
            add = self._load_balancer.add_step_metrics
        except AttributeError:
            return  # not Belayer's balancer: no step metrics
        try:
            await add.remote(counts)
        except Exception:  # noqa: BLE001
            _log.warning("step metrics lost: %s", counts, exc_info=True)

    async def _transport(self, server_id: str, body: dict, timeout: float) -> dict:
        """One chunk on `server_id` through Ray; any failure of the server is a retriable GenerateError."""
        handle = self.selector.handles[server_id]
        t0 = time.monotonic()
        served = _served.get() or Served()
        start = len(body["input_ids"]) - served.prompt_len  # the chunk's first token in the response
        try:
            if _is_belayer_engine(handle):
                sp = body["sampling_params"]
                if "seed" in sp:  # SGLang names it sampling_seed and refuses `seed` (Belayer's CPU engine takes both)
                    body = {**body, "sampling_params": {**{k: v for k, v in sp.items() if k != "seed"},
                                                        "sampling_seed": sp["seed"]}}
                r = await asyncio.wait_for(handle.call.remote("POST", "/generate", body, timeout), timeout + 5)
                if r["status"] != 200:
                    raise GenerateError(server_id, str(r["body"])[:500], r["status"], retriable=r["status"] >= 500)
                out = r["body"]
                meta = out.get("meta_info", {})
                served.add(start, len(out.get("output_ids") or []), _int_or_none(meta.get("weight_version")))
                return out
            sp = dict(body["sampling_params"])
            n = sp.pop("max_new_tokens")
            room = self._context_room(len(body["input_ids"]))
            if room is not None and room < 1:
                # The context is full. verl's servers raise for a request that cannot generate a token, where one
                # uncut request would have ended here at length: end it so (the generator takes the flag).
                return {"output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0,
                                                                          "context_limit": True},
                                                        "output_token_logprobs": None, "weight_version": ""}}
            if room is not None:
                n = min(n, room)
            sp.update(max_tokens=n, logprobs=body.get("return_logprob", False))
            wait = timeout
            while True:
                out = await self._chunk(handle, body["rid"], body["input_ids"], sp, wait)
                chunk = _sglang_shaped(out, n, self._stop_ids(sp))
                if chunk["meta_info"]["finish_reason"]["type"] != "abort" or not self.partial_rollout:
                    break
                # A weight sync aborted the chunk (async modes). Not a failure: the same chunk goes again on this
                # server, which parks it until generation resumes. Its partial tokens are dropped so that every
                # cut stays on a chunk boundary (the continuation's logprobs then match an unaborted run's).
                served.aborts += 1
                if server_id not in await self._load_balancer.get_all_servers.remote():
                    # taken out of the balancer and refusing requests (separate_async): go on elsewhere
                    raise GenerateError(server_id, "aborted by a weight sync; the server left the load balancer")
                wait = self.belayer.recovery.request_timeout_s  # parked for the length of a weight sync
            self._record(served, start, out, chunk)
            return chunk
        except GenerateError:
            raise
        except ray.exceptions.RayActorError as e:  # the server actor died or is unreachable
            raise GenerateError(server_id, f"{type(e).__name__}: {e}"[:300]) from e
        except ray.exceptions.RayTaskError as e:  # the call failed inside a live actor (e.g. engine gone)
            raise GenerateError(server_id, f"{type(e.as_instanceof_cause()).__name__}: {e}"[:300]) from e
        except asyncio.TimeoutError as e:
            raise GenerateError(server_id, f"no answer within {time.monotonic() - t0:.1f} s") from e

    async def _chunk(self, handle: Any, rid: str, prompt_ids: list[int], sp: dict, wait: float) -> Any:
        """One chunk's RPC to a verl server actor. Its answer comes whole (no token to watch), so `wait` passing
        is not by itself a hang: the chunk may sit in the queue of a busy server. While the actor answers Ray's
        readiness call the wait goes on, up to recovery.request_timeout_s in all; a chunk given up on is
        aborted on its server (verl's `abort_request`), which would otherwise decode it for nobody."""
        async def call() -> Any:
            return await handle.generate.remote(request_id=rid, prompt_ids=prompt_ids, sampling_params=sp)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait, self.belayer.recovery.request_timeout_s)
        fut = asyncio.ensure_future(call())
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), wait + 5)
                except asyncio.TimeoutError:
                    if loop.time() >= deadline or not await self._answers(handle):
                        raise
        except BaseException:
            if not fut.done():
                fut.cancel()
                try:  # fire and forget: the server may be gone; the chunk goes on elsewhere either way
                    handle.abort_request.remote(request_id=rid)
                except Exception:  # noqa: BLE001  (no such method on this server kind, or no actor)
                    pass
            raise

    async def _answers(self, handle: Any) -> bool:
        """Whether the server actor answers Ray's readiness call within monitor.liveness_timeout_s."""
        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), self.belayer.monitor.liveness_timeout_s)
            return True
        except (asyncio.TimeoutError, ray.exceptions.RayActorError):
            return False

    def _stop_ids(self, sp: dict) -> frozenset:
        ids = frozenset(int(i) for i in sp.get("stop_token_ids") or ())
        return ids if sp.get("ignore_eos") else ids | self._eos_ids()

    @staticmethod
    def _record(served: Served, start: int, out: Any, chunk: dict) -> None:
        """Notes the chunk's version, first prefill's cache hits and routed experts (verl's own fields)."""
        import numpy as np

        ids = chunk["output_ids"]
        extra = (out.get("extra_fields") if isinstance(out, dict) else getattr(out, "extra_fields", None)) or {}
        served.add(start, len(ids), _int_or_none(extra.get("global_steps")))
        pre = out.get("num_preempted") if isinstance(out, dict) else getattr(out, "num_preempted", None)
        if isinstance(pre, int) and pre >= 0:  # verl's -1 / None: this server does not say
            served.num_preempted = (served.num_preempted or 0) + pre
        if not served.cached_seen:
            served.cached_seen = True
            served.num_cached_tokens = extra.get("num_cached_tokens")
        routed = out.get("routed_experts") if isinstance(out, dict) else getattr(out, "routed_experts", None)
        if routed is not None and ids:
            routed = np.asarray(routed)
            if served.routed_experts is None:
                served.routed_experts = routed  # the first chunk's rows cover the prompt too
            else:  # later chunks: only the rows of their new tokens
                served.routed_experts = np.concatenate([served.routed_experts, routed[-len(ids):]])


def _eos_from_generation_config(d: str) -> list[int]:
    from transformers import GenerationConfig

    return _ids(GenerationConfig.from_pretrained(d, local_files_only=True).eos_token_id)


def _eos_from_model_config(d: str) -> list[int]:
    from transformers import AutoConfig

    return _ids(AutoConfig.from_pretrained(d, local_files_only=True).eos_token_id)


def _eos_from_tokenizer(d: str) -> list[int]:
    from transformers import AutoTokenizer

    return _ids(AutoTokenizer.from_pretrained(d, local_files_only=True).eos_token_id)


def _ids(e: Any) -> list[int]:
    return list(e) if isinstance(e, (list, tuple)) else [e] if e is not None else []


def _rebuild(cls: type, config: Any, balancer: Any, partial_rollout: bool, kwargs: dict) -> "BelayerLLMServerClient":
    return cls(config, balancer, partial_rollout=partial_rollout, **kwargs)


def _int_or_none(v: Any) -> Optional[int]:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    try:
        return int(str(v))
    except ValueError:
        return None  # a non-numeric version (e.g. "default"): verl has no global step for it


def _is_belayer_engine(handle: Any) -> bool:
    try:  # Ray actor handles expose their methods as attributes
        handle.call  # noqa: B018
        handle.weight_version  # noqa: B018
        return True
    except AttributeError:
        return False


def _sglang_shaped(out: Any, n: int, stop_ids: frozenset = frozenset()) -> dict:
    """verl's TokenOutput (or its dict form) as the SGLang-shaped chunk ResumableGenerator commits.

    vLLM's "completed" covers both a stop and the length limit: a chunk that used its whole budget `n` and does
    not end on a stop id was cut by length (the request goes on); SGLang names stop / length itself.
    """
    if not isinstance(out, dict):
        out = out.model_dump() if hasattr(out, "model_dump") else dict(out.__dict__)
    ids = list(out.get("token_ids") or [])
    reason = out.get("stop_reason")
    if reason in ("aborted", "abort"):
        fr = {"type": "abort", "message": "aborted by the server"}
    elif reason == "length":
        fr = {"type": "length", "length": n}
    elif reason == "stop":
        fr = {"type": "stop"}
    elif len(ids) >= n and not (ids and ids[-1] in stop_ids):  # "completed" (vLLM) or unknown
        fr = {"type": "length", "length": n}
    else:
        fr = {"type": "stop"}
    lps = out.get("log_probs")
    steps = (out.get("extra_fields") or {}).get("global_steps")
    meta = {"finish_reason": fr, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)] if lps else None,
            "weight_version": "" if steps is None else str(steps)}
    return {"output_ids": ids, "meta_info": meta}
