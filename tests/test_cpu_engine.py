"""The CPU engine speaks SGLang's native API: determinism, prefix continuation, streaming, bad input."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from belayer_plugin.generation.sglang_http import generate, generate_stream

PROMPT = [54, 280, 487, 423, 442]  # "The quick brown fox" in the tiny tokenizer
GREEDY = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}


async def _gen(url, ids, sp=GREEDY, **kw):
    async with httpx.AsyncClient() as c:
        return await generate(c, url, {"input_ids": ids, "sampling_params": sp, **kw}, 60.0)


async def _stream(url, ids, sp=GREEDY, **kw):
    chunks = []
    async with httpx.AsyncClient() as c:
        async for ch in generate_stream(c, url, {"input_ids": ids, "sampling_params": sp, **kw}, 60.0):
            chunks.append(ch)
    return chunks


async def _until_running(c: httpx.AsyncClient, url: str, n: int, timeout: float = 30.0) -> None:
    """Waits (bounded) until the engine reports `n` running requests."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (await c.get(f"{url}/get_server_info")).json()["num_running"] < n:
        assert asyncio.get_running_loop().time() < deadline, "request never started"
        await asyncio.sleep(0.005)


async def test_greedy_is_deterministic_and_equals_transformers(cpu_server, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    a = await _gen(cpu_server.url, PROMPT)
    b = await _gen(cpu_server.url, PROMPT)
    assert a["output_ids"] == b["output_ids"]
    assert len(a["output_ids"]) == 48
    assert len(set(a["output_ids"])) > 20  # the tiny model must not collapse onto one token
    m = AutoModelForCausalLM.from_pretrained(tiny_model)
    ref = m.generate(torch.tensor([PROMPT]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                     pad_token_id=0)[0, len(PROMPT):].tolist()
    assert a["output_ids"] == ref


@pytest.mark.parametrize("k", [1, 7, 20, 47])
async def test_prefix_continuation_gives_the_same_remaining_ids(cpu_server, k):
    full = (await _gen(cpu_server.url, PROMPT))["output_ids"]
    rest = await _gen(cpu_server.url, PROMPT + full[:k], {**GREEDY, "max_new_tokens": 48 - k})
    assert rest["output_ids"] == full[k:]


async def test_streaming_and_plain_give_the_same_ids_and_logprobs(cpu_server):
    plain = await _gen(cpu_server.url, PROMPT, return_logprob=True)
    chunks = await _stream(cpu_server.url, PROMPT, return_logprob=True)
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
    # Chunks are cumulative (SGLang's format): each one extends the previous.
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    lp_plain = [t[0] for t in plain["meta_info"]["output_token_logprobs"]]
    lp_stream = [t[0] for t in last["meta_info"]["output_token_logprobs"]]
    assert lp_plain == pytest.approx(lp_stream, abs=1e-5)
    assert [t[1] for t in plain["meta_info"]["output_token_logprobs"]] == plain["output_ids"]


async def test_every_intermediate_chunk_is_the_final_answers_prefix_field_for_field(cpu_server):
    # The intermediate chunks are assembled from bytes serialized once per token: each must still be exactly
    # what the final answer would say at that length (ids, logprob triples to the bit, counts, version).
    chunks = await _stream(cpu_server.url, PROMPT, return_logprob=True)
    final = chunks[-1]
    assert len(chunks) > 10
    for ch in chunks[:-1]:
        n = len(ch["output_ids"])
        assert ch["output_ids"] == final["output_ids"][:n]
        meta, fmeta = ch["meta_info"], final["meta_info"]
        assert meta["output_token_logprobs"] == fmeta["output_token_logprobs"][:n]
        assert meta["finish_reason"] is None and meta["completion_tokens"] == n
        assert {k: meta[k] for k in ("id", "prompt_tokens", "cached_tokens", "weight_version")} == \
               {k: fmeta[k] for k in ("id", "prompt_tokens", "cached_tokens", "weight_version")}
        assert set(meta) == set(fmeta)


async def test_an_http_1_0_streaming_client_gets_unframed_chunks_up_to_the_close(cpu_server):
    # HTTP/1.0 has no chunked encoding: the stream is the events' bytes, ended by the server's close.
    host, port = cpu_server.url.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}).encode()
    r, w = await asyncio.open_connection(host, int(port))
    w.write(b"POST /generate HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (len(body), body))
    raw = await asyncio.wait_for(r.read(), 60)
    w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    events = [e for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: {") for e in events[:-1])
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) > 10 and chunks[-1]["output_ids"] == (await _gen(cpu_server.url, PROMPT))["output_ids"]


async def test_a_streaming_client_that_goes_away_stops_its_decoding(start_cpu_server):
    srv = start_cpu_server("--step-delay-ms", "5")
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 4000}, "stream": True}
    async with httpx.AsyncClient() as c:
        async with c.stream("POST", srv.url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then the connection closes
        deadline = asyncio.get_running_loop().time() + 10
        while (info := (await c.get(srv.url + "/get_server_info")).json())["num_running"]:
            assert asyncio.get_running_loop().time() < deadline, "the engine decodes for a client that left"
            await asyncio.sleep(0.02)
        assert info["belayer_counters"]["aborted"] == 1 and info["belayer_counters"]["generated_tokens"] < 1000


async def test_streamed_text_is_decoded_incrementally_and_equals_the_full_decode(cpu_server, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    sp = {**GREEDY, "max_new_tokens": 200}
    chunks = await _stream(cpu_server.url, PROMPT, sp)
    assert len(chunks) > 2
    for ch in chunks:  # every chunk: the text of the ids it carries, bar bytes that do not decode yet
        full = tok.decode(ch["output_ids"], skip_special_tokens=True)
        rest = full[len(ch["text"]):]  # held back only behind bytes that do not decode yet (as SGLang)
        assert full.startswith(ch["text"]) and (len(rest) <= 4 or "\ufffd" in rest), (ch["text"], full)
    texts = [ch["text"] for ch in chunks]
    assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:])) and len(set(texts)) >= len(texts) // 4
    plain = await _gen(cpu_server.url, PROMPT, sp)
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["output_ids"] == plain["output_ids"]


