"""Incremental detokenization: the streamed text equals the full decode, at O(n) decoding cost."""

from __future__ import annotations

import pytest

from belayer_plugin.detok import IncrementalText

TEXT = "héllo wörld 日本語 🙂 done, and then some more words to decode 🙂🙂 end"


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


class _Counting:
    """The tokenizer, counting how many ids each decode is handed."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_text_of_each_prefix_is_the_full_decode_without_unfinished_characters(tok):
    ids = tok(TEXT)["input_ids"] * 4
    inc = IncrementalText(tok)
    for i in range(1, len(ids) + 1):
        full = tok.decode(ids[:i], skip_special_tokens=True)
        got = inc.update(ids[:i])
        assert "\ufffd" not in got
        assert full.startswith(got) and len(full) - len(got) <= 1, (i, got, full)
    assert inc.text == tok.decode(ids, skip_special_tokens=True)


def test_decoding_cost_grows_linearly_not_quadratically(tok):
    ids = tok(TEXT)["input_ids"] * 20  # ~600 ids
    counting = _Counting(tok)
    inc = IncrementalText(counting)
    for i in range(1, len(ids) + 1):
        inc.update(ids[:i])
    assert inc.text == tok.decode(ids, skip_special_tokens=True)
    # A whole-text decode per token would hand the tokenizer ~n^2/2 = 180k ids.
    assert counting.decoded <= 8 * len(ids), counting.decoded


def test_a_cut_and_regrown_sequence_is_decoded_afresh(tok):
    a, b = tok("one two three four")["input_ids"], tok(" five six")["input_ids"]
    inc = IncrementalText(tok)
    inc.update(a + b)
    assert inc.update(a[:2]) == tok.decode(a[:2])  # shorter: a stop string truncated the output
    other = a[:2] + tok(" seven")["input_ids"]
    inc.update(a[:3])
    assert inc.update(other) == tok.decode(other)  # same length class, different ids: starts over
