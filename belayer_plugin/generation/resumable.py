"""Resumable generation: a request survives the death of the engine serving it, token for token.

Tokens are committed as they arrive (every SSE chunk in stream mode; every `chunk_tokens` tokens in
chunked mode, for backends reached by RPC rather than HTTP). When the engine fails (broken stream,
refused connection, 5xx, no token within the stall timeout) the request goes on from prompt + committed
ids on another healthy engine, with max_new_tokens reduced and stop conditions kept; the failed engine is
reported to the fleet at once. After `max_attempts` the request alone fails, with a typed error.

Sampling parameters that cannot be continued exactly from a cut (resume_policy.py) make the request start
again from its prompt instead (a request-level retry, with a `resume_refused` event). A request whose
engines died `poison_max_deaths` times before it got a token from them is poison: it fails alone with
RequestPoisonedError, and the fleet is told so that those deaths cost no restart budget or node health.

No serving engine is no reason to drop a request while the fleet is bringing one back (FleetSelector): the
request waits for it with its committed tokens, woken by the fleet's state changes, until an engine serves,
the fleet falls below its floor (FleetBelowFloorRequestError) or the request's own deadline passes
(RequestDeadlineError); new requests join that wait up to `recovery.max_waiting` (then QueueFullError).

Owns: committing tokens as they stream, failing over to another engine and resuming from prompt + committed
ids, poison-request quarantine. Must not: restart or fence engines (it reports what it saw to the fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Protocol

import aiohttp
import httpx

from belayer_plugin.config import RecoveryConfig
from belayer_plugin.events import EventLog
from belayer_plugin.generation import stream_reader
from belayer_plugin.generation.context_log import ContextLog, Segment
from belayer_plugin.generation.resume_policy import (UnsupportedRequestError, check_request, resume_refusals,
                                                     segment_seed, stop_strings)
from belayer_plugin.generation.sglang_http import GenerateError, StreamBroken, generate, parse_chunk, stream_events


class RequestFailedError(RuntimeError):
    """One request could not be completed within its attempt budget (other requests are unaffected).

    `kind` names why in one word (the front's JSON error body carries it as `reason`); `retry_after` is set
    (seconds) where trying again later is the answer."""

    kind = "request_failed"
    retry_after: Optional[int] = None

    def __init__(self, rid: str, reason: str, log: Optional[ContextLog] = None, status: int = 502):
        self.rid, self.reason, self.log, self.status = rid, reason, log, status
        tail = f" after {len(log.segments)} attempt(s), {log.committed} token(s) committed" if log else ""
        super().__init__(f"request {rid}: {reason}{tail}")


class NoEngineError(RequestFailedError):
    """No engine serves the request and none is being brought back (waited recovery.stall_timeout_s)."""

    kind = "no_engine"

    def __init__(self, rid: str, reason: str, log: Optional[ContextLog] = None):
        super().__init__(rid, reason, log, status=503)


class FleetBelowFloorRequestError(RequestFailedError):
    """The fleet is below its floor (restart.min_healthy_engines; FleetBelowFloorError) or every engine is
    retired: no engine will come back for the request, so it ends at once, whatever its deadline."""

    kind = "fleet_below_floor"

    def __init__(self, rid: str, reason: str, log: Optional[ContextLog] = None):
        super().__init__(rid, reason, log, status=503)


class RequestDeadlineError(RequestFailedError):
    """The request's own deadline (recovery.request_timeout_s) passed, e.g. while it waited for an engine the
    fleet was bringing back. Its committed tokens are in `log`."""

    kind = "request_deadline"

    def __init__(self, rid: str, reason: str, log: Optional[ContextLog] = None):
        super().__init__(rid, reason, log, status=504)


class QueueFullError(RequestFailedError):
    """A new request found no serving engine while recovery.max_waiting requests already waited for one."""

    kind = "queue_full"

    def __init__(self, rid: str, reason: str, retry_after: int, log: Optional[ContextLog] = None):
        self.retry_after = retry_after
        super().__init__(rid, reason, log, status=503)


class RequestPoisonedError(RequestFailedError):
    """The request itself crashes engines: it was in flight on engines that died before giving it a token,
    `recovery.poison_max_deaths` times. It is failed alone and not resumed onto any other engine."""

    kind = "poisoned"

    def __init__(self, rid: str, engines: list[str], log: Optional[ContextLog] = None):
        self.engines = engines
        super().__init__(rid, f"quarantined as a poison request: engines {engines} died with it in flight "
                              f"before giving it a token (recovery.poison_max_deaths={len(engines)})",
                         log, status=422)


@dataclass(frozen=True)
class Target:
    engine: str
    url: str
    incarnation: int = -1  # the engine incarnation picked (fleet selectors), -1 when unknown


class EngineWaitError(RuntimeError):
    """A selector's reason why a pick that found no serving engine may not wait (on): `kind` is
    "fleet_below_floor", "queue_full" or "request_deadline"."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


@dataclass
class Hold:
    """How a pick that finds no serving engine waits while the fleet brings one back (FleetSelector.pick)."""

    until: float  # the request's own deadline (event loop time): recovery.request_timeout_s from its start
    admitted: bool  # already running (has had a segment): never turned away, whatever max_waiting says
    max_waiting: int  # recovery.max_waiting: a new request may join only while fewer wait
    # Called with what is awaited when the wait begins, and again when it turns into a hold (or back).
    on_wait: Optional[Callable[[str, bool], None]] = None  # (what it awaits, held: the fleet is bringing one back)


class Selector(Protocol):
    """Chooses engines for requests and hears about their failures."""

    async def pick(self, exclude: set[str], timeout: float) -> Target: ...
    def release(self, target: Target) -> None: ...
    async def failed(self, target: Target, reason: str) -> None: ...


class FleetSelector:
    """Least-loaded HEALTHY engine of a FleetManager; failures are reported to its health machine.

    With no serving engine, a pick waits for one, woken by the fleet's state changes (FleetManager.wait_changed:
    its health transitions, a retirement, the floor). While the fleet is bringing an engine back (recovering())
    and is not below its floor, a pick given a Hold waits until the request's own deadline; otherwise for
    `timeout` (recovery.stall_timeout_s) at most."""

    def __init__(self, fleet: Any):
        self.fleet = fleet
        self.n_waiting = 0  # picks now waiting for a serving engine (recovery.max_waiting bounds new ones)

    def recovering(self) -> list[str]:
        """The slots the fleet is bringing back ("engine-0 RESTARTING", ...): RESTARTING or STALE, or DEAD with
        its recovery task under way (a restart backing off, a standby being promoted; one whose budget is spent
        turns RETIRED within moments). Empty below the floor, or when nothing will come back."""
        from belayer_plugin.fleet.health import State

        if getattr(self.fleet, "fatal", None) is not None:
            return []
        out = []
        for sid, s in self.fleet.slots.items():
            st = s.health.state
            if st in (State.RESTARTING, State.STALE) or (
                    st is State.DEAD and s.recovery is not None and not s.recovery.done()):
                out.append(f"{sid} {st.value}")
        return out

    def _all_retired(self) -> bool:
        from belayer_plugin.fleet.health import State

        return all(s.health.state is State.RETIRED for s in self.fleet.slots.values())

    async def pick(self, exclude: set[str], timeout: float, hold: Optional[Hold] = None) -> Target:
        from belayer_plugin.fleet.manager import NoHealthyEngineError
        from belayer_plugin.fleet.policy import FleetBelowFloorError

        loop = asyncio.get_running_loop()
        stall_end: Optional[float] = loop.time() + timeout  # None while held (re-armed if the recovery ends)
        counted = False
        held: Optional[bool] = None  # whether the wait, once begun, is a hold (an engine is coming back)
        try:
            while True:
                try:
                    slot = self.fleet.pick_engine_excluding_urls(exclude)
                    slot.inflight += 1
                    return Target(slot.slot_id, slot.info.url, slot.health.incarnation)
                except FleetBelowFloorError as e:
                    raise EngineWaitError("fleet_below_floor", f"no engine will come back: {e}") from None
                except NoHealthyEngineError as e:
                    if self._all_retired():
                        raise EngineWaitError("fleet_below_floor", f"no engine will come back: every engine is "
                                                                   f"retired ({self.fleet.states()})") from None
                    if hold is not None and not counted:
                        if not hold.admitted and self.n_waiting >= hold.max_waiting:
                            raise EngineWaitError("queue_full", f"no serving engine and {self.n_waiting} request(s) "
                                                                f"already wait for one (recovery.max_waiting="
                                                                f"{hold.max_waiting}); states: "
                                                                f"{self.fleet.states()}") from None
                        self.n_waiting += 1
                        counted = True
                    now = loop.time()
                    back = self.recovering() if hold is not None else []
                    if back:  # an engine is coming back: wait for it until the request's own deadline
                        stall_end = None
                        left = hold.until - now
                        if left <= 0:
                            raise EngineWaitError("request_deadline", f"waited for an engine ({', '.join(back)}) "
                                                                      f"until the request's deadline") from None
                    else:  # nothing is coming back (yet: a death not confirmed, say): recovery.stall_timeout_s
                        if stall_end is None:
                            stall_end = now + timeout
                        left = stall_end - now
                        if left <= 0:
                            raise e
                    if hold is not None and hold.on_wait is not None and held is not bool(back):
                        held = bool(back)  # told when the wait begins and when it becomes a hold (or stops)
                        hold.on_wait(f"an engine the fleet is bringing back ({', '.join(back)})" if back
                                     else f"a serving engine ({e}; recovery.stall_timeout_s={timeout:g})", held)
                    await self.fleet.wait_changed(left)  # woken by the fleet's next state change
        finally:
            if counted:
                self.n_waiting -= 1

    @property
    def tokenizer_path(self) -> Optional[str]:
        return getattr(self.fleet, "model_path", None)

    @property
    def seed_per_position(self) -> bool:
        """SGLang seeds each token from (seed, absolute position); the CPU engine from seed + output index."""
        cfg = getattr(self.fleet, "cfg", None)
        return getattr(getattr(cfg, "engines", None), "kind", "cpu") == "sglang"

    def _slot(self, target: Target) -> Any:
        slot = self.fleet.slots.get(target.engine)
        if slot is not None and slot.info is not None and slot.info.url == target.url \
                and slot.health.incarnation == target.incarnation:
            return slot
        return None

    def bind(self, target: Target, rid: str) -> None:
        """Records that `rid` is in flight on the target (a death then names its requests)."""
        slot = self._slot(target)
        if slot is not None:
            slot.rids.add(rid)

    def release(self, target: Target, rid: Optional[str] = None) -> None:
        slot = self._slot(target)
        if slot is not None and slot.inflight > 0:
            slot.inflight -= 1
        if slot is not None and rid is not None:
            slot.rids.discard(rid)
            slot.drain_cut.discard(rid)
        mon = getattr(self.fleet, "monitor", None)
        if mon is not None and rid is not None and hasattr(mon, "request_ended"):
            mon.request_ended(target.engine, target.incarnation, rid)

    def started(self, target: Target, rid: str, prompt_tokens: int) -> None:
        """A streamed segment began on the target (token progress: fleet/progress.py)."""
        mon = getattr(self.fleet, "monitor", None)
        if mon is not None and hasattr(mon, "request_started"):
            mon.request_started(target.engine, target.incarnation, rid, prompt_tokens)

    def progressed(self, target: Target, rid: str, chunks: int = 1) -> None:
        """New tokens of `rid` streamed back from the target, in `chunks` stream chunks."""
        mon = getattr(self.fleet, "monitor", None)
        if mon is not None and hasattr(mon, "tokens_seen"):
            mon.tokens_seen(target.engine, target.incarnation, rid, chunks)

    def draining(self, target: Target, rid: Optional[str] = None) -> bool:
        """Whether the target's engine is being drained on purpose, or a drain cut `rid` there (a cut there is
        a move, not a failure)."""
        is_draining = getattr(self.fleet, "is_draining", None)
        return bool(is_draining and is_draining(target.engine, target.url, rid))

    def poisoned(self, rid: str, targets: list[Target], reason: str) -> None:
        self.fleet.absolve(rid, [(t.engine, t.incarnation) for t in targets], reason)

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
# Stream mode, a request's first segment only: each newest engine chunk, unparsed (raw `data:` payload, not the
# final one). There it is exactly what the client of the request would be sent, so a front forwards it as is.
ChunkFn = Callable[[bytes, ContextLog, Segment], None]
# Chunked mode's one call to an engine: (engine url, SGLang /generate body, timeout) -> SGLang-shaped response.
# Raises GenerateError (retriable: go on elsewhere). The default is HTTP /generate; trainer hooks plug in
# their own (e.g. a Ray actor RPC) and keep the resume loop here.
Transport = Callable[[str, dict, float], Awaitable[dict]]


class ResumableGenerator:
    """Runs SGLang-style /generate requests with token-level recovery."""

    def __init__(self, selector: Selector, cfg: RecoveryConfig, events: Optional[EventLog] = None,
                 client: Optional[httpx.AsyncClient] = None, transport: Optional[Transport] = None,
                 tokenizer_path: Optional[str] = None):
        if transport is not None and cfg.mode != "chunked":
            raise ValueError("a custom transport needs recovery.mode=chunked (stream mode is HTTP SSE only)")
        self.selector = selector
        self.cfg = cfg
        self.transport = transport
        self.events = events or EventLog()
        self.client = client or httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))
        # Streams go through aiohttp (a chunk per token: httpx's per-chunk cost was most of the front's CPU).
        # A session belongs to one event loop, so one is made per loop the generator runs in.
        self._streams: Optional[aiohttp.ClientSession] = None
        self._streams_loop: Optional[asyncio.AbstractEventLoop] = None
        # Called on every commit of every request (metrics, chaos triggers at a token position).
        self.observers: list[ProgressFn] = []
        # Decodes ids to check stop strings across a cut (None: the selector's model, if it names one).
        self.tokenizer_path = tokenizer_path or getattr(selector, "tokenizer_path", None)
        self._tokenizer: Any = None
        # How the engines turn a seed into per-token randomness (resume_policy.segment_seed).
        self.seed_per_position = bool(getattr(selector, "seed_per_position", False))
        # Requests now in a pick, waiting for an engine the fleet is bringing back: {rid: what they await}
        # (the front's heartbeats say so).
        self.waiting: dict[str, str] = {}

    def _stream_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._streams is None or self._streams.closed or self._streams_loop is not loop:
            self._streams = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False)
            self._streams_loop = loop
        return self._streams

    async def aclose(self) -> None:
        """Closes the generator's stream connections (its session of the running loop)."""
        if self._streams is not None and self._streams_loop is asyncio.get_running_loop():
            await self._streams.close()
        self._streams = self._streams_loop = None

    async def generate(self, rid: str, input_ids: list[int], sampling_params: dict, return_logprob: bool = False,
                       on_progress: Optional[ProgressFn] = None, on_chunk: Optional[ChunkFn] = None
                       ) -> tuple[ContextLog, dict]:
        """Runs one request to completion; returns its context log and the final SGLang-style response.

        `on_progress` is called at every commit; `on_chunk` (stream mode) with the engine's raw chunks while
        they are the client's chunks verbatim, and `on_progress` is then called only after a resume."""
        sp = dict(sampling_params or {})
        try:
            check_request(sp)
        except UnsupportedRequestError as e:
            raise RequestFailedError(rid, str(e), None, status=400) from None
        max_new = sp.get("max_new_tokens", 128)
        log = ContextLog(rid, list(input_ids), int(max_new), want_logprobs=return_logprob)
        if stop_strings(sp) and self.tokenizer_path and self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.tokenizer_path)
        outcome = "failed"
        until = asyncio.get_running_loop().time() + self.cfg.request_timeout_s
        try:
            async with asyncio.timeout_at(until):
                await self._run(log, sp, on_progress, on_chunk, until)
            outcome = "finished"
        except TimeoutError:
            awaited = self.waiting.get(rid)
            raise RequestDeadlineError(rid, f"not finished within recovery.request_timeout_s="
                                            f"{self.cfg.request_timeout_s:g} s"
                                            + (f" (waiting for an engine: {awaited})" if awaited else ""),
                                       log) from None
        finally:
            self.waiting.pop(rid, None)
            # One record per request with where each of its segments ran (the report's fleet picture).
            self.events.emit("generation", rid, "request", outcome, tokens=log.committed,
                             segments=[[g.engine, round(g.t_start, 4), round(g.t_end or time.time(), 4), g.start,
                                        g.end, g.outcome[:40]] for g in log.segments])
        return log, self.response(log, return_logprob)

    async def _pick(self, log: ContextLog, exclude: set[str], until: Optional[float]) -> Target:
        """The request's next engine. A selector whose pick takes a Hold (FleetSelector) may keep it waiting for
        an engine the fleet is bringing back, until `until`; new requests only while fewer than
        recovery.max_waiting wait. Raises EngineWaitError when it may not wait (on)."""
        # (a subclass of FleetSelector overriding pick with the plain signature, or another selector, waits as
        # it always did)
        if until is None or not _takes_hold(self.selector):
            return await self.selector.pick(exclude, self.cfg.stall_timeout_s)
        t0 = time.monotonic()

        def on_wait(awaited: str, held: bool) -> None:
            self.waiting[log.rid] = awaited
            self.events.emit("recovery", log.rid, "waiting_for_engine", f"no serving engine: waiting for {awaited}",
                             level="warning", committed=log.committed, held=held,
                             waiting=getattr(self.selector, "n_waiting", None))

        hold = Hold(until, admitted=bool(log.segments), max_waiting=self.cfg.max_waiting, on_wait=on_wait)
        try:
            target = await self.selector.pick(exclude, self.cfg.stall_timeout_s, hold)  # type: ignore[call-arg]
        except asyncio.CancelledError:
            raise  # (the request's deadline, say) generate() names what it waited for, then forgets it
        except BaseException:
            self.waiting.pop(log.rid, None)
            raise
        awaited = self.waiting.pop(log.rid, None)
        if awaited is not None:
            self.events.emit("recovery", log.rid, "engine_found", f"{target.engine} after waiting for {awaited}",
                             engine=target.engine, committed=log.committed,
                             waited_s=round(time.monotonic() - t0, 4))
        return target

    async def _run(self, log: ContextLog, sp: dict, on_progress: Optional[ProgressFn],
                   on_chunk: Optional[ChunkFn] = None, until: Optional[float] = None) -> None:
        exclude: set[str] = set()
        failures = 0
        # Engines that refused the connection (already dead, e.g. killed by another request a moment ago) since
        # this request's last delivered attempt. They stay excluded and spend no attempt: otherwise a request
        # bounces between dead engines the fleet has not yet marked and burns max_attempts in milliseconds
        # (CI: an innocent request failed that way beside a poison request). Bounded on their own.
        refused: set[str] = set()
        n_refused = 0
        refusals = resume_refusals(sp, can_check_stop=self._tokenizer is not None)
        no_progress: list[Target] = []  # engines that failed before giving this request a token
        while True:
            if log.remaining == 0 and log.max_new_tokens > 0:
                log.finish_reason = {"type": "length", "length": log.max_new_tokens}
                return
            try:
                target = await self._pick(log, exclude | refused, until)
            except EngineWaitError as e:
                if e.kind == "queue_full":
                    raise QueueFullError(log.rid, str(e), self.cfg.retry_after_s, log) from e
                if e.kind == "request_deadline":
                    raise RequestDeadlineError(log.rid, f"not finished within recovery.request_timeout_s="
                                                        f"{self.cfg.request_timeout_s:g} s: {e}", log) from e
                raise FleetBelowFloorRequestError(log.rid, str(e), log) from e
            except Exception as e:
                if refused:  # a replacement may have come back at a refused URL: once more without them
                    refused.clear()
                    continue
                raise NoEngineError(log.rid, f"no healthy engine: {e}", log) from e
            seed = sp.get("seed", sp.get("sampling_seed"))
            # A resumed sampled segment continues the fault-free run's randomness (resume_policy.segment_seed).
            seg_seed = segment_seed(seed, log.committed, self.seed_per_position)
            seg = log.begin(target.engine, target.url, seg_seed)
            bind = getattr(self.selector, "bind", None)
            if bind is not None:
                bind(target, log.rid)
            # Token progress for hang detection: stream mode only (a chunk is no per-token signal).
            seen = getattr(self.selector, "progressed", None) if self.cfg.mode == "stream" else None
            if seen is not None:
                self.selector.started(target, log.rid, len(log.prompt_ids) + log.committed)
            try:
                fr = await self._segment(log, seg, sp, seg_seed, on_progress, on_chunk,
                                         None if seen is None else (lambda n, t=target: seen(t, log.rid, n)))
                seg.outcome, seg.t_end = "finished", time.time()
                if fr is not None:
                    if fr.get("type") == "length":
                        fr = {"type": "length", "length": log.max_new_tokens}
                    log.finish_reason = fr
                    return
            except GenerateError as e:
                seg.outcome, seg.t_end = f"failed: {e.reason[:200]}", time.time()
                draining = getattr(self.selector, "draining", None)
                if e.retriable and draining is not None and draining(target, log.rid):
                    # A planned drain cut it at its committed position: it moves on, as from a planned death
                    # (no fault reported, no attempt spent, no poison evidence).
                    seg.outcome = f"drained: {e.reason[:200]}"
                    exclude = {target.url}
                    if refusals and log.committed > 0:
                        self.events.emit("recovery", log.rid, "resume_refused", "; ".join(refusals),
                                         level="warning", committed=log.committed, failed_engine=target.engine)
                        log.restart()
                    self.events.emit("recovery", log.rid, "resumed", f"from token {log.committed} (drained)",
                                     committed=log.committed, failed_engine=target.engine, drained=True)
                    continue
                if not e.retriable:
                    raise RequestFailedError(log.rid, f"rejected by {target.url}: {e.reason}", log,
                                             status=e.status or 400) from e
                await self.selector.failed(target, e.reason[:200])
                if not e.delivered:
                    n_refused += 1
                    refused.add(target.url)
                    self.events.emit("recovery", log.rid, "request_refused_by_engine", e.reason[:200],
                                     level="warning", engine=target.engine, committed=log.committed,
                                     refused=n_refused)
                    if n_refused >= _MAX_REFUSALS_PER_ATTEMPT * self.cfg.max_attempts:
                        raise RequestFailedError(log.rid, f"refused by {n_refused} engine(s); last: "
                                                          f"{e.reason[:200]}", log, status=503) from e
                    continue
                failures += 1
                exclude, refused = {target.url}, set()
                self.events.emit("recovery", log.rid, "request_failed_on_engine", e.reason[:200], level="warning",
                                 engine=target.engine, committed=log.committed, attempt=failures)
                if (seg.end == seg.start and self.cfg.mode == "stream"
                        and not e.reason.startswith(_ABORTED)):
                    # Stream mode commits every token, so "no token" means it died on this request's prefill
                    # or first step. (Chunked mode commits per chunk: any mid-chunk kill would look alike, so
                    # there max_attempts alone bounds a poison request.) Refused connections never get here:
                    # the engine was already dead, as when a request lands on a slot another request just
                    # killed (CI saw an innocent request quarantined that way).
                    no_progress.append(target)
                if len(no_progress) >= self.cfg.poison_max_deaths:
                    err = RequestPoisonedError(log.rid, [t.engine for t in no_progress], log)
                    poisoned = getattr(self.selector, "poisoned", None)
                    if poisoned is not None:
                        poisoned(log.rid, list(no_progress), err.reason)
                    self.events.emit("recovery", log.rid, "quarantined", err.reason, level="error",
                                     engines=[t.engine for t in no_progress])
                    raise err from e
                if failures >= self.cfg.max_attempts:
                    raise RequestFailedError(log.rid, f"failed on {failures} engine(s); last: {e.reason[:200]}",
                                             log) from e
                if refusals and log.committed > 0:
                    self.events.emit("recovery", log.rid, "resume_refused", "; ".join(refusals), level="warning",
                                     committed=log.committed, failed_engine=target.engine)
                    log.restart()
                # prompt_tokens and the next attempt's request id let a chaos check find the continuation in
                # the serving engine's own ledger (chaos/check.py: its prompt held the committed tokens).
                self.events.emit("recovery", log.rid, "resumed", f"from token {log.committed}",
                                 committed=log.committed, failed_engine=target.engine,
                                 prompt_tokens=len(log.prompt_ids), next_rid=f"{log.rid}.r{len(log.segments)}")
            finally:
                if bind is not None:
                    self.selector.release(target, log.rid)
                else:
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
        if self.cfg.mode == "stream" and self.cfg.stream_interval > 1 and "stream_interval" not in params:
            params["stream_interval"] = self.cfg.stream_interval
        rid = log.rid if attempt == 0 else f"{log.rid}.r{attempt}"
        return {"input_ids": log.resume_input_ids(), "sampling_params": params, "rid": rid,
                # Logprobs only when asked: cumulative stream chunks make them cost O(n^2) bytes.
                "return_logprob": log.want_logprobs}

    async def _segment(self, log: ContextLog, seg: Segment, sp: dict, seed: Optional[int],
                       on_progress: Optional[ProgressFn], on_chunk: Optional[ChunkFn] = None,
                       seen: Optional[Callable[[int], None]] = None) -> Optional[dict]:
        """Runs one segment on seg's engine; returns the finish reason, or raises GenerateError."""
        attempt = len(log.segments) - 1
        if self.cfg.mode == "stream":
            return await self._stream_segment(log, seg, sp, seed, attempt, on_progress, on_chunk, seen)
        # chunked: commit every chunk_tokens tokens
        while True:
            n = min(self.cfg.chunk_tokens, log.remaining)
            chunk_seed = seed if seed is None or self.seed_per_position else seed + (log.committed - seg.start)
            body = self._body(log, sp, chunk_seed, n, attempt)
            if self.transport is not None:
                out = await self.transport(seg.url, body, self.cfg.stall_timeout_s)
            else:
                out = await generate(self.client, seg.url, body, timeout=self.cfg.stall_timeout_s)
            meta = out.get("meta_info", {})
            before = log.committed
            got = log.append(seg, out.get("output_ids", []), meta.get("output_token_logprobs"),
                             meta.get("weight_version"))
            # Each chunk is its own engine request: the engine saw only this chunk's text.
            hit = self._stop_across_cut(log, sp, before, before)
            await self._progress(on_progress, log, seg)
            if hit is not None:
                return hit
            fr = _checked(meta.get("finish_reason") or {}, seg)
            # context_limit: the transport found the context full (an uncut request ends there at length too)
            if fr.get("type") != "length" or log.remaining == 0 or fr.get("context_limit"):
                return fr
            if got == 0:
                raise GenerateError(seg.url, "engine returned no tokens for a chunk")

    async def _stream_segment(self, log: ContextLog, seg: Segment, sp: dict, seed: Optional[int], attempt: int,
                              on_progress: Optional[ProgressFn], on_chunk: Optional[ChunkFn],
                              seen: Optional[Callable[[int], None]]) -> Optional[dict]:
        """Stream mode: commits the engine's cumulative chunks; returns the finish reason or raises GenerateError.

        A chunk is parsed and committed as it arrives only when something reads the committed state per token
        (observers, `on_progress`, a stop string to find across a cut). Otherwise only the newest chunk is
        kept, unparsed, and committed when the segment ends, fails or is cancelled: chunks are cumulative, so
        the newest one holds every token the engine sent and a failure loses nothing; the per-token cost is
        then a scan for the chunk's end, done by callbacks from the socket (stream_reader.py) for http URLs.
        """
        first = seg.start == 0 and len(log.segments) == 1  # the engine's chunks are the client's, verbatim
        stop_check = seg.start > 0 and bool(stop_strings(sp)) and self._tokenizer is not None
        eager = bool(self.observers) or stop_check or (
            on_progress is not None and not (first and on_chunk is not None))
        pending: Optional[bytes] = None  # lazy mode: the newest chunk, not yet committed
        prev: Optional[bytes] = None  # and the one before it, should the newest not parse

        async def apply(raw: bytes) -> Optional[dict]:
            chunk = parse_chunk(seg.url, raw)
            meta = chunk.get("meta_info") or {}
            before = log.committed
            if log.commit(seg, chunk.get("output_ids", []), meta.get("output_token_logprobs"),
                          meta.get("weight_version")):
                hit = self._stop_across_cut(log, sp, before, seg.start)
                if eager:
                    await self._progress(on_progress, log, seg)
                if hit is not None:
                    return hit
            fr = meta.get("finish_reason")
            return _checked(fr, seg) if fr else None

        async def flush() -> Optional[dict]:
            nonlocal pending, prev
            raw, fallback, pending, prev = pending, prev, None, None
            try:
                return await apply(raw) if raw is not None else None
            except StreamBroken:
                if fallback is None:
                    raise
                await apply(fallback)  # the newest did not parse: keep what the one before it holds
                raise

        def keep(newest: Optional[bytes], done: bool, n: int) -> None:  # lazy mode, per read: no parse
            nonlocal pending, prev
            if newest is not None:
                if seen is not None:
                    seen(n)
                pending, prev = newest, pending
                if on_chunk is not None and not done and first:
                    on_chunk(newest, log, seg)

        body = self._body(log, sp, seed, log.remaining, attempt)
        timeout = self.cfg.stall_timeout_s
        try:
            if not eager and stream_reader.supported(seg.url):
                # read by callbacks from the socket: no task woken per token (stream_reader.py); and at most
                # every recovery.stream_coalesce_ms unless a client reads the chunks as they come
                forwarding = on_chunk is not None and first
                await stream_reader.read_stream(seg.url, body, timeout, timeout, keep,
                                                0.0 if forwarding else self.cfg.stream_coalesce_ms / 1000)
            else:
                events = stream_events(self._stream_session(), seg.url, body, timeout=timeout, read_timeout=timeout)
                async with contextlib.aclosing(events):  # an early return closes the engine's stream at once
                    async for newest, done, n in events:
                        if newest is not None and eager:
                            if seen is not None:
                                seen(n)
                            fr = await apply(newest)
                            if fr is not None:
                                return fr
                        else:
                            keep(newest, done, n)
                        if done:
                            break
            fr = await flush()
            if fr is None:
                raise StreamBroken(seg.url, "stream ended with [DONE] but no finish_reason")
            return fr
        except GenerateError:
            if pending is not None:
                fr = await flush()  # the tokens it did send are kept; a finished chunk is a finished segment
                if fr is not None:
                    return fr
            raise
        except BaseException:  # cancelled (request timeout, client gone): commit what came, for the record
            if pending is not None:
                with contextlib.suppress(GenerateError):
                    await flush()
            raise

    def _stop_across_cut(self, log: ContextLog, sp: dict, before: int, engine_start: int) -> Optional[dict]:
        """When the engine's request began after `engine_start` > 0 committed tokens (a resumed segment, or
        any chunk after the first in chunked mode), the first new token at which the combined output text
        holds a stop string (the engine sees only its own output's text); truncates the log there and
        returns the finish reason."""
        stops = stop_strings(sp)
        if engine_start == 0 or not stops or self._tokenizer is None:
            return None
        ids = log.output_ids
        width = max(len(x) for x in stops) + 8  # tokens: each decodes to at least one byte
        for i in range(before + 1, log.committed + 1):
            lo = max(0, i - width)
            text = self._tokenizer.decode(ids[lo:i])
            hit = next((x for x in stops if x in text), None)
            if hit is not None and hit not in self._tokenizer.decode(ids[lo:i - 1]):
                log.truncate(i)
                return {"type": "stop", "matched": hit}
        return None

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


def _takes_hold(selector: Any) -> bool:
    try:
        return "hold" in inspect.signature(selector.pick).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


_ABORTED = "aborted by the engine"  # a pause or shutdown dropped the request: not an engine death
# Refused connections a request may meet per allowed attempt before it fails (each refused URL once until a
# replacement is picked; a selector that cannot exclude, e.g. a static list of dead URLs, stops here).
_MAX_REFUSALS_PER_ATTEMPT = 4


def _checked(fr: dict, seg: Segment) -> dict:
    if fr.get("type") == "abort":  # the engine dropped it (pause, shutdown): go on elsewhere
        raise GenerateError(seg.url, f"{_ABORTED}: {fr.get('message', '')}")
    return fr


async def _call_one(fn: Optional[ProgressFn], log: ContextLog, seg: Segment) -> None:
    if fn is not None:
        r = fn(log, seg)
        if inspect.isawaitable(r):
            await r
