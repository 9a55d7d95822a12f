"""The progress tracker's bookkeeping, pinned without engines: what a stall report says, which observations
count as activity or as gaps, and how several engines and incarnations are kept apart. The behaviour under
real load (a long prefill, a saturated engine, SIGSTOP) is in tests/test_fleet_progress.py; bench/mutation.py
runs these against mutants of fleet/progress.py."""

from __future__ import annotations

import pytest

from belayer_plugin.config import ProgressConfig
from belayer_plugin.fleet.progress import ProgressTracker, Stall, _p95

CFG = dict(enabled=True, floor_s=1.0, gap_multiplier=8.0, gap_window=32, min_gaps=4,
           prefill_s_per_1k_tokens=2.0, confirm_timeout_s=1.0, readiness_from_tokens=True)


def _tracker(**kw) -> ProgressTracker:
    t = ProgressTracker(ProgressConfig(**{**CFG, **kw}))
    t.watch("e0", 1)
    return t


def _warm(t: ProgressTracker, engine: str = "e0", inc: int = 1, rid: str = "r", start: float = 0.0,
          gap: float = 0.01, n: int = 5, prompt: int = 10) -> float:
    t.started(engine, inc, rid, prompt, start)
    now = start
    for _ in range(n):
        now += gap
        t.tokens(engine, inc, rid, now)
    return now


def test_a_stall_report_gives_the_silence_threshold_and_requests_in_flight():
    t = _tracker()
    last = _warm(t)
    t.started("e0", 1, "waiting", 500, last)  # a second request, still awaiting its first token
    [st] = t.stalled(last + 2.5)
    assert st == Stall("e0", 1, pytest.approx(2.5), pytest.approx(2.0), 2, 1)
    assert st.reason == ("progress: no token for 2.50 s with 2 request(s) in flight (threshold 2.00 s from its "
                         "recent inter-token gaps, floor and prefill allowance; 1 awaiting a first token)")


def test_a_report_is_due_exactly_at_the_deadline_and_silent_since_is_the_last_activity():
    t = _tracker()
    last = _warm(t)
    assert t.silent_since("e0", 1) == pytest.approx(last) and t.silent_since("e0", 2) is None
    assert t.silent_since("e9", 1) is None
    assert t.deadline("e0") == pytest.approx(last + 1.0)
    assert t.stalled(t.deadline("e0")) != []
    assert t.deadline("e0") is None and t.next_deadline() is None  # reported: no deadline until new activity


def test_the_earliest_deadline_over_several_engines_is_next_and_each_is_reported_alone():
    t = _tracker()
    t.watch("e1", 3)
    a = _warm(t, "e0", 1, start=0.0)
    b = _warm(t, "e1", 3, start=0.5)
    assert t.next_deadline() == pytest.approx(a + 1.0)
    assert [s.engine for s in t.stalled(a + 1.0)] == ["e0"]
    assert t.next_deadline() == pytest.approx(b + 1.0)
    [st] = t.stalled(b + 1.2)
    assert (st.engine, st.incarnation) == ("e1", 3)
    assert t.deadline("nobody") is None and t.threshold("nobody") is None


def test_forget_drops_the_engine_and_unknown_engines_are_ignored_everywhere():
    t = _tracker()
    _warm(t)
    t.forget("e0")
    t.forget("e0")  # twice is harmless
    assert t.next_deadline() is None and t.stalled(100.0) == []
    for call in (lambda: t.started("e0", 1, "r", 1, 0.0), lambda: t.tokens("e0", 1, "r", 0.0),
                 lambda: t.ended("e0", 1, "r", 0.0), lambda: t.answered("e0", 1, 0.0), lambda: t.fault("e0", 1)):
        call()
    assert t.silent_since("e0", 1) is None and not t.served_within("e0", 1, 10.0, 0.0)


def test_warm_up_needs_min_gaps_gaps_of_this_incarnation():
    t = _tracker(min_gaps=3)
    t.started("e0", 1, "r", 10, 0.0)
    t.tokens("e0", 1, "r", 0.1)  # first chunk: its wait was prefill, no gap
    t.tokens("e0", 1, "r", 0.2)
    t.tokens("e0", 1, "r", 0.3)
    assert t.threshold("e0") is None  # 2 gaps
    t.tokens("e0", 1, "r", 0.4)
    assert t.threshold("e0") == pytest.approx(1.0)  # 3 gaps: armed


def test_a_first_read_of_several_chunks_counts_all_but_the_first_as_gaps_and_chunks_are_at_least_one():
    t = _tracker(min_gaps=4)
    t.started("e0", 1, "r", 10, 0.0)
    t.tokens("e0", 1, "r", 0.1, chunks=4)  # 3 gaps
    assert t.threshold("e0") is None
    t.tokens("e0", 1, "r", 0.2, chunks=0)  # a read reporting no chunk is still one
    assert t.threshold("e0") == pytest.approx(1.0)
    t.tokens("e0", 1, "r", 20.2, chunks=0)  # its gap is 20 s over one chunk, not 20 s / 0
    assert t.threshold("e0") == pytest.approx(8 * 20.0)


