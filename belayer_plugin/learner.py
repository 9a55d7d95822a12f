"""The reference learner: a real GRPO-style gradient step on the tiny model, as a Ray actor.

Model and optimizer are checkpointed asynchronously at every step boundary (the copy is taken on the
step's thread, the write happens in the background and is published by an atomic rename), and a new
learner resumes from the latest complete checkpoint, so killing the learner loses at most the step that
was running — which the loop re-runs from the same batch with the same result.

Owns: the gradient step and saving the weights it produces. Must not: talk to engines (the loop refits them).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Optional


class Learner:
    """Holds the policy and its optimizer; `train_step` returns the directory of the new weights."""

    def __init__(self, model_path: str, run_dir: str, lr: float, seed: int, torch_threads: int = 1):
        from belayer_plugin.lean_imports import skip_unused_imports

        skip_unused_imports()  # this actor's own worker process
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        torch.set_num_threads(torch_threads)
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "learner-ckpt"
        self.weights_dir = self.run_dir / "weights"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.step = 0
        self._writer: Optional[threading.Thread] = None
        self.resumed_from = self._restore_latest()

    def _restore_latest(self) -> Optional[int]:
        import torch

        done = sorted((int(p.name.removeprefix("step-")) for p in self.ckpt_dir.glob("step-*")
                       if (p / "COMPLETE").exists()), reverse=True)
        self.found = sorted(done)  # complete checkpoints on disk when this learner started (its info says)
        for step in done:
            try:
                blob = torch.load(self.ckpt_dir / f"step-{step}" / "state.pt", weights_only=False)
            except Exception:  # a damaged checkpoint is skipped, never used
                continue
            self.model.load_state_dict(blob["model"])
            self.opt.load_state_dict(blob["opt"])
            self.step = step
            return step
        return None

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        import ray

        return {"step": self.step, "resumed_from": self.resumed_from, "checkpoints": self.found, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None}

    def train_step(self, step: int, batch: list[dict]) -> dict:
        """One update from trajectories {token_ids, gen_mask, advantage}; returns {path, loss, step}."""
        import torch

        if step != self.step + 1:
            raise ValueError(f"learner is at step {self.step}; asked for step {step}")
        self.wait_checkpoint()
        self.opt.zero_grad()
        total, n_tok = torch.zeros(()), 0
        for item in batch:
            ids = torch.tensor([item["token_ids"]])
            mask = torch.tensor(item["gen_mask"][1:], dtype=torch.float32)
            logits = self.model(input_ids=ids).logits[0, :-1]
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            total = total - float(item["advantage"]) * (lp * mask).sum()
            n_tok += int(mask.sum())
        loss = total / max(1, n_tok)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step = step
        out = self.weights_dir / f"v{step}"
        tmp = self.weights_dir / f".v{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(str(tmp), safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "belayer_tiny.json"):
            if (Path(self.model_path) / name).exists():
                shutil.copy2(Path(self.model_path) / name, tmp / name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        self._checkpoint_async(step)
        return {"path": str(out), "loss": float(loss), "step": step, "tokens": n_tok}

    def _checkpoint_async(self, step: int) -> None:
        import torch

        # Copied now (the next step mutates them); written in the background while rollouts run.
        blob = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "opt": _clone(self.opt.state_dict()), "step": step}

        def write() -> None:
            d = self.ckpt_dir / f"step-{step}"
            tmp = self.ckpt_dir / f".step-{step}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            torch.save(blob, tmp / "state.pt")
            (tmp / "COMPLETE").write_text(json.dumps({"step": step}))
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
            for old in self.ckpt_dir.glob("step-*"):  # keep the newest two
                if int(old.name.removeprefix("step-")) < step - 1:
                    shutil.rmtree(old, ignore_errors=True)

        self._writer = threading.Thread(target=write, name="learner-ckpt", daemon=True)
        self._writer.start()

    def wait_checkpoint(self) -> int:
        """Waits for the background checkpoint write; returns the step of the newest complete one."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        return self.step


def _clone(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
