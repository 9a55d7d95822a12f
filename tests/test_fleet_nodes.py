"""Node health and the resume policy as pure functions: node evidence, decay, re-admission, refunds, refusals."""

from __future__ import annotations

from belayer_plugin.config import RestartConfig
from belayer_plugin.fleet.nodes import Death, NodeHealth
from belayer_plugin.fleet.policy import RestartPolicy
from belayer_plugin.generation.resume_policy import UnsupportedRequestError, check_request, resume_refusals

import pytest

HOSTS = ["node-a", "node-b"]


def _nodes(**kw) -> NodeHealth:
    return NodeHealth(**{"min_slots": 2, "window_s": 30.0, "decay_s": 100.0, **kw})


def test_repeated_deaths_of_one_slot_are_never_node_evidence():
    n = _nodes()
    for i in range(5):
        assert n.record_death(Death("node-a", "engine-0", i, float(i)), HOSTS) is None
    assert not n.is_excluded("node-a")


def test_deaths_of_two_slots_on_one_node_within_the_window_exclude_it_with_the_evidence():
    n = _nodes()
    assert n.record_death(Death("node-a", "engine-0", 0, 0.0), HOSTS) is None
    assert n.record_death(Death("node-b", "engine-1", 0, 1.0), HOSTS) is None  # another node: no evidence
    v = n.record_death(Death("node-a", "shadow-3", 0, 2.0), HOSTS)
    assert v is not None and v.action == "exclude" and n.is_excluded("node-a")
    assert "engine-0" in v.reason and "shadow-3" in v.reason and "2 different slots" in v.reason


def test_deaths_outside_the_window_are_not_combined():
    n = _nodes(window_s=10.0)
    n.record_death(Death("node-a", "engine-0", 0, 0.0), HOSTS)
    assert n.record_death(Death("node-a", "engine-1", 0, 10.5), HOSTS) is None


def test_deaths_sharing_a_request_are_that_request_not_the_node():
    n = _nodes()
    n.record_death(Death("node-a", "engine-0", 0, 0.0, frozenset({"r1", "r2"})), HOSTS)
    assert n.record_death(Death("node-a", "engine-1", 0, 1.0, frozenset({"r2"})), HOSTS) is None
    v = n.record_death(Death("node-a", "engine-2", 0, 2.0, frozenset({"r9"})), HOSTS)
    assert v is not None and v.action == "exclude"  # engine-0 (or -1) and engine-2 share nothing


def test_the_last_node_able_to_host_engines_is_never_excluded():
    n = _nodes()
    n.record_death(Death("node-a", "engine-0", 0, 0.0), ["node-a"])
    v = n.record_death(Death("node-a", "engine-1", 0, 1.0), ["node-a"])
    assert v is not None and v.action == "refused" and "last node" in v.reason
    assert not n.is_excluded("node-a")


def test_exclusions_decay_and_can_be_lifted_by_hand():
    n = _nodes(decay_s=50.0)
    n.record_death(Death("node-a", "engine-0", 0, 0.0), HOSTS)
    n.record_death(Death("node-a", "engine-1", 0, 1.0), HOSTS)
    assert n.decay(40.0) == [] and n.is_excluded("node-a")
    assert n.decay(51.0) == ["node-a"] and not n.is_excluded("node-a")
    assert n.node_dead("node-b", 60.0, "Ray reports node node-b dead").action == "exclude"
    assert n.readmit("node-b") and not n.is_excluded("node-b") and not n.readmit("node-b")


def test_a_poison_requests_deaths_are_forgotten_as_node_evidence():
    n = _nodes()
    n.record_death(Death("node-a", "engine-0", 3, 0.0), HOSTS)
    n.forget("engine-0", 3)
    assert n.record_death(Death("node-a", "engine-1", 0, 1.0), HOSTS) is None


def test_restart_refund_gives_back_exactly_the_named_death():
    p = RestartPolicy(RestartConfig(max_restarts=2, window_s=100.0, backoff_initial_s=1.0, backoff_max_s=5.0,
                                    backoff_multiplier=2.0, min_healthy_engines=1, node_exclusion_slots=2,
                                    node_exclusion_decay_s=0.0, node_check_timeout_s=1.0))
    p.record_restart("e", 0.0, ("e", 0))
    p.record_restart("e", 1.0, ("e", 1))
    assert p.decide("e", 2.0).action == "retire"
    assert p.refund("e", ("e", 1)) and not p.refund("e", ("e", 1))
    assert p.decide("e", 2.0).action == "restart" and p.restarts_in_window("e", 2.0) == 1


@pytest.mark.parametrize("sp, exact", [
    ({"temperature": 0.0, "min_new_tokens": 5, "stop_token_ids": [3], "top_k": 5, "min_p": 0.1}, True),
    ({"temperature": 1.0, "sampling_seed": 1, "logit_bias": {"3": 1.0}, "frequency_penalty": 0.0}, True),
    ({"stop": ["ab"]}, True),
    ({"frequency_penalty": 0.5}, False),
    ({"presence_penalty": -0.2}, False),
    ({"repetition_penalty": 1.1}, False),
    ({"regex": "[a-z]+"}, False),
    ({"json_schema": "{}"}, False),
    ({"ebnf": "root ::= 'a'"}, False),
])
def test_resume_is_exact_only_where_the_engine_state_can_be_carried(sp, exact):
    assert (resume_refusals(sp) == []) is exact


def test_stop_strings_are_refused_without_a_tokenizer_and_n_above_one_is_rejected():
    assert resume_refusals({"stop": "x"}, can_check_stop=False)
    check_request({"n": 1})
    with pytest.raises(UnsupportedRequestError, match="send 3 requests"):
        check_request({"n": 3})
