"""Publishing weights to shared memory: every dtype round-trips byte for byte, and the float32 path (the
tiny model's) runs without importing torch in the holder's process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_published_tensors_round_trip_exactly_including_dtypes_numpy_lacks(tmp_path):
    import torch
    from safetensors.torch import save_file

    from belayer_plugin.engines import shared_weights

    src = tmp_path / "model"
    src.mkdir()
    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "f32": torch.randn(7), "i64": torch.arange(4)}
    save_file(tensors, str(src / "model.safetensors"))
    out = shared_weights.publish(src, tmp_path / "shm", "t")
    index = json.loads((out / "index.json").read_text())
    raw = (out / "weights.bin").read_bytes()
    for name, t in tensors.items():
        meta = index[name]
        assert meta["dtype"] == str(t.dtype).removeprefix("torch.") and meta["shape"] == list(t.shape)
        assert meta["offset"] % 64 == 0
        back = torch.frombuffer(bytearray(raw[meta["offset"]:meta["offset"] + meta["nbytes"]]),
                                dtype=t.dtype).view(t.shape)
        assert torch.equal(back, t), name


@pytest.mark.timeout(120)
def test_publishing_a_float32_model_does_not_import_torch(tiny_model, tmp_path):
    code = ("import sys; from belayer_plugin.engines import shared_weights as s; "
            f"s.publish({str(tiny_model)!r}, {str(tmp_path)!r}, 'x'); print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "False"
