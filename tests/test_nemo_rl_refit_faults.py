"""Faults during NeMo-RL's own refit (grpo.refit_policy_generation), under the fault-tolerant SGLangGeneration.

NeMo-RL's policy workers POST weight buckets to the URLs `get_rollout_engine_urls()` returns, with no timeout,
then retry /flush_cache. Belayer's refit gateway (fleet/refit_gateway.py) relays each to the slot's engine.
Real faults on real engine processes: SIGKILL and SIGSTOP of one engine's server while the stream reaches it.
Each run: NeMo-RL's refit returns (never raises, never wedges: bounded by engines.refit_request_timeout_s), the
other engine serves the new weights, the faulty engine is fenced, restarted, kept out of the router (STALE) and
receives the weights at the next refit (its own reported version and its greedy ids equal the other's). A
replacement that comes up while the trainer trains has its memory released like the others (the engine's own
/server_info says so). Below the healthy floor the refit's URL request raises FleetBelowFloorError.

Replaced on CPU (README / docs: stand-ins): the policy's CUDA-IPC streaming (CpuStreamingPolicy, NeMo-RL's
request sequence and bodies with the tensors' bytes), the SGLang servers (Belayer's CPU engines, same routes).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.test_hooks_nemo_rl import (  # noqa: F401  (nrl, nrl_cluster: fixtures)
    KNOBS,
    _gen_cfg,
    _generated,
    _router_urls,
    _wait,
    generation_and_policy,
    nrl,
    nrl_cluster,
)

pytestmark = pytest.mark.timeout(600)

REFIT_TIMEOUT_S = 4.0  # engines.refit_request_timeout_s here: how long a hung engine may hold the refit
BUCKET_GB = 0.00002  # ~20 KB buckets: the tiny model's weights take ~20 POSTs per engine


@pytest.fixture(scope="module")
def gen(nrl, nrl_cluster, tiny_model, tmp_path_factory):
    knobs = {**KNOBS, "run_dir": str(tmp_path_factory.mktemp("nemo-rl-refit")),
             "engines": {**KNOBS["engines"], "cpu_step_delay_ms": 2, "refit_request_timeout_s": REFIT_TIMEOUT_S},
             "restart": {**KNOBS["restart"], "max_restarts": 4}}
    with generation_and_policy(nrl, nrl_cluster, tiny_model, knobs) as both:
        yield both


def _train(policy) -> None:
    import torch

    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.25)  # "training" changed the policy


def _trained(nrl, gen):
    """A generation phase, then the trainer's: paused, and the policy changed."""
    grpo, _ = nrl
    pg, policy = gen
    pg.prepare_for_generation()
    pg.finish_generation()
    _train(policy)
    return grpo, pg, policy, pg.belayer_fleet


def _server_info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=30).json()


def _refit_with_fault(grpo, pg, policy, victim: str, fault: str, synchronizer: bool = False) -> dict:
    """NeMo-RL's refit; once the stream reaches `victim`'s engine, its server process gets the fault
    (SIGKILL: stopped first, so the kill lands while the stream still flows to it; SIGSTOP: left hung)."""
    fm = pg.belayer_fleet
    slot = fm.slots[victim]
    pid, url = slot.info.pid, slot.info.url
    since = pg.belayer_events.events[-1].t

    def stream(rollout_engine_urls, buffer_size_bytes):
        refs = type(policy).stream_weights_via_http(policy, rollout_engine_urls, buffer_size_bytes)
        _wait(pg, lambda e: e.kind == "refit_relayed" and e.subject == victim, since=since)
        os.kill(pid, signal.SIGSTOP)  # the next bucket to it waits on a stopped server
        if fault == "sigkill":
            os.kill(pid, signal.SIGKILL)
        return refs

    policy.stream_weights_via_http = stream
    t0 = time.monotonic()
    try:
        if synchronizer:  # NeMo-RL's own HTTP weight synchronizer (the single-controller path's refit)
            from nemo_rl.weight_sync.http_weight_synchronizer import HTTPWeightSynchronizer

            sync = HTTPWeightSynchronizer(policy=policy, generation=pg, refit_buffer_size_gb=BUCKET_GB)
            sync.sync_weights()
            assert sync.is_stale is False
        else:
            grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=BUCKET_GB)
    finally:
        del policy.stream_weights_via_http
    return {"took_s": time.monotonic() - t0, "pid": pid, "url": url, "since": since}


