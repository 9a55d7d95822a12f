"""`BelayerReplayBuffer.sample()` against a live TransferQueue: TQ's controller and storage unit started for real on
the local Ray cluster (`tq.init(config.transfer_queue)`, as verl's main_ppo does for its v1 trainer), prompts and
trajectories written as verl's trainer and AgentLoopWorkerTQ write them, the buffer built by verl's own
`PPOTrainer._build_replay_buffer` from the recipe, and Belayer's step metrics recorded through the real balancer
actor (verl's router factory on recipes/verl/router.yaml) and the v1 agent loop manager named in the recipe.

TransferQueue start-up: its controller and every SimpleStorage unit each hold 1 Ray CPU for their lifetime, and
`tq.init` waits for them with an unbounded `ray.get`. verl's config asks for 8 storage units (9 CPUs): on a
2-CPU Ray cluster `tq.init` never returns. Here: 1 unit (2 CPUs), started in ~7 s."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")
pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (bash .ci/setup_verl.sh)")

from belayer_plugin.metrics import STEP_METRICS  # noqa: E402
from tests.test_hooks_metrics import _verl_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)

STORAGE_UNITS = 1  # + the controller: the Ray CPUs TransferQueue holds while it runs
TQ_START_S = 120.0


def start_transfer_queue(cfg, storage_units: int) -> None:
    """tq.init(config.transfer_queue) as verl's main_ppo calls it (transfer_queue.enable=True), with
    `storage_units` SimpleStorage units; raises RuntimeError when it has not started within TQ_START_S (tq.init's
    own waits are unbounded, so it runs in a thread joined with that bound)."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    cfg.transfer_queue.enable = True
    units = {"backend": {"SimpleStorage": {"num_data_storage_units": storage_units}}}
    conf = OmegaConf.merge(cfg.transfer_queue, units)
    started: dict = {}

    def start() -> None:
        try:
            started["conf"] = tq.init(conf)
        except BaseException as e:  # noqa: BLE001 - reported below
            started["error"] = e

    th = threading.Thread(target=start, daemon=True)
    th.start()
    th.join(TQ_START_S)
    if th.is_alive() or "conf" not in started:
        raise RuntimeError(f"TransferQueue did not start within {TQ_START_S:g} s: {started.get('error')!r}")


@pytest.fixture(scope="module")
def live(ray_cluster):
    """Belayer's balancer actor over two (stand-in) server actors, then TransferQueue, started for real."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.workers.rollout.router import get_router_handle

    @ray.remote(num_cpus=0)
    class Server:  # a rollout server as the balancer sees one: a Ray actor that is alive or gone
        pass

    servers = {f"127.0.0.1:{9000 + i}": Server.remote() for i in range(2)}
    # verl's router factory on the recipe's router YAML; placed before TQ takes the CPUs (an actor needs one to start)
    lb = get_router_handle(servers, router_config_path=str(ROOT / "recipes" / "verl" / "router.yaml"))
    assert ray.get(lb.get_status.remote(), timeout=60)["use_fault_tolerance"]

    try:
        need = 1 + STORAGE_UNITS
        # Actors of earlier tests in this session release their CPUs asynchronously after being killed; Ray
        # offers no event for it, so wait (bounded) rather than fail on a CPU that is about to come back.
        deadline = time.monotonic() + 60
        while (free := ray.available_resources().get("CPU", 0)) < need and time.monotonic() < deadline:
            time.sleep(0.5)
        if free < need:
            pytest.fail(f"TransferQueue needs {need} free Ray CPUs (controller + {STORAGE_UNITS} storage unit), "
                        f"the cluster has {free}: tq.init would wait forever")
        t0 = time.monotonic()
        try:
            start_transfer_queue(_verl_config(), STORAGE_UNITS)
        except RuntimeError as e:
            pytest.fail(f"{e} (free Ray resources: {ray.available_resources()})")
        print(f"TransferQueue started in {time.monotonic() - t0:.1f} s")
        yield SimpleNamespace(tq=tq, lb=lb, servers=servers)
    finally:
        tq.close()  # kills the controller and storage units (a no-op where they never started)
        for h in (lb, *servers.values()):
            ray.kill(h, no_restart=True)


@pytest.fixture
def tq(live):
    """The live TransferQueue, emptied after each test."""
    yield live.tq
    for pid, items in (live.tq.kv_list() or {}).items():
        if items:
            live.tq.kv_clear(keys=list(items), partition_id=pid)


def _submit(tq, uids: list[str], global_steps: int) -> None:
    """verl's PPOTrainer._submit_batch_to_rollout: the prompts' tags, pending (the async modes also store the
    prompts' fields, for checkpoint recovery; sample() reads only the tags)."""
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids])


