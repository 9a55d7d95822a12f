"""Real SGLang 0.5.23 on CPU serves the tiny model the way Belayer relies on.

One server for the module (~12-25 s to start), from .venv-sglang (built by `.ci/setup_sglang.sh`); the
server tests skip only when that venv is absent. The launcher tests need no server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import httpx
import pytest

from belayer_plugin.engines.launch import engine_host

from belayer_plugin.engines.sglang import (
    STANDINS_DIR,
    launch_sglang_server,
    memory_occupation_body,
    resolve_python,
    sglang_server_command,
    stop_sglang_server,
    update_weights_from_disk_body,
    wait_first_token,
    weight_version_of,
)
from belayer_plugin.generation.sglang_http import generate

PROMPT = [54, 280, 487, 423, 442]  # "The quick brown fox" in the tiny tokenizer
N = 48
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
START_VERSION = "v0"


def belayer_cfg(*overrides: str):
    """The default recipe's typed config with Hydra overrides."""
    from belayer_plugin.config import load_belayer_config

    return load_belayer_config("fleet_demo", list(overrides))[0]


CFG = belayer_cfg("belayer.engines.kind=sglang").engines
HOST = engine_host(CFG.host)  # "" (the default) is the node's address: 127.0.0.1 outside Ray


def needs_sglang(fn):
    """Marks a test `sglang`; skips it only when the SGLang venv is absent (a broken one must fail)."""
    skip = pytest.mark.skipif(not resolve_python(CFG.sglang.python).is_file(),
                              reason=f"no SGLang venv at {CFG.sglang.python} (bash .ci/setup_sglang.sh)")
    return skip(pytest.mark.sglang(fn))


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


@pytest.fixture(scope="module")
def sglang_server(tiny_model, tmp_path_factory):
    """One real SGLang server for the module; its whole process group is stopped afterwards."""
    from belayer_plugin.engines.launch import free_port

    port = free_port(HOST)
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    proc = launch_sglang_server(CFG, tiny_model, HOST, port, log, weight_version=START_VERSION)
    url = f"http://{HOST}:{port}"
    try:
        wait_first_token(url, proc, CFG.startup_timeout_s)
    except BaseException as e:  # also Ctrl-C: never leave a server behind
        stop_sglang_server(proc, 5)
        if isinstance(e, (RuntimeError, TimeoutError)):
            pytest.fail(f"SGLang did not start: {e}\nlog tail:\n{_tail(log)}")
        raise
    yield url
    # SIGKILL after a short grace: SGLang's orderly exit takes ~8 s and the tests need nothing from it.
    stop_sglang_server(proc, 3)
    assert proc.poll() is not None


async def _gen(url: str, ids: Optional[list[int]], sp: dict = GREEDY, **kw) -> dict:
    body = {"sampling_params": sp, **kw} if ids is None else {"input_ids": ids, "sampling_params": sp, **kw}
    async with httpx.AsyncClient() as c:
        return await generate(c, url, body, 60.0)


# --- the launcher (no server) ----------------------------------------------------------------------------


def test_cpu_command_has_cpu_only_flags_and_standins_on_a_clean_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    argv, env = sglang_server_command(CFG, "/m", "127.0.0.1", 4321, weight_version="v3")
    assert argv[1:3] == ["-m", "sglang.launch_server"] and Path(argv[0]).is_absolute()
    joined = " ".join(argv)
    for flag in ("--device cpu", "--attention-backend torch_native", "--max-total-tokens 8192",
                 "--dtype float32", "--random-seed 0", "--skip-server-warmup", "--weight-version v3",
                 "--cuda-graph-backend-decode disabled", "--cuda-graph-backend-prefill disabled",
                 "--host 127.0.0.1", "--port 4321", "--model-path /m"):
        assert flag in joined, flag
    assert "--enable-memory-saver" not in argv and "--tp-size" not in argv
    assert env["PYTHONPATH"] == str(STANDINS_DIR)  # the caller's PYTHONPATH must not leak in
    assert env["SGLANG_USE_CPU_ENGINE"] == "0"


