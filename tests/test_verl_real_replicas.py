"""Belayer with verl 0.9.1's *own* replica class (`rollout.name=vllm`: verl's vLLMReplica), on CPU.

verl's composed ppo_trainer config plus recipes/verl/belayer.yaml; verl's LLMServerManager builds two
vLLMReplica objects in hybrid mode (as the v1 sync trainer does) and verl's own `launch_servers` starts their
server actors; verl's AgentLoopWorkers and Belayer's agent loop manager and client generate; the v1 trainer's
own CheckpointEngineManager (verl's class, not Belayer's) runs rollout -> sleep -> weight sync per step.

Replaced, because they cannot run here (hooks/verl/standins.py says why, and README lists them):
- the server actor verl's vLLMReplica launches (vLLMHttpServer, which runs vLLM inside the actor):
  `VllmServerStandin`, the same actor API over a Belayer CPU engine process;
- the trainer's hybrid workers, as far as the weight push goes (`HybridWorkersStandin`: each holds a verl
  BaseRollout adapter that caches its server's handle, as verl's ServerAdapter does);
- `import vllm` in this process (verl's module holding vLLMReplica imports it at module level).

Faults are real: a server actor's process is SIGKILLed (its engine process dies with it) mid-rollout and
between the rollout and the trainer's sleep. Each step's batch must equal the fault-free run's (verl's own
tensors), verl's replica object must end with one live server (verl's launch code appends to `servers`), the
restarted server must get the trainer's sleep and then the weight sync (read from the server actor itself),
and the next rollout must be served by both replicas.

Its own Ray cluster (Ray's GPU resource is declared for the stand-in workers: verl's launch_servers reads
their accelerator ids), so the scenarios run in a subprocess: `python -m tests.test_verl_real_replicas
--report R`, which is what tests/functional/verl_replica_kill.sh runs; the tests below run that script and judge
its report.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("kill_mid_rollout", "kill_before_sleep", "kill_before_sync", "legacy_restart")
RUN_TIMEOUT_S = 900  # a Ray cluster of verl processes (each imports verl: ~10 s of CPU) and 7 steps on 2 cores

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 120)


# ------------------------------------------------------------------ the scenarios (run in a subprocess)
class RealRun:
    """verl's objects for one run, with verl's vLLMReplica: LLMServerManager (hybrid, over the stand-in workers),
    the recipe's agent loop manager, and the checkpoint manager verl's v1 trainer builds (verl's own class)."""

    def __init__(self, cfg):
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.import_utils import load_class_from_fqn
        from verl.workers.config import CheckpointEngineConfig
        from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerManager

        from belayer_plugin.hooks.verl.standins import HybridWorkersStandin

        self.workers = HybridWorkersStandin(2)
        self.servers = LLMServerManager.create(config=cfg, worker_group=self.workers)
        manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "m")
        self.agents = manager_cls.create(config=cfg, llm_client=self.servers.get_client(
            client_cls=FullyAsyncLLMServerClient))
        # v1: trainer_base builds verl's own CheckpointEngineManager (backend naive), with no option to replace it
        self.ckpt = CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), self.workers,
                                            self.servers.get_replicas())
        self.lb = self.servers.global_load_balancer
        self.step = 0

    def batch(self):
        import numpy as np
        from verl import DataProto

        from tests.test_hooks_verl_replicas import MESSAGES

        return DataProto.from_dict(non_tensors={"raw_prompt": np.array(
            [[{"role": "user", "content": m}] for m in MESSAGES], dtype=object)}, meta_info={"global_steps": self.step})

    def start(self) -> None:
        self.ckpt.sleep_replicas()  # trainer_base: sleep all replicas, then load the checkpoint
        self.step = 1
        self.ckpt.update_weights(self.step)  # trainer_sync.on_init_end

    def generate(self):
        return self.agents.generate_sequences(self.batch())

    def close(self) -> None:
        from tests.test_hooks_verl_replicas import close_run

        close_run(self)
        self.workers.close()


def _pid(handle) -> int:
    import ray

    return ray.get(handle.pid.remote())


def _served(handle):
    import ray

    return ray.get(handle.__ray_call__.remote(lambda s: s.global_steps))


def _digest(out) -> dict:
    from tests.test_hooks_verl_replicas import _digest as digest

    return digest(out)


