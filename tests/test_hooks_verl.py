"""The verl 0.9.1 hook against real verl classes on CPU: its router factory builds Belayer's load balancer from a
router YAML; verl's SingleTurnAgentLoop and AgentLoopWorker.generate_sequences (with verl's own composed
ppo_trainer config) run through BelayerLLMServerClient; server actors are backed by Belayer engines; a server is
SIGKILLed mid-rollout and every trajectory completes with the fault-free ids (padded tensors identical)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import pytest
import torch
import yaml

pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")

from omegaconf import OmegaConf  # noqa: E402

from belayer_plugin.config import ConfigError  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.hooks._config import belayer_section  # noqa: E402
from tests.conftest import belayer_cfg  # noqa: E402
from tests.test_fleet_recovery import FAST  # noqa: E402

MESSAGES = ["The quick brown fox", "Fault tolerance means", "A rollout engine", "Checkpoint the sandbox"]
RESPONSE = 48
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
          "ignore_eos": True}
BELAYER = {"use_fault_tolerance": True, "shadow": {"num_standby": 0},
           "monitor": {"liveness_timeout_s": 1.0},
           "recovery": {"chunk_tokens": 8, "stall_timeout_s": 5, "max_attempts": 4}}


def _trainer_config(ft: bool = True):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"name": "belayer", "prompt_length": 64, "response_length": RESPONSE,
                                          "full_determinism": False}},
        "data": {}, "belayer": {**BELAYER, "use_fault_tolerance": ft}})


def _router_yaml(tmp_path, ft: bool = True) -> str:
    p = tmp_path / "belayer_router.yaml"
    p.write_text(yaml.safe_dump({"router_class": "belayer_plugin.hooks.verl.BelayerLoadBalancer",
                                 "belayer": {**BELAYER, "use_fault_tolerance": ft}}))
    return str(p)


async def _agent_loops(client, tokenizer, config, messages=MESSAGES) -> list[list[int]]:
    """verl's real SingleTurnAgentLoop, one per prompt, concurrently; returns each response's ids."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    async def one(text: str) -> list[int]:
        loop = SingleTurnAgentLoop(trainer_config=DictConfigWrap(config), server_manager=client, tokenizer=tokenizer,
                                   processor=None, dataset_cls=None, data_config=DictConfigWrap(config.data))
        out = await loop.run(dict(GREEDY), raw_prompt=[{"role": "user", "content": text}])
        assert len(out.response_ids) == RESPONSE and len(out.response_logprobs) == RESPONSE
        return list(out.response_ids)

    return list(await asyncio.wait_for(asyncio.gather(*(one(m) for m in messages)), 120))


def _verl_ppo_config(model: str, ft: bool = True):
    """verl's own ppo_trainer config (Hydra-composed from the installed package) plus the recipe addition."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.prompt_length=64", f"actor_rollout_ref.rollout.response_length={RESPONSE}",
            "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.calculate_log_probs=true"])
    GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    cfg.belayer = {**BELAYER, "use_fault_tolerance": ft}
    return cfg


async def _worker_rollout(client, config) -> "object":
    """verl's AgentLoopWorker.generate_sequences on a batch of the prompts (default single_turn_agent)."""
    import numpy as np
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(config, client)
    batch = DataProto.from_dict(non_tensors={"raw_prompt": np.array(
        [[{"role": "user", "content": m}] for m in MESSAGES], dtype=object)})
    out = await asyncio.wait_for(worker.generate_sequences(batch), 120)
    return out.batch


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@contextlib.asynccontextmanager
async def fleet_balancer_client(tmp_path, tiny_model, ft: bool = True):
    from verl.workers.rollout.router import get_router_handle

    from belayer_plugin.hooks.verl import BelayerLLMServerClient, attach_fleet, fleet_servers

    # 2 ms per decode step so the kill lands mid-rollout; no sglang-router (verl routes through the balancer)
    cfg = belayer_cfg(*FAST, "belayer.engines.cpu_step_delay_ms=2", "belayer.router.mode=direct",
                      f"belayer.use_fault_tolerance={str(ft).lower()}")
    events = EventLog(tmp_path / "events.jsonl")
    fm = FleetManager(cfg, tmp_path, events, model_path=tiny_model)
    await fm.start()
    bridge = None
    try:
        lb = get_router_handle(fleet_servers(fm), router_config_path=_router_yaml(tmp_path, ft))  # verl's factory
        bridge = attach_fleet(fm, lb)
        client = BelayerLLMServerClient(_trainer_config(ft), load_balancer_handle=lb, events=events)
        yield fm, lb, client, events
    finally:
        if bridge is not None:
            await bridge.close()
        await fm.shutdown()


