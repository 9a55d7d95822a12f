"""The pure health state machine and restart policy, tested exhaustively (no I/O)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from belayer_plugin.config import RestartConfig
from belayer_plugin.fleet.health import EngineHealth, Signal, State
from belayer_plugin.fleet.policy import FleetBelowFloorError, RestartPolicy

ALLOWED = {
    (State.HEALTHY, State.SUSPECT), (State.HEALTHY, State.DEAD), (State.HEALTHY, State.STALE),
    (State.SUSPECT, State.HEALTHY), (State.SUSPECT, State.DEAD), (State.SUSPECT, State.STALE),
    (State.DEAD, State.RESTARTING), (State.DEAD, State.RETIRED),
    (State.RESTARTING, State.STALE), (State.RESTARTING, State.DEAD),
    (State.STALE, State.HEALTHY), (State.STALE, State.DEAD),
    (State.RETIRED, State.RESTARTING),
}


def _in(state: State, threshold: int = 3) -> EngineHealth:
    h = EngineHealth("e", threshold)
    h.state = state
    return h


@pytest.mark.parametrize("state,signal", list(itertools.product(State, Signal)))
def test_every_state_signal_pair_moves_only_along_allowed_edges(state, signal):
    h = _in(state)
    tr = h.apply(signal, 1.0)
    if tr is not None:
        assert (tr.from_state, tr.to_state) in ALLOWED
        assert h.history[-1] == tr


def test_retired_leaves_only_on_the_managers_retry_as_a_new_incarnation():
    h = _in(State.RETIRED)
    assert all(h.apply(sig, 1.0) is None for sig in Signal if sig is not Signal.RETRY)
    assert h.state is State.RETIRED
    tr = h.apply(Signal.RETRY, 2.0, incarnation=0)
    assert (tr.from_state, tr.to_state) == (State.RETIRED, State.RESTARTING) and h.incarnation == 1
    assert h.apply(Signal.STARTED, 3.0, incarnation=0) is None  # news of the retired incarnation stays stale
    assert h.apply(Signal.STARTED, 3.0, incarnation=1).to_state is State.STALE


def test_retry_moves_no_slot_that_is_not_retired():
    for state in State:
        if state is not State.RETIRED:
            assert _in(state).apply(Signal.RETRY, 1.0) is None


def test_probe_failures_reach_dead_exactly_at_threshold_and_success_clears_suspicion():
    h = _in(State.HEALTHY, threshold=3)
    assert h.apply(Signal.PROBE_FAILED, 1).to_state is State.SUSPECT
    assert h.apply(Signal.PROBE_FAILED, 2) is None and h.state is State.SUSPECT
    assert h.apply(Signal.PROBE_OK, 3).to_state is State.HEALTHY
    h.apply(Signal.PROBE_FAILED, 4)
    h.apply(Signal.PROBE_FAILED, 5)
    assert h.apply(Signal.PROBE_FAILED, 6).to_state is State.DEAD


def test_a_restarted_engine_is_stale_until_its_weights_are_current():
    h = _in(State.DEAD)
    h.apply(Signal.RESTART_BEGUN, 1)
    assert h.state is State.RESTARTING and h.incarnation == 1
    assert h.apply(Signal.STARTED, 2).to_state is State.STALE
    assert not h.serving
    assert h.apply(Signal.PROBE_OK, 3) is None and h.state is State.STALE  # a good probe is not enough
    assert h.apply(Signal.WEIGHTS_CURRENT, 4).to_state is State.HEALTHY


def test_signals_about_an_older_incarnation_are_ignored():
    h = _in(State.DEAD)
    h.apply(Signal.RESTART_BEGUN, 1)
    h.apply(Signal.STARTED, 2)
    h.apply(Signal.WEIGHTS_CURRENT, 3)
    assert h.apply(Signal.LIVENESS_LOST, 4, incarnation=0) is None  # the old actor's death notice
    assert h.state is State.HEALTHY
    assert h.apply(Signal.LIVENESS_LOST, 5, incarnation=1).to_state is State.DEAD


def test_one_failed_request_only_raises_suspicion():
    h = _in(State.HEALTHY)
    assert h.apply(Signal.REQUEST_FAILED, 1).to_state is State.SUSPECT
    assert h.apply(Signal.REQUEST_FAILED, 2) is None and h.state is State.SUSPECT


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Signal)), st.integers(0, 3)), max_size=60), st.integers(1, 4))
def test_random_signal_sequences_keep_the_machine_consistent(seq, threshold):
    h = EngineHealth("e", threshold)
    for i, (sig, inc) in enumerate(seq):
        before = (h.state, h.incarnation)
        tr = h.apply(sig, float(i), incarnation=inc if inc < 3 else None)
        if tr is None:
            assert h.state is before[0]
        else:
            assert (tr.from_state, tr.to_state) in ALLOWED
        assert h.incarnation >= before[1]
        if h.state in (State.HEALTHY, State.SUSPECT):
            # serving is reachable only through a WEIGHTS_CURRENT in this very incarnation
            assert any(t.signal is Signal.WEIGHTS_CURRENT and t.incarnation == h.incarnation for t in h.history)
        assert 0 <= h.failures <= max(threshold, 1)
    assert [t.t for t in h.history] == sorted(t.t for t in h.history)


def _policy(**kw) -> RestartPolicy:
    base = dict(max_restarts=3, window_s=100.0, backoff_initial_s=1.0, backoff_max_s=5.0,
                backoff_multiplier=2.0, min_healthy_engines=1)
    base.update(kw)
    return RestartPolicy(RestartConfig(**base))


def test_backoff_grows_exponentially_up_to_the_cap_and_budget_retires():
    p = _policy(max_restarts=4)
    delays = []
    for t in range(4):
        d = p.decide("e", float(t))
        assert d.action == "restart"
        delays.append(d.delay_s)
        p.record_restart("e", float(t))
    assert delays == [1.0, 2.0, 4.0, 5.0]
    assert p.decide("e", 5.0).action == "retire"


def test_budget_is_a_sliding_window():
    p = _policy(max_restarts=2, window_s=10.0)
    p.record_restart("e", 0.0)
    p.record_restart("e", 1.0)
    assert p.decide("e", 5.0).action == "retire"
    assert p.decide("e", 10.5).action == "restart"  # the first restart left the window
    assert p.decide("other", 5.0).action == "restart"  # budgets are per engine


def test_floor_counts_restarting_engines_but_not_retired_ones_and_names_each_engine():
    p = _policy(min_healthy_engines=2)
    a, b, c = _in(State.HEALTHY), _in(State.RESTARTING), _in(State.RETIRED)
    a.engine, b.engine, c.engine = "engine-0", "engine-1", "engine-2"
    p.check_floor([a, b, c])
    b.state = State.RETIRED
    with pytest.raises(FleetBelowFloorError) as ei:
        p.check_floor([a, b, c])
    msg = str(ei.value)
    assert "only 1 usable engine(s)" in msg and "min_healthy_engines=2" in msg
    assert "engine-0: HEALTHY" in msg and "engine-1: RETIRED" in msg and "engine-2: RETIRED" in msg


def test_a_renewed_budget_restarts_without_backoff_and_other_engines_keep_theirs():
    p = _policy(max_restarts=2, window_s=100.0)
    for e in ("e", "other"):
        p.record_restart(e, 0.0)
        p.record_restart(e, 1.0)
    assert p.decide("e", 2.0).action == "retire"
    p.renew("e")
    d = p.decide("e", 2.0)
    assert d.action == "restart" and d.restarts_in_window == 0 and d.delay_s == 1.0
    assert p.decide("other", 2.0).action == "retire"
