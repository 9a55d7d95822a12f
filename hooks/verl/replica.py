"""A verl rollout replica kind whose servers are Belayer engines: `actor_rollout_ref.rollout.name=belayer`.

Registered in verl's `RolloutReplicaRegistry` when the hook is imported. Each replica runs one
`BelayerServer` Ray actor, a verl server actor (verl's `generate(request_id, prompt_ids, sampling_params)`
returning `TokenOutput`, `sleep` / `wake_up`, `abort_all_requests` / `resume_generation`, the kv-cache calls
and `set_global_steps`) in front of one Belayer engine process (the CPU engine here; the engine dies with its
actor). `rollout.custom.belayer_contract` picks which of verl's server contracts it speaks: `vllm` (verl's
vLLM server: `stop_reason="completed"` for stop and length, `"aborted"`, `num_cached_tokens`) or `sglang`
(SGLang's finish reason as is). `rollout.custom.belayer` is a Belayer section for the engines (kind, step delay).

With fault tolerance on (in `rollout.custom.belayer`), the replica's lifecycle calls never raise for a server
that died: they note it (`dead`) and skip it, so a trainer that gathers over all replicas (verl's own
CheckpointEngineManager, v1) does not fail on it; Belayer's recovery (hooks/verl/recovery.py) restarts it
through `launch_servers`. Off, they raise as verl's replicas do.

Owns: the `belayer` replica kind and this process's current recovery. Must not: import hooks/verl/recovery.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
import weakref
from typing import Any, Optional

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from belayer_plugin.config import BelayerConfig, EnginesConfig, cache_dir
from belayer_plugin.hooks._config import belayer_section

log = logging.getLogger("belayer.hooks.verl")

CONTRACTS = ("vllm", "sglang")
_replicas: "weakref.WeakSet[BelayerReplica]" = weakref.WeakSet()  # this process's replicas (for recovery)


class BelayerServer:
    """A verl server actor over one Belayer engine process (see the module doc)."""

    def __init__(self, name: str, engines: EnginesConfig, model_path: str, log_dir: str, contract: str,
                 global_steps: Optional[int] = None):
        from belayer_plugin.engines.actor import EngineActor

        self.name, self.contract, self.global_steps = name, contract, global_steps
        self.engine = EngineActor(name, engines, model_path, log_dir,
                                  weight_version="default" if global_steps is None else str(global_steps))
        self.open = asyncio.Event()  # closed by abort_all_requests until resume_generation
        self.open.set()
        self.reject = False
        self.asleep = False
        self.client: Any = None
        self.seq = 0
        self.served = 0  # tokens served so far (tests await progress with wait_served)
        self.running: dict[str, str] = {}  # verl request id -> the engine's request id, while it runs
        self._progress = asyncio.Condition()

    async def start(self) -> str:
        """Starts the engine; returns its address."""
        import httpx

        info = await self.engine.start()
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))
        return info.url

    def pid(self) -> int:
        return os.getpid()

    async def get_global_steps(self) -> Optional[int]:
        return self.global_steps

    async def wait_served(self, n: int) -> int:
        """Returns once `n` more tokens than now have been served (an event to await, e.g. for a fault)."""
        target = self.served + n
        async with self._progress:
            await self._progress.wait_for(lambda: self.served >= target)
        return self.served

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        if not self.open.is_set():  # a weight sync closed the gate: park (or refuse) as verl's servers do
            if self.reject:
                return self._aborted()
            await self.open.wait()
        if self.asleep:
            raise RuntimeError(f"{self.name} is asleep")
        sp = {k: v for k, v in sampling_params.items() if v is not None}
        want_lp = bool(sp.pop("logprobs", False))
        sp["max_new_tokens"] = int(sp.pop("max_tokens", sp.get("max_new_tokens", 128)))
        if sp.get("top_k") == -1:
            sp.pop("top_k")
        if "seed" in sp:
            sp["sampling_seed"] = sp.pop("seed")
        self.seq += 1
        body = {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": want_lp,
                "rid": f"{request_id}-{self.seq}"}
        self.running[request_id] = body["rid"]
        try:
            r = await self.client.post(f"{self.engine.url}/generate", json=body, timeout=None)
        finally:
            self.running.pop(request_id, None)
        r.raise_for_status()
        out = r.json()
        meta = out["meta_info"]
        fr = (meta.get("finish_reason") or {}).get("type")
        ids = list(out["output_ids"])
        lps = [x[0] for x in meta.get("output_token_logprobs") or []] if want_lp else None
        async with self._progress:
            self.served += len(ids)
            self._progress.notify_all()
        extra: dict[str, Any] = {"global_steps": self.global_steps}
        if self.contract == "vllm":  # verl's vLLM server: stop and length are both "completed"
            reason = "aborted" if fr == "abort" else "completed"
            extra["num_cached_tokens"] = int(meta.get("cached_tokens") or 0)
        else:
            reason = fr
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason=reason, extra_fields=extra)

    def _aborted(self) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted" if self.contract == "vllm" else "abort",
                           extra_fields={"global_steps": self.global_steps})

    async def _post(self, path: str, body: Optional[dict] = None) -> None:
        r = await self.client.post(f"{self.engine.url}{path}", json=body or {}, timeout=60)
        r.raise_for_status()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """verl's vLLM server call: aborts one request on the engine (its partial output is discarded)."""
        rid = self.running.get(request_id)
        if rid is None:
            return {"aborted": False, "request_id": request_id, "error": "Request not found"}
        r = await self.client.post(f"{self.engine.url}/abort_request", json={"rid": rid}, timeout=60)
        r.raise_for_status()
        return {"aborted": True, "request_id": request_id}

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.open.clear()
        self.reject = reject_request
        await self._post("/abort_request", {"abort_all": True})

    async def resume_generation(self) -> None:
        self.reject = False
        self.open.set()

    async def sleep(self) -> None:
        self.asleep = True
        await self._post("/release_memory_occupation")

    async def wake_up(self) -> None:
        await self._post("/resume_memory_occupation")
        self.asleep = False

    async def release_kv_cache(self) -> None:
        await self._post("/flush_cache")

    async def resume_kv_cache(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        await self._post("/flush_cache")

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps
        await self._post("/update_weight_version", {"new_version": str(global_steps)})

    async def load_weights(self, global_steps: int) -> None:
        """The trainer's weight push on CPU: wakes the server and makes it serve `global_steps`."""
        if self.asleep:
            await self.wake_up()
        await self.set_global_steps(global_steps)


_current: Any = None  # this process's ReplicaRecovery (set by Belayer's agent loop manager)


def current_recovery() -> Any:
    """This process's ReplicaRecovery (hooks/verl/recovery.py), or None."""
    return _current


def set_current_recovery(rec: Any) -> None:
    """The recovery the trainer process's checkpoint manager uses (Belayer's agent loop manager sets it)."""
    global _current
    _current = rec


class BelayerReplica(RolloutReplica):
    """verl's RolloutReplica with one BelayerServer (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        custom = dict(self.config.custom or {})
        contract = custom.get("belayer_contract", "vllm")
        if not isinstance(contract, str):  # one per replica rank (tests run both contracts side by side)
            contract = list(contract)[self.replica_rank % len(contract)]
        self.contract = str(contract)
        if self.contract not in CONTRACTS:
            raise ValueError(f"actor_rollout_ref.rollout.custom.belayer_contract: one of {CONTRACTS}, "
                             f"got {self.contract!r}")
        self.belayer: BelayerConfig = belayer_section(custom.get("belayer"),
                                                      path="actor_rollout_ref.rollout.custom.belayer")
        self.dead: Optional[str] = None  # why the server is gone, once a lifecycle call found it so
        self.incarnation = 0
        self.belayer_owner: Optional[int] = None  # the agent loop manager that heals it (one per run)

    async def init_standalone(self) -> None:
        """Standalone replica on CPU: no GPU resource pool, the server actor only."""
        self.rollout_mode = RolloutMode.STANDALONE
        self.workers = []
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """Starts (or, after a death, restarts) this replica's server; verl's replica API for both."""
        mc = self.model_config
        model = (mc.get("local_path") if hasattr(mc, "get") else getattr(mc, "local_path", None)) or \
            (mc.get("path") if hasattr(mc, "get") else mc.path)
        log_dir = str(cache_dir(self.belayer) / "verl-replicas")
        steps = None  # a restarted server serves nothing current until the next weight sync
        if self._server_handle is not None and self.dead is None:
            try:
                steps = await self._server_handle.get_global_steps.remote()
            except ray.exceptions.RayActorError:
                self.dead = "server actor gone"
        self.incarnation += 1
        name = f"belayer_replica_{self.replica_rank}{self.name_suffix}_{self.incarnation}_{uuid.uuid4().hex[:6]}"
        handle = ray.remote(BelayerServer).options(
            name=name, num_cpus=0, max_restarts=0, max_task_retries=0,
            max_concurrency=self.max_concurrency).remote(name, self.belayer.engines, str(model), log_dir,
                                                         self.contract, steps)
        address = await handle.start.remote()
        self.servers, self._server_handle, self._server_address = [handle], handle, address
        self.dead = None

    async def _each(self, method: str, **kwargs: Any) -> None:
        async def one(server: Any) -> bool:
            try:
                await getattr(server, method).remote(**kwargs)
                return True
            except ray.exceptions.RayActorError as e:
                if not self.belayer.use_fault_tolerance:
                    raise  # off: verl's behaviour, the caller's gather fails
                self.dead = f"{type(e).__name__} in {method}"
                log.warning("replica %s: server gone (%s)", self.replica_rank, self.dead)
                return False

        if all(await asyncio.gather(*(one(s) for s in self.servers))):
            return
        # verl's v1 trainer keeps this object in its own CheckpointEngineManager (no option to replace it):
        # restart in place now, so its next call (the weight sync) reaches a live server; the new server stays
        # out of the balancer (STALE) until it serves the current weights (Belayer's agent loop manager admits it).
        rec = current_recovery()  # one call per replica at a time (verl gathers over replicas), so no lock
        if rec is not None and self.dead is not None and await rec.restart(self, self.dead):
            await asyncio.gather(*(getattr(s, method).remote(**kwargs) for s in self.servers))

    async def wake_up(self) -> None:
        await self._each("wake_up")

    async def sleep(self) -> None:
        await self._each("sleep")

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self._each("abort_all_requests", reject_request=reject_request)

    async def resume_generation(self) -> None:
        await self._each("resume_generation")

    async def clear_kv_cache(self) -> None:
        await self._each("clear_kv_cache")

    async def release_kv_cache(self) -> None:
        await self._each("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._each("resume_kv_cache")


def replicas_in_process() -> list[RolloutReplica]:
    """The rollout replicas built in this process (the trainer's), of every kind (verl's vLLMReplica and
    SGLangReplica as well as Belayer's), for recovery without trainer code. Reward and teacher replicas are
    left out: they serve other models, which Belayer's recovery does not track."""
    return sorted((r for r in _replicas if not (getattr(r, "is_reward_model", False) or
                                                 getattr(r, "is_teacher_model", False))),
                  key=lambda r: r.replica_rank)


def track_replicas() -> None:
    """Records every RolloutReplica built in this process from now on (idempotent).

    verl's trainers keep their replicas inside LLMServerManager and CheckpointEngineManager and hand Belayer
    neither; the plugin is imported at `import verl`, before any replica exists, so wrapping the base class's
    constructor sees every replica of the run without a change to verl's code or the user's."""
    init = RolloutReplica.__init__
    if getattr(init, "_belayer_tracked", False):
        return

    def __init__(self: RolloutReplica, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _replicas.add(self)

    __init__._belayer_tracked = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    RolloutReplica.__init__ = __init__  # type: ignore[method-assign]


async def drop_servers(replica: RolloutReplica, timeout_s: float) -> None:
    """Kills what is left of a replica's server actors and empties its server list, so that verl's own
    `launch_servers` starts a complete new set.

    verl's vLLMReplica and SGLangReplica *append* to `servers` and then ask `servers[0]` (the dead actor) for
    the master address, so a relaunch over the old list can never succeed. Their actors are named
    (`vllm_server_<rank>_<node>`): a new one can take the name only once the old actor is gone, so this waits
    (up to `timeout_s`) until Ray reports each of them dead."""
    old = list(replica.servers)
    for s in old:
        try:
            ray.kill(s, no_restart=True)
        except Exception:  # noqa: BLE001  (already gone)
            pass

    async def gone(s: Any) -> None:
        try:
            await s.__ray_ready__.remote()
        except ray.exceptions.RayActorError:
            return
        # ray.kill is asynchronous: a call that still answered means the kill has not landed yet
        while True:
            try:
                await asyncio.wait_for(s.__ray_ready__.remote(), 1.0)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError):
                return
            await asyncio.sleep(0.05)  # bounded by the caller's wait_for

    if old:
        await asyncio.wait_for(asyncio.gather(*(gone(s) for s in old)), timeout_s)
    replica.servers = []
    replica._server_handle = None
    replica._server_address = None


def forget_server_handles(worker: Any) -> int:
    """Run inside a rollout worker actor (`__ray_call__`): drops the server handle verl's ServerAdapter cached
    (`_ensure_server_handle` looks the named server actor up once), so its next call finds the restarted
    server by name. Returns how many adapters it reset."""
    from verl.workers.rollout.base import BaseRollout

    seen: set[int] = set()
    n = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal n
        if depth > 3 or id(obj) in seen or not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        if isinstance(obj, BaseRollout) and hasattr(obj, "server_handle"):
            obj.server_handle = None
            n += 1
            return
        for v in list(vars(obj).values()):
            if isinstance(v, dict):
                for x in v.values():
                    visit(x, depth + 1)
            else:
                visit(v, depth + 1)

    visit(worker, 0)
    return n


def register() -> None:
    """Makes `actor_rollout_ref.rollout.name=belayer` resolve to BelayerReplica and starts tracking every
    replica this process builds (idempotent)."""
    RolloutReplicaRegistry.register("belayer", lambda: BelayerReplica)
    track_replicas()