async def test_kill_engine_actor_mid_rollout_agent_loop_ids_identical_and_replacement_admitted(
        ray_cluster, tiny_model, tokenizer, tmp_path):
    async with fleet_balancer_client(tmp_path, tiny_model) as (fm, lb, client, events):
        config = _trainer_config()
        golden = await _agent_loops(client, tokenizer, config)
        assert len({tuple(g) for g in golden}) == len(golden), "prompts must give distinct responses"
        # verl's AgentLoopWorker (its real rollout entry: batch in, padded DataProto out) over the same client
        ppo = _verl_ppo_config(tiny_model)
        worker_golden = await _worker_rollout(client, ppo)

        killed: dict = {}

        def kill(clog, seg):  # at token 16 of the first request that gets there: SIGKILL its server actor
            if not killed and clog.committed >= 16:
                slot = fm.slot_for_url(seg.url)
                killed.update(url=seg.url, slot=slot.slot_id, seen=clog.committed, rid=clog.rid)
                os.kill(slot.info.actor_pid, signal.SIGKILL)  # the engine server follows (PDEATHSIG)

        client.observers.append(kill)
        since = events.events[-1].t
        faulted = await _agent_loops(client, tokenizer, config)
        client.observers.remove(kill)
        assert killed, "the kill never happened"
        assert faulted == golden

        resumed = [e for e in events.events if e.kind == "resumed" and e.subject == killed["rid"]]
        assert resumed and resumed[0].figures["committed"] >= killed["seen"], "committed tokens were regenerated"
        st = await lb.get_status.remote()
        assert killed["url"] not in st["servers"]
        # the fleet restarts the engine at the current version and the bridge admits the replacement
        ev = await events.wait_for(lambda e: e.component == "verl" and e.kind == "admitted"
                                   and e.subject == killed["slot"], timeout=60, since=since)
        servers = await lb.get_all_servers.remote()
        assert len(servers) == 2 and ev.figures["url"] in servers and killed["url"] not in servers
        assert await fm.recover_dead(5) == 0  # nothing left to recover: a no-op
        assert await _agent_loops(client, tokenizer, config) == golden

        # the same kill inside verl's AgentLoopWorker.generate_sequences: identical padded tensors
        killed2: dict = {}

        def kill2(clog, seg):
            if not killed2 and clog.committed >= 12:
                slot = fm.slot_for_url(seg.url)
                killed2.update(slot=slot.slot_id)
                os.kill(slot.info.actor_pid, signal.SIGKILL)

        client.observers.append(kill2)
        since = events.events[-1].t
        faulted_batch = await _worker_rollout(client, ppo)
        client.observers.remove(kill2)
        assert killed2
        for key in ("prompts", "responses", "response_mask", "attention_mask", "input_ids", "position_ids"):
            assert torch.equal(faulted_batch[key], worker_golden[key]), key
        assert int(worker_golden["response_mask"].sum()) > 4 * 16, "responses too short for a mid-rollout kill"
        await events.wait_for(lambda e: e.component == "verl" and e.kind == "admitted"
                              and e.subject == killed2["slot"], timeout=60, since=since)

        # belayer.chaos through the hook: Belayer's injector SIGKILLs a server process (its actor lives on)
        from dataclasses import replace

        from belayer_plugin.hooks._chaos import attach_chaos

        chaos = replace(fm.cfg.chaos, enabled=True, kind="engine_server_kill", trigger="token", at=20, count=1,
                        probability=1.0, victim_state="any")
        inj = attach_chaos(replace(fm.cfg, chaos=chaos), fm, client.observers)
        since = events.events[-1].t
        try:
            assert await _agent_loops(client, tokenizer, config) == golden
        finally:
            inj.stop()
        assert inj.fired == 1
        victim = next(e for e in events.events if e.component == "chaos" and e.t >= since).subject.split()[0]
        evicted = await events.wait_for(lambda e: e.component == "verl" and e.kind == "evicted"
                                        and e.subject == victim, timeout=30, since=since)
        # after the eviction: `since` can equal the time of the previous kill's admission, which would match
        await events.wait_for(lambda e: e.component == "verl" and e.kind == "admitted" and e.subject == victim,
                              timeout=60, since=evicted.t)
        assert len(await lb.get_all_servers.remote()) == 2


