"""Phases and memory: serving, paused, released (engine memory given to the trainer) and refit.

Owns: `phase` (a refit sets REFIT for its duration: fleet/refit.py), `memory_released`, `_standby_refit_due`,
and each slot's `released` memory tags (SGLang dies when asked to resume a tag it does not hold released).
Must not: load weights or act on health; readiness probes are paused and resumed through the monitor only.
"""

from __future__ import annotations

import asyncio

from belayer_plugin.fleet.slot import Phase, Slot


class Phases:
    """FleetManager's phases and memory (a mixin: state set up by `_init_phases`).

    Uses from the fleet: cfg, ft, events, slots, monitor, shadows, weights, flush_cache (fleet/refit.py),
    _abort_all (fleet/planned.py)."""

    def _init_phases(self) -> None:
        self.phase = Phase.SERVING
        self.memory_released = False  # engines' weights and KV cache released (trainer holds the memory)
        self._standby_refit_due = False  # a refit while paused: the standbys load it once serving resumes

    async def pause(self, release_memory: bool = False) -> None:
        """Leaves the serving phase (readiness probes stop; liveness keeps watching)."""
        self.monitor.pause()
        self.phase = Phase.RELEASED if release_memory else Phase.PAUSED
        self.memory_released = release_memory
        if release_memory:  # every engine, STALE ones too (a replacement awaiting the trainer's weights)
            await self.monitor.generate_probes_settled(self.cfg.monitor.probe_timeout_s + 1.0)
            await asyncio.gather(*(self._idle_then_release(s) for s in self.slots.values()
                                   if s.actor is not None and s.health.running),
                                 return_exceptions=True)
        self.events.emit("fleet", "fleet", "phase", self.phase.value)

    async def _memory_call(self, s: Slot, path: str, tags: list[str]) -> dict:
        """A memory release or resume on the engine; probes it holds up are excused (monitor.control_call)."""
        with self.monitor.control_call(s.slot_id):
            return await s.actor.call.remote("POST", path, {"tags": tags})

    async def _idle_then_release(self, s: Slot) -> None:
        """Releases the engine's memory once nothing runs on it. SGLang asserts its scheduler is idle on a
        release and dies otherwise; the CPU engine refuses and counts it (`release_not_idle`). What is left
        after the generation phase (a straggler, a probe whose answer the monitor gave up on) gets
        monitor.probe_timeout_s to finish, then is aborted."""
        if "kv_cache" not in s.released and not await self.flush_cache(s, self.cfg.monitor.probe_timeout_s):
            self.events.emit("fleet", s.slot_id, "aborted_before_release",
                             "requests still on the engine when its memory was to be released", level="warning")
            await self._abort_all(s)
        await self._release(s, ["kv_cache", "weights"])

    async def _release(self, s: Slot, tags: list[str]) -> None:
        """Releases those of `tags` this engine still holds (a replacement released by _match_phase is not
        released twice by the pause that follows)."""
        want = [t for t in tags if t not in s.released]
        if not want:
            return
        r = await self._memory_call(s, "/release_memory_occupation", want)
        if r.get("status") != 200:  # still holds it: a later resume must not ask for it (SGLang dies on that)
            self.events.emit("fleet", s.slot_id, "release_failed", f"tags {want}: HTTP {r.get('status')}: "
                             f"{str(r.get('body'))[:200]}", level="warning", tags=want)
            return
        s.released.update(want)

    async def _resume_tags(self, s: Slot, tags: list[str]) -> None:
        """Resumes those of `tags` that this engine holds released (never one it does not: see Slot.released)."""
        want = [t for t in tags if t in s.released]
        if want:
            r = await self._memory_call(s, "/resume_memory_occupation", want)
            if r.get("status") != 200:
                self.events.emit("fleet", s.slot_id, "resume_failed", f"tags {want}: HTTP {r.get('status')}",
                                 level="warning", tags=want)
                return
            s.released.difference_update(want)

    async def resume(self) -> None:
        """Back to serving: resumes memory where released, then readiness probes."""
        await self._back_to_serving(["kv_cache", "weights"])

    async def _back_to_serving(self, tags: list[str]) -> None:
        """Resumes the released memory named by `tags` (where it was released), then serving with readiness
        probes. The `phase` event carries the tags resumed."""
        await asyncio.gather(*(self._resume_tags(s, tags) for s in self.slots.values()
                               if s.actor is not None and s.info is not None), return_exceptions=True)
        self.phase = Phase.SERVING
        self.memory_released = False
        if self.ft:
            self.monitor.resume()
        self.events.emit("fleet", "fleet", "phase", self.phase.value, tags=tags)
        if self._standby_refit_due and self.shadows is not None:
            self._standby_refit_due = False
            self.shadows.refit_in_background(self.weights)

    async def _match_phase(self, s: Slot) -> None:
        """A replacement joins in the fleet's phase (e.g. memory released while the trainer trains)."""
        if self.memory_released and self.phase is not Phase.REFIT:
            try:
                await self._release(s, ["kv_cache", "weights"])
            except Exception as e:  # it died again: Ray liveness reports it and recovery goes on
                self.events.emit("fleet", s.slot_id, "release_failed", f"{type(e).__name__}"[:200], level="warning")