def test_gaps_are_per_request_and_a_read_going_back_in_time_is_a_zero_gap():
    t = _tracker(min_gaps=1)
    t.started("e0", 1, "a", 10, 0.0)
    t.started("e0", 1, "b", 10, 0.0)
    t.tokens("e0", 1, "a", 1.0)
    t.tokens("e0", 1, "b", 3.0)
    t.tokens("e0", 1, "a", 3.5)  # a's gap is 2.5 s (not 0.5 s since b's token)
    assert t.threshold("e0") == pytest.approx(8 * 2.5)
    t2 = _tracker(min_gaps=1, floor_s=0.5)
    t2.started("e0", 1, "a", 10, 0.0)
    t2.tokens("e0", 1, "a", 2.0)
    t2.tokens("e0", 1, "a", 1.0)  # clocks of two readers: never a negative gap
    assert t2.threshold("e0") == pytest.approx(0.5)


def test_tokens_read_while_suspended_make_no_gap_and_no_warmth():
    t = _tracker(min_gaps=2)
    assert t.suspended is False
    t.started("e0", 1, "r", 10, 0.0)
    t.tokens("e0", 1, "r", 0.1)
    t.suspend()
    assert t.suspended is True
    for k in range(5):
        t.tokens("e0", 1, "r", 10.0 * (k + 1))  # held requests trickle out during a pause: no gaps
    t.resume(60.0)
    assert t.suspended is False
    assert t.threshold("e0") is None  # not warm: nothing counted while suspended
    t.tokens("e0", 1, "r", 60.1)  # resume forgot the last read: the first read after it is no gap
    t.tokens("e0", 1, "r", 60.2)
    t.tokens("e0", 1, "r", 60.3)
    assert t.threshold("e0") == pytest.approx(1.0), "50 s pause gaps would give 400 s"


def test_a_request_starting_on_a_busy_engine_does_not_reset_its_silence():
    t = _tracker()
    last = _warm(t)
    t.started("e0", 1, "r2", 0, last + 0.8)  # busy already: r's silence goes on
    assert t.deadline("e0") == pytest.approx(last + 1.0)
    assert len(t.stalled(last + 1.0)) == 1


def test_an_idle_engine_turning_busy_counts_its_silence_from_then_with_the_doubling_cleared():
    t = _tracker()
    last = _warm(t)
    t.stalled(last + 1.0)
    t.answered("e0", 1, last + 1.0)
    assert t.threshold("e0") == pytest.approx(2.0)
    t.ended("e0", 1, "r", last + 1.5)
    assert t.threshold("e0") is None
    t.started("e0", 1, "r2", -50, last + 10.0)  # a negative prompt length is no prefill allowance
    assert t.threshold("e0") == pytest.approx(1.0) and t.deadline("e0") == pytest.approx(last + 11.0)


def test_ending_a_request_is_activity_but_ending_an_unknown_one_is_not():
    t = _tracker()
    last = _warm(t)
    t.started("e0", 1, "r2", 0, last)
    t.ended("e0", 1, "ghost", last + 0.9)
    assert t.deadline("e0") == pytest.approx(last + 1.0)
    t.ended("e0", 1, "r", last + 0.9)
    assert t.deadline("e0") == pytest.approx(last + 1.9)
    t.ended("e0", 1, "r2", last + 1.0)
    assert t.deadline("e0") is None  # idle


def test_ending_a_reported_silence_reopens_reporting_and_a_restarted_rid_has_no_gap_across_its_prefill():
    t = _tracker()
    last = _warm(t)
    t.started("e0", 1, "r2", 0, last)
    assert len(t.stalled(last + 1.0)) == 1
    t.ended("e0", 1, "r2", last + 1.1)
    assert t.deadline("e0") == pytest.approx(last + 2.1)
    t.started("e0", 1, "r", 0, last + 1.2)  # r resumed as a new segment: no gap spans its prefill
    t.tokens("e0", 1, "r", last + 30.0)
    assert t.threshold("e0") == pytest.approx(1.0)


def test_the_doubling_stops_at_sixteen_answered_probes():
    t = _tracker()
    last = _warm(t)
    for k in range(20):
        t.answered("e0", 1, last + k)
    assert t.threshold("e0") == pytest.approx(2.0 ** 16)
    t.answered("e0", 2, last + 30)  # another incarnation's answer changes nothing
    assert t.threshold("e0") == pytest.approx(2.0 ** 16) and t.silent_since("e0", 1) == pytest.approx(last + 19)


def test_an_answered_probe_restarts_the_silence_and_allows_a_new_report():
    t = _tracker()
    last = _warm(t)
    assert len(t.stalled(last + 1.0)) == 1
    t.answered("e0", 1, last + 1.2)
    assert t.deadline("e0") == pytest.approx(last + 1.2 + 2.0)