class VerlProtocolServer:
    """A server actor with verl 0.9.1's server-actor generate signature, backed by one Belayer CPU engine."""

    def __init__(self, url: str):
        self.url = url

    async def generate(self, request_id, prompt_ids, sampling_params, image_data=None, video_data=None, **kw):
        import httpx
        from verl.workers.rollout.replica import TokenOutput

        sp = dict(sampling_params)
        want_lp = bool(sp.pop("logprobs", False))
        sp["max_new_tokens"] = sp.pop("max_tokens", RESPONSE)
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{self.url}/generate", json={"input_ids": prompt_ids, "sampling_params": sp,
                                                          "return_logprob": want_lp}, timeout=60)
            r.raise_for_status()
            out = r.json()
        fr = out["meta_info"]["finish_reason"]["type"]
        lps = [x[0] for x in out["meta_info"].get("output_token_logprobs") or []] if want_lp else None
        return TokenOutput(token_ids=out["output_ids"], log_probs=lps, stop_reason=fr if fr == "length" else "completed",
                           extra_fields={})

    def pid(self) -> int:
        return os.getpid()


async def test_verl_protocol_servers_kill_mid_rollout_evicts_and_resumes_and_toggle_off_is_verl_path(
        ray_cluster, tokenizer, start_cpu_server, tmp_path):
    import ray
    from verl.workers.rollout.router import get_router_handle

    from belayer_plugin.hooks.verl import BelayerLLMServerClient

    engines = [start_cpu_server("--step-delay-ms", "2") for _ in range(2)]
    actors = {f"srv-{i}": ray.remote(VerlProtocolServer).options(num_cpus=0, max_restarts=0).remote(e.url)
              for i, e in enumerate(engines)}
    pids = {sid: await a.pid.remote() for sid, a in actors.items()}
    tracer = _traced()
    try:
        # toggle off: verl's own client path through the same balancer gives the reference ids
        lb_off = get_router_handle(dict(actors), router_config_path=_router_yaml(tmp_path, ft=False))
        off = BelayerLLMServerClient(_trainer_config(ft=False), load_balancer_handle=lb_off)
        golden = await _agent_loops(off, tokenizer, _trainer_config(ft=False))
        assert not (await lb_off.get_status.remote())["use_fault_tolerance"]
        # verl's rollout tracing sees one generate span a request on either path (not none, not two), beside
        # the agent loop's own
        assert tracer.generates() == ["BelayerLLMServerClient.generate"] * len(golden) and tracer.errors == []

        lb = get_router_handle(dict(actors), router_config_path=_router_yaml(tmp_path))
        # verl ships the client to its AgentLoopWorker actors: the copy must work on its own
        client = ray.cloudpickle.loads(ray.cloudpickle.dumps(
            BelayerLLMServerClient(_trainer_config(), load_balancer_handle=lb)))
        assert client.belayer.use_fault_tolerance and client.observers == []
        killed: dict = {}

        def kill(clog, seg):
            if not killed and clog.committed >= 16:
                killed.update(sid=seg.url, seen=clog.committed)
                os.kill(pids[seg.url], signal.SIGKILL)

        client.observers.append(kill)
        tracer.ops.clear()
        assert await _agent_loops(client, tokenizer, _trainer_config()) == golden
        assert killed
        # the resumed request too is one span, finished with its output
        assert tracer.generates() == ["BelayerLLMServerClient.generate"] * len(golden) and tracer.errors == []
        st = await lb.get_status.remote()
        assert killed["sid"] not in st["servers"] and "ActorDiedError" in st["evicted"][killed["sid"]]
        # a dead handle is never admitted again; a live one is
        dead = actors[killed["sid"]]
        assert await lb.add_servers.remote({killed["sid"]: dead}) == []
        fresh = ray.remote(VerlProtocolServer).options(num_cpus=0, max_restarts=0).remote(engines[0].url)
        assert await lb.add_servers.remote({"srv-new": fresh}) == ["srv-new"]
        actors["srv-new"] = fresh
    finally:
        tracer.close()
        for a in actors.values():
            ray.kill(a, no_restart=True)


