"""A tiny real causal LM built locally: byte-level BPE trained here and a randomly initialised Qwen2.

No model hub is reachable, so tests, benchmarks and the demo serve this model. `initializer_range` is
large on purpose: with the usual 0.02 greedy decoding repeats one token, and every "same ids as the
fault-free run" test would pass trivially.

Owns: building and caching the tiny model. Must not: be needed by a run given another model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX (also the one in Qwen2 checkpoints' tokenizer.json).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Bumped when the built files change, so ensure_tiny rebuilds older copies (2: Qwen2 pre-tokenizer).
TINY_FORMAT = 2
_WORDS = (
    "the a an engine rollout policy reward sandbox checkpoint restore token model train step fault "
    "tolerance shadow handover weight version router request stream health monitor restart budget "
    "agent action observation file process container kill signal recover resume prefix context "
    "fast slow quick brown fox jumps over lazy dog and or not if then else while for def return "
    "print ls cat echo cd mkdir rm python bash run test pass fail ok error value count sum list"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ":", ";", ""]) + f" {rng.randint(0, 999)}")
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int = 512, seed: int = 0) -> None:
    """Trains a byte-level BPE tokenizer and saves it in Hugging Face format under `out_dir`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    # transformers 5 loads the tokenizer of any qwen2 model as Qwen2Tokenizer, which replaces the saved
    # pre-tokenizer with Qwen2's (one token per digit, then ByteLevel without its regex) and adds NFC.
    # SGLang 0.5.23 sees the mismatch with tokenizer.json and restores the saved one, so the two split
    # text with digits differently. Saving Qwen2's own components makes tokenizer.json, transformers and
    # SGLang agree; the vocabulary and merges trained above are unchanged.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_tiny(out_dir: str | Path, seed: int = 0, vocab_size: int = 512, hidden_size: int = 64,
              num_layers: int = 2, num_heads: int = 2, max_positions: int = 4096) -> Path:
    """Builds the tiny model (tokenizer + Qwen2 weights) under `out_dir` and returns the path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        # head_dim 32: the smallest that every CPU attention backend we use accepts
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        initializer_range=0.3,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config.eos_token_id = 0
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "belayer_tiny.json").write_text(json.dumps({"seed": seed, "kind": "belayer-tiny-qwen2", "format": TINY_FORMAT}))
    return out


def _is_current(p: Path) -> bool:
    """Whether `p` holds a complete tiny model of the current format."""
    try:
        marker = json.loads((p / "belayer_tiny.json").read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == TINY_FORMAT and (p / "model.safetensors").exists()


def ensure_tiny(path: str | Path) -> Path:
    """Returns `path`, building the tiny model there first if it is not complete (or of an older format)."""
    p = Path(path)
    if not _is_current(p):
        # Build beside, then rename: a half-built model directory must never be served.
        tmp = p.with_name(p.name + f".tmp{random.randint(0, 1 << 30)}")
        make_tiny(tmp)
        if not _is_current(p):
            import shutil

            shutil.rmtree(p, ignore_errors=True)
            tmp.rename(p)
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return p


def perturbed_copy(model: str | Path, dest: str | Path, seed: int, scale: float = 0.3) -> str:
    """A copy of `model` at `dest` with other weights (Gaussian noise of `scale` added with `seed`), as a
    training step makes: same architecture and tokenizer. Distinct seeds give distinct weights; callers check
    that their greedy ids differ (a refit judged by its label alone proves nothing)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    shutil.copytree(model, dest)
    sd = load_file(str(dest / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    save_file({k: v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()},
              str(dest / "model.safetensors"))
    return str(dest)
