"""The CPU engine's /update_weights_from_tensor (what replaces CUDA IPC in the NeMo-RL refit on CPU): SGLang's
route and fields; malformed input is a 4xx that changes nothing; streamed weights survive a memory release."""

from __future__ import annotations

import httpx

from belayer_plugin.engines.cpu_server import encode_cpu_bucket

SP = {"max_new_tokens": 8, "temperature": 0.0}


def _gen(url: str) -> list[int]:
    r = httpx.post(f"{url}/generate", json={"input_ids": [54, 280, 487], "sampling_params": SP,
                                            "return_logprob": True}, timeout=60).json()
    return [t[1] for t in r["meta_info"]["output_token_logprobs"]]


def _bucket(named: dict) -> str:
    import torch

    flat, meta, i = [], [], 0
    for n, t in named.items():
        b = t.contiguous().flatten().view(torch.uint8)
        meta.append({"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "start_idx": i, "end_idx": i + b.numel()})
        flat.append(b)
        i += b.numel()
    return encode_cpu_bucket(torch.cat(flat), meta)


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)


def test_update_weights_from_tensor_applies_versions_refuses_bad_input_and_survives_release(cpu_server, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    url = cpu_server.url
    before = _gen(url)
    sd = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    name = next(n for n in sd if n.endswith("lm_head.weight") or n.endswith("embed_tokens.weight"))
    good = {name: sd[name] * -1.0}
    bad_bodies = [
        {"serialized_named_tensors": [_bucket(good)], "load_format": "direct", "weight_version": "9"},
        {"serialized_named_tensors": ["not base64!"], "load_format": "flattened_bucket", "weight_version": "9"},
        {"serialized_named_tensors": [_bucket({"no.such.param": sd[name]})], "load_format": "flattened_bucket",
         "weight_version": "9"},
        {"serialized_named_tensors": [_bucket({name: sd[name][:1]})], "load_format": "flattened_bucket",
         "weight_version": "9"},
        {"serialized_named_tensors": [], "load_format": "flattened_bucket"},
        {"serialized_named_tensors": [_bucket(good)], "load_format": "flattened_bucket", "weight_version": 9},
    ]
    for body in bad_bodies:
        r = _post(url, body)
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert httpx.get(f"{url}/get_weight_version", timeout=5).json()["weight_version"] != "9"
    assert _gen(url) == before, "a refused update changed the weights"

    r = _post(url, {"serialized_named_tensors": [_bucket(good)], "load_format": "flattened_bucket",
                    "flush_cache": False, "weight_version": "1"})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "1"
    after = _gen(url)
    assert after != before
    httpx.post(f"{url}/release_memory_occupation", json={}, timeout=30).raise_for_status()
    assert _post(url, {"serialized_named_tensors": [_bucket(good)], "load_format": "flattened_bucket"}).status_code == 409
    httpx.post(f"{url}/resume_memory_occupation", json={}, timeout=60).raise_for_status()
    assert _gen(url) == after, "the streamed weights did not survive a memory release"
    # a load from disk drops them: the base model again
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": tiny_model, "weight_version": "0"}, timeout=60)
    assert r.status_code == 200 and _gen(url) == before
