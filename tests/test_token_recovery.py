"""Token-level recovery: in-flight requests survive real engine kills without regenerating tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal

import httpx
import pytest

from belayer_plugin.events import EventLog
from belayer_plugin.fleet.manager import FleetManager
from belayer_plugin.generation.context_log import ContextLog
from belayer_plugin.generation.front import GenerationFront
from belayer_plugin.generation.resumable import FleetSelector, RequestFailedError, ResumableGenerator
from belayer_plugin.generation.sglang_http import generate, generate_stream, get_json
from tests.conftest import belayer_cfg
from tests.test_fleet_recovery import FAST

PROMPTS = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400], [7, 8, 9, 10, 11, 12]]
N = 300
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}


def test_context_log_commits_cumulative_chunks_once():
    log = ContextLog("r", [1, 2], 10)
    seg = log.begin("e0", "u0", None)
    assert log.commit(seg, [5], [[-0.1, 5, None]], "v1") == 1
    assert log.commit(seg, [5, 6, 7], [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]], "v1") == 2
    assert log.commit(seg, [5, 6, 7], None, "v1") == 0
    assert log.resume_input_ids() == [1, 2, 5, 6, 7] and log.remaining == 7
    seg2 = log.begin("e1", "u1", None)
    log.commit(seg2, [8], [[-0.4, 8, None]], "v1")  # relative to the resumed request
    assert log.output_ids == [5, 6, 7, 8] and log.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert (seg.start, seg.end, seg2.start, seg2.end) == (0, 3, 3, 4)


@contextlib.asynccontextmanager
async def fleet_and_front(tmp_path, tiny_model, *overrides):
    # 2 ms per decode step: slow enough that a kill triggered from the client side lands mid-generation.
    cfg = belayer_cfg(*FAST, "belayer.recovery.stall_timeout_s=3", "belayer.engines.cpu_step_delay_ms=2", *overrides)
    events = EventLog(tmp_path / "events.jsonl")
    fm = FleetManager(cfg, tmp_path, events, model_path=tiny_model)
    await fm.start()
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, events)
    front = GenerationFront(gen, tiny_model, info_url=lambda: fm.pick_engine().info.url)
    await front.start()
    try:
        yield fm, gen, front
    finally:
        await front.stop()
        await gen.aclose()  # its stream session: unclosed, aiohttp warns when it is collected
        await fm.shutdown()


async def _golden(url: str) -> list[list[int]]:
    async with httpx.AsyncClient() as c:
        return [(await generate(c, url, {"input_ids": p, "sampling_params": GREEDY}, 120))["output_ids"] for p in PROMPTS]


async def _counters(fm) -> dict[str, dict]:
    out = {}
    async with httpx.AsyncClient() as c:
        for s in fm.serving_slots():  # the killed engine's replacement may still be starting
            out[s.info.url] = (await get_json(c, s.info.url, "/get_server_info", 5))["belayer_counters"]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_kill_at_random_token_every_request_completes_with_golden_ids_and_nothing_regenerated(
        tmp_path, tiny_model, seed):
    rng = random.Random(seed)
    kill_at = rng.randint(5, 200)
    async with fleet_and_front(tmp_path, tiny_model) as (fm, gen, front):
        golden = await _golden(fm.slots["engine-0"].info.url)
        base = await _counters(fm)
        killed: dict = {}

        chunks: dict[int, list[dict]] = {0: [], 1: []}
        async with httpx.AsyncClient() as c:
            async def streamed(i):
                async for ch in generate_stream(c, front.url, {"input_ids": PROMPTS[i], "sampling_params": GREEDY,
                                                                "rid": f"s{i}", "return_logprob": True}, 120):
                    chunks[i].append(ch)
                return chunks[i][-1]

            def kill(clog, seg):  # at token `kill_at` of request s0, as the front commits it
                if clog.rid == "s0" and not killed and clog.committed >= kill_at:
                    slot = fm.slots[seg.engine]
                    killed.update(url=slot.info.url, seen=clog.committed)
                    os.kill(slot.info.pid, signal.SIGKILL)

            gen.observers.append(kill)

            async def plain(i):
                return await generate(c, front.url, {"input_ids": PROMPTS[i], "sampling_params": GREEDY,
                                                     "rid": f"p{i}", "return_logprob": True}, 120)

            outs = await asyncio.gather(streamed(0), streamed(1), plain(2), plain(3))
        assert killed, "the kill never happened"
        for i, out in enumerate(outs):
            assert out["output_ids"] == golden[i], f"request {i} differs from the fault-free run"
            assert out["meta_info"]["id"] == (f"s{i}" if i < 2 else f"p{i}")
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": N}
            assert len(out["meta_info"]["output_token_logprobs"]) == N
        segs0 = outs[0]["meta_info"]["belayer"]["segments"]
        assert len(segs0) >= 2 and segs0[0]["url"] == killed["url"]
        # The front's streamed text (decoded incrementally, across the resume) is the text of each chunk's
        # ids, bar bytes that do not decode yet, and the final chunk is exactly the full decode.
        tok = front.tokenizer
        for ch in chunks[0]:
            full = tok.decode(ch["output_ids"], skip_special_tokens=True)
            rest = full[len(ch["text"]):]  # held back only behind bytes that do not decode yet (as SGLang)
            assert full.startswith(ch["text"]) and (len(rest) <= 4 or "\ufffd" in rest), (ch["text"], full)
        texts = [ch["text"] for ch in chunks[0]]
        assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:])) and len(set(texts)) >= len(texts) // 4
        assert chunks[0][-1]["text"] == tok.decode(golden[0], skip_special_tokens=True)
        assert segs0[1]["start"] >= killed["seen"], "tokens streamed before the kill were generated again"
        # Engine counters: the survivors generated exactly what the segments on them account for.
        after = await _counters(fm)
        on_survivors = {}
        for out in outs:
            for sg in out["meta_info"]["belayer"]["segments"]:
                if sg["url"] != killed["url"]:
                    on_survivors[sg["url"]] = on_survivors.get(sg["url"], 0) + sg["end"] - sg["start"]
        assert killed["url"] not in after
        for url, cnt in after.items():
            generated = cnt["generated_tokens"] - base.get(url, {}).get("generated_tokens", 0)
            assert generated == on_survivors.get(url, 0), (url, generated, on_survivors)
        assert fm.events.find(lambda e: e.kind == "resumed")


async def test_with_no_per_token_reader_chunks_are_parsed_per_segment_not_per_token_and_a_kill_loses_none(
        tmp_path, tiny_model, monkeypatch):
    """A non-streaming client (as trainers post) and a streaming one through the front, no observers: only the
    newest chunk is kept and parsed when its segment ends; a SIGKILL still loses no token."""
    from belayer_plugin.generation import resumable

    parses = []
    real_parse = resumable.parse_chunk
    monkeypatch.setattr(resumable, "parse_chunk", lambda url, raw: parses.append(url) or real_parse(url, raw))
    # and no task woken per chunk: every segment is read by callbacks from the socket (stream_reader.py),
    # none through the per-chunk async iterator
    iterated = []
    real_events = resumable.stream_events
    monkeypatch.setattr(resumable, "stream_events", lambda *a, **k: iterated.append(a[1]) or real_events(*a, **k))
    async with fleet_and_front(tmp_path, tiny_model) as (fm, gen, front):
        golden = await _golden(fm.slots["engine-0"].info.url)
        base = await _counters(fm)
        killed: dict = {}
        seen_chunks = {"lazy": 0}
        progressed = gen.selector.progressed

        def count_and_kill(target, rid, chunks=1):  # the per-read token-progress signal: no parse behind it
            progressed(target, rid, chunks)
            if rid == "lazy":
                seen_chunks[rid] += 1
                # (reads, not tokens: a reader that keeps only the newest chunk reads the socket every
                # recovery.stream_coalesce_ms, several tokens per read)
                if seen_chunks[rid] == 5 and not killed:
                    killed.update(url=target.url)
                    os.kill(fm.slots[target.engine].info.pid, signal.SIGKILL)

        gen.selector.progressed = count_and_kill
        chunks = []
        async with httpx.AsyncClient() as c:
            async def streamed():
                async with c.stream("POST", f"{front.url}/generate", json={
                        "input_ids": PROMPTS[1], "sampling_params": GREEDY, "stream": True, "rid": "fwd"},
                        timeout=120) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            chunks.append(json.loads(line[5:]))

            lazy, _ = await asyncio.gather(
                generate(c, front.url, {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "rid": "lazy"}, 120),
                streamed())
        assert killed, "the kill never happened"
        assert lazy["output_ids"] == golden[0]
        segs = lazy["meta_info"]["belayer"]["segments"]
        assert len(segs) == 2 and segs[0]["url"] == killed["url"] and segs[1]["start"] >= 5
        assert chunks[-1]["output_ids"] == golden[1] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        # The streamed request's engine chunks were forwarded as they came, tagged, with no finish reason.
        body = chunks[:-1]
        assert len(body) >= 10 and all(ch["meta_info"]["finish_reason"] is None for ch in body)
        assert all(ch["meta_info"]["belayer"]["attempt"] >= 1 and ch["meta_info"]["belayer"]["engine"] for ch in body)
        assert all(golden[1][:len(ch["output_ids"])] == ch["output_ids"] for ch in body)
        # 2 x 300 tokens streamed from the engines; a parse per token would be hundreds.
        assert len(parses) <= 6, len(parses)
        assert iterated == [], iterated
        after = await _counters(fm)
        for url, cnt in after.items():  # the survivor generated exactly what the segments on it account for
            on_it = sum(sg["end"] - sg["start"] for out in (lazy, chunks[-1])
                        for sg in out["meta_info"]["belayer"]["segments"] if sg["url"] == url)
            assert cnt["generated_tokens"] - base.get(url, {}).get("generated_tokens", 0) == on_it, url


async def test_with_a_stream_interval_chunks_commit_k_tokens_and_a_killed_request_still_ends_as_golden(
        tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, "belayer.recovery.stream_interval=4") as (fm, gen, front):
        golden = await _golden(fm.slots["engine-0"].info.url)
        seen: list[tuple[int, int]] = []  # (segment index, committed) at each commit

        def kill_at_100(clog, seg):
            seen.append((len(clog.segments), clog.committed))
            if len(clog.segments) == 1 and clog.committed >= 100:
                os.kill(fm.slots[seg.engine].info.pid, signal.SIGKILL)

        clog, resp = await gen.generate("k4", PROMPTS[0], GREEDY, on_progress=kill_at_100)
        assert resp["output_ids"] == golden[0]
        assert len(clog.segments) >= 2 and clog.segments[1].start >= 100
        first = [c for i, c in seen if i == 1]
        assert first[0] == 1 and all(b - a >= 4 for a, b in zip(first[1:], first[2:])), first


async def test_a_hung_engine_is_abandoned_after_the_stall_timeout_and_the_request_resumes(tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, "belayer.recovery.stall_timeout_s=1",
                               "belayer.monitor.probe_timeout_s=3") as (fm, gen, front):
        golden = await _golden(fm.slots["engine-1"].info.url)
        stopped = []

        def hang(clog, seg):
            if not stopped and clog.committed >= 50:
                pid = fm.slots[seg.engine].info.pid
                stopped.append(pid)
                os.kill(pid, signal.SIGSTOP)

        try:
            clog, resp = await gen.generate("h0", PROMPTS[0], GREEDY, on_progress=hang)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert resp["output_ids"] == golden[0]
        assert len(clog.segments) == 2 and clog.segments[1].start >= 50


async def test_chunked_mode_resumes_from_the_last_committed_chunk(tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, "belayer.recovery.mode=chunked",
                               "belayer.recovery.chunk_tokens=32") as (fm, gen, front):
        golden = await _golden(fm.slots["engine-0"].info.url)
        done = []

        def kill_after_third_chunk(clog, seg):
            if not done and clog.committed >= 96:
                done.append(clog.committed)
                os.kill(fm.slots[seg.engine].info.pid, signal.SIGKILL)

        clog, resp = await gen.generate("c0", PROMPTS[1], GREEDY, return_logprob=True, on_progress=kill_after_third_chunk)
        assert resp["output_ids"] == golden[1]
        assert clog.segments[1].start == done[0] == 96  # the committed chunks were kept
        assert all(lp is not None for lp in clog.logprobs)


async def test_budget_spent_fails_only_that_request_with_a_typed_error(tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, "belayer.recovery.max_attempts=1") as (fm, gen, front):
        async with httpx.AsyncClient() as c:
            async def victim():
                chunks = []
                async for line in (await c.send(c.build_request("POST", f"{front.url}/generate", json={
                        "input_ids": PROMPTS[0], "sampling_params": GREEDY, "stream": True, "rid": "victim"}),
                        stream=True)).aiter_lines():
                    if line.startswith("data:"):
                        chunks.append(line[5:].strip())
                        if len(chunks) == 10:
                            os.kill(fm.slots[json.loads(chunks[-1])["meta_info"]["belayer"]["engine"]].info.pid,
                                    signal.SIGKILL)
                return chunks

            other = asyncio.create_task(generate(c, front.url, {"input_ids": PROMPTS[2], "sampling_params": GREEDY}, 120))
            chunks = await victim()
            assert "[DONE]" not in chunks
            err = json.loads(chunks[-1])
            assert "error" in err and "request victim" in err["error"]["message"]
            # the other request ran on the other engine (least-loaded placement) and is unaffected
            assert len((await other)["output_ids"]) == N
        with pytest.raises(RequestFailedError, match="attempt"):
            await gen.generate("doomed", PROMPTS[0], GREEDY,
                               on_progress=lambda clog, seg: clog.committed == 5 and os.kill(
                                   fm.slots[seg.engine].info.pid, signal.SIGKILL))


MALFORMED = [
    (b"{", "not valid JSON"),
    (json.dumps({"input_ids": "abc"}).encode(), "input_ids"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": "many"}}).encode(), "max_new_tokens"),
    (json.dumps({"text": "hi", "sampling_params": {"no_such_param": 1}}).encode(), "no_such_param"),
    (json.dumps({"text": "hi", "stream": "yes"}).encode(), "stream"),
]


async def test_front_answers_malformed_bodies_with_400(tmp_path, tiny_model):
    # One fleet for every body (a fleet per body cost CI ~90 s): after each bad body the front still serves.
    async with fleet_and_front(tmp_path, tiny_model) as (fm, gen, front):
        async with httpx.AsyncClient() as c:
            for body, needle in MALFORMED:
                r = await c.post(f"{front.url}/generate", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
                ok = await c.post(f"{front.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
                assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3, body
                assert (await c.get(f"{front.url}/get_model_info")).status_code == 200


async def test_sampled_request_resumes_exactly_and_segments_record_seed_and_version(tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model) as (fm, gen, front):
        sp = {"max_new_tokens": 100, "temperature": 1.0, "seed": 7, "ignore_eos": True}
        killed = []

        def kill(clog, seg):
            if not killed and clog.committed >= 40:
                killed.append(clog.committed)
                os.kill(fm.slots[seg.engine].info.pid, signal.SIGKILL)

        async with httpx.AsyncClient() as c:
            golden = (await generate(c, fm.slots["engine-1"].info.url, {"input_ids": PROMPTS[0], "sampling_params": sp},
                                     60))["output_ids"]
        clog, resp = await gen.generate("s", PROMPTS[0], sp, on_progress=kill)
        # The CPU engine draws token i with seed + i, so even a sampled request resumes exactly.
        assert resp["output_ids"] == golden
        s0, s1 = clog.segments[0], clog.segments[1]
        assert s0.seed == 7 and s1.seed == 7 + s1.start
        assert s0.weight_version == s1.weight_version == "default"
