"""Belayer inside verl 0.9.1's own trainer path, on CPU, switched on from the recipe alone.

verl's composed ppo_trainer config plus recipes/verl/belayer.yaml; verl's LLMServerManager launches two
replicas of Belayer's registered replica kind (`rollout.name=belayer`: verl server actors over Belayer CPU
engines, one speaking verl's vLLM server contract and one SGLang's); verl's loader builds the agent loop manager
named by the recipe, which spawns verl's AgentLoopWorker actors; Belayer's CheckpointEngineManager (verl's,
plus recovery) runs the legacy trainer's per-step sequence: generate, sleep, (train), update weights.

Replaced, because verl's real code cannot run it on CPU: only the trainer's weight push
`actor_wg.update_weights(global_steps, mode="naive")` (FSDP workers writing into their colocated rollout
engines): `CpuActorWorkerGroup.update_weights` makes every replica's server serve `global_steps` instead.

Faults are real: server actors are SIGKILLed (their engine process dies with them) mid-rollout, between steps
(before sleep, before update_weights), and a weight sync aborts requests in an async mode. Every scenario ends
with the batch identical to the fault-free run (ids, masks, logprobs, global steps) and the next step served by
the full set of replicas.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

# verl's processes import verl (~10 s of CPU each): the module's Ray actors take minutes on a loaded 2-core box
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = ["The quick brown fox", "Fault tolerance means", "A rollout engine", "Checkpoint the sandbox"]
RESPONSE = 40
CHUNK = 8
BELAYER = {"use_fault_tolerance": True, "shadow": {"num_standby": 0}, "monitor": {"liveness_timeout_s": 2.0},
           "recovery": {"chunk_tokens": CHUNK, "stall_timeout_s": 20, "max_attempts": 4, "request_timeout_s": 120},
           # several scenarios kill the same two replicas: a budget that outlasts them (the floor test checks it)
           "restart": {"max_restarts": 8, "window_s": 600, "backoff_initial_s": 0.0, "backoff_max_s": 0.0,
                       "min_healthy_engines": 1},
           "engines": {"cpu_step_delay_ms": 8, "startup_timeout_s": 120}}
KEYS = ("prompts", "responses", "response_mask", "attention_mask", "input_ids", "position_ids", "rollout_log_probs")


def verl_config(model: str, tmp: Path, ft: bool = True, legacy: bool = True):
    """A verl user's recipe: verl's own ppo_trainer config (from the installed package) with the lines of
    recipes/verl/belayer.yaml added, composed by Hydra as verl's main_ppo does."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    verl_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    recipe_dir = tmp / "recipe"
    recipe_dir.mkdir(exist_ok=True)
    (recipe_dir / "user_recipe.yaml").write_text(
        f"hydra:\n  searchpath:\n    - file://{verl_dir}\ndefaults:\n  - ppo_trainer\n  - _self_\n"
        + (ROOT / "recipes" / "verl" / "belayer.yaml").read_text())
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(recipe_dir), version_base=None):
        cfg = compose(config_name="user_recipe", overrides=[
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.prompt_length=64",
            f"actor_rollout_ref.rollout.response_length={RESPONSE}", "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.agent.num_workers=2",
            "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            f"trainer.use_v1={str(not legacy).lower()}"])
    GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    # the test's own choices: Belayer's CPU replica kind, fast timings, the toggle
    cfg.actor_rollout_ref.rollout.name = "belayer"
    cfg.actor_rollout_ref.rollout.custom = {"belayer_contract": ["vllm", "sglang"],
                                            "belayer": {"engines": BELAYER["engines"], "use_fault_tolerance": ft}}
    cfg.belayer = OmegaConf.merge(cfg.belayer, {**BELAYER, "use_fault_tolerance": ft})
    if not legacy:
        return cfg
    cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class = \
        "belayer_plugin.hooks.verl.manager.BelayerLegacyAgentLoopManager"
    router = yaml.safe_load((ROOT / "recipes" / "verl" / "router.yaml").read_text())
    # the router YAML keeps the recipe's toggle (on): the trainer's belayer.use_fault_tolerance, as a command
    # line would set it, reaches the balancer through the agent loop manager
    router["belayer"] = {**router.get("belayer", {}), **{k: BELAYER[k] for k in ("monitor", "recovery")}}
    path = tmp / f"router-{'on' if ft else 'off'}.yaml"
    path.write_text(yaml.safe_dump(router))
    cfg.actor_rollout_ref.rollout.router_config_path = str(path)
    return cfg


class CpuActorWorkerGroup:
    """Stand-in for the trainer's actor worker group in `update_weights(global_steps, mode="naive")` only."""

    def __init__(self, replicas):
        self.replicas = replicas  # callable: the checkpoint manager's current replicas

    def update_weights(self, global_steps=None, mode="naive"):
        return [s.load_weights.remote(global_steps) for r in self.replicas() for s in r.servers]


class Run:
    """verl's objects for one run: LLMServerManager, the recipe's agent loop manager, the checkpoint manager."""

    def __init__(self, cfg, client_cls=None):
        from verl.utils.import_utils import load_class_from_fqn
        from verl.workers.config import CheckpointEngineConfig
        from verl.workers.rollout.llm_server import LLMServerManager

        self.cfg = cfg
        self.servers = LLMServerManager.create(config=cfg)  # verl's: replicas from RolloutReplicaRegistry
        manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "m")
        self.agents = manager_cls.create(config=cfg, llm_client=self.servers.get_client(client_cls=client_cls))
        # as the legacy trainer does: the recipe's checkpoint_manager_class, else verl's own
        ckpt_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "c")
        self.ckpt = ckpt_cls(CheckpointEngineConfig(backend="naive"), CpuActorWorkerGroup(lambda: self.ckpt.replicas),
                             self.servers.get_replicas())
        self.lb = self.servers.global_load_balancer
        self.step = 0

    @property
    def recovery(self):
        return self.agents.recovery

    def batch(self):
        from verl import DataProto

        return DataProto.from_dict(non_tensors={"raw_prompt": np.array(
            [[{"role": "user", "content": m}] for m in MESSAGES], dtype=object)}, meta_info={"global_steps": self.step})

    def start(self) -> None:
        """The trainer's init: sleep the replicas, then sync the weights of step 1."""
        self.ckpt.sleep_replicas()
        self.step = 1
        self.ckpt.update_weights(self.step)

    def generate(self):
        return self.agents.generate_sequences(self.batch())

    def finish_step(self) -> None:
        """After the rollout: sleep, (train), update weights to the next step."""
        self.ckpt.sleep_replicas()
        self.step += 1
        self.ckpt.update_weights(self.step)

    def close(self) -> None:
        close_run(self)


