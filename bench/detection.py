"""Fault detection latency under load: Belayer vs the detectors a user would otherwise run, at true scale.

Every detector watches the SAME engines at the same time, so each fault is timed by all of them at once:

- belayer: Belayer's monitor with recipes/belayer/default.yaml's knobs (Ray liveness of every engine actor,
  parallel readiness probes while serving, and hang detection from the tokens it streams: an engine silent
  past its own adaptive threshold is probed at once, `monitor.progress`), through FleetManager, which also
  repairs the engine. The load goes through Belayer's token-level client (ResumableGenerator over the
  fleet), as a trainer's requests do with Belayer on; that is where the token progress comes from.
- nemo_rl: NeMo-RL's own fleet health, imported from its source (../shared/upstream/nemo-rl):
  `GenerationFleetHealth` (the state machine: HEALTHY, SUSPECT, DEAD) with its `FleetHealthConfig` defaults
  (probe every 5 s, 2 s timeout, DEAD after 3 consecutive failures), fed as its SingleController feeds it
  (`_probe_generation_fleet`: every serving shard probed concurrently through its generation worker's
  `is_alive`; here the engine actor's `ping`, since NeMo-RL's vLLM worker cannot run here); detected when
  the shard leaves its serving set. Its other input is fed too in the SIGKILL trials: its own GenerationRouter
  (its GenerationRouterConfig defaults, health-managed) carries greedy chat completions to the same engines (the
  CPU engine serves /v1/chat/completions), and on each probe tick the router's per-backend failures are
  drained into `report_failure` and the serving set pushed back, as its SingleController does. In the hang
  trials the router runs no load: a hung engine fails no request before backend_timeout_s (600 s), and once
  Belayer has fenced (killed) it, the failures would be Belayer's detection, not NeMo-RL's.
- slime: `--use-fault-tolerance` heartbeat: `/health_generate` to each server in turn every 10 s with a 5 s
  timeout; one timeout or error stops the server (the 300 s first wait is left out).
- router: a real sglang-router 0.3.2 with its own defaults (health check every 60 s, 5 s timeout, 3
  failures, endpoint /health), the engines registered as workers; detected when /workers says unhealthy.

Faults: `sigkill` SIGKILLs the engine's actor process (the engine dies with it, as a vLLM/SGLang worker
does); `hang` SIGSTOPs the engine's actor and server (a wedged engine: the process exists, answers nothing);
`hang_server` SIGSTOPs the server alone (a wedged engine core whose worker process still answers: NeMo-RL's
`is_alive` probe keeps answering from the actor).
Load: streaming greedy requests kept in flight on every engine throughout (two per engine).

Last line: RESULT ratio=.. hang_ratio=.. server_hang_ratio=.. belayer_kill_s=.. nemo_rl_kill_s=.. slime_kill_s=..
  router_kill_s=.. belayer_hang_s=.. nemo_rl_hang_s=.. ... belayer_server_hang_s=.. nemo_rl_server_hang_s=..
  trials=.. ("never": not detected within the trial's wait)
  ratio: NeMo-RL's median SIGKILL detection / Belayer's; hang_ratio: the same for the hang (medians);
  belayer_hang_p50_s: Belayer's median hang detection; hang_by: the signals that found the hangs;
  false_alarms: progress suspicions of a healthy engine, over a fault-free load of calm_s seconds first and
  on the engines not faulted during the trials.
Usage: python bench/detection.py [--quick] [--trials N] [--no-router] [--calm-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.engines.launch import free_port  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.launch import resolve_model_path  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator  # noqa: E402
from belayer_plugin.ray_cluster import init_ray  # noqa: E402

SLIME = dict(interval=10.0, timeout=5.0)
ROUTER = dict(interval=60, timeout=5, threshold=3)


class NemoRLFleetHealth:
    """NeMo-RL's GenerationFleetHealth with its FleetHealthConfig defaults, probed as its SingleController's
    `_probe_generation_fleet` probes it: on its own clock, every serving shard at once, each `is_alive` bounded
    by probe_timeout_s, the result folded in with `record_probe`. `dead` maps a shard to the wall time it left
    the serving set."""

    def __init__(self, actors: dict[str, Any], urls: dict[str, str]):
        from belayer_plugin.hooks.nemo_rl.upstream import ensure_importable

        ensure_importable()
        from nemo_rl.algorithms.single_controller_utils.config import FleetHealthConfig, GenerationRouterConfig
        from nemo_rl.models.generation.fleet_health import FleetHealthPolicy, GenerationFleetHealth
        from nemo_rl.models.generation.generation_router import GenerationRouterImpl

        self.cfg = FleetHealthConfig(enabled=True)
        self.sids = list(actors)
        self.actors = actors
        base_urls = [f"{urls[sid]}/v1" for sid in self.sids]
        self.fleet = GenerationFleetHealth(shard_count=len(self.sids), base_urls=base_urls, policy=FleetHealthPolicy(
            unhealthy_threshold=self.cfg.unhealthy_threshold, healthy_threshold=self.cfg.healthy_threshold,
            max_restart_attempts_per_shard=self.cfg.max_restart_attempts_per_shard,
            min_healthy_shards=self.cfg.min_healthy_shards))
        # Its GenerationRouter (the one NeMo-Gym's requests go through), with its config's defaults: the failures
        # of the requests it forwards are the fleet health's other input. Its server thread has no stop: one
        # router a trial, left to the process's end.
        rc = GenerationRouterConfig()
        self.router = GenerationRouterImpl(
            backend_urls=base_urls, host="127.0.0.1", port=free_port(), backend_timeout_s=rc.backend_timeout_s,
            connect_timeout_s=rc.connect_timeout_s, no_healthy_backend_status=rc.no_healthy_backend_status,
            health_managed=True)
        self.router.serve_in_background()
        self.dead: dict[str, float] = {}

    async def load(self, stop: asyncio.Event, per_engine: int = 1) -> None:
        """NeMo-Gym's traffic through its router: greedy chat completions kept in flight (`per_engine` each)."""
        async def one(client: httpx.AsyncClient) -> None:
            while not stop.is_set():
                try:
                    await client.post(f"{self.router.base_url()}/chat/completions", timeout=700, json={
                        "model": "tiny", "messages": [{"role": "user", "content": "count to one hundred"}],
                        "max_tokens": 128, "temperature": 0.0})
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)

        async with httpx.AsyncClient(trust_env=False) as client:
            await asyncio.gather(*(one(client) for _ in range(per_engine * len(self.sids))))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)

            async def probe(idx: int) -> None:
                try:
                    await asyncio.wait_for(self.actors[self.sids[idx]].ping.remote(), self.cfg.probe_timeout_s)
                except (Exception, asyncio.TimeoutError) as error:
                    self.fleet.record_probe(idx, ok=False, error=f"{type(error).__name__}: {error}")
                else:
                    self.fleet.record_probe(idx, ok=True)

            await asyncio.gather(*(probe(idx) for idx in self.fleet.serving_shards()))
            # then, on the same tick as its SingleController: the router's failures drained into the fleet
            # health, and the serving set pushed back to the router
            for url, count in self.router.drain_backend_failures().items():
                idx = self.fleet.shard_for_base_url(url)
                for _ in range(count if idx is not None else 0):
                    self.fleet.report_failure(idx, RuntimeError(f"router: {count} failed request(s) to {url}"))
            self.router.set_serving_backends(self.fleet.serving_base_urls())
            serving = set(self.fleet.serving_shards())
            for idx, sid in enumerate(self.sids):
                if idx not in serving and sid not in self.dead:
                    self.dead[sid] = time.time()


