"""A verl 0.9.1 agent loop for sandbox environments with prefix-consistent recovery (`belayer_sandbox_agent`).

Each turn the model writes one shell command in a ```bash block; it runs in a Belayer sandbox as one action
of a TrajectoryRecorder (begin_action / commit), the output goes back as the next user message, and the
checkpoint policy takes full_checkpoint snapshots between actions (async, while the model generates). When
the sandbox fails (SandboxError: container killed, exec failed) the recorder restores the newest usable
checkpoint with full_restore and rolls the context back to that same boundary: token ids, messages and the
response mask are truncated together, the action in flight is dropped (never replayed), and the agent
regenerates from there. Generation goes through verl's server manager (with BelayerLLMServerClient, engine
deaths are resumed token-level underneath).

Sandboxes come from `sandbox_provider(trajectory_id, cfg) -> (Sandbox, CheckpointStore, setup or None)`:
by default `sandbox_from_config` (the recipe's `belayer.sandbox` section); tests and users may set
`SandboxAgentLoop.sandbox_provider` to their own.

Owns: the sandbox agent loop for verl. Must not: choose engines (verl's balancer and Belayer's client do).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from belayer_plugin.config import BelayerConfig, cache_dir
from belayer_plugin.hooks._config import belayer_section
from belayer_plugin.metrics import StepMetrics
from belayer_plugin.sandbox.base import Sandbox, SandboxError, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore
from belayer_plugin.sandbox.policy import CheckpointPolicy
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

COMMAND = re.compile(r"```(?:bash|sh)\s*\n(.*?)```", re.S)
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

Provider = Callable[[str, BelayerConfig], tuple[Sandbox, CheckpointStore, Optional[Callable[[Sandbox], None]]]]


def sandbox_from_config(trajectory_id: str, cfg: BelayerConfig):
    """A sandbox of `cfg.sandbox.env` on its backend, with a per-trajectory checkpoint store."""
    import os

    from belayer_plugin.envs.build import ensure_image

    from belayer_plugin.sandbox.factory import make_backend

    sc = cfg.sandbox
    backend = make_backend(sc)
    cache = sc.env_cache_dir or str(cache_dir(cfg) / "envs")
    image = ensure_image(backend, sc.env, cache)
    spec = SandboxSpec(image=image, cpus=sc.cpus, memory_mb=sc.memory_mb, pids_limit=sc.pids_limit,
                       network=sc.network)
    sb = Sandbox.create(backend, spec, trajectory_id, sc.exec_timeout_s)
    root = Path(sc.checkpoint_dir or os.path.join(cfg.run_dir or "runs", "sandbox-checkpoints")) / trajectory_id
    return sb, CheckpointStore(root, keep=sc.keep_checkpoints), None


@register("belayer_sandbox_agent")
class SandboxAgentLoop(AgentLoopBase):
    sandbox_provider: Provider = staticmethod(sandbox_from_config)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.response_length = self.rollout_config.response_length
        self.max_turns = int(self.rollout_config.get("multi_turn", {}).get("max_assistant_turns") or 8)
        self.belayer = belayer_section(self.config.get("belayer"))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        tid = f"traj-{uuid.uuid4().hex[:10]}"
        prompt_ids = await self.ct_build_initial_tokens(messages)
        sb, store, setup = await self._blocking(self.sandbox_provider, tid, self.belayer)
        counts = StepMetrics()  # this trajectory's restores and checkpoints, for the trainer's step metrics
        sc = self.belayer.sandbox
        rec = TrajectoryRecorder(tid, sb, store, checkpoint_mode=sc.checkpoint_mode,
                                 checkpoint_timeout_s=sc.checkpoint_timeout_s, restore_timeout_s=sc.restore_timeout_s,
                                 restore_retries=sc.restore_retries, deterministic=sc.replay_deterministic,
                                 replay=sc.replay_deterministic, setup=setup, on_event=counts.on_event)
        policy = CheckpointPolicy.from_config(sc.policy, rec.checkpoint, subject=tid)
        ids, mask = list(prompt_ids), []
        masks: dict[int, list[int]] = {0: []}  # the response mask at each committed boundary
        recoveries, turns = 0, 0
        try:
            await self._blocking(rec.start, ids, messages, self.belayer.use_fault_tolerance)
            while turns < self.max_turns and len(mask) < self.response_length:
                turns += 1
                out = await self.server_manager.generate(request_id=f"{tid}-{turns}", prompt_ids=ids,
                                                         sampling_params=dict(sampling_params))
                merged, mask, _ = await self.ct_merge_assistant_token(ids, out.token_ids, mask)
                ids = list(merged.token_ids)
                text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                found = COMMAND.search(text)
                if found is None or SUBMIT in text:
                    break
                action = {"command": found.group(1).strip(), "timeout": sc.exec_timeout_s}
                try:
                    await self._blocking(policy.wait_ready, sc.checkpoint_timeout_s)
                    rec.begin_action(action)
                    res = await self._blocking(rec.sandbox.exec, action["command"], action["timeout"])
                    obs = {"role": "user", "content": f"<returncode>{res.exit_code}</returncode>\n{res.output}"}
                    merged, mask, _ = await self.ct_merge_context_msg(messages, [*messages, obs], ids, mask)
                    messages.append(obs)
                    ids = list(merged.token_ids)
                    b = rec.commit(ids, messages, {"returncode": res.exit_code})
                    masks[b] = list(mask)
                    policy.note_work(0.0, "generation", action_done=True)
                    if self.belayer.use_fault_tolerance:
                        policy.maybe_checkpoint_async(b)
                except SandboxError as e:
                    if not self.belayer.use_fault_tolerance:
                        raise
                    await self._blocking(policy.wait_ready, sc.checkpoint_timeout_s)
                    rb = await self._blocking(rec.recover, f"{type(e).__name__}: {e}")
                    policy.reset()
                    recoveries += 1
                    ids, messages, mask = list(rb.token_ids), [dict(m) for m in rb.messages], list(masks[rb.boundary])
        finally:
            policy.close()
            try:
                rec.sandbox.close()
            except SandboxError:
                pass
            report = getattr(self.server_manager, "report_metrics", None)  # BelayerLLMServerClient's
            if report is not None and self.belayer.use_fault_tolerance:
                await report(counts.take())
        n = self.response_length
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):][:n], response_mask=mask[:n],
                               num_turns=turns + 1, metrics={},
                               extra_fields={"belayer_sandbox": {"trajectory": tid, "recoveries": recoveries,
                                                                 "boundaries": rec.latest, "messages": messages},
                                             "turn_scores": [], "tool_rewards": []})

    async def _blocking(self, fn: Callable, *args: Any) -> Any:
        return await self.loop.run_in_executor(None, fn, *args)
