"""The resume policy as pure functions: which sampling parameters a cut request resumes under exactly.

The real-engine checks of the same rules are in tests/test_resume_sampling.py and test_sglang_sampling.py;
these pin each rule's boundary without an engine (bench/mutation.py runs them against mutants).
"""

from __future__ import annotations

import pytest

from belayer_plugin.generation.resume_policy import (
    UnsupportedRequestError,
    check_request,
    resume_refusals,
    segment_seed,
    stop_strings,
)


@pytest.mark.parametrize("sp", [{}, {"n": None}, {"n": 1}, {"max_new_tokens": 8, "temperature": 0.7}])
def test_one_sequence_per_request_is_accepted(sp):
    check_request(sp)
    check_request(sp, {"text": "hi"})


@pytest.mark.parametrize("n", [0, 2, 5])
def test_n_other_than_one_is_refused_up_front_naming_the_fan_out(n):
    with pytest.raises(UnsupportedRequestError) as ei:
        check_request({"n": n})
    msg = str(ei.value)
    assert f"sampling_params.n={n!r}" in msg and f"send {n} requests" in msg and "distinct seeds" in msg
    assert isinstance(ei.value, ValueError)  # the front answers a ValueError with 400


@pytest.mark.parametrize("sp", [
    {},
    {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "logit_bias": {"5": 1.0},
     "stop_token_ids": [2], "ignore_eos": True, "max_new_tokens": 64, "min_new_tokens": 3, "sampling_seed": 7},
    {"frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1.0},
    {"frequency_penalty": None, "presence_penalty": None, "repetition_penalty": None},
    {"regex": "", "json_schema": None, "ebnf": "", "structural_tag": None, "stop_regex": "", "custom_params": None},
])
def test_position_free_parameters_and_neutral_penalties_resume_exactly(sp):
    assert resume_refusals(sp) == []
    assert resume_refusals(sp, {"custom_logit_processor": None}) == []
    assert resume_refusals(sp, None, can_check_stop=False) == []  # no stop strings: no tokenizer needed


@pytest.mark.parametrize("key", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [0.5, -0.5, "0.25"])
def test_a_frequency_or_presence_penalty_is_refused_naming_its_value(key, value):
    (reason,) = resume_refusals({key: value})
    assert reason == f"{key}={value} counts output tokens, which a resume moves into the prompt"


@pytest.mark.parametrize("value", [1.1, 0.9, 2])
def test_a_repetition_penalty_other_than_one_is_refused_naming_its_value(value):
    (reason,) = resume_refusals({"repetition_penalty": value})
    assert reason == f"repetition_penalty={value} counts output tokens, which a resume moves into the prompt"


@pytest.mark.parametrize("key", ["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_a_penalty_that_is_not_a_number_is_never_called_neutral(key):
    (reason,) = resume_refusals({key: "strong"})
    assert reason.startswith(f"{key}=strong counts output tokens")
    (reason,) = resume_refusals({key: [1.0]})  # a TypeError in float(): refused as well
    assert reason.startswith(f"{key}=[1.0] ")


@pytest.mark.parametrize("key", ["regex", "json_schema", "ebnf", "structural_tag"])
def test_constrained_decoding_is_refused_naming_the_grammar_kind(key):
    assert resume_refusals({key: "x"}) == [f"constrained decoding ({key}) cannot be continued from a prefix"]


def test_stop_regex_and_custom_logit_processors_are_refused_with_their_reasons():
    assert resume_refusals({"stop_regex": "a+"}) == ["stop_regex is matched by the engine on its own output only"]
    custom = ["a custom logit processor keeps state Belayer cannot carry"]
    assert resume_refusals({}, {"custom_logit_processor": "pickled"}) == custom
    assert resume_refusals({"custom_params": {"k": 1}}) == custom
    assert resume_refusals({"custom_params": {"k": 1}}, {"custom_logit_processor": "p"}) == custom  # said once


def test_every_refusal_of_one_request_is_listed_in_order():
    sp = {"frequency_penalty": 1, "presence_penalty": 1, "repetition_penalty": 1.2, "regex": "r", "ebnf": "e",
          "stop_regex": "s", "custom_params": {"a": 1}, "stop": "END"}
    reasons = resume_refusals(sp, can_check_stop=False)
    assert [r.split(" ")[0].split("=")[0] for r in reasons] == [
        "frequency_penalty", "presence_penalty", "repetition_penalty", "constrained", "constrained", "stop_regex",
        "a", "stop"]
    assert "(regex)" in reasons[3] and "(ebnf)" in reasons[4]


@pytest.mark.parametrize("stop", ["END", ["END"], ["", "END", None, 3]])
def test_stop_strings_resume_only_where_a_tokenizer_can_check_the_combined_text(stop):
    assert resume_refusals({"stop": stop}) == []
    assert resume_refusals({"stop": stop}, can_check_stop=False) == [
        "stop strings may straddle the cut and no tokenizer is available to check them"]


@pytest.mark.parametrize("stop, want", [
    (None, []), ("", []), ([], []), ("END", ["END"]), (["a", "b"], ["a", "b"]),
    (["", "a", None, 7, "b"], ["a", "b"]),
])
def test_stop_strings_are_the_non_empty_strings_of_stop(stop, want):
    assert stop_strings({"stop": stop}) == want
    assert stop_strings({}) == []


def test_stop_token_ids_alone_need_no_tokenizer():
    assert resume_refusals({"stop_token_ids": [2, 3], "stop": [None, ""]}, can_check_stop=False) == []


@pytest.mark.parametrize("seed, committed, per_position, want", [
    (7, 12, False, 19), (7, 0, False, 7), (0, 5, False, 5), ("3", 4, False, 7),
    (7, 12, True, 7), ("3", 4, True, 3), (0, 9, True, 0),
    (None, 12, True, None), (None, 3, False, None),
])
def test_a_segment_seed_is_the_requests_or_shifted_by_the_committed_count(seed, committed, per_position, want):
    got = segment_seed(seed, committed, per_position)
    assert got == want and (want is None or type(got) is int)
