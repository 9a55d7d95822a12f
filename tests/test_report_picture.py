"""The fleet picture: lanes and state spans are derived from the event log exactly (a handover closes the
standby's lane, a transition opens a new span), and the PNG is drawn with requests jumping lanes."""

from __future__ import annotations

from belayer_plugin.events import EventLog
from belayer_plugin.report import _fleet_lanes, timeline_png


def _log() -> EventLog:
    ev = EventLog()
    t = 1000.0

    def at(dt: float, *args, **kw):
        e = ev.emit(*args, **kw)
        e.t = t + dt
        return e

    at(0.0, "fleet", "engine-0", "transition", "up", "RESTARTING", "HEALTHY")
    at(0.1, "fleet", "engine-1", "transition", "up", "RESTARTING", "HEALTHY")
    at(0.2, "shadow", "shadow-0", "shadow_ready", "standing by")
    at(2.0, "fleet", "engine-0", "transition", "killed", "HEALTHY", "DEAD")
    at(2.3, "shadow", "engine-0", "handover", "shadow-0 took over the slot", shadow="shadow-0")
    at(2.3, "fleet", "engine-0", "transition", "handover", "DEAD", "HEALTHY")
    at(1.0, "generation", "r1", "request", "finished", tokens=12,
       segments=[["engine-0", t + 1.0, t + 2.0, 0, 6, "failed: killed"], ["engine-1", t + 2.1, t + 2.6, 6, 12, "finished"]])
    at(3.0, "generation", "r2", "request", "finished", tokens=12, segments=[["engine-0", t + 2.5, t + 3.0, 0, 12, "finished"]])
    ev.events.sort(key=lambda e: e.t)
    return ev


def test_lanes_and_state_spans_follow_the_events():
    ev = _log()
    lanes, spans = _fleet_lanes(ev.events, ev.events[-1].t)
    assert lanes == ["engine-0", "engine-1", "shadow-0"]
    assert [s[2] for s in spans["engine-0"]] == ["HEALTHY", "DEAD", "HEALTHY"]
    assert spans["engine-0"][1][:2] == (1002.0, 1002.3)
    assert spans["shadow-0"] == [(1000.2, 1002.3, "STANDBY")]  # the standby's lane ends at its handover
    assert spans["engine-1"][-1][1] == ev.events[-1].t  # open spans run to the end of the run


def test_picture_is_drawn(tmp_path):
    p = tmp_path / "timeline.png"
    timeline_png(_log(), p)
    assert p.stat().st_size > 10_000 and p.read_bytes()[:4] == b"\x89PNG"