def _heals_at_the_next_refit(grpo, pg, policy, victim: str, old_url: str, since: float) -> None:
    fm = pg.belayer_fleet
    other = next(s for s in fm.slots if s != victim)
    _wait(pg, lambda e: e.subject == victim and e.kind == "awaiting_weights", timeout=120, since=since)  # STALE
    assert fm.slots[victim].health.state.value == "STALE" and fm.slots[victim].info.url != old_url
    assert fm.slots[victim].info.url not in _router_urls(pg) and fm.slots[other].info.url in _router_urls(pg)
    assert all(len(t) == 12 for t in _generated(pg))  # the other engine serves meanwhile
    pg.finish_generation()  # the trainer trains: the replacement's memory is released with the others'
    for s in fm.slots.values():
        assert _server_info(s.info.url)["memory_released"] is True, s.slot_id
    _train(policy)
    grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=BUCKET_GB)
    assert pg.belayer_gateway.missed == {}
    assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    v = fm.weights.version
    assert pg.verify_weight_versions() == {"engine-0": v, "engine-1": v}  # each engine's own report
    assert {s.info.url for s in fm.slots.values()} <= _router_urls(pg)
    want = _generated(pg)
    for s in fm.slots.values():  # both engines serve the streamed weights: the same greedy ids
        r = httpx.post(f"{s.info.url}/generate", json={"input_ids": [54, 280, 487, 423, 442], "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}, timeout=60).json()
        assert [t[1] for t in r["meta_info"]["output_token_logprobs"]] == want[0], s.slot_id


def test_check_weights_asks_every_engine_and_names_one_that_cannot_answer(gen):
    pg, _ = gen
    # Belayer's CPU engine has no /weights_checker (SGLang's debugging route): each slot is asked, and the
    # first that cannot answer is named with what it said, instead of NeMo-RL's engines list being empty
    with pytest.raises(RuntimeError, match=r"engine slot engine-\d .*/weights_checker answered HTTP 404"):
        pg.check_weights("snapshot")


def test_nemo_rls_coming_synchronizer_gets_the_per_slot_urls_and_a_refit_lock(gen):
    pg, _ = gen
    assert pg.recover_updatable_engines() == 0  # nothing died: nothing to wait for
    urls, lock = pg.get_updatable_engines_and_lock()
    assert urls == [f"{pg.belayer_gateway.url}/slot/engine-0", f"{pg.belayer_gateway.url}/slot/engine-1"]
    with lock:
        pass


def test_an_engine_sigkilled_during_nemo_rls_weight_stream_misses_the_refit_then_rejoins_at_the_next(nrl, gen):
    grpo, _ = nrl
    pg, policy = gen
    fm = pg.belayer_fleet
    pg.prepare_for_generation()
    before = _generated(pg)
    pg.finish_generation()
    _train(policy)
    f = _refit_with_fault(grpo, pg, policy, "engine-1", "sigkill")
    # the refit completed on engine-0; engine-1's share was absorbed, never half-loaded into a live engine
    miss = pg.belayer_gateway.missed
    assert set(miss) == {"engine-1"} and "engine-0" not in miss, miss
    assert fm.weights.version == "1" and fm.slots["engine-0"].health.state.value == "HEALTHY"
    assert pg.verify_weight_versions() == {"engine-0": "1"}
    assert _generated(pg) != before  # the new weights serve
    assert f["url"] not in _router_urls(pg)
    _heals_at_the_next_refit(grpo, pg, policy, "engine-1", f["url"], f["since"])


def test_an_engine_hung_during_nemo_rls_weight_stream_is_fenced_within_the_refit_timeout(nrl, gen):
    grpo, pg, policy, fm = _trained(nrl, gen)
    f = _refit_with_fault(grpo, pg, policy, "engine-0", "sigstop")
    try:
        # bounded: the hung POST waited engines.refit_request_timeout_s, not forever (NeMo-RL's has no timeout)
        assert f["took_s"] < REFIT_TIMEOUT_S + 60, f
        assert "no answer" in pg.belayer_gateway.missed.get("engine-0", ""), pg.belayer_gateway.missed
        killed = [e for e in pg.belayer_events.events if e.t >= f["since"] and e.subject == "engine-0"
                  and e.kind == "transition" and e.to_state == "DEAD"]
        assert killed and killed[0].figures.get("signal") == "killed", killed  # fenced by Belayer, not a crash
        assert fm.slots["engine-1"].health.state.value == "HEALTHY"
        assert pg.verify_weight_versions() == {"engine-1": fm.weights.version}
    finally:
        try:
            os.kill(f["pid"], signal.SIGKILL)  # fenced already; never leave a stopped process behind
        except ProcessLookupError:
            pass
    _heals_at_the_next_refit(grpo, pg, policy, "engine-0", f["url"], f["since"])


def test_an_engine_restarted_while_the_trainer_trains_has_its_memory_released_like_the_others(nrl, gen):
    grpo, pg, policy, fm = _trained(nrl, gen)
    # the trainer's weights are the fleet's (a replacement can only wait for the next refit to get them)
    grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=BUCKET_GB)
    pg.finish_generation()  # the trainer trains: memory released
    victim = fm.slots["engine-1"]
    old = victim.info.url
    since = pg.belayer_events.events[-1].t
    os.kill(victim.info.pid, signal.SIGKILL)
    _wait(pg, lambda e: e.subject == "engine-1" and e.kind == "awaiting_weights", since=since, timeout=120)
    assert victim.info.url != old and victim.health.state.value == "STALE"
    info = _server_info(victim.info.url)
    assert info["memory_released"] is True, info  # not a full engine's memory held through training
    _train(policy)
    grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=BUCKET_GB)
    assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    assert all(_server_info(s.info.url)["memory_released"] is False for s in fm.slots.values())


