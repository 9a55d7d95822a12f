"""The CPU engine's Qwen2 forward pass in plain torch, so an engine never imports transformers.

transformers costs ~3.5 s of CPU at every engine start (its import pulls torch._dynamo and more) while the
CPU engine needs one architecture's forward pass. This module computes exactly transformers' Qwen2 forward
(same operations, same order: greedy ids and logprobs agree with it; tests compare them) from a Hugging Face
checkpoint directory or from tensors already in memory, under the checkpoint's own parameter names, so
weight updates by name work unchanged. A model it does not cover (another architecture, a RoPE variant,
sliding windows) is reported by `unsupported_reason`, and the engine then loads it with transformers.

Owns: the Qwen2 forward pass and loading its weights. Must not: import transformers, serve HTTP or schedule
requests (engines/cpu_engine.py does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

_ARCH = "qwen2"


def read_config(path: str | Path) -> dict:
    """The checkpoint's config.json as a dict."""
    return json.loads((Path(path) / "config.json").read_text())


def _rope(cfg: dict) -> dict:
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling at the top level.
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        return rp
    scaling = cfg.get("rope_scaling") or {}
    return {"rope_theta": cfg.get("rope_theta", 10000.0),
            "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}


def unsupported_reason(cfg: dict) -> Optional[str]:
    """Why this module cannot run the model of `cfg` (None: it can)."""
    if cfg.get("model_type") != _ARCH:
        return f"model_type {cfg.get('model_type')!r} (only {_ARCH!r} is native)"
    rope_type = _rope(cfg).get("rope_type", "default")
    if rope_type != "default":
        return f"RoPE type {rope_type!r}"
    if cfg.get("use_sliding_window"):
        return "sliding-window attention"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"activation {cfg.get('hidden_act')!r}"
    return None


def _expected_names(cfg: dict) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.q_proj.weight", p + "self_attn.q_proj.bias",
                  p + "self_attn.k_proj.weight", p + "self_attn.k_proj.bias",
                  p + "self_attn.v_proj.weight", p + "self_attn.v_proj.bias",
                  p + "self_attn.o_proj.weight",
                  p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    if not cfg.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    return names


# safetensors' dtype names (its format spec) -> torch dtype attribute names.
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def map_safetensors(file: str | Path) -> dict[str, Any]:
    """The tensors of one safetensors file, mapped as transformers 5 maps them (engines.mapped); ValueError
    for a file that is truncated or whose header is malformed, before any tensor is used."""
    from belayer_plugin.engines.mapped import map_tensors

    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > os.fstat(f.fileno()).st_size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        entries = {}
        for name, meta in header.items():
            begin, end = (8 + n + int(o) for o in meta["data_offsets"])
            entries[name] = (_DTYPES[meta["dtype"]], list(meta["shape"]), begin, end - begin)
        return map_tensors(file, entries)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{file}: not a valid safetensors file ({e})") from e


def load_safetensors(path: str | Path) -> dict[str, Any]:
    """Every tensor of a checkpoint directory's safetensors file(s), by name; FileNotFoundError if none."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (p / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no safetensors weights in {p}")
    state: dict[str, Any] = {}
    for f in files:
        state.update(map_safetensors(p / f))
    return state


class NativeQwen2:
    """A Qwen2 causal LM over named tensors; called like transformers' model by the CPU engine."""

    def __init__(self, cfg: dict, state: dict[str, Any]):
        import torch

        reason = unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"the native model cannot run this checkpoint: {reason}")
        self.cfg = cfg
        self.config = SimpleNamespace(vocab_size=cfg["vocab_size"],
                                      max_position_embeddings=cfg.get("max_position_embeddings"))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.n_heads
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.scaling = self.head_dim ** -0.5
        theta = float(_rope(cfg).get("rope_theta", 10000.0))
        # As transformers computes it: integer arange cast to float32, then base ** (x / dim).
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float()
                                         / self.head_dim))
        names = _expected_names(cfg)
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        missing = [n for n in names if n not in state]
        unexpected = [n for n in state if n not in names and not (n == "lm_head.weight" and self.tied)]
        if missing or unexpected:
            raise ValueError(f"weights do not match the {_ARCH} config: missing {missing[:5]} "
                             f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
        self.params: dict[str, Any] = {}
        self.load_state_dict(state)

    def eval(self) -> "NativeQwen2":
        return self

    def state_dict(self) -> dict[str, Any]:
        """The parameters by name (lm_head.weight included, the embedding itself when tied)."""
        return dict(self.params)

    def load_state_dict(self, named: dict[str, Any], strict: bool = False, assign: bool = True) -> None:
        """Replaces the named parameters (float32); a tied head follows a new embedding."""
        for name, t in named.items():
            self.params[name] = t.float()  # a no-op for float32 (the same tensor, still mapped)
        if self.tied and "model.embed_tokens.weight" in named and "lm_head.weight" not in named:
            self.params["lm_head.weight"] = self.params["model.embed_tokens.weight"]

    def _norm(self, x: Any, w: Any) -> Any:
        import torch

        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + self.eps))

    def __call__(self, input_ids: Any, past_key_values: Optional[list] = None, use_cache: bool = True) -> Any:
        """Logits for `input_ids` (1 x T) after the cached positions; returns .logits and .past_key_values."""
        import torch
        import torch.nn.functional as F

        p = self.params
        cache = past_key_values if past_key_values is not None else [None] * self.n_layers
        past = 0 if cache[0] is None else cache[0][0].shape[2]
        b, t = input_ids.shape
        pos = torch.arange(past, past + t, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = None
        if t > 1 and past > 0:  # a chunk after cached positions: causal within the chunk, all of the past
            mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
        h = F.embedding(input_ids, p["model.embed_tokens.weight"])
        new_cache = []
        rep = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            pre = f"model.layers.{i}."
            x = self._norm(h, p[pre + "input_layernorm.weight"])
            q = F.linear(x, p[pre + "self_attn.q_proj.weight"], p[pre + "self_attn.q_proj.bias"])
            k = F.linear(x, p[pre + "self_attn.k_proj.weight"], p[pre + "self_attn.k_proj.bias"])
            v = F.linear(x, p[pre + "self_attn.v_proj.weight"], p[pre + "self_attn.v_proj.bias"])
            q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
            k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
            v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if cache[i] is not None:
                k = torch.cat((cache[i][0], k), dim=2)
                v = torch.cat((cache[i][1], v), dim=2)
            new_cache.append((k, v))
            kk, vv = (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None and t > 1,
                                               scale=self.scaling)
            a = a.transpose(1, 2).reshape(b, t, -1)
            h = h + F.linear(a, p[pre + "self_attn.o_proj.weight"])
            x = self._norm(h, p[pre + "post_attention_layernorm.weight"])
            gate = F.linear(x, p[pre + "mlp.gate_proj.weight"])
            up = F.linear(x, p[pre + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, p[pre + "mlp.down_proj.weight"])
        h = self._norm(h, p["model.norm.weight"])
        logits = F.linear(h, p["lm_head.weight"])
        return SimpleNamespace(logits=logits, past_key_values=new_cache if use_cache else None)


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def from_pretrained(path: str | Path) -> NativeQwen2:
    """The native model of a checkpoint directory (config.json + safetensors), in float32."""
    return NativeQwen2(read_config(path), load_safetensors(path))


def usable(path: str | Path) -> Optional[str]:
    """Why the checkpoint at `path` cannot be served natively (None: it can)."""
    p = Path(path)
    try:
        cfg = read_config(p)
    except (OSError, ValueError) as e:
        return f"config.json unreadable: {e}"
    reason = unsupported_reason(cfg)
    if reason is None and not (p / "tokenizer.json").exists():
        reason = "no tokenizer.json"
    return reason