def close_run(run) -> None:
    """Kills a run's agent loop workers, server actors and balancer."""
    import ray

    for w in run.agents.agent_loop_workers:
        ray.kill(w, no_restart=True)
    for r in run.servers.get_replicas():
        for s in r.servers:
            ray.kill(s, no_restart=True)
    ray.kill(run.lb, no_restart=True)


def same_batch(a, b) -> None:
    for k in KEYS:
        assert torch.equal(a.batch[k], b.batch[k]), k
    for k in ("min_global_steps", "max_global_steps"):
        assert list(a.non_tensor_batch[k]) == list(b.non_tensor_batch[k]), k


def served_by(out) -> set:
    return {seg["url"] for s in out.non_tensor_batch["belayer"] for seg in s["segments"]}


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_model, tmp_path_factory):
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    # the client an async trainer mode builds (colocate_async / separate_async): in the sync sequence it
    # behaves as the sync one (no aborts happen there), and the weight-sync scenario needs it
    r = Run(verl_config(tiny_model, tmp_path_factory.mktemp("verl")), client_cls=FullyAsyncLLMServerClient)
    r.start()
    yield r
    r.close()


@pytest.fixture(scope="module")
def golden(run):
    out = run.generate()
    run.finish_step()
    return out


def _pid(handle) -> int:
    import ray

    return ray.get(handle.pid.remote())


