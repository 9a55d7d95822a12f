"""Refit tests load weights that really differ (issue 44, item 5): a label alone proves nothing, so every
refit goes to a perturbed copy of the tiny model (same architecture and tokenizer, other weights) and the test
checks that the engines' greedy ids changed with it."""

from __future__ import annotations

import httpx

from belayer_plugin.engines.tiny_model import perturbed_copy  # noqa: F401  (the tests' import)
from belayer_plugin.generation.sglang_http import generate

PROBE = [54, 280, 487, 423, 442]
PROBE_SP = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


async def greedy_ids(url: str, prompt: list[int] = PROBE) -> list[int]:
    """The greedy ids an engine computes for the probe prompt with the weights it holds now."""
    async with httpx.AsyncClient() as c:
        return (await generate(c, url, {"input_ids": prompt, "sampling_params": PROBE_SP}, 60))["output_ids"]
