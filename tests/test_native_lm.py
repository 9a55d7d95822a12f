"""The CPU engine's plain-torch Qwen2 (native_lm) and tokenizer (light_tokenizer) against transformers."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

from belayer_plugin.engines import native_lm, shared_weights
from belayer_plugin.engines.light_tokenizer import LightTokenizer

IDS = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 64, 128, 2, 1, 77, 500, 23, 9, 410, 11]


def _qwen2(tmp_path, tiny_model, name: str, **over):
    """A random Qwen2 checkpoint beside the tiny model's tokenizer, with config fields overridden."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = native_lm.read_config(tiny_model)
    base.pop("transformers_version", None)
    cfg = Qwen2Config(**{**base, **over})
    torch.manual_seed(1)
    m = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    return _save_beside_tokenizer(m, tmp_path / name, tiny_model), m


def _save_beside_tokenizer(model, out, tiny_model):
    """Saves a transformers model under `out` with the tiny model's tokenizer files; returns `out`."""
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model}/{f}", out / f)
    return out


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def test_prefill_logits_equal_transformers_exactly(tiny_model):
    ref = _reference(tiny_model)(torch.tensor([IDS])).logits
    got = native_lm.from_pretrained(tiny_model)(torch.tensor([IDS])).logits
    assert torch.equal(got, ref)


@torch.no_grad()
def test_cached_decoding_and_a_chunk_after_the_cache_match_the_full_forward(tiny_model):
    m = native_lm.from_pretrained(tiny_model)
    full = m(torch.tensor([IDS])).logits[0]
    r = m(torch.tensor([IDS[:5]]))
    steps = [r.logits[0, -1]]
    cache = r.past_key_values
    for i in range(5, len(IDS)):
        r = m(torch.tensor([[IDS[i]]]), past_key_values=cache)
        cache = r.past_key_values
        steps.append(r.logits[0, -1])
    assert torch.allclose(torch.stack(steps), full[4:], atol=1e-4)
    head = m(torch.tensor([IDS[:8]]))
    tail = m(torch.tensor([IDS[8:]]), past_key_values=head.past_key_values).logits[0]
    assert torch.allclose(tail, full[8:], atol=1e-4)  # a wrong mask (or none) attends to the future here


@torch.no_grad()
def test_grouped_query_attention_and_an_untied_head_match_transformers(tmp_path, tiny_model):
    path, ref = _qwen2(tmp_path, tiny_model, "gqa", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       tie_word_embeddings=False, rope_parameters={"rope_theta": 1000.0, "rope_type": "default"})
    m = native_lm.from_pretrained(path)
    assert not torch.equal(m.params["lm_head.weight"], m.params["model.embed_tokens.weight"])
    x = torch.tensor([IDS])
    assert torch.allclose(m(x).logits, ref(x).logits, atol=1e-5)


def test_greedy_decoding_equals_transformers_generate(tiny_model):
    ref = _reference(tiny_model).generate(torch.tensor([IDS]), max_new_tokens=64, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(IDS):].tolist()
    m = native_lm.from_pretrained(tiny_model)
    out, cache, nxt = [], None, IDS
    with torch.no_grad():
        for _ in range(64):
            r = m(torch.tensor([nxt]), past_key_values=cache)
            cache = r.past_key_values
            nxt = [int(torch.argmax(r.logits[0, -1]))]
            out.append(nxt[0])
    assert out == ref


@torch.no_grad()
def test_a_new_embedding_moves_a_tied_head_with_it(tiny_model):
    m = native_lm.from_pretrained(tiny_model)
    x = torch.tensor([IDS])
    before = m(x).logits
    m.load_state_dict({"model.embed_tokens.weight": m.params["model.embed_tokens.weight"] * 2})
    assert m.params["lm_head.weight"] is m.params["model.embed_tokens.weight"]
    assert not torch.allclose(m(x).logits, before)