async def test_a_stream_interval_sends_the_first_token_at_once_then_a_chunk_every_k_tokens(cpu_server):
    chunks = await _stream(cpu_server.url, PROMPT, {**GREEDY, "stream_interval": 4})
    sizes = [len(ch["output_ids"]) for ch in chunks]
    assert sizes[0] == 1 and sizes[-1] == GREEDY["max_new_tokens"]
    assert all(b - a >= 4 for a, b in zip(sizes[:-1], sizes[1:-1])), sizes  # as SGLang: never fewer unsent
    assert len(chunks) <= 2 + GREEDY["max_new_tokens"] // 4
    assert chunks[-1]["output_ids"] == (await _gen(cpu_server.url, PROMPT))["output_ids"]


def test_a_reader_that_falls_behind_parses_only_the_newest_cumulative_chunk():
    from belayer_plugin.generation.sglang_http import newest_event

    assert newest_event(b'data: {"a":1}\n\ndata: {"a":2}\n\ndata: {"a') == (b'{"a":2}', False, b'data: {"a', 2)
    assert newest_event(b'data: {"a') == (None, False, b'data: {"a', 0)
    assert newest_event(b'data: {"a":2}\r\n\r\ndata: [DONE]\r\n\r\n') == (b'{"a":2}', True, b"", 1)
    assert newest_event(b": keep-alive\n\n") == (None, False, b"", 0)