class SlimeHeartbeat:
    """Every `interval`: /health_generate to each server in turn; one failure stops it."""

    def __init__(self, urls: dict[str, str], client: httpx.AsyncClient):
        self.urls, self.client, self.dead = dict(urls), client, {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SLIME["interval"])
            for sid, url in self.urls.items():
                if sid in self.dead:
                    continue
                try:
                    ok = (await self.client.get(f"{url}/health_generate", timeout=SLIME["timeout"])).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    self.dead[sid] = time.time()


class RouterWatch:
    """A real sglang-router with its default health checks; polls /workers for `is_healthy: false`."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--health-check-interval-secs", str(ROUTER["interval"]),
             "--health-check-timeout-secs", str(ROUTER["timeout"]),
             "--health-failure-threshold", str(ROUTER["threshold"])],
            stdout=open(log_dir / "router-baseline.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.dead: dict[str, float] = {}
        self.urls: dict[str, str] = {}

    async def ready(self, client: httpx.AsyncClient) -> None:
        for _ in range(600):
            try:
                if (await client.get(f"{self.url}/workers", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)  # a starting process: nothing to await; bounded by the loop count
        raise TimeoutError("baseline router did not start")

    async def set_workers(self, client: httpx.AsyncClient, urls: dict[str, str]) -> None:
        for w in (await client.get(f"{self.url}/workers", timeout=5)).json().get("workers", []):
            await client.delete(f"{self.url}/workers/{w['id']}", timeout=5)
        for u in urls.values():
            await client.post(f"{self.url}/workers", json={"url": u}, timeout=5)
        self.urls, self.dead = dict(urls), {}

    async def run(self, client: httpx.AsyncClient) -> None:
        by_url = {u: s for s, u in self.urls.items()}
        while True:
            await asyncio.sleep(0.25)
            try:
                ws = (await client.get(f"{self.url}/workers", timeout=5)).json().get("workers", [])
            except (httpx.HTTPError, ValueError):
                continue
            for w in ws:
                sid = by_url.get(w.get("url"))
                if sid and w.get("is_healthy") is False and sid not in self.dead:
                    self.dead[sid] = time.time()

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def load(fm: FleetManager, gen: ResumableGenerator, stop: asyncio.Event) -> None:
    """Keeps two streaming greedy requests in flight per engine, through Belayer's token-level client."""
    async def one(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                await gen.generate(f"load-{k}-{i}", list(range(3, 40)),
                                   {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True})
            except Exception:  # e.g. no healthy engine for a moment: try again shortly
                await asyncio.sleep(0.2)

    await asyncio.gather(*(one(k) for k in range(2 * len(fm.slots))))


async def trial(fm: FleetManager, kind: str, sid: str, client: httpx.AsyncClient, router: Optional[RouterWatch],
                wait_s: float, signals: list[str], false_alarms: list) -> dict[str, Optional[float]]:
    t_start = time.time()
    slot = fm.slots[sid]
    actors = {s: sl.actor for s, sl in fm.slots.items() if sl.health.serving}
    urls = {s: sl.info.url for s, sl in fm.slots.items() if sl.health.serving}
    nemo, slime = NemoRLFleetHealth(actors, urls), SlimeHeartbeat(urls, client)
    tasks = [asyncio.create_task(nemo.run()), asyncio.create_task(slime.run())]
    if kind == "sigkill":
        # NeMo-Gym's requests through NeMo-RL's router: a killed engine fails them at once. Not for the hangs: a
        # hung engine fails none before backend_timeout_s (600 s), and after Belayer fences it (kills it) their
        # failures would be Belayer's detection, not NeMo-RL's.
        tasks.append(asyncio.create_task(nemo.load(asyncio.Event())))
    if router is not None:
        await router.set_workers(client, urls)
        tasks.append(asyncio.create_task(router.run(client)))
    # a random phase of every periodic detector
    await asyncio.sleep(random.uniform(0, max(nemo.cfg.probe_interval_s, SLIME["interval"])))
    if kind != "sigkill":
        await under_load(fm, slot, client)
    pids = {"sigkill": [slot.info.actor_pid], "hang": [slot.info.actor_pid, slot.info.pid],
            "hang_server": [slot.info.pid]}[kind]
    t0 = time.time()
    for p in pids:
        os.kill(p, signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
    det = await fm.events.wait_for(lambda e: e.kind == "detected" and e.subject == sid, wait_s, since=t0)
    arms = {"nemo_rl": nemo.dead, "slime": slime.dead}
    if router is not None:
        arms["router"] = router.dead
    deadline = t0 + wait_s
    while time.time() < deadline and not all(sid in d for d in arms.values()):
        await asyncio.sleep(0.05)  # the baselines are plain loops with no event to await; bounded
    for t in tasks:
        t.cancel()
    out = {"belayer": det.t - t0}
    print(f"    belayer: {det.figures.get('signal')}: {det.reason[:160]}", flush=True)
    signals.append(str(det.figures.get("signal")))
    out.update({k: (d[sid] - t0 if sid in d else None) for k, d in arms.items()})
    if kind == "hang_server" and out["nemo_rl"] is not None and out["nemo_rl"] >= out["belayer"]:
        # Its probe answers from the live actor while the server alone is stopped: it can only have seen the
        # engine gone once Belayer fenced it (killing the actor). Not a detection of its own.
        print(f"    nemo_rl: its probe failed only after Belayer fenced the engine ({out['nemo_rl']:.2f} s): never "
              f"on its own", flush=True)
        out["nemo_rl"] = None
    if kind != "sigkill":
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)  # Belayer fenced it already; make sure nothing stays stopped
            except ProcessLookupError:
                pass
    await fm.wait_all_healthy(300)
    false_alarms.extend(e for e in _progress_alarms(fm, t_start) if e.subject != sid)
    return out


def _progress_alarms(fm: FleetManager, since: float) -> list:
    """Suspicions raised by token progress since `since` (transitions with a progress signal)."""
    return [e for e in fm.events.events if e.t >= since and e.kind == "transition"
            and str(e.figures.get("signal", "")).startswith("progress_") and e.to_state in ("SUSPECT", "DEAD")]


async def under_load(fm: FleetManager, slot: Any, client: httpx.AsyncClient, tokens: int = 64,
                     timeout: float = 60.0) -> None:
    """Waits until the victim streams: requests in flight and `tokens` more generated (a hang *under load*;
    a victim restarted a moment ago may have no request yet). Bounded; the engine offers no event to await."""
    url = f"{slot.info.url}/get_server_info"
    base = (await client.get(url, timeout=5)).json()["belayer_counters"]["generated_tokens"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = (await client.get(url, timeout=5)).json()["belayer_counters"]["generated_tokens"]
        if slot.rids and n - base >= tokens:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{slot.slot_id} did not stream {tokens} tokens within {timeout:g} s")


def fmt(x: Optional[float]) -> str:
    return f"{x:7.2f}" if x is not None else "  never"


async def main_async(args: argparse.Namespace) -> None:
    cfg, _ = load_belayer_config("fleet_demo", ["belayer.use_fault_tolerance=true", "belayer.shadow.num_standby=0",
                                                "belayer.restart.backoff_initial_s=0",
                                                "belayer.restart.max_restarts=100",
                                                "belayer.engines.cpu_step_delay_ms=5"])
    model = resolve_model_path(cfg)
    init_ray(cfg.ray)
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-detection-"))
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=model)
    await fm.start()
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=200))
    router = None if args.no_router else RouterWatch(run_dir)
    if router is not None:
        await router.ready(client)
    stop = asyncio.Event()
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, fm.events, client=client)
    loader = asyncio.create_task(load(fm, gen, stop))
    m = cfg.monitor
    wait_s = 240.0 if router is not None else 60.0
    print(f"{cfg.engines.num_engines} CPU engines under load; Belayer: probe_interval_s={m.probe_interval_s} "
          f"probe_timeout_s={m.probe_timeout_s} failure_threshold={m.failure_threshold} + Ray liveness + token "
          f"progress (floor_s={m.progress.floor_s} gap_multiplier={m.progress.gap_multiplier} "
          f"confirm_timeout_s={m.progress.confirm_timeout_s}, enabled={m.progress.enabled}); NeMo-RL's "
          f"GenerationFleetHealth with FleetHealthConfig's defaults; slime {SLIME}; "
          f"sglang-router 0.3.2 defaults {ROUTER if router else '(skipped)'}; "
          f"{args.trials} trial(s) per fault; a detector silent for {wait_s:.0f} s reads 'never'")
    res: dict[str, dict[str, list[Optional[float]]]] = {}
    by: dict[str, list[str]] = {"sigkill": [], "hang": [], "hang_server": []}
    false_alarms: list = []
    if args.calm_s > 0:  # fault-free load first: every progress suspicion here is a false alarm
        t_calm = time.time()
        await asyncio.sleep(args.calm_s)  # the measurement window itself
        false_alarms.extend(_progress_alarms(fm, t_calm))
        print(f"  calm load {args.calm_s:.0f} s: {len(false_alarms)} progress suspicion(s)", flush=True)
    try:
        for kind in ("sigkill", "hang", "hang_server"):
            res[kind] = {}
            for i in range(args.trials):
                r = await trial(fm, kind, f"engine-{i % cfg.engines.num_engines}", client, router, wait_s, by[kind],
                                false_alarms)
                for k, v in r.items():
                    res[kind].setdefault(k, []).append(v)
                print(f"  {kind:7s} trial {i}: " + "  ".join(f"{k} {fmt(v)} s" for k, v in r.items()), flush=True)
    finally:
        stop.set()
        loader.cancel()
        if router is not None:
            router.stop()
        await client.aclose()
        await gen.aclose()
        await fm.shutdown()

    def med(xs: list[Optional[float]]) -> Optional[float]:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    figures, ratios = [], {}
    for kind, arms in res.items():
        meds = {k: med(v) for k, v in arms.items()}
        def spread(xs: list[Optional[float]]) -> str:
            xs = [x for x in xs if x is not None]
            return f"{min(xs):.2f}..{max(xs):.2f}" if xs else "-"

        print(f"{kind:7s} medians: " + "  ".join(f"{k} {fmt(v)} s ({spread(arms[k])}, {sum(x is None for x in arms[k])} never)"
                                                  for k, v in meds.items()))
        tag = {"sigkill": "kill", "hang": "hang", "hang_server": "server_hang"}[kind]
        for k, v in meds.items():
            figures.append(f"{k}_{tag}_s={v:.3f}" if v is not None else f"{k}_{tag}_s=never")
        b, n = meds["belayer"], meds["nemo_rl"]
        ratios[kind] = (n / b) if (b and n) else float("nan")
    hb = med(res["hang"]["belayer"])
    hang_by = ",".join(sorted(set(by["hang"]))) or "-"
    print(f"RESULT ratio={ratios['sigkill']:.1f} hang_ratio={ratios['hang']:.2f} "
          f"server_hang_ratio={ratios['hang_server']:.2f} "
          f"belayer_hang_p50_s={'never' if hb is None else f'{hb:.3f}'} hang_by={hang_by} "
          f"false_alarms={len(false_alarms)} calm_s={args.calm_s:.0f} " + " ".join(figures) + f" trials={args.trials}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one trial per fault")
    ap.add_argument("--trials", type=int, default=0, help="trials per fault (default 5)")
    ap.add_argument("--no-router", action="store_true", help="skip the sglang-router arm (~3 min per trial)")
    ap.add_argument("--calm-s", type=float, default=-1,
                    help="fault-free load before the trials, counting false hang alarms (default 300; --quick 30)")
    args = ap.parse_args()
    if args.calm_s < 0:
        args.calm_s = 30.0 if args.quick else 300.0
    args.trials = args.trials or (1 if args.quick else 5)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
