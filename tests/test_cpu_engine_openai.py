"""The CPU engine's OpenAI surface, through NeMo-RL's own GenerationRouter (imported from its source): chat
completions answer with the engine's own generation, malformed ones get a 400 naming the field, and a SIGKILLed
engine becomes a failure the router counts for that backend (what NeMo-RL's fleet health is fed)."""

from __future__ import annotations

import signal

import httpx
import pytest

from belayer_plugin.engines.launch import free_port

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
        "temperature": 0.0}


@pytest.fixture(scope="module")
def nemo_router_cls():
    from belayer_plugin.hooks.nemo_rl.upstream import ensure_importable

    ensure_importable()
    from nemo_rl.models.generation.generation_router import GenerationRouterImpl

    return GenerationRouterImpl


def test_chat_completion_is_the_engines_own_greedy_generation(cpu_server):
    from belayer_plugin.engines.cpu_openai import chat_prompt

    r = httpx.post(f"{cpu_server.url}/v1/chat/completions", json=CHAT, timeout=60).json()
    native = httpx.post(f"{cpu_server.url}/generate", json={
        "text": chat_prompt(CHAT["messages"]), "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}},
        timeout=60).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"] == native["text"]
    assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length"
    models = httpx.get(f"{cpu_server.url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


@pytest.mark.parametrize("body,field", [
    ({"model": "m"}, "messages"), ({**CHAT, "messages": [{"role": "user"}]}, "messages[0]"),
    ({**CHAT, "stream": True}, "stream"), ({**CHAT, "n": 2}, "n"), ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools")])
def test_malformed_chat_completions_get_a_400_naming_the_field(cpu_server, body, field):
    r = httpx.post(f"{cpu_server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_nemo_rls_router_forwards_chats_and_counts_a_killed_engine_as_its_backends_failure(
        start_cpu_server, nemo_router_cls):
    a, b = start_cpu_server(), start_cpu_server("--step-delay-ms", "50")
    backends = [f"{a.url}/v1", f"{b.url}/v1"]
    router = nemo_router_cls(backend_urls=backends, host="127.0.0.1", port=free_port(), backend_timeout_s=600.0,
                             connect_timeout_s=5.0, no_healthy_backend_status=409, health_managed=True)
    router.serve_in_background()
    url = router.base_url()
    with httpx.Client(timeout=120) as c:
        assert c.post(f"{url}/chat/completions", json=CHAT).status_code == 200
        router.set_serving_backends([backends[1]])  # only the slow engine, which is killed mid-request
        import threading

        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=c.post(f"{url}/chat/completions",
                                                                 json={**CHAT, "max_tokens": 200})))
        t.start()
        # the request is in the engine: its own count of running requests says so (bounded)
        for _ in range(200):
            if httpx.get(f"{b.url}/get_server_info", timeout=5).json()["num_running"]:
                break
            t.join(0.05)
        b.kill(signal.SIGKILL)
        t.join(60)
    assert out["r"].status_code in (409, 500), out["r"].text  # the router's own answer for a failed backend
    assert router.drain_backend_failures() == {backends[1]: 1}
