"""The health machine's records beyond tests/test_fleet_health.py's edges: what each transition records, and
the probe-failure count and incarnation a restart or a retry starts from (bench/mutation.py runs these against
mutants of fleet/health.py)."""

from __future__ import annotations

from belayer_plugin.fleet.health import EngineHealth, Signal, State, Transition


def _healthy(threshold: int = 2) -> EngineHealth:
    h = EngineHealth("engine-3", threshold)
    h.apply(Signal.STARTED, 1.0)
    h.apply(Signal.WEIGHTS_CURRENT, 2.0)
    return h


def test_a_transition_records_time_engine_incarnation_states_signal_and_reason():
    h = EngineHealth("engine-3", 2)
    assert (h.state, h.incarnation, h.failures, h.since, h.history) == (State.RESTARTING, 0, 0, 0.0, [])
    tr = h.apply(Signal.STARTED, 1.5)
    assert tr == Transition(1.5, "engine-3", 0, State.RESTARTING, State.STALE, Signal.STARTED, "")
    tr2 = h.apply(Signal.WEIGHTS_CURRENT, 2.5, incarnation=0, reason="v7 loaded")
    assert tr2.reason == "v7 loaded" and h.since == 2.5 and h.history == [tr, tr2]
    assert h.apply(Signal.WEIGHTS_CURRENT, 3.0) is None and len(h.history) == 2 and h.since == 2.5
    assert h.serving and h.running


def test_a_restart_starts_a_new_incarnation_with_no_probe_failures():
    h = _healthy(threshold=2)
    h.apply(Signal.PROBE_FAILED, 3.0)
    assert (h.state, h.failures) == (State.SUSPECT, 1)
    h.apply(Signal.LIVENESS_LOST, 4.0)
    tr = h.apply(Signal.RESTART_BEGUN, 5.0)
    assert (tr.incarnation, h.incarnation, h.failures) == (1, 1, 0)
    h.apply(Signal.STARTED, 6.0, incarnation=1)
    h.apply(Signal.WEIGHTS_CURRENT, 7.0, incarnation=1)
    assert h.apply(Signal.PROBE_FAILED, 8.0).to_state is State.SUSPECT  # one failure of 2, not two


def test_a_retried_slot_is_the_next_incarnation_with_no_probe_failures():
    h = _healthy(threshold=2)
    for inc in (1, 2):  # two restarts: incarnation 2
        h.apply(Signal.KILLED, 10.0 * inc)
        h.apply(Signal.RESTART_BEGUN, 10.0 * inc + 1)
        h.apply(Signal.STARTED, 10.0 * inc + 2)
        h.apply(Signal.WEIGHTS_CURRENT, 10.0 * inc + 3)
    assert h.incarnation == 2
    h.apply(Signal.PROBE_FAILED, 40.0)
    h.apply(Signal.LIVENESS_LOST, 41.0)
    h.apply(Signal.RETIRE, 42.0)
    assert (h.state, h.failures) == (State.RETIRED, 1)
    tr = h.apply(Signal.RETRY, 50.0)
    assert (tr.from_state, tr.to_state, tr.incarnation, h.failures) == (State.RETIRED, State.RESTARTING, 3, 0)
    h.apply(Signal.STARTED, 51.0, incarnation=3)
    h.apply(Signal.WEIGHTS_CURRENT, 52.0, incarnation=3)
    assert h.apply(Signal.PROBE_FAILED, 53.0).to_state is State.SUSPECT


def test_a_good_probe_or_resumed_progress_clears_the_probe_failure_count():
    for clear in (Signal.PROBE_OK, Signal.PROGRESS_RESUMED):
        h = _healthy(threshold=2)
        h.apply(Signal.PROBE_FAILED, 3.0)
        h.apply(clear, 4.0)
        assert (h.state, h.failures) == (State.HEALTHY, 0)
        h.apply(Signal.PROBE_FAILED, 5.0)
        assert h.state is State.SUSPECT  # counted from zero again


def test_a_hang_confirmed_by_a_failed_probe_kills_a_serving_engine_only():
    for state in (State.HEALTHY, State.SUSPECT):
        h = _healthy()
        h.state = state
        tr = h.apply(Signal.PROGRESS_HUNG, 9.0, reason="no token for 4 s")
        assert (tr.from_state, tr.to_state, tr.reason) == (state, State.DEAD, "no token for 4 s")
    for state in (State.STALE, State.RESTARTING, State.DEAD):
        h = _healthy()
        h.state = state
        assert h.apply(Signal.PROGRESS_HUNG, 9.0) is None and h.state is state


def test_a_serving_engine_on_other_weights_is_stale_until_they_are_current():
    for state in (State.HEALTHY, State.SUSPECT):
        h = _healthy()
        h.state = state
        assert h.apply(Signal.VERSION_MISMATCH, 9.0).to_state is State.STALE and not h.serving and h.running
        assert h.apply(Signal.WEIGHTS_CURRENT, 10.0).to_state is State.HEALTHY
    h = EngineHealth("e", 2)  # RESTARTING: not yet up, nothing to mark
    assert h.apply(Signal.VERSION_MISMATCH, 1.0) is None
