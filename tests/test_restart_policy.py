"""The restart policy's bookkeeping beyond tests/test_fleet_health.py: the reasons it gives, refunds of a
restart spent on a poison request's death, and the floor's report naming each engine's last transitions
(bench/mutation.py runs these against mutants of fleet/policy.py)."""

from __future__ import annotations

import pytest

from belayer_plugin.config import RestartConfig
from belayer_plugin.fleet.health import EngineHealth, Signal, State
from belayer_plugin.fleet.policy import FleetBelowFloorError, RestartPolicy


def _policy(**kw) -> RestartPolicy:
    base = dict(max_restarts=3, window_s=100.0, backoff_initial_s=1.0, backoff_max_s=5.0,
                backoff_multiplier=2.0, min_healthy_engines=1)
    base.update(kw)
    return RestartPolicy(RestartConfig(**base))


def test_each_decision_says_which_restart_of_the_budget_it_is_or_why_it_retires():
    p = _policy(max_restarts=2, window_s=30.0)
    d = p.decide("e", 0.0)
    assert (d.action, d.delay_s, d.restarts_in_window, d.reason) == ("restart", 1.0, 0, "restart 1 of 2 in the window")
    p.record_restart("e", 0.0)
    assert p.decide("e", 1.0).reason == "restart 2 of 2 in the window"
    p.record_restart("e", 1.0)
    d = p.decide("e", 2.0)
    assert (d.action, d.delay_s, d.restarts_in_window) == ("retire", 0.0, 2)
    assert d.reason == "2 restarts within 30 s (budget restart.max_restarts=2)"


def test_a_restart_leaves_the_window_exactly_window_s_later():
    p = _policy(max_restarts=1, window_s=10.0)
    p.record_restart("e", 0.0)
    assert p.restarts_in_window("e", 9.99) == 1
    assert p.restarts_in_window("e", 10.0) == 0


def test_a_refund_gives_back_the_restart_spent_on_that_death_only():
    p = _policy(max_restarts=2)
    p.record_restart("e", 0.0, cause="death-1")
    p.record_restart("e", 1.0, cause="death-2")
    assert p.decide("e", 2.0).action == "retire"
    assert p.refund("e", "death-9") is False and p.restarts_in_window("e", 2.0) == 2
    assert p.refund("e", "death-1") is True
    d = p.decide("e", 2.0)
    assert d.action == "restart" and d.restarts_in_window == 1
    assert p.refund("e", "death-1") is False, "refunded once"
    assert p.refund("e", "death-2") is True and p.restarts_in_window("e", 2.0) == 0
    assert p.refund("other", "death-2") is False  # an engine with no restarts has nothing to refund


def test_a_refund_removes_one_entry_when_two_restarts_answer_the_same_cause():
    p = _policy(max_restarts=5)
    p.record_restart("e", 0.0, cause="poison")
    p.record_restart("e", 1.0, cause="poison")
    assert p.refund("e", "poison") is True and p.restarts_in_window("e", 2.0) == 1


def test_renewing_an_engine_without_restarts_is_harmless():
    p = _policy()
    p.renew("never-restarted")
    assert p.restarts_in_window("never-restarted", 0.0) == 0


def test_the_floor_report_names_each_engine_with_its_last_eight_transitions_and_their_reasons():
    p = _policy(min_healthy_engines=2)
    a = EngineHealth("engine-0", failure_threshold=1)
    b = EngineHealth("engine-1", failure_threshold=1)
    a.apply(Signal.STARTED, 1.0)
    a.apply(Signal.WEIGHTS_CURRENT, 2.0)
    a.apply(Signal.PROBE_FAILED, 3.0, reason="timed out")
    for k in range(3):  # 3 restarts of b: 9 transitions, the report keeps the last 8
        b.apply(Signal.LIVENESS_LOST if k else Signal.KILLED, 10.0 + k)
        b.apply(Signal.RESTART_BEGUN, 10.5 + k)
        b.apply(Signal.STARTED, 10.7 + k, reason=f"try {k}")
    b.apply(Signal.KILLED, 20.0)
    b.apply(Signal.RETIRE, 21.0, reason="budget")
    assert len(b.history) == 11
    a.state = State.RETIRED
    with pytest.raises(FleetBelowFloorError) as ei:
        p.check_floor([a, b])
    e = ei.value
    assert (e.usable, e.floor, e.engines) == (0, 2, [a, b])
    lines = str(e).split("\n")
    assert lines[0] == "only 0 usable engine(s), below the floor restart.min_healthy_engines=2:"
    assert lines[1] == ("  engine-0: RETIRED, incarnation 0; history: RESTARTING->STALE (started), "
                        "STALE->HEALTHY (weights_current), HEALTHY->DEAD (probe_failed: timed out)")
    assert lines[2] == ("  engine-1: RETIRED, incarnation 3; history: STALE->DEAD (liveness_lost), "
                        "DEAD->RESTARTING (restart_begun), RESTARTING->STALE (started: try 1), STALE->DEAD (liveness_lost), "
                        "DEAD->RESTARTING (restart_begun), RESTARTING->STALE (started: try 2), "
                        "STALE->DEAD (killed), DEAD->RETIRED (retire: budget)")
    assert len(lines) == 3


def test_the_floor_report_marks_an_engine_without_history():
    p = _policy(min_healthy_engines=1)
    h = EngineHealth("engine-7", failure_threshold=3, state=State.RETIRED)
    with pytest.raises(FleetBelowFloorError) as ei:
        p.check_floor(iter([h]))  # any iterable, read once
    assert str(ei.value).split("\n")[1] == "  engine-7: RETIRED, incarnation 0; history: -"
    assert isinstance(ei.value, RuntimeError)


def test_exactly_the_floor_is_enough():
    p = _policy(min_healthy_engines=2)
    p.check_floor([EngineHealth("a", 1, state=State.DEAD), EngineHealth("b", 1, state=State.STALE)])
    p.check_floor(iter([EngineHealth("a", 1, state=State.HEALTHY), EngineHealth("b", 1, state=State.SUSPECT),
                        EngineHealth("c", 1, state=State.RETIRED)]))


def test_the_window_is_measured_from_each_restarts_own_time():
    p = _policy(max_restarts=1, window_s=10.0)
    p.record_restart("e", 5.0)
    assert p.restarts_in_window("e", 14.99) == 1
    assert p.restarts_in_window("e", 15.0) == 0