def _trajectory(tq, uid: str, session_id: int, prompt: list[int], response: list[int], global_steps: int) -> str:
    """verl's AgentLoopWorkerTQ._agent_loop_postprocess for one single-turn output (key `{uid}_{session_id}_0`)."""
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    out = AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                          response_logprobs=[-0.5] * len(response), reward_score=float(session_id),
                          metrics=AgentLoopMetrics(),
                          extra_fields={"min_global_steps": global_steps, "max_global_steps": global_steps})
    field = out.as_dict()
    field.update(uid=uid, session_id=session_id, global_steps=global_steps)  # the prompt's kwargs
    input_ids = torch.cat([field["prompts"], field["responses"]])
    field.update(loss_mask=field["response_mask"], input_ids=input_ids, position_ids=torch.arange(len(input_ids)))
    key = f"{uid}_{session_id}_0"
    p, r = len(prompt), len(response)
    tq.kv_batch_put(keys=[key], partition_id="train", fields=list_of_dict_to_tensordict([field]),
                    tags=[{"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r,
                           "global_steps": global_steps, "min_global_steps": global_steps,
                           "max_global_steps": global_steps}])
    return key


def _group(tq, uid: str, n: int, global_steps: int, finished: bool = True, start: int = 0) -> dict[str, list[int]]:
    """AgentLoopWorkerTQ._run_prompt: running, n sessions' trajectories, then finished. Returns key -> response."""
    tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
    put = {}
    for s in range(start, start + n):
        response = [100 + 10 * s + j for j in range(3 + s)]  # ragged lengths, as real responses
        put[_trajectory(tq, uid, s, [1, 2, 3, 4], response, global_steps)] = response
    if finished:
        tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})
    return put


def _manager(cfg, lb):
    """The v1 agent loop manager the recipe names, loaded as verl's main_ppo loads it (its workers not started:
    `create()` would start them; sample() only takes the step's metrics)."""
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import LLMServerClient

    from belayer_plugin.hooks.verl.manager import current_manager

    cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    m = cls(config=cfg, llm_client=LLMServerClient(cfg, lb))
    assert current_manager() is m and m.llm_client._load_balancer is lb
    return m


def _replay_buffer(cfg, mode: str, refills: list[int]):
    """verl's own PPOTrainer._build_replay_buffer on the recipe's trainer.v1.sampler.custom_sampler."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = SimpleNamespace(config=cfg, trainer_mode=mode, _add_prompts_to_generate=lambda n: refills.append(n) or n)
    return PPOTrainer._build_replay_buffer(trainer)


def _fields(tq, batch) -> dict[str, list]:
    """What verl's trainer reads back for the sampled batch (trainer_base: tq.kv_batch_get on batch.keys)."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                           select_fields=["uid", "session_id", "responses", "input_ids", "rm_scores"])
    return {"uid": list(data["uid"]), "session_id": list(data["session_id"]),
            "responses": [t.tolist() for t in data["responses"].unbind(0)],
            "input_ids": [t.tolist() for t in data["input_ids"].unbind(0)],
            "reward": [float(t.sum()) for t in data["rm_scores"].unbind(0)]}  # as_dict: reward_score -> rm_scores


BELAYER_KEYS = {f"belayer/{n}" for n in STEP_METRICS}