def test_gpu_command_has_no_cpu_only_flags_and_no_standins():
    cfg = belayer_cfg("belayer.engines.kind=sglang", "belayer.engines.sglang.device=cuda",
                      "belayer.engines.sglang.attention_backend=''", "belayer.engines.sglang.max_total_tokens=0",
                      "belayer.engines.sglang.tp_size=2", "belayer.engines.sglang.mem_fraction_static=0.7",
                      "belayer.engines.sglang.enable_memory_saver=true",
                      "belayer.engines.sglang.extra_args=[--log-level,warning]").engines
    argv, env = sglang_server_command(cfg, "/m", "127.0.0.1", 4321)
    joined = " ".join(argv)
    for flag in ("--skip-server-warmup", "--cuda-graph-backend", "--attention-backend", "--max-total-tokens"):
        assert flag not in joined, flag
    for flag in ("--device cuda", "--tp-size 2", "--mem-fraction-static 0.7", "--enable-memory-saver"):
        assert flag in joined, flag
    assert argv[-2:] == ["--log-level", "warning"]  # extra_args last, so they can override
    assert env["PYTHONPATH"] == "" and "SGLANG_USE_CPU_ENGINE" not in env


def test_relative_python_resolves_against_cwd_then_the_repo_root(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    assert resolve_python(".venv-sglang/bin/python") == root / ".venv-sglang/bin/python"
    (tmp_path / ".venv-sglang/bin").mkdir(parents=True)
    (tmp_path / ".venv-sglang/bin/python").touch()
    assert resolve_python(".venv-sglang/bin/python") == tmp_path / ".venv-sglang/bin/python"
    assert resolve_python("/abs/python") == Path("/abs/python")


def test_cpu_rejects_tensor_parallelism_and_unknown_memory_tags():
    cfg = belayer_cfg("belayer.engines.kind=sglang", "belayer.engines.sglang.tp_size=2").engines
    with pytest.raises(ValueError, match="tp_size"):
        sglang_server_command(cfg, "/m", "127.0.0.1", 1)
    with pytest.raises(ValueError, match="kv"):
        memory_occupation_body(["weights", "kv"])
    assert memory_occupation_body(["weights", "kv_cache"]) == {"tags": ["weights", "kv_cache"]}


def test_standins_import_but_fail_loudly_when_used():
    code = (
        "import torchvision.transforms as T\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from torchvision.io import decode_image\n"
        "from vllm._custom_ops import rotary_embedding\n"
        "assert InterpolationMode.BICUBIC.value == 'bicubic'\n"
        "for f in (lambda: T.Compose([]), lambda: decode_image(b''), lambda: rotary_embedding(1, 2, 3, 4, 5, 6)):\n"
        "    try:\n"
        "        f()\n"
        "    except RuntimeError as e:\n"
        "        assert 'stand-in' in str(e)\n"
        "    else:\n"
        "        raise SystemExit('a stand-in did something')\n"
        "try:\n"
        "    import vllm.distributed.parallel_state\n"  # SGLang's guarded imports must keep failing
        "except ImportError:\n"
        "    print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(STANDINS_DIR)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --- the real server -------------------------------------------------------------------------------------


@needs_sglang
async def test_greedy_is_deterministic_and_equals_transformers(sglang_server, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    a = await _gen(sglang_server, PROMPT)
    b = await _gen(sglang_server, PROMPT)
    assert a["output_ids"] == b["output_ids"]
    assert len(a["output_ids"]) == N
    assert len(set(a["output_ids"])) > 20  # the tiny model must not collapse onto one token
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = m.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                     max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):]
    assert a["output_ids"] == ref.tolist()


@needs_sglang
@pytest.mark.parametrize("k", [1, 7, 20, 47])
async def test_prefix_continuation_gives_the_same_remaining_ids(sglang_server, k):
    full = (await _gen(sglang_server, PROMPT))["output_ids"]
    rest = await _gen(sglang_server, PROMPT + full[:k], {**GREEDY, "max_new_tokens": N - k})
    assert rest["output_ids"] == full[k:]


@needs_sglang
async def test_text_prompts_are_tokenized_like_belayers_tokenizer(sglang_server, tiny_model):
    from transformers import AutoTokenizer

    # Digits and accents: where a raw ByteLevel pre-tokenizer and Qwen2's (what transformers loads) differ.
    text = "Checkpoint 1234 at step 56: héllo wörld!"
    ids = AutoTokenizer.from_pretrained(tiny_model).encode(text, add_special_tokens=False)
    by_text = await _gen(sglang_server, None, text=text)
    by_ids = await _gen(sglang_server, ids)
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["output_ids"] == by_ids["output_ids"]


@needs_sglang
async def test_stream_chunks_are_cumulative_end_with_done_and_match_plain(sglang_server):
    plain = await _gen(sglang_server, PROMPT, return_logprob=True)
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "stream": True}
    datas: list[str] = []
    async with httpx.AsyncClient() as c:
        async with c.stream("POST", f"{sglang_server}/generate", json=body, timeout=60.0) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    datas.append(line[5:].strip())
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert len(chunks) > 1
    for prev, cur in zip(chunks, chunks[1:]):
        # cumulative: each chunk repeats everything so far and adds to it
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert len(cur["output_ids"]) > len(prev["output_ids"])
        assert prev["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"] == plain["output_ids"]
    assert [t[1] for t in last["meta_info"]["output_token_logprobs"]] == plain["output_ids"]
    assert [t[0] for t in last["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in plain["meta_info"]["output_token_logprobs"]], abs=1e-4)


@needs_sglang
async def test_generate_through_sglang_router_gives_the_same_ids(sglang_server, tmp_path):
    from belayer_plugin.fleet.router import Router

    direct = (await _gen(sglang_server, PROMPT))["output_ids"]
    router = Router(belayer_cfg().router, tmp_path)
    try:
        await router.start()
        await router.add(sglang_server)  # POST /workers, then waits until GET /workers shows it healthy
        assert await router.worker_urls() == {sglang_server}
        via = await _gen(router.url, PROMPT)
    finally:
        await router.aclose()
    assert via["output_ids"] == direct
    assert len(via["output_ids"]) == N  # the router kept max_new_tokens and ignore_eos


@needs_sglang
async def test_memory_release_and_resume_answer_but_change_nothing_on_cpu(sglang_server):
    before = (await _gen(sglang_server, PROMPT))["output_ids"]
    async with httpx.AsyncClient() as c:
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r = await c.post(f"{sglang_server}{path}", json=memory_occupation_body(["weights", "kv_cache"]),
                             timeout=30.0)
            assert r.status_code == 200 and r.json() is None
            assert (await _gen(sglang_server, PROMPT))["output_ids"] == before  # nothing was released


@needs_sglang
async def test_update_weights_from_disk_changes_outputs_and_reported_version(sglang_server, tiny_model,
                                                                             tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    # Other weights for the same architecture: the tiny model's, perturbed.
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    sd = load_file(str(other / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in sd.items()},
              str(other / "model.safetensors"))

    async with httpx.AsyncClient() as c:
        async def version() -> str:
            r = await c.get(f"{sglang_server}/get_model_info", timeout=10.0)
            r.raise_for_status()
            return weight_version_of(r.json())

        async def update(path: str, v: str) -> None:
            r = await c.post(f"{sglang_server}/update_weights_from_disk",
                             json=update_weights_from_disk_body(path, v), timeout=120.0)
            assert r.status_code == 200 and r.json()["success"] is True, r.text

        first = await _gen(sglang_server, PROMPT)
        assert weight_version_of(first) == START_VERSION == await version()  # --weight-version at launch
        assert (await c.get(f"{sglang_server}/get_weight_version", timeout=10.0)).status_code == 404  # 0.5.23
        try:
            await update(str(other), "v1")
            assert await version() == "v1"
            changed = await _gen(sglang_server, PROMPT)
            assert weight_version_of(changed) == "v1"
            assert changed["output_ids"] != first["output_ids"]
        finally:
            await update(tiny_model, "v2")  # the other tests compare against the original weights
        back = await _gen(sglang_server, PROMPT)
        assert weight_version_of(back) == "v2" == await version()
        assert back["output_ids"] == first["output_ids"]
