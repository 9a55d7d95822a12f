"""Model weights in shared memory, mapped by every CPU engine (main and shadow) without copying.

A holder publishes a model directory once into /dev/shm: the tensors back to back in one file plus an
index, beside the model's small config and tokenizer files. Engines map that file copy-on-write and build
their parameters on top of it, so N engines hold one copy of the weights: a standing-by shadow costs its
process overhead, not another copy of the model.

Owns: the shared-memory copy of each published weight version and its release. Must not: serve requests.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

MARKER = "belayer_shm.json"
_ALIGN = 64
_SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "belayer_tiny.json")


def is_shared(path: str | Path) -> bool:
    """Whether `path` is a published shared-memory model directory."""
    return (Path(path) / MARKER).exists()


def _tensors(path: Path) -> list[tuple[str, str, list[int], bytes]]:
    """(name, torch dtype name, shape, raw bytes) of every tensor in a safetensors file.

    Read through numpy when numpy has every dtype of the file: the holder then never imports torch (~2 s of
    CPU at every fleet start on a 2-core VM); a file with bfloat16 or another torch-only dtype goes through
    torch."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as st:
            return [(name, a.dtype.name, list(a.shape), a.tobytes())
                    for name in st.keys() for a in (st.get_tensor(name),)]
    except (SafetensorError, TypeError, ValueError):
        pass  # a dtype numpy lacks
    import torch

    with safe_open(str(path), framework="pt") as st:
        return [(name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
                for name in st.keys() for t in (st.get_tensor(name).contiguous(),)]


def publish(model_dir: str | Path, root: str | Path = "/dev/shm", tag: Optional[str] = None) -> Path:
    """Copies a model directory's tensors into one shared-memory file; returns the published directory.

    Published atomically: the directory appears under its final name only once complete.
    """
    src = Path(model_dir)
    final = Path(root) / f"belayer-weights-{tag or uuid.uuid4().hex[:12]}"
    if is_shared(final):
        return final
    tmp = Path(root) / f".{final.name}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        index: dict[str, Any] = {}
        offset = 0
        with open(tmp / "weights.bin", "wb") as out:
            for f in sorted(src.glob("*.safetensors")):
                for name, dtype, shape, data in _tensors(f):
                    pad = (-offset) % _ALIGN
                    out.write(b"\0" * pad)
                    offset += pad
                    out.write(data)
                    index[name] = {"dtype": dtype, "shape": shape, "offset": offset, "nbytes": len(data)}
                    offset += len(data)
        for name in _SMALL_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, tmp / name)
        (tmp / "index.json").write_text(json.dumps(index))
        (tmp / MARKER).write_text(json.dumps({"source": str(src), "bytes": offset}))
        try:
            tmp.rename(final)
        except OSError:  # published meanwhile by someone else: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def unpublish(path: str | Path) -> None:
    """Removes a published directory (engines that mapped it keep their mapping until they exit)."""
    shutil.rmtree(path, ignore_errors=True)


def map_state(path: str | Path) -> dict[str, Any]:
    """The published tensors by name, viewing the shared-memory file (engines.mapped: zero copy)."""
    from belayer_plugin.engines.mapped import map_tensors

    p = Path(path)
    index = json.loads((p / "index.json").read_text())
    return map_tensors(p / "weights.bin", {name: (m["dtype"], m["shape"], m["offset"], m["nbytes"])
                                           for name, m in index.items()})


def load_native_model(path: str | Path) -> Any:
    """native_lm's model over the published shared-memory file (zero copy for float32 weights)."""
    from belayer_plugin.engines import native_lm

    return native_lm.NativeQwen2(native_lm.read_config(path), map_state(path))


def load_model(path: str | Path) -> Any:
    """A transformers causal LM whose parameters live in the published shared-memory file (zero copy)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    state = map_state(p)
    config = AutoConfig.from_pretrained(p)
    # Built on the meta device: initialising real random weights first would cost a private copy of the
    # model that the allocator keeps after they are replaced.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still = [m for m in missing if not m.endswith("lm_head.weight")]
    if still or unexpected:
        raise ValueError(f"shared weights do not match the model: missing {still[:5]}, unexpected {unexpected[:5]}")
    # Non-persistent buffers (e.g. rotary inv_freq) are not in the file: rebuild their modules on the CPU.
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(mod)(config=config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"shared weights left tensors uninitialised: {left[:5]}")
    model.eval()
    return model


class WeightsHolder:
    """Owns published shared-memory weights for a fleet (run it as a Ray actor or in-process)."""

    def __init__(self, root: str = "/dev/shm", run_tag: Optional[str] = None):
        self.root = root
        self.run_tag = run_tag or uuid.uuid4().hex[:8]
        self.published: dict[str, str] = {}

    def publish(self, model_dir: str, version: str) -> str:
        """Publishes `model_dir` as `version` (once); returns the directory engines load from."""
        if version not in self.published:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in version)
            self.published[version] = str(publish(model_dir, self.root, f"{self.run_tag}-{safe}"))
        return self.published[version]

    def release(self, keep: Optional[list[str]] = None) -> None:
        """Drops every published version except `keep`."""
        for v in list(self.published):
            if keep is None or v not in keep:
                unpublish(self.published.pop(v))
