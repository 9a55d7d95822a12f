"""Refit and weight versions: the fleet's current policy version, loading it into engines and verifying it.

Owns: `weights` (the fleet's version and where its weights are) and the rule that an engine serving any other
version is STALE or fenced, never routed. Covers Belayer's own refit (load from disk), refits the trainer
streams itself (begin/adopt/end_external_refit) and the refused-load retry after a cache flush. Must not: kill
or restart engines itself (a fenced engine goes to recovery through `_on_signal`), or release and resume engine
memory other than through fleet/phases.py (`_memory_call`, `_resume_tags`, `_back_to_serving`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Optional

from belayer_plugin.fleet.health import Signal, State
from belayer_plugin.fleet.slot import Phase, Slot, WeightVersionError, Weights


class Refit:
    """FleetManager's refit and weight versions (a mixin: state set up by `_init_refit`).

    Uses from the fleet: cfg, events, slots, monitor, shadows, holder, engine_model_path, phase,
    _standby_refit_due, _apply, _on_signal, _deregister, _try_register, _match_phase, _memory_call,
    _resume_tags, _back_to_serving, serving_slots, raise_if_fatal."""

    def _init_refit(self) -> None:
        self.weights = Weights()

    async def _make_current(self, s: Slot) -> None:
        """STALE -> HEALTHY once the engine verifiably serves the fleet's current version; then register."""
        if s.health.state is not State.STALE:
            return
        want = self.weights
        if s.served_version != want.version and want.external:
            # Only the trainer holds these weights: STALE (unrouted) until its next refit streams them here.
            # Meanwhile it follows the fleet's phase like the others: a replacement must not hold a full
            # engine's memory on a colocated GPU while the policy trains.
            await self._match_phase(s)
            self.events.emit("fleet", s.slot_id, "awaiting_weights", f"serves {s.served_version}; version "
                             f"{want.version} comes with the trainer's next refit", version=want.version,
                             released=sorted(s.released))
            return
        if s.served_version != want.version:
            ok = await self._update_weights(s, want)
            if not ok:
                return
        if want is not self.weights:  # a refit happened meanwhile: go again with the newer version
            return await self._make_current(s)
        await self._apply(s, Signal.WEIGHTS_CURRENT, f"serves weight version {s.served_version}")
        await self._match_phase(s)
        if s.health.state is State.HEALTHY:
            await self._try_register(s)
        elif s.health.state is State.SUSPECT:
            # A probe failed while the phase was matched (CI: a 0.5 s probe timeout under load): the slot was
            # left unregistered for good when its next probe turned it HEALTHY again. That HEALTHY registers it.
            s.register_when_healthy = True

    async def _update_weights(self, s: Slot, want: Weights) -> bool:
        """Loads `want` into the engine and checks the version it then reports; False if it failed."""
        path = want.path or self.engine_model_path
        try:
            if "weights" in s.released:
                # Weights must be resident to be replaced (SGLang: resume the weights, not yet the KV cache).
                await self._memory_call(s, "/resume_memory_occupation", ["weights"])
                s.released.discard("weights")
            r = await self._load_from_disk(s.actor, path, want.version)
            if r["status"] != 200:
                # SGLang loads the weights, then refuses to flush its prefix cache while a request is still in
                # its scheduler (one a client abandoned just before the refit, as a partial rollout's abort
                # does) and answers 400, keeping the old version label. That engine is healthy: once the
                # request has drained (the flush), the same load succeeds. Fencing it would cost a restart.
                self.events.emit("fleet", s.slot_id, "refit_refused", f"HTTP {r['status']}: {r['body']}"[:300],
                                 level="warning", version=want.version)
                if await self.flush_cache(s, self.cfg.engines.flush_cache_timeout_s):
                    r = await self._load_from_disk(s.actor, path, want.version)
            version = await asyncio.wait_for(s.actor.weight_version.remote(), self.cfg.monitor.liveness_timeout_s * 5)
        except Exception as e:  # the engine died mid-refit: liveness reports it; nothing to do here
            self.events.emit("fleet", s.slot_id, "refit_failed", f"{type(e).__name__}: {e}"[:300], level="warning",
                             version=want.version)
            return False
        s.served_version = version
        if r["status"] != 200 or version != want.version:
            self.events.emit("fleet", s.slot_id, "weight_version_mismatch",
                             f"expected {want.version}, engine reports {version} (HTTP {r['status']})",
                             level="error", expected=want.version, actual=version)
            return False
        return True

    async def _load_from_disk(self, actor: Any, path: str, version: str, timeout: Optional[float] = None) -> dict:
        # Bounded: a hung engine must not hold the refit (and the whole step) hostage.
        t = self.cfg.engines.startup_timeout_s if timeout is None else timeout
        return await asyncio.wait_for(actor.call.remote(
            "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": version}, t), t)

    async def flush_cache(self, s: Slot, timeout: float) -> bool:
        """Flushes the engine's prefix cache once its requests have drained, within `timeout` s; False if not.

        SGLang refuses a flush while any request runs or waits. Its `timeout` query makes the scheduler itself
        wait for idle (no polling); an engine that answers at once instead (the CPU engine, a flush already
        pending) is asked again with backoff until the deadline."""
        loop = asyncio.get_running_loop()
        end, delay = loop.time() + timeout, 0.05
        while True:
            left = end - loop.time()
            try:
                r = await asyncio.wait_for(s.actor.call.remote("POST", f"/flush_cache?timeout={max(left, 0):.3f}",
                                                               None, left + 5), left + 5)
                if isinstance(r, dict) and r.get("status") == 200:
                    return True
            except Exception:
                if s.actor is None or not s.health.serving:
                    return False  # it died: liveness and recovery take it from here
            if loop.time() + delay > end:
                return False
            await asyncio.sleep(delay)  # backoff between refusals, not synchronisation
            delay = min(delay * 2, 1.0)

    async def _update_weights_actor(self, actor: Any, want: Weights) -> bool:
        r = await self._load_from_disk(actor, want.path or self.engine_model_path, want.version, 600.0)
        return r["status"] == 200 and await actor.weight_version.remote() == want.version

    async def refit(self, weights_path: str, version: str) -> dict[str, str]:
        """Loads new policy weights into every engine and verifies each reports `version`.

        Engines that die meanwhile are restarted by recovery straight onto the new version; a live engine
        that does not serve it is an error event, deregistered and fenced (restarted onto it), never used.
        Returns {engine: version served}; raises WeightVersionError when no engine could load `version`.
        """
        self.raise_if_fatal()
        prev = self.phase
        self.phase = Phase.REFIT
        self.monitor.pause()
        if self.holder is not None:
            weights_path = await self.holder.publish.remote(weights_path, version)
        self.weights = Weights(version, weights_path)  # first: restarts racing with us pick it up
        self.events.emit("fleet", "fleet", "refit_begin", f"to {version}", version=version)
        targets = [s for s in self.slots.values() if s.health.state in (State.HEALTHY, State.SUSPECT)]
        # A slot whose engine died and was replaced (handover, restart) during the refit has a new incarnation
        # that its own path brought to this version: only the incarnation we tried to update can be stale.
        incarnations = {s.slot_id: s.health.incarnation for s in targets}
        results = await asyncio.gather(*(self._update_weights(s, self.weights) for s in targets))
        if self.shadows is not None:
            # Off the refit barrier: the trainer waits for the serving engines only. Paused, the standbys load
            # the version only once serving resumes (_back_to_serving): loading beside the serving engines'
            # refit, then beside their resume, it slowed the barrier on shared CPUs (~2.5%, then +14 ms of
            # resume per step: bench/overhead.py). Serving, they start now. A standby needed before it is
            # current is brought up to date by the handover itself (which settles a refit under way, then
            # checks the version).
            if prev in (Phase.SERVING, Phase.REFIT):
                self.shadows.refit_in_background(self.weights)
            else:
                self._standby_refit_due = True
        bad = []
        for s, ok in zip(targets, results):
            if not ok and s.health.state in (State.HEALTHY, State.SUSPECT) \
                    and s.health.incarnation == incarnations[s.slot_id]:
                alive = await self._alive(s)
                if alive:
                    # Never silent: the engine leaves the router and is fenced and restarted.
                    await self._deregister(s)
                    await self._apply(s, Signal.VERSION_MISMATCH, f"serves {s.served_version}, want {version}")
                    bad.append(s.slot_id)
                    await self._on_signal(s.slot_id, Signal.KILLED, s.health.incarnation, "stale after refit")
        self.phase = prev if prev is not Phase.REFIT else Phase.SERVING
        if self.phase is Phase.SERVING:
            self.monitor.resume()
        served = {sid: s.served_version for sid, s in self.slots.items() if s.health.serving}
        self.events.emit("fleet", "fleet", "refit_done", f"to {version}", version=version, engines=served,
                         mismatched=bad)
        if targets and not served:
            # Not one engine could load it: the weights, not the engines, are at fault.
            raise WeightVersionError(f"no engine could load weight version {version} from {weights_path}; "
                                     f"engines {bad} were fenced")
        return served

    async def _alive(self, s: Slot) -> bool:
        try:
            return bool(await asyncio.wait_for(s.actor.server_alive.remote(), self.cfg.monitor.liveness_timeout_s))
        except Exception:
            return False

    async def verify_versions(self) -> dict[str, str]:
        """Asks every serving engine for its version; a mismatch fences it (never silent)."""
        out = {}
        for s in self.serving_slots():
            try:
                v = await s.actor.weight_version.remote()
            except Exception:
                continue  # dying: liveness handles it
            out[s.slot_id] = v
            if v != self.weights.version:
                self.events.emit("fleet", s.slot_id, "weight_version_mismatch",
                                 f"expected {self.weights.version}, engine reports {v}", level="error")
                await self._deregister(s)
                await self._apply(s, Signal.VERSION_MISMATCH, f"serves {v}, want {self.weights.version}")
                await self._on_signal(s.slot_id, Signal.KILLED, s.health.incarnation, "stale weights")
        return out

    async def begin_external_refit(self) -> None:
        """The trainer streams weights itself next (NeMo-RL's refit): readiness probes stop (a long update
        must not look like a hang), Ray liveness stays on, weights memory comes back where it was released."""
        self.raise_if_fatal()
        self.phase = Phase.REFIT
        self.monitor.pause()
        await asyncio.gather(*(self._resume_tags(s, ["weights"]) for s in self.slots.values()
                               if s.actor is not None and s.info is not None), return_exceptions=True)
        self.events.emit("fleet", "fleet", "phase", self.phase.value, tags=["weights"])

    async def adopt_version(self, version: str, slot_ids: Iterable[str]) -> dict[str, str]:
        """The trainer streamed weight `version` into the engines of `slot_ids`: it becomes the fleet's current
        version. Each engine is asked what it serves: at `version` it is current (a STALE one turns HEALTHY and
        joins the router); otherwise it leaves the router and stays STALE until a refit reaches it (Belayer
        never loads other weights in its place). Returns {slot: version it reports}."""
        self.raise_if_fatal()
        self.weights = Weights(version, None, external=True)  # first: recoveries racing with us pick it up
        out: dict[str, str] = {}
        for sid in slot_ids:
            s = self.slots[sid]
            if s.info is None or not s.health.running:
                continue
            try:
                v = await asyncio.wait_for(s.actor.weight_version.remote(), self.cfg.monitor.liveness_timeout_s * 5)
            except Exception:
                continue  # dying: liveness reports it and recovery brings it back STALE
            out[sid] = s.served_version = v
            if v == version:
                await self._make_current(s)
        for s in self.serving_slots():  # never silent: whatever serves another version leaves the router
            if s.served_version != version:
                self.events.emit("fleet", s.slot_id, "weight_version_mismatch",
                                 f"expected {version}, engine reports {s.served_version}", level="error",
                                 expected=version, actual=s.served_version)
                await self._deregister(s)
                await self._apply(s, Signal.VERSION_MISMATCH, f"serves {s.served_version}, want {version}")
        self.events.emit("fleet", "fleet", "version_adopted", f"to {version}", version=version, engines=out,
                         stale=[sid for sid, s in self.slots.items() if s.health.state is State.STALE])
        return out

    async def end_external_refit(self) -> None:
        """After the trainer's refit: KV cache memory back where released, then serving with readiness probes."""
        await self._back_to_serving(["kv_cache"])
