"""The CPU engine's OpenAI-compatible surface: `/v1/chat/completions` (non-streaming) and `/v1/models`.

NeMo-RL's GenerationRouter (the router in front of its fleet for NeMo-Gym) forwards exactly these OpenAI routes,
and counts the requests that fail on a backend as that backend's failures: the CPU engine serves them so that
NeMo-RL's own router can run in front of it (bench/detection.py's NeMo-RL arm feeds its fleet health from it).
A chat's messages become the prompt as `role: content` lines (the CPU engine's tokenizer has no chat
template); generation is the engine's own, as for `/generate`.

Owns: the OpenAI request and response shapes of the CPU engine. Must not: hold model or scheduler state, or
accept what it does not do (streaming, n > 1, tools): those are a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

_CHAT_REFUSED = ("tools", "tool_choice", "functions", "response_format")


def chat_prompt(messages: Any) -> str:
    """The prompt text of a chat: one `role: content` line per message, then `assistant:`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string role and content")
        lines.append(f"{m['role']}: {m['content']}")
    return "\n".join(lines) + "\nassistant:"


def generate_body(body: Any) -> dict:
    """The engine's own /generate body for an OpenAI chat completion body; ValueError naming what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    refused = [k for k in _CHAT_REFUSED if body.get(k)]
    if refused:
        raise ValueError(f"not supported by the CPU engine: {', '.join(refused)}")
    if body.get("stream"):
        raise ValueError("stream: not supported by the CPU engine's chat completions (use /generate)")
    if body.get("n", 1) != 1:
        raise ValueError("n: only 1 is supported")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError("max_tokens must be a non-negative integer")
    sampling: dict[str, Any] = {"max_new_tokens": max_tokens}
    for key in ("temperature", "top_p"):
        if key in body:
            sampling[key] = body[key]
    return {"text": chat_prompt(body.get("messages")), "sampling_params": sampling}


def chat_response(model: str, out: dict) -> dict:
    """An OpenAI chat completion from the engine's /generate answer."""
    meta = out["meta_info"]
    finish = (meta.get("finish_reason") or {}).get("type", "stop")
    return {"id": f"chatcmpl-{meta.get('id') or uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                         "finish_reason": "length" if finish == "length" else "stop"}],
            "usage": {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
                      "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}}


def models_response(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "belayer"}]}


def bad_request(msg: str) -> web.Response:
    return web.json_response({"error": {"message": msg, "type": "invalid_request_error", "code": 400}}, status=400)
