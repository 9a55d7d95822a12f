"""Real SGLang (0.5.23) as a Belayer engine: the server command, its venv, and its HTTP admin API.

SGLang runs from its own venv (``engines.sglang.python``, built by ``.ci/setup_sglang.sh``): it pins
transformers==5.19 while verl 0.9.1, in Belayer's venv, needs <5.11. Belayer only starts the process and
talks HTTP to it; nothing here imports sglang.

On a CPU-only machine it serves text models with ``--device cpu --attention-backend torch_native``, CUDA
graphs disabled, warm-up skipped and an explicit ``--max-total-tokens`` (otherwise it sizes a 15 GB KV
cache and never turns healthy), with Belayer's import stand-ins for torchvision and vllm on PYTHONPATH
(see ``sglang_standins/README.md``). GPU flags follow SGLang's documented server arguments but are
unverified here (no GPU on the machines this was written on).

A trainer may hand over its own server arguments (``sglang_server_command(server_kwargs=...)``, or per
engine actor the JSON object in ``$BELAYER_SGLANG_SERVER_ARGS``: the NeMo-RL hook puts NeMo-RL's
``SGLangGenerationWorker._compute_server_args`` there). They are ServerArgs keyword arguments, converted
generically (``foo_bar`` -> ``--foo-bar``; True -> the bare flag; False and None -> omitted; a list -> its
values after one flag, as SGLang's ``nargs="+"`` options read them; a dict -> JSON) and win over
``engines.sglang`` for every key they set, except those in BELAYER_OWNED_SERVER_ARGS (Belayer picks the
port and the host it serves on, tracks the weight version, and names the model directory).

What 0.5.23 answers on CPU (measured on the tiny model, one server):

- ``GET /health`` and ``GET /health_generate``: the same handler. 503 while starting; then it submits a
  one-token generation and polls for it with ``asyncio.sleep(1)``, so a 200 takes >= 1 s (never probe it
  with a 1 s timeout). ``GET /ready``: 200/503 at once (not paused and healthy).
- ``GET /get_model_info`` (= ``/model_info``): ``{"model_path", "weight_version", "model_type", ...}``.
  ``GET /get_server_info`` (= ``/server_info``): the server arguments.
- ``GET /get_weight_version``: 404 in 0.5.23. The version is in ``/get_model_info`` and in every
  ``/generate`` response's ``meta_info.weight_version`` ("default" until set).
- ``POST /generate``: ``output_ids``, ``meta_info.finish_reason`` (``{"type": "length"|"stop", ...}``),
  ``meta_info.weight_version``; with ``return_logprob`` ``output_token_logprobs`` as
  ``[logprob, token_id, null]``. With ``stream: true`` every SSE chunk carries the CUMULATIVE
  ``output_ids``, ``finish_reason`` is null until the last chunk, then ``data: [DONE]``.
- ``POST /update_weights_from_disk {"model_path", "weight_version"}``: reloads the weights (not the
  tokenizer) and sets the version: ``{"success": true, "message": ..., "num_paused_requests": 0}``.
- ``POST /update_weight_version {"new_version"}``: sets the version only (aborts running requests by
  default).
- ``POST /pause_generation {"mode"}`` / ``POST /continue_generation``: ``{"status": "ok", ...}``.
- ``POST /abort_request {"abort_all": true}``: 200, empty body.
- ``GET|POST /flush_cache``: 200 with text; does nothing while requests run.
- ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` (``{"tags": [...]}``): 200 with body
  ``null`` on CPU, and nothing is released (generation keeps working in between). A GPU feature: it needs
  ``--enable-memory-saver`` (torch_memory_saver) there; unverified here.

Process facts on this 2-core machine: process start to first served token 12.3 s when idle, 17-28 s while
other work shares the cores (two servers starting together under Ray: ~43 s each); ~2 GB RSS. SIGTERM
stops it in ~6-8 s; each server leaves two 16 KB ``/dev/shm/sglang_loads_*.shm`` files and a semaphore
behind, even after SIGTERM. Text prompts are tokenized by SGLang's own loader, which restores
tokenizer.json's pre-tokenizer where transformers 5 replaces it (see tiny_model.build_tokenizer).

Owns: SGLang's server command, its venv check, start and stop of a bare server and its admin HTTP calls.
Must not: import sglang (it runs in its own venv) or decide anything about health.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from belayer_plugin.config import EnginesConfig, SGLangConfig

STANDINS_DIR = Path(__file__).resolve().parent / "sglang_standins"

# Memory regions /release_memory_occupation and /resume_memory_occupation accept as tags (0.5.23's
# sglang.srt.constants). No tags means all of them.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# A trainer's server arguments for the server an engine actor starts (a JSON object of ServerArgs keyword
# arguments), set in that actor's Ray runtime_env: they differ per engine (NeMo-RL: base_gpu_id, random_seed).
SERVER_ARGS_ENV = "BELAYER_SGLANG_SERVER_ARGS"
# Server arguments that stay Belayer's whatever a trainer passes: Belayer picks the port (and the host it
# serves on), starts the server with the weight version it tracks and names the model directory it loads.
BELAYER_OWNED_SERVER_ARGS = ("model_path", "host", "port", "weight_version")


def repo_root() -> Optional[Path]:
    """The source checkout holding this package (the directory with pyproject.toml), if there is one."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "belayer_plugin").is_dir():
            return parent
    return None