def test_sync_sample_from_a_live_transferqueue_returns_exactly_the_finished_group_and_belayers_step_metrics_as_deltas(
        live, tq):
    import ray

    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient
    from belayer_plugin.hooks.verl.step_metrics import BelayerReplayBuffer

    cfg = _verl_config(mode="sync")  # verl's ppo_trainer config + recipes/verl/belayer.yaml
    m = _manager(cfg, live.lb)
    assert isinstance(m.llm_client, BelayerLLMServerClient)
    m.take_step_metrics()  # start from this test's counts (the balancer actor is the module's)
    refills: list[int] = []
    rb = _replay_buffer(cfg, "sync", refills)
    assert type(rb) is BelayerReplayBuffer

    # one GRPO step's prompts (n=2): `done` finished both sessions, `late` is still running with one written
    done, late = str(uuid.uuid4()), str(uuid.uuid4())
    _submit(tq, [done, late], global_steps=1)
    put = _group(tq, done, n=2, global_steps=1)
    late_put = _group(tq, late, n=1, global_steps=1, finished=False)

    # the step's faults, recorded where Belayer records them in a run: a server's actor dies and the client that
    # saw it reports it (the balancer evicts it: one death); the request resumed on the other server (the client
    # adds its counts to the balancer's); the manager restarted the dead replica (its own event sink)
    dead = next(iter(live.servers))
    ray.kill(live.servers[dead], no_restart=True)
    assert ray.get(live.lb.report_failure.remote(dead, "connection reset"), timeout=60) is True
    asyncio.run(asyncio.wait_for(m.llm_client.report_metrics({"requests_resumed": 1, "tokens_saved": 16}), 60))
    m.recovery.events.emit("verl", "replica-0", "restarted", "incarnation 2")

    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=1)

    # verl's batch: exactly the finished group's trajectories, their tags as written, the values as written
    assert batch.partition_id == "train"
    assert sorted(batch.keys) == sorted(put), batch.keys
    by_key = dict(zip(batch.keys, batch.tags))
    for key, response in put.items():
        assert by_key[key]["status"] == "success" and by_key[key]["global_steps"] == 1
        assert by_key[key]["response_len"] == len(response) and by_key[key]["prompt_len"] == 4
    got = _fields(tq, batch)
    assert got["uid"] == [done] * 2
    assert {k: r for k, r in zip(batch.keys, got["responses"])} == put
    assert all(ids == [1, 2, 3, 4] + r for ids, r in zip(got["input_ids"], got["responses"]))
    assert {k: (s, r) for k, s, r in zip(batch.keys, got["session_id"], got["reward"])} == {
        f"{done}_{s}_0": (s, float(s)) for s in (0, 1)}
    # verl consumed the sampled prompt, left the running one and all trajectories for the trainer to clear
    left = tq.kv_list("train")["train"]
    assert done not in left and left[late]["status"] == "running"
    assert set(put) | set(late_put) <= set(left)
    assert refills == []

    # the step's metrics: verl's own (sync, nothing evicted: none) with Belayer's, counted once
    assert set(metrics) == BELAYER_KEYS, sorted(metrics)
    assert metrics["belayer/engine_deaths_detected"] == 1
    assert metrics["belayer/requests_resumed"] == 1 and metrics["belayer/tokens_saved"] == 16
    assert metrics["belayer/cold_restarts"] == 1
    others = BELAYER_KEYS - {f"belayer/{n}" for n in
                             ("engine_deaths_detected", "requests_resumed", "tokens_saved", "cold_restarts")}
    assert {metrics[k] for k in others} == {0.0}

    # the next step (no fault): the late group finishes, is sampled alone, and Belayer's values are deltas, 0
    tq.kv_clear(keys=batch.keys, partition_id="train")  # the trainer, after its update (trainer_base)
    put2 = _group(tq, late, n=1, global_steps=1, start=1)
    batch2, metrics2 = rb.sample(global_steps=2, partition_id="train", batch_size=1)
    assert sorted(batch2.keys) == sorted([*late_put, *put2])
    assert set(metrics2) == BELAYER_KEYS and set(metrics2.values()) == {0.0}, metrics2


def test_async_sample_from_a_live_transferqueue_keeps_verls_eviction_metrics_beside_belayers(live, tq):
    from belayer_plugin.hooks.verl.step_metrics import BelayerReplayBufferAsync

    cfg = _verl_config(mode="colocate_async")
    m = _manager(cfg, live.lb)
    m.take_step_metrics()
    refills: list[int] = []
    rb = _replay_buffer(cfg, "colocate_async", refills)
    assert type(rb) is BelayerReplayBufferAsync
    threshold = cfg.trainer.v1.sampler.max_off_policy_threshold  # verl's default: 8, strategy drop

    stale, fresh = str(uuid.uuid4()), str(uuid.uuid4())
    _submit(tq, [stale], global_steps=1)
    stale_put = _group(tq, stale, n=2, global_steps=1)
    now = threshold + 2
    _submit(tq, [fresh], global_steps=now)
    put = _group(tq, fresh, n=2, global_steps=now)
    m.recovery.events.emit("verl", "replica-1", "restarted", "incarnation 2")

    batch, metrics = rb.sample(global_steps=now, partition_id="train", batch_size=1)

    assert sorted(batch.keys) == sorted(put)
    assert _fields(tq, batch)["uid"] == [fresh] * 2
    # verl evicted the stale group from TransferQueue and asked for one prompt in its place
    left = tq.kv_list("train")["train"]
    assert not ({stale, *stale_put} & set(left)) and refills == [1]
    # verl's own metrics, unchanged, beside Belayer's
    span = now - 1 + 1  # verl: global_steps - the prompt's global_steps + 1
    assert metrics["training/off_policy/evicted_samples"] == 1
    assert metrics["training/off_policy/evicted_samples_staleness/max"] == span
    assert set(metrics) == BELAYER_KEYS | {"training/off_policy/evicted_samples",
                                           *(f"training/off_policy/evicted_samples_staleness/{s}"
                                             for s in ("mean", "max", "min"))}, sorted(metrics)
    assert metrics["belayer/cold_restarts"] == 1 and metrics["belayer/engine_deaths_detected"] == 0
