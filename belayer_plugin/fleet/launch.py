"""Starts a fleet: N engine actors on Ray and the real sglang-router with every engine registered.

Owns: the model path, the run directory and a fleet without fault tolerance (`Fleet`: engines behind the
router). Must not: watch, restart or hand over (that is the FleetManager's).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from belayer_plugin.config import BelayerConfig, cache_dir
from belayer_plugin.engines.actor import EngineInfo, remote_engine_actor
from belayer_plugin.fleet.router import Router


def resolve_model_path(cfg: BelayerConfig) -> str:
    """The configured model, or the tiny model under the cache dir (built on first use)."""
    if cfg.engines.model_path:
        return str(Path(cfg.engines.model_path).expanduser().resolve())
    from belayer_plugin.engines.tiny_model import ensure_tiny

    return str(ensure_tiny(cache_dir(cfg) / "tiny-qwen2"))


def make_run_dir(cfg: BelayerConfig) -> Path:
    """The run's directory (logs, reports), created."""
    d = Path(cfg.run_dir) if cfg.run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    return d.resolve()


@dataclass
class EngineHandle:
    engine_id: str
    actor: Any
    info: EngineInfo


class Fleet:
    """Engine actors plus (in sglang_router mode) the router they are registered with."""

    def __init__(self, cfg: BelayerConfig, run_dir: Path, model_path: Optional[str] = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.model_path = model_path or resolve_model_path(cfg)
        self.engines: dict[str, EngineHandle] = {}
        self.router: Optional[Router] = None

    async def start_engine(self, engine_id: str, weight_version: str = "default") -> EngineHandle:
        """Creates one engine actor and waits until its server is healthy."""
        cls = remote_engine_actor(self.cfg.engines)
        actor = cls.remote(engine_id, self.cfg.engines, self.model_path, str(self.run_dir / "engines"), weight_version)
        info = await actor.start.remote()
        handle = EngineHandle(engine_id, actor, info)
        self.engines[engine_id] = handle
        return handle

    async def start(self) -> None:
        """Starts every engine concurrently, then the router, then registers each engine."""
        n = self.cfg.engines.num_engines
        await asyncio.gather(*(self.start_engine(f"engine-{i}") for i in range(n)))
        if self.cfg.router.mode == "sglang_router":
            self.router = Router(self.cfg.router, self.run_dir)
            await self.router.start()
            for h in self.engines.values():
                await self.router.add(h.info.url)

    @property
    def url(self) -> Optional[str]:
        """Where clients send /generate (the router), or None in direct mode."""
        return self.router.url if self.router else None

    async def shutdown(self) -> None:
        """Stops the router and every engine; safe to call twice."""
        import ray

        if self.router is not None:
            await self.router.aclose()
            self.router = None
        stops = [h.actor.stop.remote() for h in self.engines.values()]
        for ref in stops:
            try:
                await ref
            except ray.exceptions.RayActorError:
                pass  # already dead: nothing to stop
        for h in self.engines.values():
            ray.kill(h.actor, no_restart=True)
        self.engines.clear()