def resolve_python(python: str) -> Path:
    """The SGLang interpreter named by `python`.

    An absolute path is used as is; a bare name (``python3``) is looked up on PATH; any other relative path
    (``.venv-sglang/bin/python``) resolves against the current working directory first, then against the
    repository root that holds this package, so it works from the checkout and from Ray workers whose
    working directory is elsewhere. A path that exists nowhere comes back as the repo-root candidate (or
    cwd's when there is no checkout), so errors name a sensible place.
    """
    p = Path(python).expanduser()
    if p.is_absolute():
        return p
    if os.sep not in python:
        found = shutil.which(python)
        return Path(found) if found else p
    candidates = [Path.cwd() / p]
    root = repo_root()
    if root is not None:
        candidates.append(root / p)
    for c in candidates:
        if c.exists():
            return c.absolute()  # not resolve(): a venv's python is a symlink to the base interpreter
    return candidates[-1].absolute()


def _sglang_cfg(cfg: Union[EnginesConfig, SGLangConfig]) -> SGLangConfig:
    return cfg.sglang if isinstance(cfg, EnginesConfig) else cfg


def sglang_env(cfg: Union[EnginesConfig, SGLangConfig], model_path: str = "",
               torch_threads: Optional[int] = None) -> dict[str, str]:
    """Extra environment for an SGLang server process (merged over the caller's environment)."""
    s = _sglang_cfg(cfg)
    use_standins = s.standins_on_path and s.device == "cpu"
    # Replace, never extend, PYTHONPATH: SGLang's venv must not see another venv's packages (a Ray worker's
    # PYTHONPATH can name Belayer's), and on GPU a real torchvision must not be shadowed by a stand-in.
    env = {"PYTHONPATH": str(STANDINS_DIR) if use_standins else ""}
    if s.device == "cpu":
        # "1" selects SGLang's CPU engine, which needs sgl-kernel's CPU build (not installable here); with
        # "0" the ops run their native PyTorch paths.
        env["SGLANG_USE_CPU_ENGINE"] = "0"
        if torch_threads:
            # Several servers share a few cores: oversubscribed OpenMP makes them all slow.
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    if model_path and Path(model_path).is_dir():
        # A local model needs no hub; without these, transformers may try (and wait on) the network.
        env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def server_kwargs_from_env(environ: Optional[dict[str, str]] = None) -> Optional[dict[str, Any]]:
    """The server arguments in ``$BELAYER_SGLANG_SERVER_ARGS`` (None when unset or empty)."""
    raw = (os.environ if environ is None else environ).get(SERVER_ARGS_ENV, "")
    if not raw:
        return None
    kwargs = json.loads(raw)
    if not isinstance(kwargs, dict):
        raise ValueError(f"${SERVER_ARGS_ENV}: must be a JSON object of SGLang server arguments, got {raw[:200]!r}")
    return kwargs


