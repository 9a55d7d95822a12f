"""Refit tests load weights that really differ (issue 44, item 5): a label alone proves nothing, so every
refit goes to a perturbed copy of the tiny model (same architecture and tokenizer, other weights) and the test
checks that the engines' greedy ids changed with it."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from belayer_plugin.generation.sglang_http import generate

PROBE = [54, 280, 487, 423, 442]
PROBE_SP = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def perturbed_copy(model: str, dest: Path, seed: int, scale: float = 0.3) -> str:
    """The tiny model with other weights (Gaussian noise of `scale` added with `seed`): what a training step
    makes. Distinct seeds give distinct weights; the caller checks their greedy ids differ (greedy_ids)."""
    import torch
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    shutil.copytree(model, dest)
    sd = load_file(str(dest / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    save_file({k: v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()},
              str(dest / "model.safetensors"))
    return str(dest)


async def greedy_ids(url: str, prompt: list[int] = PROBE) -> list[int]:
    """The greedy ids an engine computes for the probe prompt with the weights it holds now."""
    async with httpx.AsyncClient() as c:
        return (await generate(c, url, {"input_ids": prompt, "sampling_params": PROBE_SP}, 60))["output_ids"]