def _kill(replica) -> None:
    os.kill(_pid(replica.server_handle), signal.SIGKILL)  # its engine process dies with it (PDEATHSIG)


def _full(run) -> None:
    import ray

    servers = ray.get(run.lb.get_all_servers.remote())
    assert sorted(servers) == sorted(r.server_address for r in run.ckpt.replicas) and len(servers) == 2
    assert len(run.ckpt.replicas) == 2


def test_recipe_switches_belayer_on_in_verls_agent_loop_and_fills_verl_fields(run, golden):
    import ray

    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    assert isinstance(run.agents.llm_client, BelayerLLMServerClient)
    nt = golden.non_tensor_batch
    # v1 trainer_base builds these with dtype=int: a None from the client was a TypeError at the first step
    assert np.array(list(nt["min_global_steps"]), dtype=int).tolist() == [1] * len(MESSAGES)
    assert np.array(list(nt["max_global_steps"]), dtype=int).tolist() == [1] * len(MESSAGES)
    # vLLM's "completed" at a full chunk is a length cut, not a stop: responses run past the first chunk
    lengths = golden.batch["response_mask"].sum(-1).tolist()
    assert min(lengths) > CHUNK, lengths
    assert "num_cached_tokens" in nt and len(nt["belayer"]) == len(MESSAGES)
    # both server contracts served this batch (replica 0: vLLM's, replica 1: SGLang's)
    assert served_by(golden) == {r.server_address for r in run.ckpt.replicas}
    assert ray.get(run.lb.get_status.remote())["use_fault_tolerance"]
    # a step without a fault: every Belayer metric is in verl's logged metrics, all zero
    from belayer_plugin.metrics import STEP_METRICS

    assert set(_logged(golden)) == set(STEP_METRICS) and set(_logged(golden).values()) == {0.0}
    # the next step on the same weights gives the same batch, now at global steps 2
    again = run.generate()
    for k in KEYS:
        assert torch.equal(again.batch[k], golden.batch[k]), k
    assert set(again.non_tensor_batch["min_global_steps"]) == {2}
    run.finish_step()


def _logged(out) -> dict:
    """Belayer's metrics of a step as verl's legacy trainer hands them to its Tracking logger: ray_trainer.fit
    does `timing_raw.update(gen_output.meta_info["timing"])` after generate_sequences (ray_trainer.py line 1518),
    then `metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))` (line 1783) and
    `logger.log(data=metrics, step=...)` (line 1802). verl's own compute_timing_metrics runs here."""
    from verl.trainer.ppo.metric_utils import compute_timing_metrics

    timing_raw = {"gen": 1.0}
    timing_raw.update(out.meta_info["timing"])
    logged = compute_timing_metrics(batch=out, timing_raw=timing_raw)
    return {k[len("timing_s/belayer/"):]: v for k, v in logged.items() if k.startswith("timing_s/belayer/")}


def _at_step(golden, step: int):
    g = golden.non_tensor_batch
    return {k: [step] * len(g[k]) for k in ("min_global_steps", "max_global_steps")}


def _same_but_step(out, golden, step: int) -> None:
    for k in KEYS:
        assert torch.equal(out.batch[k], golden.batch[k]), k
    for k, v in _at_step(golden, step).items():
        assert list(out.non_tensor_batch[k]) == v, k


