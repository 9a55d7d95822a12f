"""Chaos for trainer runs: the recipe's `belayer.chaos` section drives Belayer's own ChaosInjector against the
fleet under a trainer hook. Fault-injection code is imported only when `belayer.chaos.enabled` is true.

Owns: wiring a trainer run's chaos section to the injector. Must not: act without chaos.enabled.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from belayer_plugin.config import BelayerConfig


def attach_chaos(cfg: BelayerConfig, fleet: Any, observers: Optional[list] = None) -> Any:
    """A started ChaosInjector on `fleet` (None when chaos is off). Token triggers need the generation
    observers list (e.g. BelayerLLMServerClient.observers); requests there name engines by URL."""
    if not cfg.chaos.enabled:
        return None
    from belayer_plugin.chaos.injector import ChaosInjector  # noqa: PLC0415  (only with chaos on)

    inj = ChaosInjector(cfg.chaos, fleet.events, fleet)
    if observers is not None:
        def observe(clog: Any, seg: Any) -> None:
            slot = fleet.slot_for_url(seg.url)
            inj.gen_observer(clog, SimpleNamespace(engine=slot.slot_id if slot else seg.engine, url=seg.url))

        observers.append(observe)
    fleet.events.subscribe(inj.on_event)
    inj.start()
    return inj
