"""Exact resume, or a clear refusal, for sampling parameters: golden runs against runs cut at several
positions (the engine aborts the request, or its server is SIGKILLed) and resumed on another engine."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from belayer_plugin.config import RecoveryConfig
from belayer_plugin.events import EventLog
from belayer_plugin.generation.resumable import RequestFailedError, ResumableGenerator, StaticSelector
from belayer_plugin.generation.sglang_http import generate
from tests.conftest import ServerProc, belayer_cfg

PROMPT = [54, 280, 487, 423, 442]
# Seeded sampling that hits EOS at token 35 with min_new_tokens=20 (checked below as a precondition):
# without min_new_tokens reduced by the committed count, a resumed request masks EOS too long.
MIN_NEW = {"max_new_tokens": 60, "temperature": 1.0, "sampling_seed": 291, "min_new_tokens": 20}


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("resume-engines")
    # 5 ms per step: a cut triggered from the client lands where it is asked to (no coalesced chunks).
    stable = ServerProc(tiny_model, d, ["--step-delay-ms", "5"])
    out = {"stable": stable, "dir": d, "model": tiny_model}
    yield out
    stable.kill(signal.SIGTERM)
    if "victim" in out:
        out["victim"].kill(signal.SIGTERM)


def _recovery() -> RecoveryConfig:
    return belayer_cfg("belayer.recovery.stall_timeout_s=10").recovery


async def _golden(url: str, sp: dict) -> dict:
    async with httpx.AsyncClient() as c:
        return await generate(c, url, {"input_ids": PROMPT, "sampling_params": sp}, 60)


async def _cut_run(servers, sp: dict, at: int, how: str, rid: str, tokenizer: bool = True):
    """Runs `sp` starting on a victim engine that fails once `at` tokens are committed; resumes on the other."""
    if how == "kill" or "victim" not in servers:
        # 20 ms per step on the victim: an abort posted at token `at` lands before the request can finish.
        victim = ServerProc(servers["model"], servers["dir"], ["--step-delay-ms", "20"])
        if how != "kill":
            servers["victim"] = victim  # aborts leave it running: reused
    else:
        victim = servers["victim"]
    events = EventLog()
    gen = ResumableGenerator(StaticSelector([victim.url, servers["stable"].url]), _recovery(), events,
                             tokenizer_path=servers["model"] if tokenizer else None)
    cut = []

    async def fail(clog, seg):
        if not cut and seg.url == victim.url and clog.committed >= at:
            cut.append(clog.committed)
            if how == "kill":
                os.killpg(victim.proc.pid, signal.SIGKILL)
            else:
                async with httpx.AsyncClient() as c:
                    await c.post(f"{victim.url}/abort_request", json={"rid": rid}, timeout=5)

    try:
        clog, resp = await gen.generate(rid, PROMPT, sp, on_progress=fail)
    finally:
        if how == "kill":
            victim.kill()
    assert cut, f"the cut at {at} never happened (finished with {clog.committed} tokens)"
    return clog, resp, events


@pytest.mark.parametrize("how, at", [("abort", 5), ("abort", 25), ("kill", 25)])
async def test_min_new_tokens_resumes_exactly_at_any_cut(servers, how, at):
    golden = await _golden(servers["stable"].url, MIN_NEW)
    n = len(golden["output_ids"])
    assert golden["meta_info"]["finish_reason"]["type"] == "stop" \
        and MIN_NEW["min_new_tokens"] < n < MIN_NEW["max_new_tokens"], \
        f"precondition: EOS right after min_new_tokens, got {n} tokens ({golden['meta_info']['finish_reason']})"
    clog, resp, _ = await _cut_run(servers, MIN_NEW, at, how, f"min-{how}-{at}")
    assert len(clog.segments) == 2 and clog.segments[1].start >= at
    assert resp["output_ids"] == golden["output_ids"]
    assert resp["meta_info"]["finish_reason"]["type"] == "stop"


async def _straddling_stop(servers) -> tuple[str, int, list[int]]:
    """A stop string spanning tokens [m-2, m+10) of the greedy output, m chosen where they decode cleanly: a cut
    at token m falls inside it, 10 tokens (200 ms on the victim) before the fault-free run would stop."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(servers["model"])
    base = (await _golden(servers["stable"].url, {"max_new_tokens": 80, "temperature": 0.0}))["output_ids"]
    for m in range(20, 60):
        piece = tok.decode(base[m - 2:m + 10])
        if piece.isprintable() and "\ufffd" not in piece and piece not in tok.decode(base[:m + 9]):
            return piece, m, base
    pytest.fail("no cleanly decodable 12-token span in the greedy output")


