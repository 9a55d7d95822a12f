"""Prometheus metrics fed from events (no module reads another's internals).

Owns: StepMetrics and Prometheus FleetMetrics, both fed from events. Must not: read any component's state
directly.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from belayer_plugin.events import Event

_STATES = ("HEALTHY", "SUSPECT", "DEAD", "RESTARTING", "STALE", "RETIRED")


class FleetMetrics:
    """Counters and gauges for one fleet, in their own registry."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.state = Gauge("belayer_engine_state", "1 for the engine's current health state", ["engine", "state"], registry=r)
        self.transitions = Counter("belayer_engine_transitions", "health transitions", ["to_state"], registry=r)
        self.restarts = Counter("belayer_engine_restarts", "engine restarts", registry=r)
        self.handovers = Counter("belayer_shadow_handovers", "standby handovers", registry=r)
        self.retired = Counter("belayer_engines_retired", "engines retired after their budget", registry=r)
        self.detection = Histogram("belayer_detection_seconds", "fault to DEAD", registry=r,
                                   buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.weight_version = Gauge("belayer_fleet_weight_version_info", "current policy version", ["version"], registry=r)

    def on_event(self, ev: Event) -> None:
        if ev.kind == "transition" and ev.to_state:
            self.transitions.labels(ev.to_state).inc()
            for s in _STATES:
                self.state.labels(ev.subject, s).set(1 if s == ev.to_state else 0)
            if ev.to_state == "RETIRED":
                self.retired.inc()
        elif ev.kind == "restarted":
            self.restarts.inc()
        elif ev.kind == "refit_done":
            self.weight_version.clear()
            self.weight_version.labels(str(ev.figures.get("version"))).set(1)
        if ev.kind == "detected" and "latency_from_first_symptom_s" in ev.figures:
            self.detection.observe(float(ev.figures["latency_from_first_symptom_s"]))
        elif ev.kind == "handover":
            self.handovers.inc()

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Exposes /metrics on host:port (loopback by default); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


STEP_METRICS = ("engine_deaths_detected", "handovers", "cold_restarts", "engines_retired", "requests_resumed",
                "tokens_saved", "requests_failed", "env_restores", "env_rollback_actions", "checkpoints",
                "checkpoints_unchanged", "checkpoint_s", "detection_s_max", "handover_s_max", "chaos_faults")


class StepMetrics:
    """Recovery counters and timings accumulated from events between two `take()` calls, flat and named
    for a trainer's logger (wandb / tensorboard / mlflow through verl's and NeMo-RL's own tracking).

    Names (all under `belayer/`): engine_deaths_detected, detection_s_max, handovers, handover_s_max,
    cold_restarts, engines_retired, requests_resumed, tokens_saved (tokens kept by token-level resume,
    not regenerated), requests_failed, env_restores, env_rollback_actions, checkpoints,
    checkpoints_unchanged (skipped: no side effect), checkpoint_s (time checkpoints ran), chaos_faults.
    Every value is a delta since the previous `take()` (`*_max`: the largest since then), so a step without
    a fault reports zeros.
    """

    _ZERO = STEP_METRICS

    def __init__(self, prefix: str = "belayer/"):
        import threading

        self.prefix = prefix
        self._lock = threading.Lock()
        self._acc = dict.fromkeys(self._ZERO, 0.0)

    def on_event(self, ev: "Event | dict") -> None:
        """Feed with EventLog.subscribe (Event) or a sandbox on_event callback (dict record)."""
        get = ev.get if isinstance(ev, dict) else lambda k, d=None: getattr(ev, k, d)
        kind, comp = get("kind"), get("component")
        fig = (get("figures") or {}) if not isinstance(ev, dict) else {**ev, **(ev.get("figures") or {})}
        a = self._acc
        with self._lock:
            if kind == "detected":
                a["engine_deaths_detected"] += 1
                lat = fig.get("latency_from_first_symptom_s")
                if lat is not None:
                    a["detection_s_max"] = max(a["detection_s_max"], float(lat))
            elif kind == "handover" and comp == "shadow":
                a["handovers"] += 1
                a["handover_s_max"] = max(a["handover_s_max"], float(fig.get("took_s") or 0.0))
            elif kind == "restarted" and comp in ("restart", "verl"):  # fleet slot, or a verl replica
                a["cold_restarts"] += 1
            elif kind == "transition" and get("to_state") == "RETIRED":
                a["engines_retired"] += 1
            elif kind == "resumed" and comp == "recovery":
                a["requests_resumed"] += 1
                a["tokens_saved"] += int(fig.get("committed") or 0)
            elif kind in ("quarantined",) or (kind == "request" and get("reason") == "failed"):
                a["requests_failed"] += 1
            elif kind == "rollback":
                a["env_restores"] += 1
                a["env_rollback_actions"] += int(fig.get("discarded_actions") or 0)
            elif kind == "checkpoint" and comp == "sandbox":
                a["checkpoints"] += 1
                a["checkpoint_s"] += float(fig.get("duration_s") or 0.0)
            elif kind == "checkpoint_skipped" and "checkpoint_boundary" in fig:
                a["checkpoints_unchanged"] += 1
            elif kind == "inject" and comp == "chaos":
                a["chaos_faults"] += 1

    def add(self, counts: dict[str, float]) -> None:
        """Merges counts taken elsewhere (another process's `take()`, with or without the prefix): sums, and
        the larger value for `*_max`; unknown names are refused."""
        with self._lock:
            for k, v in counts.items():
                name = k[len(self.prefix):] if k.startswith(self.prefix) else k
                if name not in self._acc:
                    raise KeyError(f"unknown step metric {k!r} (known: {', '.join(self._ZERO)})")
                a = self._acc
                a[name] = max(a[name], float(v)) if name.endswith("_max") else a[name] + float(v)

    def take(self) -> dict[str, float]:
        """The counters since the last call (then reset), keyed `<prefix><name>`."""
        with self._lock:
            out = {f"{self.prefix}{k}": v for k, v in self._acc.items()}
            self._acc = dict.fromkeys(self._ZERO, 0.0)
        return out
