"""A verl 0.9.1 load balancer (RequestLoadBalancer protocol) that evicts dead servers and admits recovered ones.

verl builds it in a Ray actor as `BelayerLoadBalancer(servers, yaml_config)` when the rollout config names
`router_config_path` with `router_class: belayer_plugin.hooks.verl.BelayerLoadBalancer`. Routing is verl's
own (sticky by request id, then least in-flight); Belayer adds membership:

- evict: a client that saw a server fail calls `report_failure`; the server leaves the pool when Ray says its
  actor is gone (ActorDiedError, or not ready within monitor.liveness_timeout_s). A live server whose request
  failed stays (the request resumes elsewhere; the fleet decides about the engine).
- admit: `add_servers` admits a server only once its actor answers Ray's readiness call (waiting up to
  engines.startup_timeout_s), so a half-started or dead replacement never gets traffic. The Belayer fleet bridge (`attach_fleet`) calls it for restarted engines.
- `acquire_server(..., exclude=, wait_s=)` lets a resuming request skip the server that failed it and wait
  (bounded) for a replacement when the pool is empty.
- step metrics: every eviction of an admitted server counts one `engine_deaths_detected`, and the clients in
  verl's agent loop workers add their requests' recovery counts (`add_step_metrics`); Belayer's agent loop
  manager takes them once per step (`take_step_metrics`, see hooks/verl/step_metrics.py).
- `rollout.full_determinism` and `belayer.use_fault_tolerance` (verl passes neither to router plugins, and
  command-line overrides never reach the router YAML: Belayer's agent loop manager calls `configure` with the
  trainer's values at start-up): a new request goes to the server
  its request id hashes to (a hash that is the same in every process and run, unlike Python's `hash`), whatever
  the load; with fault tolerance off, verl's own formula.

Owns: the balancer's view of which servers are admitted. Must not: restart servers (hooks/verl/recovery.py
does).
"""

from __future__ import annotations

import asyncio
import logging
import random
import zlib
from collections import OrderedDict
from typing import Any, Optional

log = logging.getLogger("belayer.hooks.verl")

NO_SERVERS = "No available servers in load balancer"  # verl's own message (its clients match on it)


