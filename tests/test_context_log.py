"""The context log of one request as a pure record: what is committed, from which segment, and what a resume is
given. The end-to-end checks (a real engine killed mid-request) are in tests/test_token_recovery.py; these pin
each method's arithmetic without an engine (bench/mutation.py runs them against mutants)."""

from __future__ import annotations

import time

import pytest

from belayer_plugin.generation.context_log import ContextLog, Segment


def test_a_new_log_has_nothing_committed_and_resumes_from_its_prompt():
    log = ContextLog("r1", [1, 2, 3], 5)
    assert (log.rid, log.want_logprobs, log.finish_reason) == ("r1", True, None)
    assert log.committed == 0 and log.remaining == 5
    assert log.resume_input_ids() == [1, 2, 3]
    assert log.summary() == {"segments": [], "attempts": 0, "resumed_from": []}


def test_a_segment_begins_at_the_committed_count_on_its_engine_with_its_seed():
    log = ContextLog("r", [1], 10)
    t0 = time.time()
    seg = log.begin("e0", "http://e0", 42)
    assert (seg.engine, seg.url, seg.weight_version, seg.start, seg.end, seg.seed) == ("e0", "http://e0", "", 0, 0, 42)
    assert seg.outcome == "running" and seg.t_end == 0.0 and t0 <= seg.t_start <= time.time()
    log.append(seg, [7, 8], None, None)
    seg2 = log.begin("e1", "http://e1", None)
    assert (seg2.start, seg2.end, seg2.seed) == (2, 2, None)
    assert log.segments == [seg, seg2]


def test_append_commits_ids_with_their_logprobs_and_records_the_weight_version():
    log = ContextLog("r", [1], 10)
    seg = log.begin("e0", "u", None)
    assert log.append(seg, [5, 6], [[-0.5, 5, "a"], [-1.5, 6, None]], "v3") == 2
    assert log.output_ids == [5, 6] and log.logprobs == [-0.5, -1.5]
    assert (seg.start, seg.end, seg.weight_version) == (0, 2, "v3")
    assert log.committed == 2 and log.remaining == 8 and log.resume_input_ids() == [1, 5, 6]
    # plain floats and ints are logprobs too; a version left out keeps the segment's last one
    assert log.append(seg, [7], [-2], None) == 1 and log.logprobs == [-0.5, -1.5, -2.0]
    assert type(log.logprobs[-1]) is float and seg.weight_version == "v3" and seg.end == 3
    assert log.append(seg, [8], [-3.0], "") == 1 and seg.weight_version == "v3"


def test_nothing_new_commits_nothing():
    log = ContextLog("r", [1], 10)
    seg = log.begin("e0", "u", None)
    assert log.append(seg, [], [[-1.0, 5, None]], "v9") == 0
    assert log.output_ids == [] and log.logprobs == [] and seg.end == 0 and seg.weight_version == ""


def test_missing_or_short_logprobs_are_kept_as_none_never_shifted_onto_other_tokens():
    log = ContextLog("r", [1], 10)
    seg = log.begin("e0", "u", None)
    log.append(seg, [5, 6], None, "v")
    log.append(seg, [7, 8], [[-0.1, 7, None]], "v")  # fewer logprobs than ids: none is trusted
    log.append(seg, [9], [[-0.9, 9, None], [-9.0, 10, None]], "v")  # more: the first ones are this chunk's
    log.append(seg, [10], [[None, 10, None]], "v")
    log.append(seg, [11], [None], "v")
    assert log.output_ids == [5, 6, 7, 8, 9, 10, 11]
    assert log.logprobs == [None, None, None, None, -0.9, None, None]
    log.append(seg, [13], [(-0.3, 13)], "v")  # tuples as well as lists
    assert log.logprobs[-1] == -0.3 and type(log.logprobs[-1]) is float


def test_commit_takes_only_what_a_cumulative_chunk_adds_to_its_segment():
    log = ContextLog("r", [1, 2], 10)
    seg = log.begin("e0", "u0", None)
    assert log.commit(seg, [5], [[-0.1, 5, None]], "v1") == 1
    assert log.commit(seg, [5, 6, 7], [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]], "v2") == 2
    assert seg.weight_version == "v2"
    assert log.commit(seg, [5, 6, 7], None, "v1") == 0 and seg.weight_version == "v2"
    # the next segment's chunks count from its own start, not from the request's
    seg2 = log.begin("e1", "u1", None)
    assert log.commit(seg2, [8, 9], None, "v2") == 2
    assert log.output_ids == [5, 6, 7, 8, 9] and log.logprobs == [-0.1, -0.2, -0.3, None, None]
    assert (seg.start, seg.end, seg2.start, seg2.end) == (0, 3, 3, 5)