def _urls(out) -> list:
    return sorted({seg["url"] for s in out.non_tensor_batch["belayer"] for seg in s["segments"]})


def _kill_mid_rollout(run: RealRun, victim) -> tuple[object, dict]:
    from tests.test_hooks_verl_replicas import CHUNK

    killed: dict = {}

    async def both():
        async def kill():
            await asyncio.wait_for(victim.server_handle.wait_served.remote(2 * CHUNK), 120)
            killed.update(pid=_pid(victim.server_handle), address=victim.server_address)
            os.kill(killed["pid"], signal.SIGKILL)

        k = asyncio.create_task(kill())
        out = await asyncio.get_running_loop().run_in_executor(None, run.generate)
        await k
        return out

    return asyncio.run(both()), killed


def _step(run: RealRun, victim=None, when: str = "", ckpt=None) -> dict:
    """One trainer step (rollout, sleep, weight sync) with `victim`'s server SIGKILLed `when` (mid_rollout or
    before_sleep); `ckpt` is the checkpoint manager the trainer uses (the run's own by default). Returns what
    verl's objects and the servers themselves show."""
    import ray

    ckpt = ckpt or run.ckpt
    rec: dict = {"step": run.step, "killed": None}
    if victim is not None:
        rec["before"] = {"pid": _pid(victim.server_handle), "address": victim.server_address}
    if when == "mid_rollout":
        out, rec["killed"] = _kill_mid_rollout(run, victim)
    else:
        out = run.generate()
    if when == "before_sleep":
        rec["killed"] = {"pid": _pid(victim.server_handle), "address": victim.server_address}
        os.kill(rec["killed"]["pid"], signal.SIGKILL)
    rec.update(batch=_digest(out), urls=_urls(out))
    t0 = time.monotonic()
    ckpt.sleep_replicas()  # trainer_sync.on_sample_end
    rec["sleep_s"] = round(time.monotonic() - t0, 2)
    if when == "before_sync":  # after the trainer's sleep: the weight push (through the workers) meets it dead
        rec["killed"] = {"pid": _pid(victim.server_handle), "address": victim.server_address}
        os.kill(rec["killed"]["pid"], signal.SIGKILL)
    elif victim is not None:  # what the trainer's sleep left: verl's replica object, read from its new server
        rec["after_sleep"] = {"servers": len(victim.servers), "pid": _pid(victim.server_handle),
                              "address": victim.server_address,
                              "slept": ray.get(victim.server_handle.get_slept.remote()),
                              "steps_served": _served(victim.server_handle),
                              "routed": victim.server_address in ray.get(run.lb.get_all_servers.remote())}
    run.step += 1
    ckpt.update_weights(run.step)  # trainer_sync.on_step_end: the hybrid workers' push
    if victim is not None:
        rec["after_sync"] = {"steps_served": _served(victim.server_handle), "step": run.step,
                             "servers": len(victim.servers), "pid": _pid(victim.server_handle),
                             "address": victim.server_address}
    return rec


CONTEXT_ROOM = 21