async def test_logprobs_match_transformers(cpu_server, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    out = await _gen(cpu_server.url, PROMPT, {**GREEDY, "max_new_tokens": 8}, return_logprob=True)
    ids = PROMPT + out["output_ids"]
    m = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0]
    ref = torch.log_softmax(logits, -1)
    expect = [float(ref[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out["output_ids"])]
    got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(expect, abs=1e-4)


async def test_seeded_sampling_is_reproducible_and_differs_across_seeds(cpu_server):
    sp = {"max_new_tokens": 32, "temperature": 1.0, "top_k": 50, "top_p": 0.9, "ignore_eos": True}
    a = await _gen(cpu_server.url, PROMPT, {**sp, "seed": 1})
    b = await _gen(cpu_server.url, PROMPT, {**sp, "seed": 1})
    c = await _gen(cpu_server.url, PROMPT, {**sp, "seed": 2})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


async def test_stop_token_ids_and_text_input(cpu_server):
    full = (await _gen(cpu_server.url, PROMPT))["output_ids"]
    stop_at = full[5]
    first = full.index(stop_at)
    out = await _gen(cpu_server.url, PROMPT, {**GREEDY, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == full[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    async with httpx.AsyncClient() as c:
        by_text = await generate(c, cpu_server.url, {"text": "The quick brown fox", "sampling_params": GREEDY}, 60)
    assert by_text["output_ids"] == full


async def test_concurrent_requests_progress_together(cpu_server):
    """A short request submitted after a long one finishes first: decoding is interleaved."""
    async with httpx.AsyncClient() as c:
        long = asyncio.create_task(generate(c, cpu_server.url, {
            "input_ids": PROMPT, "rid": "long", "sampling_params": {**GREEDY, "max_new_tokens": 3000}}, 120))
        await _until_running(c, cpu_server.url, 1)
        short = await generate(c, cpu_server.url, {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 4}}, 60)
        assert not long.done(), "the short request waited for the long one"
        assert len(short["output_ids"]) == 4
        out = await long
        assert len(out["output_ids"]) == 3000


@pytest.mark.parametrize("body,needle", [
    (b"not json", "not valid JSON"),
    (json.dumps([1, 2]).encode(), "JSON object"),
    (json.dumps({}).encode(), "exactly one of text or input_ids"),
    (json.dumps({"text": "a", "input_ids": [1]}).encode(), "exactly one of text or input_ids"),
    (json.dumps({"input_ids": []}).encode(), "non-empty list"),
    (json.dumps({"input_ids": [[1, 2]]}).encode(), "batched"),
    (json.dumps({"input_ids": [1, 99999]}).encode(), "out of range"),
    (json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}).encode(), "max_new_tokens"),
    (json.dumps({"input_ids": [1], "sampling_params": {"temperature": "hot"}}).encode(), "temperature"),
    (json.dumps({"input_ids": [1], "sampling_params": {"stream_interval": 0}}).encode(), "stream_interval"),
    (json.dumps({"input_ids": [1], "sampling_params": {"bogus": 1}}).encode(), "unknown sampling_params: bogus"),
    (json.dumps({"input_ids": [1], "no_such_field": 1}).encode(), "unknown fields: no_such_field"),
    (json.dumps({"input_ids": [1], "return_hidden_states": True}).encode(), "not supported"),
])
async def test_bad_requests_get_400_with_a_reason_and_the_server_keeps_serving(cpu_server, body, needle):
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{cpu_server.url}/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert needle in r.json()["error"]["message"]
        ok = await c.get(f"{cpu_server.url}/health_generate", timeout=10)
        assert ok.status_code == 200


async def test_info_routes_and_weight_update_change_version_and_outputs(start_cpu_server, tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    srv = start_cpu_server("--weight-version", "v0")
    async with httpx.AsyncClient() as c:
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info", "/get_weight_version"):
            r = await c.get(srv.url + path)
            assert r.status_code == 200 and r.json()["weight_version"] == "v0", path
        before = await _gen(srv.url, PROMPT)
        m = AutoModelForCausalLM.from_pretrained(tiny_model)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
        m.save_pretrained(tmp_path / "v1")
        r = await c.post(srv.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "v1"),
                                                                     "weight_version": "v1"})
        assert r.status_code == 200 and r.json()["success"]
        after = await _gen(srv.url, PROMPT)
        assert after["meta_info"]["weight_version"] == "v1"
        assert after["output_ids"] != before["output_ids"]
        r = await c.post(srv.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert r.status_code == 400 and not r.json()["success"]
        assert (await c.get(srv.url + "/get_weight_version")).json()["weight_version"] == "v1"


async def test_release_and_resume_memory_occupation(start_cpu_server):
    srv = start_cpu_server()
    async with httpx.AsyncClient() as c:
        golden = (await _gen(srv.url, PROMPT))["output_ids"]
        assert (await c.post(srv.url + "/release_memory_occupation", json={})).status_code == 200
        r = await c.post(srv.url + "/generate", json={"input_ids": PROMPT})
        assert r.status_code == 503
        assert (await c.get(srv.url + "/health_generate")).status_code == 503
        assert (await c.get(srv.url + "/health")).status_code == 200  # alive, just not serving
        assert (await c.post(srv.url + "/resume_memory_occupation", json={})).status_code == 200
        assert (await _gen(srv.url, PROMPT))["output_ids"] == golden


async def test_abort_request_finishes_it_with_abort(start_cpu_server):
    srv = start_cpu_server("--step-delay-ms", "5")  # ~20 s for the whole request: it is still running when aborted
    async with httpx.AsyncClient() as c:
        # within the context length (a longer request is refused with 400)
        task = asyncio.create_task(_stream(srv.url, PROMPT, {**GREEDY, "max_new_tokens": 4000}, rid="victim"))
        await _until_running(c, srv.url, 1)
        r = await c.post(srv.url + "/abort_request", json={"rid": "victim"})
        assert r.status_code == 200 and r.json()["aborted"] == 1
        chunks = await asyncio.wait_for(task, 30)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await c.post(srv.url + "/abort_request", json={})).status_code == 400
        assert (await c.post(srv.url + "/flush_cache")).status_code == 200


async def test_release_frees_the_native_model_and_its_caches_by_reference_counting(tiny_model):
    # Engines are released at every training step; the release skips a full gc pass (~30 ms of CPU in a torch
    # process) for the native model, which is only right while nothing of it sits in a reference cycle.
    import gc
    import weakref

    from belayer_plugin.engines.cpu_server import Engine, Request, Sampling

    eng = Engine(str(tiny_model), "v0", 4, 1, model_impl="native")
    await eng.load()
    req = Request(rid="r", prompt_ids=PROMPT, sampling=Sampling(max_new_tokens=8), return_logprob=False)
    eng.running.append(req)
    eng._step([req])  # a KV cache exists
    leaves = req.cache
    while isinstance(leaves, (list, tuple)):
        leaves = leaves[0]
    model, cache = weakref.ref(eng.model), weakref.ref(leaves)  # the model and a tensor of its KV cache
    del leaves
    gc.disable()
    try:
        await eng.release_memory()
        assert eng.released
        assert model() is None and cache() is None
    finally:
        gc.enable()
    await eng.resume_memory()
    assert eng.model is not None and not eng.released
