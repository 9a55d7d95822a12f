"""Which sampling parameters a request can be resumed under exactly, token for token.

A resumed request goes on from prompt + committed ids on another engine. That is exact when the engine's
next-token distribution depends only on the token sequence and on parameters Belayer can carry across
the cut:
- greedy, temperature / top_p / top_k / min_p, logit_bias, stop_token_ids, ignore_eos: position-free;
- seeded sampling: the segment's seed follows the engine's seeding scheme (`segment_seed`): Belayer's CPU
  engine draws output token i with seed + i, so a segment starting after k tokens gets seed + k; SGLang's
  seeded sampler (only under --enable-deterministic-inference) hashes the seed with each token's absolute
  position, so a segment gets the request's seed unchanged;
- max_new_tokens and min_new_tokens: reduced by the committed count;
- stop strings: the engine only sees its own segment's text, so Belayer checks the combined text at every
  new token of a resumed segment (a stop string straddling the cut ends the request where the fault-free
  run ends it); without a tokenizer to decode with, this is refused.
Not exact, so refused (the request restarts from its prompt on another engine, a request-level retry with
a `resume_refused` event naming the reason, as Dynamo does for guided decoding):
- frequency / presence / repetition penalties: SGLang counts output tokens only, and committed tokens
  moved into the prompt would no longer be penalised;
- constrained decoding (regex, json_schema, ebnf, structural_tag): the grammar state starts at the first
  output token and SGLang's API cannot start it from a prefix;
- a custom logit processor or stop_regex: state Belayer cannot see.
`n > 1` is rejected up front: each of the n sequences is its own request (send n requests, with seeds).

Checked on real SGLang 0.5.23 on CPU (tests/test_sglang_sampling.py): greedy, logit_bias, min_new_tokens,
stop_token_ids and stop strings resume with the fault-free ids (in a stream SGLang withholds tokens that could
begin a stop string, so a cut lands before it; in chunked mode one straddles a chunk boundary, with or
without a failure there); with each penalty the
plain continuation from prompt + committed ids gives other ids than the fault-free run (so refusing is
needed), and the retry from the prompt gives the fault-free ids. Sampled requests (temperature > 0) are
resumed, not refused: on CPU SGLang cannot run deterministic inference (it refuses the torch_native attention
backend), so sampling_seed is ignored and no two runs agree even without faults; the resumed request is a
continuation of the committed tokens drawn from the same distribution, which a restart would not improve.

Owns: the rule per sampling parameter (continue exactly, or restart from the prompt). Must not: do I/O.
"""

from __future__ import annotations

from typing import Any, Optional

_GRAMMAR = ("regex", "json_schema", "ebnf", "structural_tag")


class UnsupportedRequestError(ValueError):
    """A request Belayer cannot run with token-level recovery at all (e.g. n > 1)."""


def check_request(sp: dict, body: dict | None = None) -> None:
    """Raises UnsupportedRequestError for requests the resumable path cannot run."""
    n = sp.get("n")
    if n is not None and n != 1:
        raise UnsupportedRequestError(
            f"sampling_params.n={n!r}: token-level recovery tracks one sequence per request; "
            f"send {n} requests (with distinct seeds) instead")


def resume_refusals(sp: dict, body: dict | None = None, can_check_stop: bool = True) -> list[str]:
    """Why resuming this request from a cut would not be exact (empty: it resumes exactly)."""
    out = []
    for k in ("frequency_penalty", "presence_penalty"):
        if _num(sp.get(k), 0.0) != 0.0:
            out.append(f"{k}={sp[k]} counts output tokens, which a resume moves into the prompt")
    if _num(sp.get("repetition_penalty"), 1.0) != 1.0:
        out.append(f"repetition_penalty={sp['repetition_penalty']} counts output tokens, which a resume "
                   f"moves into the prompt")
    for k in _GRAMMAR:
        if sp.get(k):
            out.append(f"constrained decoding ({k}) cannot be continued from a prefix")
    if sp.get("stop_regex"):
        out.append("stop_regex is matched by the engine on its own output only")
    if (body or {}).get("custom_logit_processor") or sp.get("custom_params"):
        out.append("a custom logit processor keeps state Belayer cannot carry")
    if stop_strings(sp) and not can_check_stop:
        out.append("stop strings may straddle the cut and no tokenizer is available to check them")
    return out


def segment_seed(seed: Optional[int], committed: int, per_position: bool) -> Optional[int]:
    """The seed for a segment that starts after `committed` output tokens.

    `per_position`: the engine derives each token's randomness from the seed and the token's absolute
    position (SGLang's deterministic sampler), so the seed stays the request's; otherwise it seeds the
    request's i-th output token with seed + i (Belayer's CPU engine), so the segment gets seed + committed.
    """
    if seed is None:
        return None
    return int(seed) if per_position else int(seed) + committed


def stop_strings(sp: dict) -> list[str]:
    stop = sp.get("stop") or []
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str) and s]


def _num(v: Any, neutral: float) -> float:
    try:
        return neutral if v is None else float(v)
    except (TypeError, ValueError):
        return neutral + 1.0  # not a number: the engine rejects it; never call it neutral
