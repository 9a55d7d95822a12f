"""Belayer under verl 0.9.1's v1 trainer as verl's main_ppo runs it: TransferQueue, the recipe's
`BelayerAgentLoopManager` (verl's AgentLoopManagerTQ) built by its own `create()`, verl's AgentLoopWorkerTQ
actors writing each trajectory into TransferQueue, the recipe's `BelayerReplayBuffer` built by verl's own
`PPOTrainer._build_replay_buffer` sampling them, and the v1 trainer's own CheckpointEngineManager (verl's class)
running the sync trainer's sequence: submit -> sample -> sleep (on_sample_end) -> weight sync (on_step_end).

verl's vLLMReplica (rollout.name=vllm) in hybrid mode; replaced because they cannot run here, exactly as in
tests/test_verl_real_replicas.py (hooks/verl/standins.py): the server actor vLLMReplica launches
(`VllmServerStandin` over a Belayer CPU engine process), the trainer's hybrid workers as far as the weight push
goes, and `import vllm` in this process.

The fault is real: one replica's server actor SIGKILLed mid-rollout (its engine process dies with it), once
it has served two chunks. The trajectories verl's trainer reads back from TransferQueue (responses, input ids,
logprobs, the weight versions in the tags) must equal the fault-free step's, Belayer's per-request record must
survive TransferQueue's storage (`extra_fields["belayer"]`, nested lists and dicts), the killed replica must be
restarted by the trainer's sleep, synced and then serve the next step, and the step's metrics (verl's sampler
metrics plus Belayer's) must count the resumed requests.

Its own Ray cluster (TransferQueue holds 2 Ray CPUs for its lifetime, and the stand-in workers declare GPUs), so
the run is a subprocess: `KIND=vllm-tq tests/functional/verl_replica_kill.sh` (`python -m
tests.test_verl_v1_transferqueue --report R`); the test judges its report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")
pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (bash .ci/setup_verl.sh)")

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600
ROLLOUT_S = 240.0  # one step's trajectories in TransferQueue (4 requests of 40 tokens, a restart on 2 cores)
FIELDS = ["uid", "session_id", "responses", "input_ids", "rollout_log_probs", "extra_fields"]

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 120)


# ------------------------------------------------------------------ the run (in a subprocess)
class V1Run:
    """What verl's TaskRunnerV1 builds, in its order: TransferQueue, the trainer's LLMServerManager and v1
    CheckpointEngineManager (trainer_base.init steps 9-10, then its sleep), the recipe's agent loop manager by its
    own create(), and the replay buffer from the recipe's custom sampler."""

    def __init__(self, cfg):
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
        from verl.utils.import_utils import load_class_from_fqn
        from verl.workers.config import CheckpointEngineConfig
        from verl.workers.rollout.llm_server import LLMServerManager

        from belayer_plugin.hooks.verl.standins import HybridWorkersStandin

        self.cfg = cfg
        self.workers = HybridWorkersStandin(2)
        self.servers = LLMServerManager.create(config=cfg, worker_group=self.workers)
        self.ckpt = CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), self.workers,
                                            self.servers.get_replicas())
        self.ckpt.sleep_replicas()  # trainer_base.init: sleep all replicas to load the checkpoint
        self.step = 1
        self.ckpt.update_weights(self.step)  # trainer_sync.on_init_end
        cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
        # TaskRunnerV1.init_agent_loop_manager: the trainer's get_llm_client() is the manager's get_client()
        self.agents = cls.create(config=cfg, llm_client=self.servers.get_client(), teacher_client=None,
                                 reward_loop_worker_handles=None)
        trainer = object.__new__(PPOTrainerSync)  # only its replay-buffer builder runs (PPOTrainer.__init__'s call)
        trainer.config, trainer.trainer_mode = cfg, "sync"
        self.buffer = trainer._build_replay_buffer()
        self.lb = self.servers.global_load_balancer

    def submit(self, messages: list[str]) -> list[str]:
        """trainer_base._submit_batch_to_rollout for one batch of prompts; returns their uids."""
        import numpy as np
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        uids = [f"s{self.step}-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(messages))]
        batch = tu.get_tensordict({
            "raw_prompt": np.array([[{"role": "user", "content": m}] for m in messages], dtype=object),
            "index": np.arange(len(messages)), "uid": np.array(uids, dtype=object)})
        tu.assign_non_tensor_data(batch, "global_steps", self.step)
        tq.kv_batch_put(keys=uids, partition_id="train",
                        tags=[{"is_prompt": True, "status": "pending", "global_steps": self.step} for _ in uids])
        self.agents.generate_sequences(batch)  # returns at once: AgentLoopWorkerTQ writes into TransferQueue
        return uids

    def wait_terminal(self, uids: list[str], timeout: float) -> dict[str, str]:
        """Each prompt's terminal status tag (finished / failure). verl's sample() would wait forever and refill
        failed prompts from the dataloader; TransferQueue has no change event, so its tags are read every 0.5 s,
        bounded by `timeout`."""
        import transfer_queue as tq

        deadline = time.monotonic() + timeout
        while True:
            tags = (tq.kv_list(partition_id="train") or {}).get("train", {})
            status = {u: (tags.get(u) or {}).get("status") for u in uids}
            if all(s in ("finished", "failure") for s in status.values()) or time.monotonic() > deadline:
                return status
            time.sleep(0.5)

    def sample(self, n: int) -> tuple[dict, dict]:
        """trainer_base._step_once's sample and what the trainer reads back for the batch."""
        import transfer_queue as tq

        batch, metrics = self.buffer.sample(global_steps=self.step, partition_id="train", batch_size=n)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=FIELDS)
        rows = {}
        responses, input_ids = data["responses"].unbind(0), data["input_ids"].unbind(0)
        logprobs = data["rollout_log_probs"].unbind(0)
        for i, uid in enumerate(list(data["uid"])):
            extra = data["extra_fields"][i]
            extra = getattr(extra, "data", extra)  # a NonTensorData around the dict
            rows[str(uid)] = {"responses": responses[i].tolist(), "input_ids": input_ids[i].tolist(),
                              "logprobs": [round(float(x), 4) for x in logprobs[i].tolist()],
                              "min_global_steps": extra.get("min_global_steps"),
                              "max_global_steps": extra.get("max_global_steps"),
                              "belayer": extra.get("belayer")}
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)  # trainer_base: after the step
        return rows, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

    def close(self) -> None:
        from tests.test_hooks_verl_replicas import close_run

        close_run(self)  # agent loop workers, server actors, balancer
        self.workers.close()