class BelayerLoadBalancer:
    def __init__(self, servers: dict[str, Any], config: Optional[dict] = None):
        from belayer_plugin.hooks._config import belayer_section
        from belayer_plugin.metrics import StepMetrics

        config = dict(config or {})
        self.cfg = belayer_section(config.get("belayer"))
        self.ft = self.cfg.use_fault_tolerance
        self.max_sticky = int(config.get("max_cache_size", 10000))
        self.full_determinism = bool(config.get("full_determinism", False))
        self._servers: dict[str, Any] = dict(servers)
        self._inflight: dict[str, int] = {sid: 0 for sid in servers}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._evicted: dict[str, str] = {}  # server id -> why
        self._rejected: dict[str, str] = {}  # server id -> why it was not admitted
        self._changed: Optional[asyncio.Condition] = None
        self._step_metrics = StepMetrics()  # since the last take_step_metrics (one process collects them all)

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    # ------------------------------------------------------------------ verl's protocol
    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    async def acquire_server(self, request_id: str, exclude: Optional[list[str]] = None,
                             wait_s: float = 0.0, **extra: Any) -> tuple[str, Any]:
        """Sticky, then least in-flight, among admitted servers not in `exclude`; waits up to `wait_s` for one."""
        skip = set(exclude or ())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_s)
        while True:
            sid = self._sticky.get(request_id)
            if sid is None or sid not in self._inflight or sid in skip:
                cands = [s for s in self._inflight if s not in skip]
                if cands and self.full_determinism:
                    sid = (sorted(cands)[zlib.crc32(request_id.encode()) % len(cands)] if self.ft
                           else cands[hash(request_id) % len(cands)])  # off: verl's GlobalRequestLoadBalancer
                elif cands:
                    low = min(self._inflight[s] for s in cands)
                    sid = random.choice([s for s in cands if self._inflight[s] == low])
                else:
                    sid = None
            if sid is not None:
                self._sticky[request_id] = sid
                self._sticky.move_to_end(request_id)
                while len(self._sticky) > self.max_sticky:
                    self._sticky.popitem(last=False)
                self._inflight[sid] += 1
                return sid, self._servers[sid]
            left = deadline - loop.time()
            if left <= 0:
                raise RuntimeError(f"{NO_SERVERS} (excluded: {sorted(skip)}; evicted: {self._evicted})")
            async with self._cond():  # woken by add_servers
                try:
                    await asyncio.wait_for(self._cond().wait(), left)
                except asyncio.TimeoutError:
                    pass

    def release_server(self, server_id: str, request_id: Optional[str] = None) -> None:
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1

    async def add_servers(self, servers: dict[str, Any]) -> list[str]:
        """Admits each server whose actor is ready (in parallel); returns the ids admitted."""
        ids = list(servers)
        if self.ft:
            wait = self.cfg.engines.startup_timeout_s  # a replacement may still be starting its worker
            ready = await asyncio.gather(*(self._ready(servers[s], wait) for s in ids))
        else:
            ready = [None] * len(ids)
        admitted = []
        for sid, why_not in zip(ids, ready):
            if why_not:
                self._rejected[sid] = why_not
                log.warning("not admitting %s: %s", sid, why_not)
                continue
            self._servers[sid] = servers[sid]
            self._inflight.setdefault(sid, 0)
            self._evicted.pop(sid, None)
            self._rejected.pop(sid, None)
            admitted.append(sid)
        await self._notify()
        return admitted

    def remove_servers(self, server_ids: list[str]) -> None:
        for sid in server_ids:
            self._inflight.pop(sid, None)
            self._servers.pop(sid, None)

    def get_all_servers(self) -> list[str]:
        return list(self._inflight)

    def clear_sticky_cache(self) -> dict:
        n = len(self._sticky)
        self._sticky.clear()
        return {"cleared_entries": n, "server_loads": dict(self._inflight)}

    def get_status(self) -> dict:
        return {"servers": dict(self._inflight), "total_inflight": sum(self._inflight.values()),
                "active_servers": len(self._inflight), "registered_handles": list(self._servers),
                "evicted": dict(self._evicted), "rejected": dict(self._rejected),
                "use_fault_tolerance": self.ft, "full_determinism": self.full_determinism}

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    # ------------------------------------------------------------------ Belayer's additions
    def set_full_determinism(self, enabled: bool) -> None:
        """`rollout.full_determinism`: route new requests by a stable hash of their id (see the module doc)."""
        self.full_determinism = bool(enabled)

    def configure(self, use_fault_tolerance: bool, full_determinism: bool) -> dict:
        """The trainer's settings (Belayer's agent loop manager calls it at start-up): its
        `belayer.use_fault_tolerance`, command-line toggles included, wins over the router YAML's, which verl
        reads from a file the trainer's overrides never reach. Returns get_status()."""
        if use_fault_tolerance != self.ft:
            log.warning("belayer.use_fault_tolerance=%s from the trainer's config (the router YAML says %s)",
                        use_fault_tolerance, self.ft)
        self.ft = bool(use_fault_tolerance)
        self.set_full_determinism(full_determinism)
        return self.get_status()

    async def report_failure(self, server_id: str, reason: str) -> bool:
        """A request failed on `server_id`: evicts it if its actor is gone; returns whether it was evicted."""
        handle = self._servers.get(server_id)
        if handle is None or not self.ft:
            return False
        why = await self._ready(handle, self.cfg.monitor.liveness_timeout_s)
        if why is None:
            return False  # alive: the request resumes elsewhere, the server keeps serving others
        self.evict(server_id, f"{reason}; {why}")
        return True

    def evict(self, server_id: str, reason: str) -> None:
        if server_id in self._inflight:  # counted once per server, whoever reports it first
            log.warning("evicting %s: %s", server_id, reason)
            self._step_metrics.add({"engine_deaths_detected": 1})
        self._evicted[server_id] = reason[:300]
        self.remove_servers([server_id])

    def add_step_metrics(self, counts: dict[str, float]) -> None:
        """Recovery counts from a client or agent loop in another process (StepMetrics names)."""
        self._step_metrics.add(counts)

    def take_step_metrics(self) -> dict[str, float]:
        """The counts since the last call (then reset), keyed `belayer/<name>`."""
        return self._step_metrics.take()

    async def _ready(self, handle: Any, timeout: float) -> Optional[str]:
        """None if the actor answers Ray's readiness call in time, else why not (Ray liveness, no HTTP)."""
        import ray

        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), timeout)
            return None
        except ray.exceptions.RayActorError as e:  # ActorDiedError and ActorUnavailableError
            return f"actor gone: {type(e).__name__}"
        except asyncio.TimeoutError:
            return f"actor not ready within {timeout:g} s"
