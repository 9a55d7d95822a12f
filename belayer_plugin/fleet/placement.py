"""Node evidence and placement: which Ray nodes may host engines and standbys, and where a new one goes.

Owns: the node-health record (`nodes`, fleet/nodes.py decides), the deaths absolved as a poison request's
(`_absolved`), the bounded node checks (`_node_checks`) and the trainer's per-actor Ray options
(`actor_options`). Must not: start, stop or signal engines, or touch the router; it only emits node events and
answers placement questions for the fleet's recovery, scale-out and shadow pool.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from belayer_plugin.fleet.nodes import Death, NodeHealth, Verdict


class Placement:
    """FleetManager's node evidence and placement (a mixin: state set up by `_init_placement`).

    Uses from the fleet: cfg, events, slots, shadows, policy (refunds), _closing, _bg."""

    def _init_placement(self) -> None:
        cfg = self.cfg
        self.nodes = NodeHealth(cfg.restart.node_exclusion_slots, cfg.shadow.fault_window_s,
                                cfg.restart.node_exclusion_decay_s)
        self._absolved: set[tuple[str, int]] = set()  # (slot, incarnation) deaths a poison request caused
        self._node_checks: dict[str, asyncio.Task] = {}
        # Extra Ray options per engine or standby id (e.g. a trainer's placement group bundle); None: none.
        self.actor_options: Optional[Callable[[str], dict]] = None

    @property
    def excluded_nodes(self) -> set[str]:
        """Ray nodes that may not host engines now (node evidence; see fleet/nodes.py)."""
        for n in self.nodes.decay(time.monotonic()):
            self.events.emit("fleet", n, "node_readmitted",
                             f"exclusion decayed after restart.node_exclusion_decay_s="
                             f"{self.cfg.restart.node_exclusion_decay_s:g} s")
        return set(self.nodes.excluded)

    def readmit_node(self, node: str) -> bool:
        """Lifts a node's exclusion by hand (e.g. after the machine was repaired); True if it was excluded."""
        ok = self.nodes.readmit(node)
        if ok:
            self.events.emit("fleet", node, "node_readmitted", "re-admitted by hand")
        return ok

    def exclusions(self) -> dict[str, str]:
        """{node: why it is excluded}, for reports."""
        return {n: why for n, (_, why) in self.nodes.excluded.items()}

    async def alive_nodes(self) -> list[str]:
        """The ids of the Ray nodes alive now, as the GCS reports them."""
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        return sorted(n["NodeID"] for n in nodes if n.get("Alive"))

    async def placement(self, role: str) -> dict:
        """Ray options placing a new engine ("engine") or standby ("standby") on a node that may host it.

        Nothing is pinned while no node is excluded (Ray places it), except standbys with
        shadow.placement=spread, which go to the alive node with the fewest standbys, then engines.
        """
        excluded = self.excluded_nodes
        spread = role == "standby" and self.cfg.shadow.placement == "spread"
        if not excluded and not spread:
            return {}
        admitted = [n for n in await self.alive_nodes() if n not in excluded]
        # A node whose actor just became unreachable is not chosen while Ray's verdict on it is pending
        # (restart.node_check_timeout_s): a lost node stays alive in the GCS for seconds, and a standby pinned
        # there dies at once and spends the pool's restart budget.
        pending = {n for n, t in self._node_checks.items() if not t.done()}
        allowed = [n for n in admitted if n not in pending] or admitted
        if not allowed:
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        load = {n: [0, 0] for n in allowed}
        for s in self.slots.values():
            if s.info is not None and s.info.node_id in load:
                load[s.info.node_id][1] += 1
        for node in (self.shadows.nodes() if self.shadows is not None else []):
            if node in load:
                load[node][0] += 1
        node = min(allowed, key=lambda n: (load[n] if spread else load[n][::-1], n))
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def actor_env(self) -> dict:
        """Ray options passing chaos-only switches to CPU engines (never without chaos.enabled)."""
        c = self.cfg.chaos
        if c.enabled and c.poison_token_id >= 0 and self.cfg.engines.kind == "cpu":
            return {"runtime_env": {"env_vars": {"BELAYER_CHAOS_POISON_TOKEN_ID": str(c.poison_token_id)}}}
        return {}

    async def actor_opts(self, sid: str, role: str) -> dict:
        """All Ray options for a new engine or standby: a trainer's own options for that id (`actor_options`)
        win over Belayer's placement; none (or empty) lets Belayer place it."""
        extra = self.actor_options(sid) if self.actor_options else {}
        if extra:
            return {**extra, **self.actor_env()}
        try:
            return {**await self.placement(role), **self.actor_env()}
        except Exception:  # the GCS did not answer: let Ray place it
            return self.actor_env()

    def note_death(self, node: str, position: str, incarnation: int, rids: frozenset = frozenset()) -> None:
        """Feeds one engine or standby death into node health; excludes the node on node evidence."""
        if (position, incarnation) in self._absolved or not node or self._closing:
            return
        t = asyncio.ensure_future(self._note_death(Death(node, position, incarnation, time.monotonic(), rids)))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _note_death(self, d: Death) -> None:
        try:
            hosts = await self.alive_nodes()
        except Exception:  # GCS unreachable: no verdict now (never exclude on missing information)
            return
        if (d.position, d.incarnation) in self._absolved:
            return
        self._verdict(self.nodes.record_death(d, hosts))

    def _verdict(self, v: Optional[Verdict]) -> None:
        if v is None:
            return
        if v.action == "exclude":
            self.events.emit("fleet", v.node, "node_excluded", v.reason, level="error")
        else:
            self.events.emit("fleet", v.node, "node_exclusion_refused", v.reason, level="warning")

    def check_node(self, node: str) -> None:
        """An actor on `node` is unreachable: asks Ray (bounded) whether the node itself is dead."""
        t = self._node_checks.get(node)
        if node and (t is None or t.done()) and not self.nodes.is_excluded(node) and not self._closing:
            self._node_checks[node] = asyncio.create_task(self._check_node(node), name=f"node-check-{node[:8]}")

    async def _check_node(self, node: str) -> None:
        deadline = time.monotonic() + self.cfg.restart.node_check_timeout_s
        while not self._closing:
            try:
                alive = node in await self.alive_nodes()
            except Exception:
                alive = True
            if not alive:
                self._verdict(self.nodes.node_dead(node, time.monotonic(), f"Ray reports node {node[:12]} dead"))
                return
            if time.monotonic() >= deadline:
                return
            # The GCS marks a lost node dead only after its health checks fail (seconds): there is no
            # event to await from here, so ask once a second until restart.node_check_timeout_s.
            await asyncio.sleep(1.0)

    def absolve(self, rid: str, deaths: list[tuple[str, int]], reason: str) -> None:
        """A poison request caused these (slot, incarnation) deaths: refund their restarts, forget them as
        node evidence, and say so in the events."""
        refunded = []
        for slot, inc in deaths:
            self._absolved.add((slot, inc))
            self.nodes.forget(slot, inc)
            if self.policy.refund(slot, (slot, inc)):
                refunded.append(slot)
        self.events.emit("fleet", rid, "poison_request", reason, level="error", deaths=[list(d) for d in deaths],
                         refunded=refunded)