def test_nemo_rls_http_weight_synchronizer_survives_an_engine_killed_during_its_stream(nrl, gen):
    """The single-controller (async GRPO) path refits through NeMo-RL's HTTPWeightSynchronizer: the same calls."""
    grpo, pg, policy, fm = _trained(nrl, gen)
    f = _refit_with_fault(grpo, pg, policy, "engine-0", "sigkill", synchronizer=True)
    # the version NeMo-RL's worker streamed (its per-worker counter) is the fleet's now
    assert set(pg.belayer_gateway.missed) == {"engine-0"} and fm.weights.version == str(policy.weight_version)
    assert pg.verify_weight_versions() == {"engine-1": fm.weights.version}
    _heals_at_the_next_refit(grpo, pg, policy, "engine-0", f["url"], f["since"])


def test_the_generation_object_refuses_to_be_shipped_to_another_process_with_a_clear_error(gen):
    import ray.cloudpickle as cloudpickle

    pg, _ = gen
    with pytest.raises(TypeError, match="cannot be sent to another process.*use_fault_tolerance=false"):
        cloudpickle.dumps(pg)


def test_below_the_healthy_floor_the_refit_url_request_raises_the_typed_error(nrl, nrl_cluster, tiny_model, tmp_path):
    from belayer_plugin.fleet.policy import FleetBelowFloorError
    from belayer_plugin.hooks.nemo_rl import fault_tolerant

    _, sg = nrl
    knobs = {**KNOBS, "run_dir": str(tmp_path),
             "restart": {**KNOBS["restart"], "max_restarts": 0, "min_healthy_engines": 2}}
    pg = fault_tolerant(sg.SGLangGeneration)(cluster=nrl_cluster, sglang_cfg=_gen_cfg(tiny_model, True, knobs))
    try:
        pg.finish_generation()
        since = pg.belayer_events.events[-1].t
        os.kill(pg.belayer_fleet.slots["engine-1"].info.pid, signal.SIGKILL)
        _wait(pg, lambda e: e.kind == "below_floor", since=since)
        with pytest.raises(FleetBelowFloorError) as e:
            pg.get_rollout_engine_urls()
        assert e.value.usable == 1 and e.value.floor == 2 and "engine-1" in str(e.value)
    finally:
        pg.shutdown()
