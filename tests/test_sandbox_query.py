"""The scripted trials' state query: an exec whose output stream the runtime lost (exit 0, nothing printed)
is asked again, never taken for an empty state; a failing query is a dead sandbox."""

from __future__ import annotations

import pytest

from belayer_plugin.sandbox.base import ExecResult, SandboxDead
from belayer_plugin.sandbox.scripted import QUERY, golden_state, query_state


class _Replies:
    """Answers QUERY with the given results in turn (the runtime's side of one sandbox's exec calls)."""

    def __init__(self, *results: ExecResult):
        self.results = list(results)
        self.calls: list[str] = []

    def exec(self, command: str, timeout: float) -> ExecResult:
        self.calls.append(command)
        return self.results.pop(0)


def test_a_lost_output_stream_is_queried_again_not_taken_for_an_empty_state():
    sb = _Replies(ExecResult("", "", 0, 0.01), ExecResult(golden_state(3), "", 0, 0.01))
    assert query_state(sb) == golden_state(3)
    assert sb.calls == [QUERY, QUERY]


def test_a_failing_query_is_a_dead_sandbox():
    with pytest.raises(SandboxDead):
        query_state(_Replies(ExecResult("", "container is not running", 1, 0.01)))


def test_output_lost_every_time_is_returned_as_is_and_fails_the_golden_comparison():
    sb = _Replies(*[ExecResult("", "", 0, 0.01)] * 3)
    assert query_state(sb) == "" != golden_state(3) and len(sb.calls) == 3
