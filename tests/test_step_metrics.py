"""Per-step recovery metrics for trainers' loggers: counted from events, reset by take()."""

from __future__ import annotations

from belayer_plugin.events import EventLog
from belayer_plugin.metrics import StepMetrics


def test_counts_recovery_events_per_step_and_resets():
    ev, m = EventLog(), StepMetrics()
    ev.subscribe(m.on_event)
    ev.emit("monitor", "engine-0", "detected", "actor died", latency_from_first_symptom_s=0.04)
    ev.emit("shadow", "engine-0", "handover", "shadow-0 took over", took_s=0.21)
    ev.emit("recovery", "r1", "resumed", "from token 40", committed=40)
    ev.emit("recovery", "r2", "resumed", "from token 7", committed=7)
    ev.emit("fleet", "engine-1", "transition", "budget spent", "DEAD", "RETIRED")
    # sandbox records arrive as dicts from on_event callbacks
    m.on_event({"component": "sandbox", "subject": "t", "kind": "checkpoint", "duration_s": 0.5})
    m.on_event({"component": "sandbox", "subject": "t", "kind": "checkpoint_skipped", "checkpoint_boundary": 1})
    m.on_event({"component": "sandbox", "subject": "t", "kind": "checkpoint_skipped", "reason": "sandbox died"})
    m.on_event({"component": "sandbox", "subject": "t", "kind": "rollback", "discarded_actions": 2})
    got = m.take()
    assert got["belayer/engine_deaths_detected"] == 1 and got["belayer/detection_s_max"] == 0.04
    assert got["belayer/handovers"] == 1 and got["belayer/handover_s_max"] == 0.21
    assert got["belayer/requests_resumed"] == 2 and got["belayer/tokens_saved"] == 47
    assert got["belayer/engines_retired"] == 1
    assert got["belayer/checkpoints"] == 1 and got["belayer/checkpoint_s"] == 0.5
    assert got["belayer/checkpoints_unchanged"] == 1  # a policy's "skipped: sandbox died" is not one
    assert got["belayer/env_restores"] == 1 and got["belayer/env_rollback_actions"] == 2
    assert set(m.take().values()) == {0.0}  # the next step starts from zero


def test_host_cpu_counts_cpu_burnt_by_another_process():
    import resource
    import subprocess
    import sys

    from belayer_plugin.loop import host_cpu_s

    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    a = host_cpu_s()
    assert a is not None  # Linux: /proc/stat
    # a child burns ~0.6 s of CPU: the host figure sees it, though this process's own CPU does not
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"],
                   check=True, timeout=60)
    b = host_cpu_s()
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    burnt = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
    assert burnt >= 0.55
    assert b - a >= burnt - 0.05  # jiffies: 10 ms granularity


def test_an_event_record_has_every_field_and_a_copy_of_its_figures(tmp_path):
    import json
    from dataclasses import asdict, fields

    from belayer_plugin.events import Event

    log = EventLog(tmp_path / "events.jsonl")
    ev = log.emit("fleet", "engine-0", "transition", "probe failed", "HEALTHY", "SUSPECT", level="warning",
                  latency_s=0.5, engines=["a", "b"])
    d = ev.to_dict()
    assert set(d) == {f.name for f in fields(Event)} and d == asdict(ev)
    d["figures"]["latency_s"] = 9  # a reader's change does not reach the event
    assert ev.figures["latency_s"] == 0.5
    assert json.loads((tmp_path / "events.jsonl").read_text()) == asdict(ev)