def _pid(handle) -> int:
    import ray

    return ray.get(handle.pid.remote())


def _step(run: V1Run, messages: list[str], victim=None) -> dict:
    """One sync-trainer step; with `victim`, its server SIGKILLed once it has served two chunks."""
    import ray

    from tests.test_hooks_verl_replicas import CHUNK

    rec: dict = {"step": run.step, "killed": None}
    uids = run.submit(messages)
    if victim is not None:
        ray.get(victim.server_handle.wait_served.remote(2 * CHUNK), timeout=120)
        rec["killed"] = {"pid": _pid(victim.server_handle), "address": victim.server_address}
        os.kill(rec["killed"]["pid"], signal.SIGKILL)
    status = run.wait_terminal(uids, ROLLOUT_S)
    rec["status"] = [status[u] for u in uids]
    if any(s != "finished" for s in rec["status"]):
        return rec
    rows, rec["metrics"] = run.sample(len(uids))
    rec["rows"] = [rows.get(u) for u in uids]  # in prompt order
    run.ckpt.sleep_replicas()  # trainer_sync.on_sample_end
    if victim is not None:
        rec["after_sleep"] = {"servers": len(victim.servers), "pid": _pid(victim.server_handle),
                              "address": victim.server_address,
                              "routed": victim.server_address in ray.get(run.lb.get_all_servers.remote())}
    run.step += 1
    run.ckpt.update_weights(run.step)  # trainer_sync.on_step_end
    return rec


def run_v1(model: str, tmp: Path) -> dict:
    import ray

    from tests.test_hooks_verl_replicas import MESSAGES, verl_config

    cfg = verl_config(model, tmp, legacy=False)  # the recipe's v1 manager, verl's default trainer
    cfg.actor_rollout_ref.rollout.name = "vllm"  # verl's own replica kind
    cfg.actor_rollout_ref.rollout.custom = {"belayer": {"engines": {"cpu_step_delay_ms": 8, "startup_timeout_s": 120}}}
    from tests.test_hooks_verl_transferqueue import start_transfer_queue

    start_transfer_queue(cfg, 1)
    run = V1Run(cfg)
    rep: dict = {"manager": f"{type(run.agents).__module__}.{type(run.agents).__qualname__}",
                 "manager_bases": [f"{c.__module__}.{c.__qualname__}" for c in type(run.agents).__mro__],
                 "buffer": f"{type(run.buffer).__module__}.{type(run.buffer).__qualname__}",
                 "replica_class": f"{type(run.ckpt.replicas[0]).__module__}.{type(run.ckpt.replicas[0]).__qualname__}",
                 "checkpoint_manager": f"{type(run.ckpt).__module__}.{type(run.ckpt).__qualname__}"}
    try:
        rep["golden"] = _step(run, MESSAGES)
        victim = run.servers.get_replicas()[1]
        rep["fault"] = _step(run, MESSAGES, victim)
        rep["next"] = _step(run, MESSAGES)
        rep["end"] = {"routed": sorted(ray.get(run.lb.get_all_servers.remote())),
                      "addresses": sorted(r.server_address for r in run.servers.get_replicas())}
    except Exception as e:  # noqa: BLE001  (the report says where the run ended)
        rep["error"] = f"{type(e).__name__}: {e}"[:3000]
    finally:
        run.close()
        import transfer_queue as tq

        tq.close()
    return rep