class _Tracer:
    """The client of a rollout-trace backend (weave's create_call / finish_call, what verl's rollout_trace_op
    calls) and the one weave module verl reads the call's attributes from: weave needs a W&B server, which
    cannot run here; verl's decorator and its configuration do."""

    def __init__(self):
        self.ops: list[str] = []
        self.errors: list[BaseException] = []

    def create_call(self, op, inputs, attributes=None):
        self.ops.append(op)
        return op

    def generates(self) -> list[str]:
        return [op for op in self.ops if op.endswith(".generate")]

    def finish_call(self, call, output=None, exception=None):
        if exception is not None:
            self.errors.append(exception)

    def close(self) -> None:
        from verl.utils.rollout_trace import RolloutTraceConfig

        RolloutTraceConfig.reset()
        for name in _WEAVE_MODULES:
            sys.modules.pop(name, None)


_WEAVE_MODULES = ("weave", "weave.trace", "weave.trace.context")


def _traced() -> _Tracer:
    """verl's RolloutTraceConfig set up as RolloutTraceConfig.init("weave") sets it, over a recording client."""
    import contextvars
    import types

    from verl.utils.rollout_trace import RolloutTraceConfig

    assert not any(n in sys.modules for n in _WEAVE_MODULES), "weave is installed: use it instead"
    context = types.ModuleType("weave.trace.context")
    context.call_context = types.SimpleNamespace(call_attributes=contextvars.ContextVar("attrs", default={}))
    for name in _WEAVE_MODULES:
        sys.modules[name] = context if name.endswith("context") else types.ModuleType(name)
    tracer = _Tracer()
    cfg = RolloutTraceConfig.get_instance()
    cfg.backend, cfg.client, cfg.token2text, cfg._initialized = "weave", tracer, False, True
    return tracer


def test_recipe_section_is_validated_all_at_once():
    with pytest.raises(ConfigError) as e:
        belayer_section({"recovery": {"chunk_tokens": 0}, "monitor": {"failure_threshold": "x"}, "bogus": 1})
    msg = str(e.value)
    assert "chunk_tokens" in msg and "failure_threshold" in msg and "bogus" in msg
    cfg = belayer_section(OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "recipes", "verl",
                                                      "router.yaml")).belayer)
    assert cfg.use_fault_tolerance and cfg.recovery.mode in ("stream", "chunked")
    addition = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "recipes", "verl", "belayer.yaml"))
    assert belayer_section(addition.belayer).recovery.chunk_tokens == 128
    from belayer_plugin.hooks.verl import router_config_path

    assert os.path.isfile(router_config_path())