def server_args_argv(kwargs: dict[str, Any]) -> list[str]:
    """ServerArgs keyword arguments as ``sglang.launch_server`` flags: ``foo_bar`` -> ``--foo-bar``; True -> the
    bare flag (SGLang's booleans are store_true flags defaulting to False); False and None -> omitted (SGLang's
    default then applies, which is what ServerArgs(**kwargs) would hold for a False flag); a list -> the flag
    once, then each value (SGLang's list options are ``nargs="+"``), an empty list omitted; a dict -> JSON."""
    argv: list[str] = []
    for key, value in kwargs.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if value:
                argv += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def belayer_server_kwargs(s: SGLangConfig) -> dict[str, Any]:
    """The server arguments ``engines.sglang`` sets, as ServerArgs keywords ("", 0 and false: SGLang chooses)."""
    kwargs: dict[str, Any] = {"device": s.device, "random_seed": s.random_seed}
    if s.dtype:
        kwargs["dtype"] = s.dtype
    if s.attention_backend:
        kwargs["attention_backend"] = s.attention_backend
    if s.max_total_tokens > 0:
        kwargs["max_total_tokens"] = s.max_total_tokens
    if s.mem_fraction_static > 0:
        kwargs["mem_fraction_static"] = s.mem_fraction_static
    if s.tp_size > 1:
        kwargs["tp_size"] = s.tp_size  # GPU: unverified here
    if s.device == "cpu":
        # No CUDA graphs on CPU (0.5.23's spelling; --disable-cuda-graph is deprecated and maps to this).
        # Warm-up only costs start-up time here: nothing to compile or capture.
        kwargs.update(cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled",
                      skip_server_warmup=True)
    elif s.enable_memory_saver:
        # GPU: lets /release_memory_occupation free weights and KV cache (a standby shadow). Unverified here.
        kwargs["enable_memory_saver"] = True
    return kwargs


def sglang_server_command(cfg: EnginesConfig, model_path: str, host: str, port: int, *,
                          weight_version: str = "default",
                          server_kwargs: Optional[dict[str, Any]] = None) -> tuple[list[str], dict[str, str]]:
    """argv (``<cfg.sglang.python> -m sglang.launch_server ...``) and extra environment for one server.

    `server_kwargs` (default: ``$BELAYER_SGLANG_SERVER_ARGS``, set per engine actor by a trainer hook) are a
    trainer's ServerArgs keywords: they win over ``engines.sglang`` for every key they set, except
    BELAYER_OWNED_SERVER_ARGS (the arguments here). ``engines.sglang.extra_args`` come last, as given (raw
    flags; argparse keeps an option's last occurrence)."""
    s = cfg.sglang
    if s.device == "cpu" and s.tp_size != 1:
        raise ValueError("engines.sglang.tp_size: must be 1 on device cpu")
    if server_kwargs is None:
        server_kwargs = server_kwargs_from_env()
    kwargs = belayer_server_kwargs(s)
    kwargs.update({k: v for k, v in (server_kwargs or {}).items() if k not in BELAYER_OWNED_SERVER_ARGS})
    if (kwargs.get("nnodes") or 1) > 1:
        # One server process per node rank, rendezvousing at dist_init_addr: one Belayer engine actor starts
        # one process on one node, so an engine spanning nodes cannot be one of its engines.
        raise ValueError(f"SGLang server arguments: nnodes={kwargs['nnodes']}; Belayer runs single-node engines only")
    argv = [str(resolve_python(s.python)), "-m", "sglang.launch_server",
            "--model-path", model_path, "--host", host, "--port", str(port), "--weight-version", weight_version]
    argv += server_args_argv(kwargs)
    argv += list(s.extra_args)
    threads = cfg.torch_threads if s.device == "cpu" else None
    return argv, sglang_env(cfg, model_path, threads)