def test_replica_server_sigkilled_mid_rollout_batch_identical_then_recovered_before_next_step(run, golden):
    import ray

    victim = run.ckpt.replicas[0]
    old = victim.server_address
    killed = {}

    async def kill_mid_rollout():
        await asyncio.wait_for(victim.server_handle.wait_served.remote(2 * CHUNK), 60)
        killed["pid"] = _pid(victim.server_handle)
        os.kill(killed["pid"], signal.SIGKILL)

    async def both():
        k = asyncio.create_task(kill_mid_rollout())
        out = await asyncio.get_running_loop().run_in_executor(None, run.generate)
        await k
        return out

    since = time.time()
    out = asyncio.run(both())
    assert killed
    _same_but_step(out, golden, run.step)
    resumed = [s["resumed_from"][0] for s in out.non_tensor_batch["belayer"] if s["resumed_from"]]
    # resumed where the last chunk was committed: nothing committed is generated again
    assert resumed and all(x % CHUNK == 0 for x in resumed) and max(resumed) >= CHUNK, resumed
    assert old not in ray.get(run.lb.get_all_servers.remote())
    run.finish_step()  # the dead replica is removed before sleep, restarted, synced, admitted
    # this step's metrics as verl logs them: one death, each resume and the committed tokens it kept
    m = _logged(out)
    starts = [x for s in out.non_tensor_batch["belayer"] for x in s["resumed_from"]]
    assert m["engine_deaths_detected"] == 1 and m["cold_restarts"] == 0, m
    assert m["requests_resumed"] == len(starts) and m["tokens_saved"] == sum(starts) > 0, m
    ev = run.recovery.events
    assert any(e.kind == "restarted" and e.t >= since for e in ev.events)
    _full(run)
    assert victim.server_address != old
    nxt = run.generate()
    _same_but_step(nxt, golden, run.step)
    assert victim.server_address in served_by(nxt), "the restarted replica did not serve the next step"
    # the next step: the restart done between the steps, and no death or resume counted twice (deltas)
    m = _logged(nxt)
    assert m["cold_restarts"] == 1 and m["engine_deaths_detected"] == 0 and m["requests_resumed"] == 0, m
    run.finish_step()


@pytest.mark.parametrize("when", ["before_sleep", "before_update_weights"])
def test_replica_killed_between_steps_is_never_called_and_rejoins_at_current_weights(run, golden, when):
    import ray

    out = run.generate()
    _same_but_step(out, golden, run.step)
    victim = run.ckpt.replicas[1]
    old = victim.server_address
    if when == "before_sleep":
        _kill(victim)
        run.ckpt.sleep_replicas()  # verl's gather over a dead replica raised here
        # restarted, but STALE: not routed before the weight sync
        assert victim.server_address != old and victim in run.ckpt.replicas
        assert ray.get(victim.server_handle.get_global_steps.remote()) is None
        assert victim.server_address not in ray.get(run.lb.get_all_servers.remote()), "admitted before its weights"
    else:
        run.ckpt.sleep_replicas()
        _kill(victim)
    assert old not in ray.get(run.lb.get_all_servers.remote()) or when == "before_update_weights"
    run.step += 1
    run.ckpt.update_weights(run.step)  # before_update_weights: removed, restarted, synced, admitted here
    assert victim.server_address != old
    assert ray.get(victim.server_handle.get_global_steps.remote()) == run.step
    _full(run)
    nxt = run.generate()
    _same_but_step(nxt, golden, run.step)
    assert victim.server_address in served_by(nxt)
    run.finish_step()


