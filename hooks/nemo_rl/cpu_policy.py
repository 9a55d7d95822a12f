"""What NeMo-RL's `refit_policy_generation` calls on the policy, on CPU (NeMo-RL's Policy needs CUDA).

Replaces exactly one GPU-only step of the refit: `Policy.stream_weights_via_http` (nemo_rl/models/policy/utils.py
`stream_weights_via_http_impl`). Kept from it: one Ray task per FSDP rank; rank r streams to engine
`r // num_gpus_per_engine` of `rollout_engine_urls`; `weight_version` is a per-worker counter sent as a string;
buckets are NeMo-RL's own FlattenedTensorBucket; the POST goes to `/update_weights_from_tensor` with the same
fields (`serialized_named_tensors`, `load_format="flattened_bucket"`, `flush_cache=False`, `weight_version`);
after streaming, `/flush_cache` is retried (1 s apart, up to 60 tries). Replaced: the CUDA IPC handles
(ForkingPickler of CUDA tensors, opened by an engine on the same GPU) by the tensor bytes themselves
(`encode_cpu_bucket`: torch.save of the flattened bucket, base64), and the Gloo gather across the TP ranks of
an engine by each engine's first rank sending the full tensors. Not for production use.

Owns: the CPU stand-in for NeMo-RL's policy refit calls. Must not: be used on a GPU run.
"""

from __future__ import annotations

import time
from typing import Any

import ray


@ray.remote(num_cpus=0)
def _stream_rank(state: dict, urls: list[str], per_engine: int, rank: int, version: int, buffer_bytes: int,
                 flush_tries: int) -> str:
    import httpx

    from belayer_plugin.engines.cpu_server import encode_cpu_bucket
    from belayer_plugin.hooks.nemo_rl.upstream import ensure_importable

    ensure_importable()  # a fresh Ray worker: NeMo-RL's source on its path too
    from nemo_rl.models.generation.sglang.utils.train_utils import FlattenedTensorBucket  # noqa: PLC0415

    url = next((u for i, u in enumerate(urls) if i * per_engine <= rank < (i + 1) * per_engine), None)
    if url is None:  # NeMo-RL's own failure when there are fewer URLs than ranks need
        raise RuntimeError(f"No rollout engine matched rank={rank} with num_gpus_per_engine={per_engine} and "
                           f"{len(urls)} engine URL(s)")
    if rank % per_engine:
        return url  # the engine's first rank posts (NeMo-RL gathers the TP ranks there)

    def post(bucket: list) -> None:
        b = FlattenedTensorBucket(named_tensors=bucket)
        meta = [{"name": m.name, "shape": list(m.shape), "dtype": str(m.dtype).removeprefix("torch."),
                 "start_idx": m.start_idx, "end_idx": m.end_idx} for m in b.get_metadata()]
        body = {"serialized_named_tensors": [encode_cpu_bucket(b.get_flattened_tensor(), meta)],
                "load_format": "flattened_bucket", "flush_cache": False, "weight_version": str(version)}
        # no timeout, as NeMo-RL's requests.post: an engine that hangs holds this rank (Belayer's gateway bounds it)
        r = httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=None)
        r.raise_for_status()
        if not r.json().get("success", True):
            raise RuntimeError(f"Weight sync failed on rollout engine: {r.json().get('message')}")

    bucket, size = [], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if bucket and size + n >= buffer_bytes:
            post(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        post(bucket)
    for _ in range(flush_tries):  # as NeMo-RL: the flush is refused while requests still run
        try:
            if httpx.get(f"{url}/flush_cache", timeout=None).status_code == 200:  # NeMo-RL: no timeout either
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"Timeout while flushing cache at {url}.")


class CpuStreamingPolicy:
    """The policy side of NeMo-RL's SGLang refit on CPU: `world_size` ranks holding `model`'s weights."""

    def __init__(self, model: Any, world_size: int, flush_tries: int = 60):
        self.model, self.world_size, self.flush_tries = model, world_size, flush_tries
        self.num_gpus_per_engine = 0
        self.weight_version = 0  # NeMo-RL's worker_state["weight_version"]
        self.calls: list[str] = []
        self.streamed_to: list[list[str]] = []

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        self.num_gpus_per_engine = num_gpus_per_engine
        self.calls.append("set_rollout_num_gpus_per_engine")

    def offload_before_refit(self) -> None:
        self.calls.append("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")

    def get_free_memory_bytes(self) -> int:
        return 1 << 30

    def stream_weights_via_http(self, rollout_engine_urls: list[str], buffer_size_bytes: int) -> list:
        assert self.num_gpus_per_engine, "stream_weights_via_http called before set_rollout_num_gpus_per_engine"
        self.calls.append("stream_weights_via_http")
        self.weight_version += 1
        self.streamed_to.append(list(rollout_engine_urls))
        state = ray.put({n: t.detach().clone() for n, t in self.model.state_dict().items()})
        return [_stream_rank.remote(state, list(rollout_engine_urls), self.num_gpus_per_engine, r,
                                    self.weight_version, buffer_size_bytes, self.flush_tries)
                for r in range(self.world_size)]