@pytest.mark.parametrize("how", ["abort", "kill"])
async def test_a_stop_string_straddling_the_cut_ends_the_request_where_the_fault_free_run_does(servers, how):
    stop, m, _ = await _straddling_stop(servers)
    sp = {"max_new_tokens": 80, "temperature": 0.0, "stop": [stop]}
    golden = await _golden(servers["stable"].url, sp)
    assert golden["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    clog, resp, _ = await _cut_run(servers, sp, m, how, f"stop-{how}")
    cut = clog.segments[1].start
    assert cut < len(golden["output_ids"]), "the cut must fall before the end of the stop string"
    assert resp["output_ids"] == golden["output_ids"]
    assert clog.finish_reason == {"type": "stop", "matched": stop}


async def test_stop_strings_without_a_tokenizer_fail_over_from_the_prompt(servers):
    stop, m, _ = await _straddling_stop(servers)
    sp = {"max_new_tokens": 80, "temperature": 0.0, "stop": [stop]}
    golden = await _golden(servers["stable"].url, sp)
    clog, resp, events = await _cut_run(servers, sp, m, "abort", "stop-notok", tokenizer=False)
    assert clog.segments[-1].start == 0 and resp["output_ids"] == golden["output_ids"]
    assert "no tokenizer" in events.find(lambda e: e.kind == "resume_refused")[0].reason


@pytest.mark.parametrize("extra, reason", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"regex": "[a-z ]+"}, "constrained decoding (regex)"),
    ({"json_schema": '{"type": "string"}'}, "constrained decoding (json_schema)"),
    ({"ebnf": 'root ::= "a"+'}, "constrained decoding (ebnf)"),
])
async def test_parameters_that_cannot_continue_exactly_restart_from_the_prompt_with_a_reason(servers, extra, reason):
    sp = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 7, **extra}
    golden = await _golden(servers["stable"].url, sp)
    clog, resp, events = await _cut_run(servers, sp, 12, "abort", f"refuse-{reason[:12]}")
    refused = events.find(lambda e: e.kind == "resume_refused")
    assert len(refused) == 1 and reason in refused[0].reason and refused[0].figures["committed"] >= 12
    assert clog.segments[-1].start == 0, "the retry must start from the prompt, not from the cut"
    assert resp["output_ids"] == golden["output_ids"]  # seeded: the retry from the prompt is the golden run


async def test_n_above_one_is_refused_up_front_with_a_clear_error(servers):
    gen = ResumableGenerator(StaticSelector([servers["stable"].url]), _recovery(), EventLog())
    with pytest.raises(RequestFailedError) as ei:
        await gen.generate("fan-out", PROMPT, {"max_new_tokens": 4, "n": 2})
    assert ei.value.status == 400 and "send 2 requests" in str(ei.value)


def test_a_resumed_segment_seed_follows_the_engines_seeding_scheme():
    from belayer_plugin.generation.resume_policy import segment_seed

    # CPU engine: output token i drawn with seed + i, so a segment after 12 tokens starts at seed + 12.
    assert segment_seed(7, 12, per_position=False) == 19 and segment_seed(7, 0, per_position=False) == 7
    # SGLang's deterministic sampler hashes (seed, absolute position): the request's seed, unchanged.
    assert segment_seed(7, 12, per_position=True) == 7
    assert segment_seed(None, 12, per_position=True) is None and segment_seed(None, 3, per_position=False) is None