def test_v1_path_verls_own_checkpoint_manager_dead_replica_restarted_in_place_then_admitted(run, golden):
    """verl's v1 trainer builds verl's CheckpointEngineManager itself (backend naive), with no option to
    replace it: the replica object restarts its server in place when the trainer's sleep finds it dead, the
    weight sync reaches the new server, and the recipe's agent loop manager admits it before the rollout."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager

    plain = CheckpointEngineManager(run.ckpt.config, CpuActorWorkerGroup(lambda: plain.replicas),
                                    run.servers.get_replicas())
    out = run.generate()
    _same_but_step(out, golden, run.step)
    victim = next(r for r in plain.replicas if r.replica_rank == 1)
    old = victim.server_address
    _kill(victim)
    plain.sleep_replicas()  # trainer_sync.on_sample_end: verl's gather would raise on the dead server
    servers = ray.get(run.lb.get_all_servers.remote())
    assert victim.server_address != old and old not in servers and victim.server_address not in servers
    run.step += 1
    plain.update_weights(run.step)  # on_step_end: the (stand-in) weight push reaches the new server
    assert ray.get(victim.server_handle.get_global_steps.remote()) == run.step
    nxt = run.generate()  # the agent loop manager admits the replica first
    _same_but_step(nxt, golden, run.step)
    _full(run)
    assert victim.server_address in served_by(nxt)
    run.finish_step()


def test_weight_sync_abort_in_async_mode_waits_for_wake_up_and_reports_both_versions(run, golden):
    """colocate_async's sequence while requests are in flight: abort, sleep, update weights, resume."""
    victim = run.ckpt.replicas[0]

    async def sync_mid_rollout():
        await asyncio.wait_for(victim.server_handle.wait_served.remote(CHUNK), 60)
        loop = asyncio.get_running_loop()
        # The victim's requests run in lockstep, so right after wait_served all of them sit between chunks and an
        # abort would find nothing to abort (CI saw it). SGLang's /pause_generation holds the engine's requests
        # in place: the abort lands once a chunk is held there, then the engine goes on.
        async with httpx.AsyncClient(base_url=victim.server_address, timeout=10) as engine:
            (await engine.post("/pause_generation", json={})).raise_for_status()
            try:
                deadline = time.monotonic() + 30
                while not (await engine.get("/server_info")).json()["running_rids"]:
                    assert time.monotonic() < deadline, "no chunk reached the paused engine in 30 s"
                    await asyncio.sleep(0.02)  # a state to observe, not an event: bounded poll
                await loop.run_in_executor(None, run.ckpt.abort_replicas)
            finally:
                (await engine.post("/continue_generation", json={})).raise_for_status()
        await loop.run_in_executor(None, run.ckpt.sleep_replicas)
        run.step += 1
        await loop.run_in_executor(None, run.ckpt.update_weights, run.step)
        await loop.run_in_executor(None, run.ckpt.resume_generation_replicas)

    async def both():
        first = run.step
        k = asyncio.create_task(sync_mid_rollout())
        out = await asyncio.get_running_loop().run_in_executor(None, run.generate)
        await k
        return first, out

    first, out = asyncio.run(both())
    for k in KEYS:
        assert torch.equal(out.batch[k], golden.batch[k]), k
    nt = out.non_tensor_batch
    spans = [i for i in range(len(MESSAGES)) if nt["min_global_steps"][i] != nt["max_global_steps"][i]]
    assert spans, "no request was in flight across the weight sync"
    for i in spans:  # a trajectory that spans two versions says so, token span by token span
        assert (nt["min_global_steps"][i], nt["max_global_steps"][i]) == (first, first + 1)
        assert [s[2] for s in nt["belayer"][i]["global_steps_spans"]] == [first, first + 1]
    # the chunk held in the engine was aborted and sent again once generation resumed (a request between
    # chunks was parked at the gate instead)
    assert sum(b["weight_sync_aborts"] for b in nt["belayer"]) >= 1
    # not failures: every request stayed on its first server, nothing was evicted or restarted
    assert all(b["attempts"] == 1 for b in nt["belayer"])
    _full(run)
    nxt = run.generate()
    _same_but_step(nxt, golden, run.step)
    run.finish_step()


def _direct_client(run, **recovery):
    """A Belayer client in this process over the run's balancer, with its own recovery knobs."""
    from omegaconf import OmegaConf

    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    cfg = OmegaConf.create(OmegaConf.to_container(run.cfg, resolve=False))
    cfg.belayer.recovery = OmegaConf.merge(cfg.belayer.recovery, recovery)
    return BelayerLLMServerClient(cfg, run.lb)


def _counters(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=30).json()["belayer_counters"]


HOLD_S = 7.0  # the fault: both engines hold their requests this long, past the client's first check (stall + 5 s)