@lru_cache(maxsize=8)
def _python_has_sglang(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import importlib.util as u; import sys; "
                            "sys.exit(0 if u.find_spec('sglang') and u.find_spec('torch') else 1)"],
                           capture_output=True, timeout=30, env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def sglang_available(cfg: Union[EnginesConfig, SGLangConfig]) -> bool:
    """Whether the configured SGLang interpreter exists and can find sglang and torch (cheap: no import).

    A full ``import sglang`` takes ~7 s here; a venv that finds the packages but fails to import them is
    broken, and should fail loudly when a server starts rather than be skipped.
    """
    python = resolve_python(_sglang_cfg(cfg).python)
    return python.is_file() and _python_has_sglang(str(python))


# --- the HTTP admin API (0.5.23): request bodies and response fields -----------------------------------

MODEL_INFO_PATH = "/get_model_info"  # holds weight_version; 0.5.23 has no /get_weight_version


def weight_version_of(response: dict[str, Any]) -> str:
    """The weight version in a /get_model_info answer or a /generate response (or stream chunk)."""
    if "weight_version" in response:
        return str(response["weight_version"])
    meta = response.get("meta_info") or {}
    if "weight_version" in meta:
        return str(meta["weight_version"])
    raise KeyError("no weight_version in this response (neither top-level nor meta_info)")


