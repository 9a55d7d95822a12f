"""Fuzzing /generate (hypothesis): random bodies to the CPU engine and to the front get a 200 or a clear
4xx naming the problem, never a 5xx or a dropped connection, and the server keeps serving.

Bodies: top-level values of every JSON type, SGLang-shaped objects with each field missing, of the wrong
type, wrongly nested, unicode text, huge and negative numbers, unknown fields; raw bytes that are not
JSON. Example counts are bounded (FUZZ_EXAMPLES) so CI stays fast; README records them.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import belayer_cfg

FUZZ_EXAMPLES = {"engine": 100, "front": 60, "bytes": 30}
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                 derandomize=True)

NUM = st.one_of(st.integers(-(2**70), 2**70), st.integers(-3, 20),
                st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0, 1, -1, 0.5, 1e308, -1e308]))
SCALAR = st.one_of(st.none(), st.booleans(), NUM, st.text(max_size=40))
JSON = st.recursive(SCALAR, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
                    max_leaves=8)
IDS = st.one_of(st.lists(st.integers(-(2**40), 2**40), max_size=30), st.lists(st.integers(0, 511), min_size=1, max_size=30),
                st.lists(st.lists(st.integers(0, 511), max_size=3), max_size=3), JSON)
SAMPLING = st.one_of(
    st.fixed_dictionaries({}, optional={
        "max_new_tokens": st.one_of(st.integers(-(2**70), 2**70), st.integers(0, 8), JSON),
        "temperature": st.one_of(NUM, JSON), "top_p": st.one_of(NUM, JSON), "top_k": st.one_of(NUM, JSON),
        "seed": st.one_of(NUM, JSON), "sampling_seed": NUM, "min_new_tokens": st.one_of(NUM, JSON),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), JSON),
        "stop_token_ids": st.one_of(st.lists(st.integers(-(2**70), 2**70), max_size=3), JSON),
        "ignore_eos": st.one_of(st.booleans(), JSON), "bogus_param": JSON}),
    JSON)
BODY = st.one_of(
    JSON,  # any top-level JSON value
    st.fixed_dictionaries({}, optional={
        "text": st.one_of(st.text(max_size=200), JSON), "input_ids": IDS, "sampling_params": SAMPLING,
        "stream": st.one_of(st.booleans(), JSON), "return_logprob": st.one_of(st.booleans(), JSON),
        "rid": st.one_of(st.text(max_size=20), JSON), "unknown_field": JSON,
        "image_data": st.one_of(st.none(), st.text(max_size=5))}),
)


def _assert_answer(r: httpx.Response, url: str) -> None:
    """A 200 with a result, or a 4xx whose JSON names the problem; never a 5xx."""
    if r.status_code == 200:
        text = r.text
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            chunks = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert chunks and (chunks[-1] == "[DONE]" or "error" in json.loads(chunks[-1])), text[-300:]
            if chunks[-1] == "[DONE]":
                assert "output_ids" in json.loads(chunks[-2])
        else:
            assert isinstance(r.json()["output_ids"], list)
        return
    assert 400 <= r.status_code < 500, f"{url}: HTTP {r.status_code}: {r.text[:300]}"
    msg = r.json()["error"]["message"]
    assert isinstance(msg, str) and len(msg) > 5, r.text


def _post(client: httpx.Client, url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(f"{url}/generate", content=body, headers={"content-type": "application/json"})
    return client.post(f"{url}/generate", content=json.dumps(body), headers={"content-type": "application/json"})


def _still_serving(client: httpx.Client, url: str) -> None:
    r = client.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2,
                                                                                           "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text


@pytest.fixture(scope="module")
def front(cpu_server, tiny_model):
    """The drop-in front over one CPU engine, served from its own event-loop thread."""
    from belayer_plugin.generation.front import GenerationFront
    from belayer_plugin.generation.resumable import ResumableGenerator, StaticSelector

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    async def start():
        gen = ResumableGenerator(StaticSelector([cpu_server.url]), belayer_cfg().recovery)
        f = GenerationFront(gen, tiny_model)
        await f.start()
        return f

    f = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    yield f
    asyncio.run_coroutine_threadsafe(f.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


@settings(max_examples=FUZZ_EXAMPLES["engine"], **_SETTINGS)
@given(body=BODY)
def test_cpu_engine_answers_any_generate_body_with_200_or_a_clear_4xx(cpu_server, body):
    with httpx.Client(timeout=120) as c:
        _assert_answer(_post(c, cpu_server.url, body), cpu_server.url)
        assert cpu_server.proc.poll() is None, "the engine process died"


@settings(max_examples=FUZZ_EXAMPLES["front"], **_SETTINGS)
@given(body=BODY)
def test_front_answers_any_generate_body_with_200_or_a_clear_4xx(front, cpu_server, body):
    with httpx.Client(timeout=120) as c:
        _assert_answer(_post(c, front.url, body), front.url)


@settings(max_examples=FUZZ_EXAMPLES["bytes"], **_SETTINGS)
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=100).map(lambda s: ("{" + s).encode("utf-8", "surrogatepass"))))
def test_engine_and_front_answer_non_json_bytes_with_400_and_keep_serving(front, cpu_server, raw):
    with httpx.Client(timeout=120) as c:
        for url in (cpu_server.url, front.url):
            _assert_answer(_post(c, url, raw), url)


def test_after_fuzzing_both_servers_still_generate(front, cpu_server):
    with httpx.Client(timeout=120) as c:
        _still_serving(c, cpu_server.url)
        _still_serving(c, front.url)
    assert cpu_server.proc.poll() is None