def test_a_chunk_held_past_the_stall_timeout_on_a_live_server_waits_and_one_given_up_is_aborted_there(run, golden):
    """verl's servers answer a chunk whole: no token shows progress. A chunk held in a live server's queue past
    recovery.stall_timeout_s is waited for (the actor answers Ray), not moved; one given up on (past the request
    deadline) is aborted on its server, which the engine's own counter shows."""
    prompt = list(range(40, 52))
    sp = {"temperature": 0.0, "max_tokens": 24, "logprobs": False}
    urls = [r.server_address for r in run.ckpt.replicas]
    patient = _direct_client(run, stall_timeout_s=0.2)
    want = asyncio.run(patient.generate("held-ref", prompt_ids=prompt, sampling_params=dict(sp)))

    async def held(client, rid):
        async with httpx.AsyncClient(timeout=10) as h:
            for u in urls:
                (await h.post(f"{u}/pause_generation", json={})).raise_for_status()
            task = asyncio.create_task(client.generate(rid, prompt_ids=prompt, sampling_params=dict(sp)))
            try:
                await asyncio.sleep(HOLD_S)  # the fault's length, not a synchronisation
            finally:
                for u in urls:
                    (await h.post(f"{u}/continue_generation", json={})).raise_for_status()
            return await asyncio.wait_for(task, 120)

    out = asyncio.run(held(patient, "held-1"))
    assert out.token_ids == want.token_ids
    assert out.extra_fields["belayer"]["attempts"] == 1, out.extra_fields["belayer"]  # never moved
    before = [_counters(u)["aborted"] for u in urls]
    impatient = _direct_client(run, stall_timeout_s=0.2, request_timeout_s=1, max_attempts=1)
    with pytest.raises(Exception):  # out of time and attempts (the request's error, whichever ends it first)
        asyncio.run(held(impatient, "held-2"))
    after = [_counters(u)["aborted"] for u in urls]
    assert sum(after) > sum(before), (before, after)  # the chunk given up on was aborted on its engine


def test_below_the_healthy_floor_the_typed_error_names_the_replicas(run, golden):
    from dataclasses import replace

    from belayer_plugin.hooks.verl import BelayerCheckpointEngineManager, FleetBelowFloorError, ReplicaRecovery

    cfg = run.recovery.cfg
    strict = ReplicaRecovery(replace(cfg, restart=replace(cfg.restart, max_restarts=0, min_healthy_engines=2)),
                             run.lb)
    ckpt = BelayerCheckpointEngineManager(run.ckpt.config, CpuActorWorkerGroup(lambda: ckpt.replicas),
                                          list(run.ckpt.replicas), recovery=strict)
    victim = ckpt.replicas[1]
    _kill(victim)
    with pytest.raises(FleetBelowFloorError) as e:
        ckpt.sleep_replicas()
    assert e.value.usable == 1 and e.value.floor == 2 and "replica-1" in str(e.value) and "RETIRED" in str(e.value)
    assert victim not in ckpt.replicas  # never called into again
    # the run's own manager (budget left) restarts it for the next step
    run.finish_step()
    _full(run)


def test_toggle_off_is_verls_own_client_and_a_dead_replica_fails_the_step(ray_cluster, tiny_model, tmp_path, golden):
    import ray
    from verl.workers.rollout.llm_server import LLMServerClient

    cfg = verl_config(tiny_model, tmp_path, ft=False)
    cfg.actor_rollout_ref.rollout.agent.num_workers = 1
    r = Run(cfg)
    try:
        assert type(r.agents.llm_client) is LLMServerClient and r.recovery is None
        assert not ray.get(r.lb.get_status.remote(), timeout=60)["use_fault_tolerance"]  # the YAML says on
        r.start()
        out = r.generate()
        for k in KEYS[:-1]:
            assert torch.equal(out.batch[k], golden.batch[k]), k
        # verl decodes each response in one request, Belayer in chunks (each chunk re-prefills the committed
        # tokens): the same tokens, logprobs equal to float rounding
        d = (out.batch["rollout_log_probs"] - golden.batch["rollout_log_probs"]).abs().max().item()
        assert d < 1e-4, d
        assert "belayer" not in out.non_tensor_batch
        _kill(r.ckpt.replicas[0])
        with pytest.raises(Exception) as e:  # verl's behaviour: the trainer's next gather fails
            r.ckpt.sleep_replicas()
        assert "ActorDied" in type(e.value).__name__ or "died" in str(e.value).lower()
    finally:
        r.close()


