"""Node health: which Ray nodes may host engines. Pure: no I/O, time is passed in.

A node is excluded only on node evidence, i.e. faults independent of any one slot or request:
- engines of `min_slots` different positions (slots or standbys) died on it within `window_s`, and no
  request was in flight on two of those deaths (a request that crashes every engine it reaches is poison,
  not hardware); or
- Ray reports the node dead.
Repeated deaths of one slot are never node evidence: they follow the restart budget. The last node able
to host engines is never excluded (the refusal is recorded); an exclusion decays after `decay_s` (0: never)
and can be lifted by hand with `readmit`. Every verdict carries its evidence as text for events and reports.

Owns: node evidence (deaths per node), exclusion and its decay. Must not: do I/O or read clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass(frozen=True)
class Death:
    """One engine death on a node, with the requests that were in flight on it."""

    node: str
    position: str  # the slot id, or the standby id
    incarnation: int
    t: float
    rids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Verdict:
    node: str
    action: str  # "exclude" | "refused" (it would have been the last node able to host engines)
    reason: str


@dataclass
class NodeHealth:
    """Deaths per node and the nodes excluded from hosting engines."""

    min_slots: int
    window_s: float
    decay_s: float
    deaths: list[Death] = field(default_factory=list)
    excluded: dict[str, tuple[float, str]] = field(default_factory=dict)  # node -> (since, reason)

    def is_excluded(self, node: str) -> bool:
        return node in self.excluded

    def record_death(self, d: Death, hosts: Iterable[str]) -> Optional[Verdict]:
        """Records a death; returns a verdict when the node's deaths now amount to node evidence.

        `hosts`: the nodes Ray reports alive (able to host engines), used to never exclude the last one.
        """
        self.deaths = [x for x in self.deaths if d.t - x.t < self.window_s] + [d]
        if d.node in self.excluded:
            return None
        evidence = self._independent([x for x in self.deaths if x.node == d.node])
        if len(evidence) < self.min_slots:
            return None
        what = ", ".join(f"{x.position} (incarnation {x.incarnation})" for x in evidence)
        reason = (f"engines of {len(evidence)} different slots died on node {d.node[:12]} within "
                  f"{self.window_s:g} s with no request in common: {what}")
        return self._exclude(d.node, d.t, reason, hosts)

    def node_dead(self, node: str, now: float, reason: str) -> Optional[Verdict]:
        """Ray reports the node dead: exclude it (a dead node hosts nothing, so it is never 'the last')."""
        if node in self.excluded:
            return None
        self.excluded[node] = (now, reason)
        return Verdict(node, "exclude", reason)

    def forget(self, position: str, incarnation: int) -> None:
        """Drops a death from the evidence (it was caused by a poison request)."""
        self.deaths = [x for x in self.deaths if (x.position, x.incarnation) != (position, incarnation)]

    def readmit(self, node: str) -> bool:
        """Lifts an exclusion by hand; True if the node was excluded."""
        self.deaths = [x for x in self.deaths if x.node != node]
        return self.excluded.pop(node, None) is not None

    def decay(self, now: float) -> list[str]:
        """Re-admits nodes excluded for longer than decay_s; returns them."""
        if self.decay_s <= 0:
            return []
        back = [n for n, (since, _) in self.excluded.items() if now - since >= self.decay_s]
        for n in back:
            self.readmit(n)
        return back

    def _independent(self, deaths: list[Death]) -> list[Death]:
        """The largest set found greedily of deaths at distinct positions sharing no request (newest first)."""
        chosen: list[Death] = []
        for x in reversed(deaths):
            if any(x.position == c.position or (x.rids & c.rids) for c in chosen):
                continue
            chosen.append(x)
        return chosen

    def _exclude(self, node: str, now: float, reason: str, hosts: Iterable[str]) -> Verdict:
        others = [h for h in hosts if h != node and h not in self.excluded]
        if not others:
            return Verdict(node, "refused", f"not excluded: it is the last node able to host engines ({reason})")
        self.excluded[node] = (now, reason)
        return Verdict(node, "exclude", reason)
