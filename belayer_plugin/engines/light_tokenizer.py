"""A Qwen2 checkpoint's tokenizer read straight from tokenizer.json, for the CPU engine (no transformers).

transformers 5 loads a qwen2 model's tokenizer as `Qwen2Tokenizer`, which swaps the saved pre-tokenizer
for Qwen2's own. Qwen2 checkpoints (and Belayer's tiny model, see tiny_model.build_tokenizer) already save
exactly that one, so the Rust tokenizer of tokenizer.json encodes and decodes as transformers does; the
engine serves natively only such checkpoints (native_lm.usable) and tests compare the two.

Owns: encoding and decoding with a tokenizer.json. Must not: import transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


class LightTokenizer:
    """The subset of a transformers tokenizer the CPU engine uses: call, decode, eos_token_id."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        p = Path(path)
        self.backend_tokenizer = Tokenizer.from_file(str(p / "tokenizer.json"))
        cfg_file = p / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        eos = cfg.get("eos_token", "<|endoftext|>")  # Qwen2Tokenizer's own default
        if isinstance(eos, dict):  # older files: an AddedToken's fields
            eos = eos.get("content")
        self.eos_token_id: Optional[int] = (self.backend_tokenizer.token_to_id(eos)
                                            if isinstance(eos, str) else None)

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=True).ids}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens kept unless asked (transformers' default, not tokenizers')."""
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