# ------------------------------------------------------------------ tests/functional/verl_replica_kill.sh
def _digest(out) -> dict:
    import hashlib

    d = {k: hashlib.sha1(out.batch[k].numpy().tobytes()).hexdigest()[:16] for k in KEYS}
    for k in ("min_global_steps", "max_global_steps"):
        d[k] = [int(x) for x in out.non_tensor_batch[k]]
    return d


def _steps(model: str, tmp: Path, steps: int, kill_at: int | None) -> dict:
    """`steps` trainer steps of the legacy per-step sequence; at step `kill_at` one replica's server is
    SIGKILLed mid-rollout. Returns what the comparison needs."""
    import ray

    r = Run(verl_config(model, tmp))
    try:
        r.start()
        rep: dict = {"steps": [], "killed": None}
        for i in range(steps):
            at_start = len(ray.get(r.lb.get_all_servers.remote()))
            if i == kill_at:
                victim = r.ckpt.replicas[0]

                async def both():
                    async def kill():
                        await asyncio.wait_for(victim.server_handle.wait_served.remote(2 * CHUNK), 120)
                        rep["killed"] = {"step": r.step, "pid": _pid(victim.server_handle),
                                         "server": victim.server_address}
                        os.kill(rep["killed"]["pid"], signal.SIGKILL)

                    k = asyncio.create_task(kill())
                    out = await asyncio.get_running_loop().run_in_executor(None, r.generate)
                    await k
                    return out

                out = asyncio.run(both())
            else:
                out = r.generate()
            rep["steps"].append({"step": r.step, "batch": _digest(out), "replicas_at_start": at_start,
                                 "servers_used": len(served_by(out))})
            r.finish_step()
        rep["replicas_at_end"] = len(ray.get(r.lb.get_all_servers.remote()))
        rep["events"] = [f"{e.subject} {e.kind}" for e in r.recovery.events.events if e.component == "verl"]
        return rep
    finally:
        r.close()


def main(argv: list[str] | None = None) -> int:
    """verl_replica_kill: the fault-free run, then the same run with one replica killed; compares them."""
    import argparse
    import json
    import tempfile

    from belayer_plugin.engines.tiny_model import ensure_tiny
    from belayer_plugin.ray_cluster import init_ray
    from tests.conftest import belayer_cfg

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=1, help="0-based step whose rollout loses a replica")
    p.add_argument("--report", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))
    model = str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))
    init_ray(belayer_cfg().ray)
    tmp = Path(tempfile.mkdtemp(prefix="belayer-verl-"))
    (tmp / "golden").mkdir()
    (tmp / "chaos").mkdir()
    golden = _steps(model, tmp / "golden", a.steps, None)
    chaos = _steps(model, tmp / "chaos", a.steps, a.kill_at)
    problems = []
    if not chaos["killed"]:
        problems.append("the fault was never delivered")
    for g, c in zip(golden["steps"], chaos["steps"]):
        if g["batch"] != c["batch"]:
            problems.append(f"step {c['step']}: batch differs from the fault-free run: {c['batch']} vs {g['batch']}")
        if c["replicas_at_start"] != 2:
            problems.append(f"step {c['step']} started on {c['replicas_at_start']} replica(s), not 2")
    if len(chaos["steps"]) != a.steps:
        problems.append(f"ran {len(chaos['steps'])} of {a.steps} steps")
    if chaos["replicas_at_end"] != 2 or not any(e.endswith(" admitted") for e in chaos["events"]):
        problems.append(f"the killed replica was not re-admitted: {chaos['events']}")
    Path(a.report).write_text(json.dumps({"golden": golden, "chaos": chaos, "problems": problems}, indent=1))
    print(f"verl_replica_kill: killed {chaos['killed']}; events {chaos['events']}")
    print(f"verl_replica_kill (EXPECT=survival) -> {'PASS' if not problems else 'FAIL'}")
    for x in problems:
        print(f"  - {x}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
