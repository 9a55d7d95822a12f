"""Prometheus metrics fed from events (no module reads another's internals)."""

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