def test_a_token_clears_the_doubling():
    t = _tracker()
    last = _warm(t)
    t.answered("e0", 1, last + 0.5)
    t.tokens("e0", 1, "r", last + 0.6)
    assert t.threshold("e0") == pytest.approx(8 * 0.6)
    t.tokens("e0", 1, "r", last + 0.61)
    assert t.threshold("e0") == pytest.approx(8 * 0.6)  # p95 of the gaps, not their last


def test_resume_rearms_a_reported_silence_and_clears_the_doubling():
    t = _tracker(min_gaps=1)
    last = _warm(t)
    assert len(t.stalled(last + 1.0)) == 1
    t.answered("e0", 1, last + 1.0)
    t.suspend()
    t.resume(last + 5.0)
    t.tokens("e0", 1, "r", last + 5.1)  # no gap (last read forgotten), no warmth yet
    assert t.threshold("e0") is None
    t.tokens("e0", 1, "r", last + 5.2)
    assert t.threshold("e0") == pytest.approx(1.0)
    assert t.deadline("e0") == pytest.approx(last + 6.2)


def test_the_prefill_allowance_covers_every_request_awaiting_its_first_token():
    t = _tracker(prefill_s_per_1k_tokens=3.0)
    last = _warm(t)
    t.started("e0", 1, "p1", 1000, last)
    t.started("e0", 1, "p2", 500, last)
    assert t.threshold("e0") == pytest.approx(1.0 + 4.5)
    t.tokens("e0", 1, "p1", last + 0.1)
    assert t.threshold("e0") == pytest.approx(1.0 + 1.5)
    [st] = t.stalled(last + 10)
    assert (st.inflight, st.waiting_first_token) == (3, 1)


def test_only_the_last_gap_window_gaps_count():
    t = _tracker(gap_window=4, min_gaps=1)
    t.started("e0", 1, "r", 10, 0.0)
    now = 0.0
    for gap in (5.0, 0.01, 0.01, 0.01, 0.01):
        now += gap
        t.tokens("e0", 1, "r", now)
    assert t.threshold("e0") == pytest.approx(1.0)  # the 5 s gap was the first read's prefill, not kept
    t.tokens("e0", 1, "r", now + 0.5)
    assert t.threshold("e0") == pytest.approx(4.0)
    for k in range(4):
        t.tokens("e0", 1, "r", now + 0.5 + 0.01 * (k + 1))
    assert t.threshold("e0") == pytest.approx(1.0), "the 0.5 s gap left the window of 4"


def test_served_within_counts_the_window_inclusively_and_not_past_the_deadline():
    t = _tracker()
    last = _warm(t)
    t.ended("e0", 1, "r", last)  # idle: no deadline, only the window decides
    assert t.served_within("e0", 1, 2.0, last + 2.0)
    assert not t.served_within("e0", 1, 2.0, last + 2.01)
    t.started("e0", 1, "r2", 0, last + 0.1)
    assert t.served_within("e0", 1, 5.0, last + 1.09)
    assert not t.served_within("e0", 1, 5.0, last + 1.1)  # the deadline itself is overdue


@pytest.mark.parametrize("xs, want", [
    ([], 0.0), ([3.0], 3.0), ([2.0, 1.0], 2.0), (list(range(1, 21)), 19), (list(range(1, 101)), 95),
    (list(range(1, 22)), 20), ([5.0] * 10, 5.0),
])
def test_p95_is_the_nearest_rank_value(xs, want):
    from collections import deque
    assert _p95(deque(xs)) == want


def test_a_late_read_of_an_ended_request_spans_no_gap():
    t = _tracker(min_gaps=1)
    t.started("e0", 1, "r", 10, 0.0)
    t.started("e0", 1, "other", 0, 0.0)
    t.tokens("e0", 1, "r", 0.1)
    t.tokens("e0", 1, "r", 0.2)
    t.ended("e0", 1, "r", 0.3)
    t.tokens("e0", 1, "r", 9.0)  # its stream's last chunk read after it ended: no 8.8 s gap
    assert t.threshold("e0") == pytest.approx(1.0)


def test_served_within_is_inclusive_of_the_window_and_exclusive_of_the_deadline():
    t = _tracker()
    t.started("e0", 1, "r", 10, 0.0)
    for k in range(1, 6):
        t.tokens("e0", 1, "r", 0.5 * k)  # 4 gaps of 0.5 s: threshold 4 s
    t.ended("e0", 1, "r", 2.5)
    assert t.served_within("e0", 1, 2.0, 4.5) and not t.served_within("e0", 1, 2.0, 4.75)
    t.started("e0", 1, "r2", 0, 3.0)  # busy again: deadline 3 + 4 = 7
    assert t.deadline("e0") == 7.0
    assert t.served_within("e0", 1, 5.0, 6.5) and not t.served_within("e0", 1, 5.0, 7.0)


def test_a_one_token_prompt_awaiting_its_first_token_is_counted_as_waiting():
    t = _tracker()
    last = _warm(t)
    t.started("e0", 1, "tiny", 1, last)
    [st] = t.stalled(last + 5.0)
    assert (st.inflight, st.waiting_first_token) == (2, 1)