def _prompt_ids(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.test_hooks_verl_replicas import MESSAGES

    tok = AutoTokenizer.from_pretrained(model)
    return [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for m in MESSAGES]


def _context_limit(run: RealRun, prompt_ids: list[int]) -> dict:
    """One request whose response reaches rollout.max_model_len: verl's own client (one uncut request; the
    server clamps max_tokens to the room left) against Belayer's chunked client on the same server pool."""
    from tests.test_hooks_verl_replicas import RESPONSE

    sp = {"temperature": 0.0, "max_tokens": RESPONSE, "logprobs": False}

    async def both():
        verl_out = await run.servers.get_client().generate("ctx-verl", prompt_ids=list(prompt_ids),
                                                           sampling_params=dict(sp))
        ours = await run.agents.llm_client.generate("ctx-belayer", prompt_ids=list(prompt_ids), sampling_params=dict(sp))
        return verl_out, ours

    verl_out, ours = asyncio.run(both())
    return {"prompt_len": len(prompt_ids), "verl_ids": list(verl_out.token_ids), "belayer_ids": list(ours.token_ids),
            "belayer_stop_reason": ours.stop_reason}


# each scenario: (replica index, when, the checkpoint manager) for the faulty step; a plain step follows
PLAN = {"kill_mid_rollout": (1, "mid_rollout", "v1"), "kill_before_sleep": (0, "before_sleep", "v1"),
        "kill_before_sync": (1, "before_sync", "v1"), "legacy_restart": (1, "mid_rollout", "legacy")}


def _below_floor(run: RealRun) -> dict:
    """Last, as it ends the run: a restart budget of 0 and a floor of 2, then one replica's server SIGKILLed;
    verl's own checkpoint manager's next call (the trainer's sleep) must end with the typed error naming the
    replica, at once (not a hang, not verl's ActorDiedError)."""
    from dataclasses import replace

    from belayer_plugin.fleet.policy import RestartPolicy

    rec = run.agents.recovery
    rec.policy = RestartPolicy(replace(rec.cfg.restart, max_restarts=0, min_healthy_engines=2))
    victim = run.servers.get_replicas()[0]
    os.kill(_pid(victim.server_handle), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        run.ckpt.sleep_replicas()
    except Exception as e:  # noqa: BLE001  (what the trainer would see)
        return {"error_type": type(e).__name__, "error": str(e)[:1500], "took_s": round(time.monotonic() - t0, 2)}
    return {"error_type": None, "took_s": round(time.monotonic() - t0, 2)}


def run_scenarios(names: list[str], model: str, tmp: Path, floor: bool = True) -> dict:
    """One run of verl's objects: a fault-free step (the golden batch), then for each scenario its faulty step
    and a plain step after it. Every step's batch must equal the golden one (ids, masks, logprobs)."""
    import ray

    from belayer_plugin.hooks.verl import BelayerCheckpointEngineManager
    from tests.test_hooks_verl_replicas import verl_config

    cfg = verl_config(model, tmp, legacy=True)  # the legacy agent loop manager makes DataProto batches
    cfg.actor_rollout_ref.rollout.name = "vllm"  # verl's own replica kind
    cfg.actor_rollout_ref.rollout.custom = {"belayer": {"engines": {"cpu_step_delay_ms": 8, "startup_timeout_s": 120}}}
    # a context limit that cuts the longest prompt's response at CONTEXT_ROOM tokens (not a chunk multiple)
    prompts = _prompt_ids(model)
    cfg.actor_rollout_ref.rollout.max_model_len = max(len(x) for x in prompts) + CONTEXT_ROOM
    run = RealRun(cfg)
    replica = run.ckpt.replicas[0]
    rep: dict = {"replica_class": f"{type(replica).__module__}.{type(replica).__qualname__}",
                 "checkpoint_manager": f"{type(run.ckpt).__module__}.{type(run.ckpt).__qualname__}",
                 "golden": None, "context_limit": None, "scenarios": {}, "below_floor": None}
    try:
        run.start()
        rep["golden"] = _step(run)
        try:
            rep["context_limit"] = _context_limit(run, max(prompts, key=len))
        except Exception as e:  # noqa: BLE001  (the scenarios still run; the context test reads the error)
            rep["context_limit"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        for name in names:
            index, when, manager = PLAN[name]
            victim = run.servers.get_replicas()[index]
            ckpt = run.ckpt
            if manager == "legacy":  # the legacy trainer's: the recipe's checkpoint_manager_class
                ckpt = BelayerCheckpointEngineManager(run.ckpt.config, run.workers, list(run.servers.get_replicas()))
            since = len(run.agents.recovery.events.events)
            sc: dict = {"checkpoint_manager": f"{type(ckpt).__module__}.{type(ckpt).__qualname__}"}
            try:
                sc["fault"] = _step(run, victim, when, ckpt)
                sc["next"] = _step(run, ckpt=ckpt)
                sc["end"] = {"routed": sorted(ray.get(run.lb.get_all_servers.remote())),
                             "addresses": sorted(r.server_address for r in run.servers.get_replicas())}
            except Exception as e:  # noqa: BLE001  (the report says which scenario ended the run, and how)
                sc["error"] = f"{type(e).__name__}: {e}"[:2000]
            sc["events"] = [f"{e.subject} {e.kind}" for e in run.agents.recovery.events.events[since:]
                            if e.component == "verl"]
            rep["scenarios"][name] = sc
            if "error" in sc:
                break  # the run's objects are in an unknown state
        if floor:
            rep["below_floor"] = _below_floor(run)
    finally:
        run.close()
    return rep


def main(argv: list[str] | None = None) -> int:
    """Runs the scenarios after a fault-free step and writes their report; prints PASS/FAIL for the
    functional script (EXPECT=survival)."""
    import argparse
    import tempfile

    from belayer_plugin.engines.tiny_model import ensure_tiny
    from belayer_plugin.hooks.verl.standins import install_server_standin
    from belayer_plugin.ray_cluster import init_ray
    from tests.conftest import belayer_cfg

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--report", required=True)
    a = p.parse_args(argv)
    names = a.scenarios.split(",")
    os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))
    model = str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))
    install_server_standin("vllm")
    init_ray(belayer_cfg().ray, num_gpus=2)
    rep = run_scenarios(names, model, Path(tempfile.mkdtemp(prefix="belayer-verl-real-")))
    rep["problems"] = {n: judge(rep, n) for n in names}
    bf = rep.get("below_floor") or {}
    rep["problems"]["below_floor"] = [] if bf.get("error_type") == "FleetBelowFloorError" else [
        f"below the floor the trainer's next call did not end with FleetBelowFloorError: {bf}"]
    Path(a.report).write_text(json.dumps(rep, indent=1, default=str))
    for n, ps in rep["problems"].items():
        print(f"verl_replica_kill {n}: {'PASS' if not ps else 'FAIL'}; events {rep['scenarios'].get(n, {}).get('events')}")
        for x in ps:
            print(f"  - {x}")
    ok = not any(rep["problems"].values())
    print(f"verl_replica_kill (EXPECT=survival, verl's vLLMReplica) -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _same(step: dict, golden: dict) -> bool:
    from tests.test_hooks_verl_replicas import KEYS

    return all(step["batch"][k] == golden["batch"][k] for k in KEYS) and \
        set(step["batch"]["min_global_steps"]) == set(step["batch"]["max_global_steps"]) == {step["step"]}


def judge(rep: dict, name: str) -> list[str]:
    """What must hold after a scenario, read from verl's and the servers' own state."""
    if rep["golden"] is None:
        return ["the fault-free step did not run"]
    sc = rep["scenarios"].get(name)
    if sc is None:
        return ["not run (an earlier scenario ended the run)"]
    if "error" in sc:
        return [f"the run ended: {sc['error']}"]
    problems = []
    if rep["replica_class"] != "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMReplica":
        problems.append(f"not verl's replica class: {rep['replica_class']}")
    fault, nxt = sc["fault"], sc["next"]
    for s in (fault, nxt):
        if not _same(s, rep["golden"]):
            problems.append(f"step {s['step']}: batch differs from the fault-free step's")
    if not fault["killed"]:
        return problems + ["the fault was never delivered"]
    sync = fault["after_sync"]
    if name == "kill_before_sync":  # restarted by the weight sync itself (verl's own checkpoint manager's)
        if sync["servers"] != 1 or sync["pid"] == fault["killed"]["pid"]:
            problems.append(f"after the weight sync verl's replica holds {sync['servers']} server(s), pid "
                            f"{sync['pid']} (killed {fault['killed']['pid']})")
        if sync["steps_served"] != sync["step"]:
            problems.append(f"after the weight sync the restarted server serves {sync['steps_served']}, not step "
                            f"{sync['step']}")
        if sc["end"]["routed"] != sc["end"]["addresses"] or len(sc["end"]["routed"]) != 2:
            problems.append(f"not both replicas routed at the end: {sc['end']}")
        if sync["address"] not in nxt["urls"]:
            problems.append("the restarted replica did not serve the next step")
        return problems
    after = fault["after_sleep"]
    if after["servers"] != 1:
        problems.append(f"verl's replica holds {after['servers']} server(s) after the restart, not 1")
    if after["pid"] == fault["killed"]["pid"]:
        problems.append("the replica's server after the trainer's sleep is the killed one")
    if not after["slept"]:
        problems.append("the restarted server never got the trainer's sleep")
    if after["routed"]:
        problems.append("the restarted server was routed before it served the current weights")
    if sync["steps_served"] != sync["step"]:
        problems.append(f"after the weight sync the restarted server serves {sync['steps_served']}, not step "
                        f"{sync['step']}")
    end = sc["end"]
    if end["routed"] != end["addresses"] or len(end["routed"]) != 2:
        problems.append(f"not both replicas routed at the end: {end}")
    if after["address"] not in nxt["urls"]:
        problems.append("the restarted replica did not serve the next step")
    return problems


# ------------------------------------------------------------------ pytest: judges the subprocess's report
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("verl-real") / "report.json"
    # the functional script itself (tests/functional/verl_replica_kill.sh), so CI runs what a user runs
    env = {**os.environ, "BELAYER_PY": sys.executable, "EXPECT": "survival", "KIND": "vllm"}
    p = subprocess.run(["bash", str(ROOT / "tests" / "functional" / "verl_replica_kill.sh"), "--report", str(path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if not path.exists():
        pytest.fail(f"the scenario run wrote no report (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    rep = json.loads(path.read_text())
    rep["_output"] = p.stdout[-4000:] + p.stderr[-4000:]
    return rep


def _check(report: dict, name: str) -> dict:
    problems = report["problems"][name]
    sc = report["scenarios"].get(name, {})
    assert not problems, f"{name}: {problems}\nevents: {sc.get('events')}\n{report['_output'][-3000:]}"
    return sc


def test_verls_vllm_replica_server_killed_mid_rollout_batch_identical_and_v1_sleep_restarts_it(report):
    rep = _check(report, "kill_mid_rollout")
    assert rep["checkpoint_manager"] == "verl.checkpoint_engine.base.CheckpointEngineManager"  # v1: verl's own
    assert set(rep["fault"]["urls"]) >= {rep["fault"]["before"]["address"]}  # killed while serving this rollout
    assert any(e.endswith("restarted") for e in rep["events"]) and any(e.endswith("admitted") for e in rep["events"])


def test_verls_vllm_replica_server_killed_before_the_trainers_sleep_is_restarted_not_called_dead(report):
    rep = _check(report, "kill_before_sleep")
    assert rep["checkpoint_manager"] == "verl.checkpoint_engine.base.CheckpointEngineManager"
    # the weight push went through the hybrid worker's cached handle: it had to be pointed at the new server
    assert any(e.endswith("workers_reset") for e in rep["events"]), rep["events"]


def test_a_response_that_reaches_the_context_limit_ends_at_length_as_verls_own_uncut_request_does(report):
    ctx = report["context_limit"]
    assert ctx is not None and "error" not in ctx, (ctx, report["_output"][-3000:])
    # verl's server clamps the uncut request to the room left; Belayer's chunks stop at the same token (the room
    # is not a chunk multiple: the last chunk is clamped too, then the full context ends the request)
    assert len(ctx["verl_ids"]) == CONTEXT_ROOM, ctx
    assert ctx["belayer_ids"] == ctx["verl_ids"] and ctx["belayer_stop_reason"] == "length", ctx


def test_verls_vllm_replica_server_killed_before_the_weight_sync_is_restarted_and_the_sync_runs_again(report):
    rep = _check(report, "kill_before_sync")
    assert rep["checkpoint_manager"] == "verl.checkpoint_engine.base.CheckpointEngineManager"
    assert any(e == "sync sync_retried" for e in rep["events"]), rep["events"]


def test_below_the_healthy_floor_verls_own_checkpoint_manager_call_ends_with_the_typed_error_naming_the_replica(
        report):
    bf = report.get("below_floor")
    assert bf is not None, report["_output"][-3000:]
    assert bf["error_type"] == "FleetBelowFloorError", bf
    assert "replica-0" in bf["error"] and "RETIRED" in bf["error"], bf
    assert bf["took_s"] < 60, bf  # at once: the next lifecycle call, no waiting on a dead actor


def test_legacy_trainer_restarts_verls_vllm_replica_through_its_own_launch_code(report):
    rep = _check(report, "legacy_restart")
    assert rep["checkpoint_manager"] == "belayer_plugin.hooks.verl.recovery.BelayerCheckpointEngineManager"
    assert not any(e.endswith("restart_failed") for e in rep["events"]), rep["events"]


if __name__ == "__main__":
    sys.exit(main())