def update_weights_from_disk_body(model_path: str, weight_version: str, *, abort_all_requests: bool = False,
                                  flush_cache: bool = True) -> dict[str, Any]:
    """Body of ``POST /update_weights_from_disk``: load new weights (not the tokenizer) and set the version."""
    return {"model_path": model_path, "weight_version": weight_version,
            "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}


def update_weight_version_body(new_version: str, *, abort_all_requests: bool = False) -> dict[str, Any]:
    """Body of ``POST /update_weight_version`` (version only; SGLang's default aborts running requests)."""
    return {"new_version": new_version, "abort_all_requests": abort_all_requests}


def memory_occupation_body(tags: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Body of ``POST /release_memory_occupation`` or ``/resume_memory_occupation`` (GPU; unverified here).

    `tags` picks regions among MEMORY_TAGS; None means all. On CPU both routes answer `null` and release
    nothing.
    """
    if tags is None:
        return {}
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; SGLang 0.5.23 knows {list(MEMORY_TAGS)}")
    return {"tags": list(tags)}


def pause_generation_body(mode: str = "retract") -> dict[str, Any]:
    """Body of ``POST /pause_generation``: abort (fail running requests), retract (requeue, KV recomputed
    on continue) or in_place (keep them and their KV cache)."""
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
    return {"mode": mode}


# --- running a server outside Ray (tests, benchmarks) ---------------------------------------------------


def launch_sglang_server(cfg: EnginesConfig, model_path: str, host: str, port: int, log_path: Path, *,
                         weight_version: str = "default") -> subprocess.Popen:
    """Starts one server in its own process group (so it and its scheduler children die together)."""
    if not host:  # "" would make SGLang listen on every interface and the URL name none
        raise ValueError("launch_sglang_server: no host; resolve engines.host with engines.launch.engine_host")
    argv, extra_env = sglang_server_command(cfg, model_path, host, port, weight_version=weight_version)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:
        return subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **extra_env}, start_new_session=True)


def wait_first_token(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Waits until `url` serves a one-token /generate; returns the seconds waited.

    Raises RuntimeError if the process exits first, TimeoutError after `timeout_s`, PortClashError (a
    RuntimeError) if another process listens on the port. A generation is the readiness signal that
    matters (and what /health does internally, at a 1 s polling granularity); it counts only while the
    listener on the port is held by `proc` or its children (ports.listener_ownership): a port picked free
    may be taken by another process before the server binds it.
    """
    from urllib.parse import urlsplit

    import httpx

    from belayer_plugin.ports import Ownership, PortClashError, listener_ownership

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    with httpx.Client() as client:
        while True:
            own = listener_ownership(proc.pid, host, port)
            if own is Ownership.FOREIGN:
                raise PortClashError(host, port)
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {proc.returncode} before serving a token")
            if own is Ownership.OURS:  # held before and after the request: our server answered it
                try:
                    r = client.post(f"{url}/generate", json=body, timeout=max(1.0, deadline - time.monotonic()))
                    if (r.status_code == 200 and r.json().get("output_ids")
                            and listener_ownership(proc.pid, host, port) is Ownership.OURS):
                        return time.monotonic() - t0
                except (httpx.HTTPError, ValueError):
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang server at {url} served no token within {timeout_s} s")
            time.sleep(0.05)  # a starting server offers no event to await; the deadline bounds this


def start_sglang_server(cfg: EnginesConfig, model_path: str, log_path: Path, *,
                        weight_version: str = "default") -> tuple[subprocess.Popen, str, float]:
    """Starts one server on a free port and waits for its first token; returns (process, URL, seconds from
    the served attempt's process start to its first token).

    A port that another process takes before the server binds it is a clash: the server (killed, if it
    still runs) starts again on a fresh port, ports.PORT_ATTEMPTS in all, all within cfg.startup_timeout_s.
    Raises what wait_first_token raises otherwise (the server stopped first)."""
    from belayer_plugin.engines.address import engine_host, free_port
    from belayer_plugin.ports import PORT_ATTEMPTS, PortClashError, log_says_address_in_use, log_size

    host = engine_host(cfg.host)
    deadline = time.monotonic() + cfg.startup_timeout_s
    clashes: list[str] = []
    for _ in range(PORT_ATTEMPTS):
        port = free_port(host)
        url = f"http://{host}:{port}"
        since = log_size(log_path)  # the log is appended to: only this attempt's lines count
        t0 = time.monotonic()
        proc = launch_sglang_server(cfg, model_path, host, port, log_path, weight_version=weight_version)
        try:
            wait_first_token(url, proc, max(0.0, deadline - time.monotonic()))
            return proc, url, time.monotonic() - t0
        except PortClashError as e:
            clashes.append(str(e))
        except RuntimeError as e:
            if not log_says_address_in_use(log_path, since):
                stop_sglang_server(proc, cfg.shutdown_timeout_s)
                raise
            clashes.append(f"{e}: its log reports a failed bind on port {port}")  # the taker has gone since
        except BaseException:
            stop_sglang_server(proc, cfg.shutdown_timeout_s)
            raise
        stop_sglang_server(proc, cfg.shutdown_timeout_s)
    raise RuntimeError(f"another process took the SGLang server's port {PORT_ATTEMPTS} times: " + "; ".join(clashes))


def stop_sglang_server(proc: subprocess.Popen, grace_s: float = 10.0) -> Optional[int]:
    """Stops a server's whole process group: SIGTERM, then SIGKILL after `grace_s`; returns the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return proc.wait()
    # Also reap children that outlived the leader (SGLang's scheduler and detokenizer processes).
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait(grace_s)


def measure_sglang_cold_start(cfg: EnginesConfig, model_path: str, log_path: Optional[Path] = None) -> float:
    """Seconds from process start to the first served token for one fresh server (stopped afterwards)."""
    import tempfile

    log = log_path or Path(tempfile.mkdtemp(prefix="belayer-sglang-")) / "server.log"
    proc, _, seconds = start_sglang_server(cfg, model_path, log)
    stop_sglang_server(proc, cfg.shutdown_timeout_s)
    return seconds