@torch.no_grad()
def test_shared_memory_weights_serve_the_same_logits(tiny_model, tmp_path):
    pub = shared_weights.publish(tiny_model, root=tmp_path)
    m = shared_weights.load_native_model(pub)
    x = torch.tensor([IDS])
    assert torch.equal(m(x).logits, native_lm.from_pretrained(tiny_model)(x).logits)


def test_checkpoints_it_cannot_run_are_named_and_bad_files_refused(tmp_path, tiny_model):
    cfg = native_lm.read_config(tiny_model)
    assert native_lm.unsupported_reason(cfg) is None and native_lm.usable(tiny_model) is None
    assert "llama" in native_lm.unsupported_reason({**cfg, "model_type": "llama"})
    assert "yarn" in native_lm.unsupported_reason({**cfg, "rope_parameters": {"rope_type": "yarn"}})
    assert "sliding" in native_lm.unsupported_reason({**cfg, "use_sliding_window": True})
    state = native_lm.load_safetensors(tiny_model)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        native_lm.NativeQwen2(cfg, state)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # a half-written checkpoint
    with pytest.raises(ValueError, match="model.safetensors"):
        native_lm.from_pretrained(bad)
    for junk in (b"\x00" * 4, (10**9).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"{x"):
        (bad / "model.safetensors").write_bytes(junk)
        with pytest.raises(ValueError, match="safetensors"):
            native_lm.from_pretrained(bad)


def test_mapped_weights_equal_the_safetensors_library_for_every_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
               "i64": torch.arange(7), "empty": torch.zeros(0, 5), "scalar": torch.tensor(3.5)}
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    ref, got = load_file(tmp_path / "t.safetensors"), native_lm.map_safetensors(tmp_path / "t.safetensors")
    assert ref.keys() == got.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]), k


def test_light_tokenizer_encodes_and_decodes_as_transformers(tiny_model):
    from transformers import AutoTokenizer

    ref, light = AutoTokenizer.from_pretrained(tiny_model), LightTokenizer(tiny_model)
    assert light.eos_token_id == ref.eos_token_id is not None
    texts = ["hello world 12345", "<|im_start|>user\nHi é ü 中文 🙂<|im_end|>", "  two  spaces\tand\n\n",
             "ﬁ café (NFC) e\u0301", "x" * 300]
    for t in texts:
        assert light(t)["input_ids"] == ref(t)["input_ids"], t
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids


async def test_auto_serves_other_architectures_through_transformers(tmp_path, tiny_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import ServerProc

    cfg = native_lm.read_config(tiny_model)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=cfg["max_position_embeddings"],
                                         eos_token_id=0, pad_token_id=0, bos_token_id=None))
    out = _save_beside_tokenizer(llama, tmp_path / "llama", tiny_model)
    refused = subprocess.run([sys.executable, "-m", "belayer_plugin.engines.cpu_server", "--model-path", str(out),
                              "--port", "1", "--model-impl", "native"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "model_type 'llama'" in refused.stderr
    servers = [ServerProc(str(out), tmp_path), ServerProc(tiny_model, tmp_path)]
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            impls = [(await c.get(s.url + "/server_info")).json()["model_impl"] for s in servers]
            assert impls == ["transformers", "native"]
            r = await c.post(servers[0].url + "/generate", json={"input_ids": IDS, "sampling_params": {
                "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    finally:
        for s in servers:
            s.kill()


def test_a_native_engine_loads_and_decodes_without_importing_transformers(tiny_model):
    # The whole point of native_lm: ~3.5 s of CPU less per engine start. A stray import would undo it silently.
    code = f"""
import asyncio, sys
from belayer_plugin.engines.cpu_server import Engine

async def main():
    e = Engine({tiny_model!r}, "v0", 4, 1)
    await e.load()
    assert e.native and e.tokenizer(" hello")["input_ids"]
    assert "transformers" not in sys.modules, "transformers was imported"
    print("ok")

asyncio.run(main())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