def test_remaining_never_goes_below_zero():
    log = ContextLog("r", [1], 2)
    seg = log.begin("e0", "u", None)
    log.append(seg, [5, 6], None, None)
    assert log.remaining == 0
    log.append(seg, [7], None, None)  # an engine that overshot max_new_tokens
    assert log.committed == 3 and log.remaining == 0


def test_truncate_drops_the_tail_from_the_ids_the_logprobs_and_the_last_segment():
    log = ContextLog("r", [1], 10)
    seg = log.begin("e0", "u", None)
    log.append(seg, [5, 6], [-0.5, -0.6], None)
    seg2 = log.begin("e1", "u", None)
    log.append(seg2, [7, 8, 9], [-0.7, -0.8, -0.9], None)
    log.truncate(3)
    assert log.output_ids == [5, 6, 7] and log.logprobs == [-0.5, -0.6, -0.7]
    assert (seg.start, seg.end, seg2.start, seg2.end) == (0, 2, 2, 3)
    log.truncate(3)  # keeping everything drops nothing
    log.truncate(9)
    assert log.output_ids == [5, 6, 7] and log.logprobs == [-0.5, -0.6, -0.7] and seg2.end == 3
    log.truncate(2)
    assert log.output_ids == [5, 6] and seg2.end == 2 and log.remaining == 8


def test_truncate_of_a_log_without_segments_keeps_the_ids_consistent():
    log = ContextLog("r", [1], 10, output_ids=[4, 5, 6], logprobs=[None, -1.0, -2.0])
    log.truncate(1)
    assert log.output_ids == [4] and log.logprobs == [None] and log.segments == []


def test_restart_drops_every_committed_token_and_resumes_from_the_prompt():
    log = ContextLog("r", [1, 2], 10)
    seg = log.begin("e0", "u", None)
    log.append(seg, [5, 6], [-0.5, -0.6], "v")
    log.restart()
    assert log.output_ids == [] and log.logprobs == [] and log.committed == 0 and log.remaining == 10
    assert log.resume_input_ids() == [1, 2]
    assert log.begin("e1", "u", None).start == 0


def test_resume_input_ids_is_a_new_list_that_leaves_the_prompt_alone():
    log = ContextLog("r", [1, 2], 10)
    log.append(log.begin("e0", "u", None), [5], None, None)
    ids = log.resume_input_ids()
    ids.append(99)
    assert log.prompt_ids == [1, 2] and log.output_ids == [5]


def test_summary_lists_each_attempt_and_where_each_resume_started():
    log = ContextLog("r", [1], 10)
    s1 = log.begin("e0", "u0", 1)
    log.append(s1, [5, 6], None, "v1")
    s1.outcome, s1.t_end = "failed: killed", 5.0
    s2 = log.begin("e1", "u1", 3)
    log.append(s2, [7], None, "v1")
    s3 = log.begin("e2", "u2", 4)
    out = log.summary()
    assert out["attempts"] == 3 and out["resumed_from"] == [2, 3]
    assert [s["engine"] for s in out["segments"]] == ["e0", "e1", "e2"]
    assert out["segments"][0] == {**s1.__dict__} and out["segments"][0]["outcome"] == "failed: killed"
    assert out["segments"][2]["start"] == 3 and s3.end == 3


@pytest.mark.parametrize("lp, want", [(-0.25, -0.25), (0, 0.0), ([-1, 3, None], -1.0), ([None, 3, "x"], None),
                                      (None, None), ((-2.5,), -2.5)])
def test_each_logprob_form_the_engines_send_is_read_as_a_float_or_none(lp, want):
    log = ContextLog("r", [1], 10)
    seg = log.begin("e0", "u", None)
    log.append(seg, [5], [lp], None)
    assert log.logprobs == [want] and (want is None or type(log.logprobs[0]) is float)


def test_a_segment_built_directly_defaults_to_running_now():
    t0 = time.time()
    seg = Segment("e", "u", "v", 0, 0, None)
    assert seg.outcome == "running" and seg.t_end == 0.0 and t0 <= seg.t_start <= time.time()


def test_truncate_shortens_the_last_of_several_segments_only():
    log = ContextLog("r", [1], 10)
    segs = []
    for k in range(3):
        segs.append(log.begin(f"e{k}", "u", None))
        log.append(segs[-1], [10 + 2 * k, 11 + 2 * k], None, None)
    log.truncate(5)
    assert [(s.start, s.end) for s in segs] == [(0, 2), (2, 4), (4, 5)]