def main(argv: list[str] | None = None) -> int:
    import argparse
    import dataclasses
    import tempfile

    from belayer_plugin.engines.tiny_model import ensure_tiny
    from belayer_plugin.hooks.verl.standins import install_server_standin
    from belayer_plugin.ray_cluster import init_ray
    from tests.conftest import belayer_cfg

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))
    model = str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))
    install_server_standin("vllm")
    # Ray CPUs are accounting here: TransferQueue's controller and storage unit hold one each for their lifetime,
    # and verl's AgentLoopWorkerTQ actors need one each to be placed
    init_ray(dataclasses.replace(belayer_cfg().ray, num_cpus=8), num_gpus=2)
    rep = run_v1(model, Path(tempfile.mkdtemp(prefix="belayer-verl-v1-")))
    rep["problems"] = judge(rep)
    Path(a.report).write_text(json.dumps(rep, indent=1, default=str))
    for x in rep["problems"]:
        print(f"  - {x}")
    print(f"verl v1 TransferQueue kill mid-rollout -> {'PASS' if not rep['problems'] else 'FAIL'}")
    return 0 if not rep["problems"] else 1


def judge(rep: dict) -> list[str]:
    """What must hold, read from TransferQueue (what verl's trainer trains on), verl's objects and the servers."""
    if "error" in rep:
        return [f"the run ended: {rep['error']}"]
    problems = []
    if not any(b.endswith("AgentLoopManagerTQ") for b in rep["manager_bases"]):
        problems.append(f"the recipe's manager is not verl's AgentLoopManagerTQ: {rep['manager_bases']}")
    if rep["buffer"] != "belayer_plugin.hooks.verl.step_metrics.BelayerReplayBuffer":
        problems.append(f"the replay buffer is {rep['buffer']}")
    if rep["replica_class"] != "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMReplica":
        problems.append(f"not verl's replica class: {rep['replica_class']}")
    golden, fault, nxt = rep["golden"], rep["fault"], rep["next"]
    for s in (golden, fault, nxt):
        if s["status"] != ["finished"] * len(s["status"]):
            return problems + [f"step {s['step']}: prompt statuses in TransferQueue {s['status']}"]
        for row in s["rows"]:
            if row is None:
                return problems + [f"step {s['step']}: a prompt's trajectory was not sampled"]
            if not (row["min_global_steps"] == row["max_global_steps"] == s["step"]):
                problems.append(f"step {s['step']}: a trajectory reports weight versions "
                                f"{row['min_global_steps']}..{row['max_global_steps']}")
    for s in (fault, nxt):
        for k in ("responses", "input_ids", "logprobs"):
            if [r[k] for r in s["rows"]] != [r[k] for r in golden["rows"]]:
                problems.append(f"step {s['step']}: {k} in TransferQueue differ from the fault-free step's")
    if not fault["killed"]:
        return problems + ["the fault was never delivered"]
    dead = fault["killed"]["address"]
    segs = [seg for r in fault["rows"] for seg in ((r["belayer"] or {}).get("segments") or [])]
    if not segs:
        problems.append("Belayer's per-request record did not survive TransferQueue (extra_fields['belayer'])")
    resumed = [r for r in fault["rows"] if len({seg["url"] for seg in (r["belayer"] or {}).get("segments") or []}) > 1]
    if not resumed or not all(dead in {seg["url"] for seg in r["belayer"]["segments"]} for r in resumed):
        problems.append(f"no request resumed away from the killed server {dead} (segments {segs[:6]})")
    if fault["metrics"].get("belayer/requests_resumed", 0) < max(1, len(resumed)):
        problems.append(f"the step's metrics do not count the resumed requests: {fault['metrics']}")
    after = fault.get("after_sleep") or {}
    if after.get("servers") != 1 or after.get("pid") == fault["killed"]["pid"]:
        problems.append(f"the trainer's sleep did not leave verl's replica one new server: {after}")
    if after.get("routed"):
        problems.append("the restarted server was routed before it served the current weights")
    end = rep["end"]
    if end["routed"] != end["addresses"] or len(end["routed"]) != 2:
        problems.append(f"not both replicas routed at the end: {end}")
    served_next = {seg["url"] for r in nxt["rows"] for seg in (r["belayer"] or {}).get("segments") or []}
    if after.get("address") not in served_next:
        problems.append("the restarted replica did not serve the next step")
    return problems


# ------------------------------------------------------------------ pytest: judges the subprocess's report
def test_v1_trainer_with_transferqueue_kill_mid_rollout_trajectories_identical_and_replica_restarted(tmp_path):
    path = tmp_path / "report.json"
    # the functional script (tests/functional/verl_replica_kill.sh KIND=vllm-tq), so CI runs what a user runs
    env = {**os.environ, "BELAYER_PY": sys.executable, "EXPECT": "survival", "KIND": "vllm-tq"}
    p = subprocess.run(["bash", str(ROOT / "tests" / "functional" / "verl_replica_kill.sh"), "--report", str(path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if not path.exists():
        pytest.fail(f"the run wrote no report (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    rep = json.loads(path.read_text())
    assert not rep["problems"], f"{rep['problems']}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.returncode == 0


if __name__ == "__main__":
    sys.exit(main())