class ScriptedAgent:
    """A verl server manager whose 'model' runs a fixed script: step k appends a line to a file and shows it."""

    def __init__(self, tokenizer, steps: int, on_step=None):
        self.tok, self.steps, self.on_step = tokenizer, steps, on_step
        self.calls = 0
        self.reported: list[dict] = []

    async def report_metrics(self, counts: dict) -> None:  # BelayerLLMServerClient's: to the step's metrics
        self.reported.append(counts)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        k = self.tok.decode(prompt_ids).count("<returncode>")  # actions the context says are done
        if self.on_step is not None:
            self.on_step(k)
        text = (f"```bash\necho step{k} >> /root/log && cat /root/log\n```" if k < self.steps
                else "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        return TokenOutput(token_ids=self.tok.encode(text, add_special_tokens=False), stop_reason="completed",
                           extra_fields={})


def test_sandbox_agent_loop_container_killed_mid_trajectory_restores_and_matches_fault_free(
        tokenizer, tmp_path):
    import shutil

    if not shutil.which("podman"):
        pytest.skip("podman not installed (bash .ci/setup_containers.sh)")
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from belayer_plugin.hooks.verl.agent_loop import SandboxAgentLoop, sandbox_from_config

    config = _trainer_config()
    config.belayer.sandbox = {"backend": "podman", "checkpoint_dir": str(tmp_path / "ck"), "exec_timeout_s": 20,
                              "env_cache_dir": os.path.join(os.environ["BELAYER_CACHE_DIR"], "envs"),
                              "policy": {"enabled": False, "every_n_actions": 1, "async_checkpoint": False}}
    config.actor_rollout_ref.rollout.response_length = 512
    made = []

    def provider(tid, cfg):
        out = sandbox_from_config(tid, cfg)
        made.append(out[0])
        return out

    async def run(on_step=None):
        agent = ScriptedAgent(tokenizer, 3, on_step)
        loop = SandboxAgentLoop(trainer_config=DictConfigWrap(config), server_manager=agent, tokenizer=tokenizer,
                                processor=None, dataset_cls=None, data_config=DictConfigWrap(config.data))
        loop.sandbox_provider = provider
        out = await asyncio.wait_for(loop.run({}, raw_prompt=[{"role": "user", "content": "log three steps"}]), 240)
        return out, agent

    golden, quiet = asyncio.run(run())
    g = golden.extra_fields["belayer_sandbox"]
    assert g["recoveries"] == 0 and g["boundaries"] == 3
    # one report per trajectory for the trainer's step metrics: no restore without a fault
    (q,) = quiet.reported
    assert q["belayer/env_restores"] == 0 and q["belayer/env_rollback_actions"] == 0, q
    assert (q["belayer/checkpoints"] > 0) == (q["belayer/checkpoint_s"] > 0), q
    assert "step0\nstep1\nstep2" in g["messages"][-2]["content"]

    killed = []

    def kill_at_step_2(k):  # the container dies after two committed actions, before the third runs
        if k == 2 and not killed:
            killed.append(True)
            made[-1].kill()

    faulted, agent = asyncio.run(run(kill_at_step_2))
    f = faulted.extra_fields["belayer_sandbox"]
    assert killed and f["recoveries"] == 1
    # prefix consistency: the same context, mask and environment state as without the fault
    assert faulted.response_ids == golden.response_ids and faulted.response_mask == golden.response_mask
    assert f["messages"] == g["messages"] and "step0\nstep1\nstep2" in f["messages"][-2]["content"]
    assert agent.calls == 5, "only the action whose effect was lost is regenerated"
    (m,) = agent.reported
    assert m["belayer/env_restores"] == 1 and m["belayer/checkpoints"] >= q["belayer/checkpoints"], m


def test_external_module_loads_through_verls_own_env_var():
    import subprocess
    import sys

    code = ("from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r; "
            "from verl.workers.rollout.router import _resolve_router_class as f; "
            "print(r['belayer_sandbox_agent']['_target_'], f('belayer_plugin.hooks.verl.BelayerLoadBalancer').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VERL_USE_EXTERNAL_MODULES": "belayer_plugin.hooks.verl"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["belayer_plugin.hooks.verl.agent_loop.SandboxAgentLoop", "BelayerLoadBalancer"]
    loops = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "recipes", "verl", "agent_loops.yaml")))
    assert loops == [{"name": "belayer_sandbox_agent", "_target_": out.stdout.split()[0]}]
