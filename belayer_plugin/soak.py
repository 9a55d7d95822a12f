"""Randomized fail-stop soak campaigns (`belayer soak envs|engines|all`), each compared with its fault-free run.

envs: scripted trajectories in real sandboxes (Podman and/or Docker) with containers killed at random
moments (during actions, checkpoints and restores) and published checkpoints corrupted (bit flips or
truncation); every trial must end with the fault-free final file system, in-memory counter and LLM context,
never restore a corrupt checkpoint and leave nothing running (belayer_plugin.sandbox.scripted.run_trial). A trial
counts only with a kill delivered, and with CRIU working some recovery must come from a CRIU restore
(scripted.campaign_violations): a rebuild from the image with replay reaches the same state.

engines: a fleet of CPU engines with a standby behind the front, under concurrent load (streaming and plain,
greedy and sampled); each round's requests are first run fault-free (the golden ids), then again while one
engine is SIGKILLed, SIGSTOPped (hang) or loses its Ray actor, at a random token position of a random request
or between requests, while the fleet is paused with memory released (the requests go out as soon as it
resumes, not once the victim is replaced), or during a refit to weights whose ids differ (requests sent while
it runs and after it; their golden ids computed on the fault-free fleet first). Every request must complete
with the golden ids of its weights (0 lost, 0 inconsistent), and every engine that served the round (survivors,
a promoted standby, an engine that came up in it) must have generated exactly the tokens the requests committed
on it (0 regenerated).

Writes soak.json (the figures and every violation) and soak.png; prints a live progress bar.

Owns: soak campaigns and their comparison with fault-free runs. Must not: be imported by library code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

ENGINE_FAULTS = ("server_kill", "hang", "actor_kill")
ENGINE_PHASES = ("token", "idle", "paused", "refit")


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="trial", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


# ------------------------------------------------------------------------------------------ sandboxes
ENV_ATTEMPTS_PER_TRIAL = 2  # seeds tried per trial asked for: a trial counts only with a kill delivered


def run_env_campaign(trials: int, seed: int = 0, duration_s: float = 0.0, backend: str = "both",
                     n_actions: int = 5, mode: str = "full", corrupt_prob: float = 0.2,
                     progress: bool = True, cache_dir: Optional[str] = None) -> dict:
    """Runs sandbox trials until `trials` of them had a kill delivered (at most ENV_ATTEMPTS_PER_TRIAL x
    `trials` seeds; or until `duration_s` passes, when > 0); returns the summary. Fewer delivered trials than
    asked, or no CRIU restore where one was possible, fail the campaign (scripted.campaign_violations)."""
    from belayer_plugin.envs.build import ensure_image
    from belayer_plugin.sandbox.criu import criu_problem
    from belayer_plugin.sandbox.scripted import RECOVERY_KINDS, campaign_violations, run_trial

    backends: list[Any] = []
    daemon = None
    if backend in ("podman", "both"):
        from belayer_plugin.sandbox.podman import PodmanBackend

        backends.append(PodmanBackend())
    if backend in ("docker", "both"):
        from belayer_plugin.sandbox.docker_backend import DockerBackend, DockerDaemon

        daemon = DockerDaemon().start()
        backends.append(DockerBackend(daemon.url))
    work = Path(tempfile.mkdtemp(prefix="belayer-soak-envs-"))
    stats: Counter = Counter()
    by_backend: Counter = Counter()
    failures: list[dict] = []
    durations: list[float] = []
    results: list[Any] = []
    t0 = time.monotonic()
    bar = _bar(trials, "envs", progress)
    done = 0
    timed_out = False
    try:
        images = {b.name: ensure_image(b, "busybox", Path(cache_dir) / "envs" if cache_dir else None) for b in backends}
        for i in range(trials * ENV_ATTEMPTS_PER_TRIAL):
            if done >= trials:
                break
            if duration_s and time.monotonic() - t0 > duration_s:
                timed_out = True
                break
            be = backends[i % len(backends)]
            s = seed + i
            d = work / str(s)
            delivered = True
            try:
                r = run_trial(be, images[be.name], s, d, n_actions=n_actions, mode=mode, corrupt_prob=corrupt_prob)
                results.append(r)
                v = r.violations
                delivered = r.delivered
                durations.append(r.duration_s)
                stats["recoveries"] += r.recoveries
                stats["kills_planned"] += r.faults_planned
                stats["kills_delivered"] += r.faults_fired
                stats["kills_missed"] += r.missed
                for ph in r.fired_phases:
                    stats[f"killed_during_{ph}"] += 1
                stats["corrupted"] += int(r.corrupted is not None)
                stats["corrupt_detected"] += int(any(e.get("kind") == "checkpoint_corrupt" for e in r.events))
                stats["restore_failures"] += sum(1 for e in r.events if e.get("kind") == "restore_failed")
                stats["checkpoint_failures"] += sum(1 for e in r.events if e.get("kind") == "checkpoint_failed")
                for k in RECOVERY_KINDS:  # which checkpoint each recovery came from
                    stats[f"recovered_by_{k}"] += r.recovered_by.get(k, 0)
                stats["recoveries_after_criu_checkpoint"] += r.criu_restorable
                stats["rebuilt_from_image"] = stats["recovered_by_rebuild_replay"]
            except Exception as e:  # a crash of the harness is a violation too
                v = [f"trial raised {type(e).__name__}: {e}"]
            shutil.rmtree(d, ignore_errors=True)
            if not delivered:  # it tested no recovery: not a trial, but counted and reported
                stats["undelivered_trials"] += 1
                if not v:
                    continue
            done += 1
            by_backend[be.name] += 1
            if v:
                failures.append({"backend": be.name, "seed": s, "violations": v})
            bar.update(1)
            bar.set_postfix(violations=sum(len(f["violations"]) for f in failures),
                            delivered=stats["kills_delivered"], refresh=False)
    finally:
        bar.close()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    criu_available = criu_problem("") is None
    campaign = campaign_violations(results, criu_available, mode, None if timed_out else trials)
    if campaign:
        failures.append({"backend": backend, "seed": None, "violations": campaign})
    return {"campaign": "envs", "trials": done, "seed": seed, "backends": dict(by_backend), "actions": n_actions,
            "mode": mode, "criu_available": criu_available,
            "violations": sum(len(f["violations"]) for f in failures),
            "inconsistent_trials": sum(1 for f in failures if f["seed"] is not None), "failures": failures[:50],
            "stats": dict(stats),
            "trial_s": {"mean": round(sum(durations) / len(durations), 3) if durations else None,
                        "max": round(max(durations), 3) if durations else None},
            "duration_s": round(time.monotonic() - t0, 1)}


# ------------------------------------------------------------------------------------------ engines
PROMPT_POOL = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400], [7, 8, 9, 10, 11, 12],
               [300, 301, 5], [11, 22, 33, 44, 55, 66, 77], [400, 12, 401], [9, 90, 190, 290]]


def _request(rng: random.Random, i: int, tokens: int) -> dict:
    sampled = rng.random() < 0.5
    sp: dict[str, Any] = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.8 if sampled else 0.0}
    if sampled:
        sp["sampling_seed"] = rng.randrange(1 << 30)
    return {"input_ids": rng.choice(PROMPT_POOL), "sampling_params": sp, "stream": rng.random() < 0.5,
            "rid": f"q{i}"}


async def _send(client: Any, url: str, req: dict, timeout: float) -> dict:
    from belayer_plugin.generation.sglang_http import generate, generate_stream

    body = {k: v for k, v in req.items() if k != "stream"}
    if not req["stream"]:
        return await generate(client, url, body, timeout)
    last = None
    async for chunk in generate_stream(client, url, body, timeout, read_timeout=timeout):
        last = chunk
    if last is None or "error" in last:
        raise RuntimeError(f"stream of {req['rid']} ended with {last}")
    return last


async def _counters(client: Any, fm: Any) -> dict[str, Optional[int]]:
    """Each serving engine's and ready standby's own count of generated tokens (/get_server_info), by URL:
    a standby promoted in the round is then judged from its value before it, not from nothing. None for an
    engine that answered without counters (real SGLang keeps none); absent when it did not answer."""
    from belayer_plugin.generation.sglang_http import get_json

    urls = [s.info.url for s in fm.serving_slots()]
    if fm.shadows is not None:
        urls += [sh.info.url for sh in fm.shadows.ready]
    out = {}
    for url in urls:
        try:
            info = await get_json(client, url, "/get_server_info", 5)
            out[url] = info["belayer_counters"].get("generated_tokens", 0) if "belayer_counters" in info else None
        except Exception:
            pass  # dying: not a survivor
    return out


def regenerated(base: dict[str, Optional[int]], after: dict[str, Optional[int]], committed: dict[str, int],
                victim_url: Optional[str]) -> list[tuple[str, Optional[int], int]]:
    """(url, generated in the round, committed there) of every engine that served the round and generated
    other than the tokens the requests committed on it: the survivors, a promoted standby (from its count
    before the round) and an engine that came up in the round (from 0: a restart, a standby built meanwhile).
    The victim is left out: it died with tokens no request committed. An engine other than the victim on which
    requests committed tokens but whose counter could not be read is one too, with None generated: unchecked
    is not clean. An engine that keeps no counters (None: real SGLang) cannot be judged and is skipped; the
    campaign then reports regenerated tokens as not counted."""
    out: list[tuple[str, Optional[int], int]] = []
    for url, n in after.items():
        if url == victim_url or n is None:
            continue
        made = n - (base.get(url) or 0)
        if made != committed.get(url, 0):
            out.append((url, made, committed.get(url, 0)))
    out += [(url, None, n) for url, n in committed.items() if n and url not in after and url != victim_url]
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def _engine_campaign(cfg: Any, run_dir: Path, faults: int, seed: int, duration_s: float, concurrency: int,
                           tokens: int, progress: bool, phases: tuple[str, ...] = ENGINE_PHASES,
                           in_turn: bool = False) -> dict:
    import httpx

    from belayer_plugin.engines.tiny_model import perturbed_copy
    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager
    from belayer_plugin.generation.front import GenerationFront
    from belayer_plugin.generation.resume_policy import segment_seed
    from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
    from belayer_plugin.ray_cluster import init_ray

    init_ray(cfg.ray)
    events = EventLog(run_dir / "events.jsonl")
    fm = FleetManager(cfg, run_dir, events)
    await fm.start()
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, events)
    front = GenerationFront(gen, fm.model_path, info_url=lambda: fm.pick_engine().info.url)
    await front.start()
    rng = random.Random(seed)
    stats: Counter = Counter()
    failures: list[dict] = []
    recover_s: list[float] = []
    t0 = time.monotonic()
    bar = _bar(faults, "engines", progress)
    n_req = 0
    timeout = cfg.recovery.request_timeout_s
    model = fm.model_path
    cur_path = model  # the weights the fleet serves: refit rounds move it to a perturbed copy
    wdir = run_dir / "weights"
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
            for r in range(faults):
                if duration_s and time.monotonic() - t0 > duration_s:
                    break
                kind = ENGINE_FAULTS[r % len(ENGINE_FAULTS)]  # every kind, in turn
                phase = phases[r % len(phases)] if in_turn else rng.choice(phases)
                reqs = [_request(rng, n_req + i, tokens) for i in range(concurrency)]
                n_req += len(reqs)
                golden = await asyncio.gather(*(_send(client, front.url, q, timeout) for q in reqs))
                victim_req, at = rng.randrange(len(reqs)), rng.randint(1, tokens - 1)
                fired: dict = {}
                bad: list[str] = []
                golden_new: Optional[list] = None
                if phase == "refit":
                    # Weights whose ids differ, their golden ids computed on the fault-free fleet, which then
                    # goes back to the current weights: the faulty refit below must show the new ids.
                    new_path = perturbed_copy(model, wdir / f"r{r}", seed=seed * 100_003 + r)
                    await fm.refit(new_path, f"soak-r{r}-golden")
                    golden_new = await asyncio.gather(*(_send(client, front.url, q, timeout) for q in reqs))
                    await fm.refit(cur_path, f"soak-r{r}-back")
                    if all(a["output_ids"] == b["output_ids"] for a, b in zip(golden, golden_new)):
                        bad.append(f"round {r}'s new weights give the same ids as the current ones")
                    else:
                        stats["refits_to_distinct_weights"] += 1

                def fire(slot_id: str, why: str) -> None:
                    slot = fm.slots[slot_id]
                    pid = slot.info.actor_pid if kind == "actor_kill" else slot.info.pid
                    sig = signal.SIGSTOP if kind == "hang" else signal.SIGKILL
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        return
                    fired.update(slot=slot_id, url=slot.info.url, pid=pid, t=time.time(), why=why,
                                 mono=time.monotonic())
                    if kind == "hang":  # never leave it stopped: the fleet fences it with SIGKILL anyway
                        fired["stopped_pid"] = pid

                def at_token(clog: Any, seg: Any) -> None:
                    if not fired and clog.rid == reqs[victim_req]["rid"] and clog.committed >= at:
                        fire(seg.engine, f"token {clog.committed} of {clog.rid}")

                sent_at: list[float] = []

                def send_all() -> Any:
                    sent_at.append(time.time())
                    return asyncio.gather(*(_send(client, front.url, q, timeout) for q in reqs),
                                          return_exceptions=True)

                base = await _counters(client, fm)
                victim_slot = rng.choice(sorted(s.slot_id for s in fm.serving_slots()))
                during: list = []  # refit: the requests sent while the refit with the fault ran
                if phase == "idle":
                    fire(victim_slot, "between requests")
                elif phase == "paused":  # the trainer's phase: engines paused with memory released
                    await fm.pause(release_memory=True)
                    fire(victim_slot, "while paused, memory released")
                    # Not waiting for recover_dead: the requests go out at once and meet the slot recovering
                    # (held, or served by the others).
                    await fm.resume()
                elif phase == "refit":  # mid-refit, to the weights whose golden ids were computed above
                    t_mark = time.time()
                    refit = asyncio.create_task(fm.refit(new_path, f"soak-r{r}"))
                    await events.wait_for(lambda e: e.kind == "refit_begin", timeout=60, since=t_mark)
                    fire(victim_slot, "during a refit")
                    during = await send_all()
                    try:
                        await refit
                    except Exception as e:  # noqa: BLE001  (a failed refit is a violation, never hidden)
                        bad.append(f"the refit with the fault failed: {type(e).__name__}: {e}"[:300])
                    cur_path = new_path
                else:
                    gen.observers.append(at_token)
                try:
                    outs = await send_all()
                finally:
                    if at_token in gen.observers:
                        gen.observers.remove(at_token)
                after = await _counters(client, fm)
                if not fired:
                    stats["faults_missed"] += 1
                    bad.append(f"the {kind} at {phase} was never delivered (request ended before token {at}?)")
                else:
                    stats["faults_delivered"] += 1
                    stats[f"{kind}@{phase}"] += 1
                per_url: Counter = Counter()
                straddled: list[tuple[dict, list[int], int]] = []

                def tally(q: dict, o: Any, want: list[list[int]]) -> Optional[list[int]]:
                    """Counts one answer; returns its ids when they equal none of `want` (checked by the caller)."""
                    stats["requests"] += 1
                    stats["streaming" if q["stream"] else "plain"] += 1
                    stats["sampled" if q["sampling_params"]["temperature"] > 0 else "greedy"] += 1
                    if isinstance(o, BaseException):
                        stats["lost"] += 1
                        bad.append(f"{q['rid']} lost: {type(o).__name__}: {str(o)[:200]}")
                        return None
                    stats["completed"] += 1
                    segs = o["meta_info"]["belayer"]["segments"]
                    stats["resumed"] += max(0, len(segs) - 1)
                    for sg in segs:
                        per_url[sg["url"]] += sg["end"] - sg["start"]
                    if o["meta_info"]["id"] != q["rid"]:
                        stats["inconsistent"] += 1
                        bad.append(f"{q['rid']} answered as {o['meta_info']['id']}")
                        return None
                    return None if o["output_ids"] in want else o["output_ids"]

                for q, g, gn, d in zip(reqs, golden, golden_new or golden, during or [None] * len(reqs)):
                    if d is not None:  # sent mid-refit: the old weights', the new ones', or old then new
                        ids = tally(q, d, [g["output_ids"], gn["output_ids"]])
                        if ids is not None:
                            straddled.append((q, ids, _lcp(ids, g["output_ids"])))
                for q, g, gn, o in zip(reqs, golden, golden_new or golden, outs):
                    if golden_new is not None and not isinstance(o, BaseException):
                        stats["checked_at_new_weights"] += 1
                    if tally(q, o, [gn["output_ids"]]) is not None:  # after a refit: the new version's ids
                        stats["inconsistent"] += 1
                        bad.append(f"{q['rid']} differs from its fault-free run"
                                   + (" at the new weights" if golden_new is not None else ""))
                stats["engines_counted_new"] += sum(1 for u in after if u not in base)
                stats["engines_without_counters"] += sum(1 for n in after.values() if n is None)
                for url, made, committed in regenerated(base, after, per_url, fired.get("url")):
                    if made is None:
                        stats["unread_counters"] += 1
                        bad.append(f"{url} served the round ({committed} tokens committed) but its counters "
                                   f"could not be read")
                        continue
                    stats["regenerated_tokens"] += abs(made - committed)
                    bad.append(f"{url} generated {made} tokens in the round, requests committed {committed}")
                # A request that met the refit: its first k ids are the old weights' golden ids, the rest what
                # the new weights continue from them (asked of the fleet, now at the new weights only).
                for q, ids, k in straddled:
                    sp = dict(q["sampling_params"], max_new_tokens=len(ids) - k)
                    if "sampling_seed" in sp:
                        sp["sampling_seed"] = segment_seed(sp["sampling_seed"], k, gen.seed_per_position)
                    cont = {"input_ids": q["input_ids"] + ids[:k], "sampling_params": sp, "stream": False,
                            "rid": f"{q['rid']}-cont"}
                    try:
                        rest = (await _send(client, front.url, cont, timeout))["output_ids"]
                    except Exception as e:  # noqa: BLE001
                        rest = [f"{type(e).__name__}"]
                    if k == 0 or rest != ids[k:]:
                        stats["inconsistent"] += 1
                        bad.append(f"{q['rid']} (sent mid-refit) equals neither version's ids nor old-then-new "
                                   f"(first {k} ids the old version's)")
                    else:
                        stats["straddled_refit"] += 1
                if fired:
                    # the round ends when the victim's slot serves again and the standby pool is refilled
                    n_rec = len(recover_s)
                    why = await _full_strength(fm, cfg, events, fired["slot"], fired["t"], recover_s)
                    if why:
                        bad.append(why)
                    elif len(recover_s) > n_rec and min(sent_at) < fired["t"] + recover_s[-1]:
                        # the requests went out before the victim's slot was replaced: they met the recovery
                        stats[f"met_recovery@{phase}"] += 1
                if bad:
                    failures.append({"round": r, "fault": kind, "phase": phase, "at": at, "violations": bad})
                bar.update(1)
                bar.set_postfix(lost=stats["lost"], inconsistent=stats["inconsistent"],
                                regenerated=stats["regenerated_tokens"], refresh=False)
    finally:
        bar.close()
        await front.stop()
        await gen.aclose()
        await fm.shutdown()
    return {"campaign": "engines", "faults": stats["faults_delivered"], "rounds": len(recover_s) + stats["faults_missed"],
            "seed": seed, "concurrency": concurrency, "tokens_per_request": tokens,
            "requests": stats["requests"], "completed": stats["completed"], "lost": stats["lost"],
            "inconsistent": stats["inconsistent"],
            # None: some engine keeps no counters (real SGLang), so the figure would claim what was not counted
            "regenerated_tokens": None if stats["engines_without_counters"] else stats["regenerated_tokens"],
            "violations": sum(len(f["violations"]) for f in failures), "failures": failures[:50],
            "stats": dict(stats), "replaced_after_s": _dist(recover_s),
            "duration_s": round(time.monotonic() - t0, 1)}


async def _full_strength(fm: Any, cfg: Any, events: Any, slot: str, since: float, recover_s: list) -> str:
    """Awaits the victim's replacement (a handover or a restart) and, with standbys, a refilled pool; bounded.
    Returns a violation, or "" when the fleet is back to full strength."""
    budget = cfg.engines.startup_timeout_s + 60
    try:
        ev = await events.wait_for(lambda e: e.subject == slot and e.kind in ("handover", "restarted"),
                                   timeout=budget, since=since)
    except TimeoutError:
        return f"{slot} was not replaced within {budget:g} s"
    recover_s.append(round(ev.t - since, 3))
    if fm.shadows is not None and ev.kind == "handover":
        try:
            await events.wait_for(lambda e: e.component == "shadow" and e.kind == "shadow_ready",
                                  timeout=budget, since=ev.t)
        except TimeoutError:
            return f"the standby pool was not refilled within {budget:g} s after {slot}'s handover"
    return ""


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "median": s[len(s) // 2], "p95": s[min(len(s) - 1, int(0.95 * len(s)))], "max": s[-1]}


def run_engine_campaign(faults: int, seed: int = 0, duration_s: float = 0.0, concurrency: int = 6, tokens: int = 48,
                        overrides: Optional[list[str]] = None, progress: bool = True,
                        run_dir: Optional[Path] = None, phases: tuple[str, ...] = ENGINE_PHASES,
                        in_turn: bool = False) -> dict:
    """Runs up to `faults` engine fault rounds under load (or until `duration_s` passes), each in a phase drawn
    from `phases` (in turn with `in_turn`, else at random); fault kinds go in turn. Returns the summary."""
    bad = [p for p in phases if p not in ENGINE_PHASES]
    if bad or not phases:
        raise ValueError(f"phases must be among {ENGINE_PHASES}, got {list(phases)}")
    from belayer_plugin.config import load_belayer_config

    cfg, _ = load_belayer_config("demo", ["belayer.chaos.enabled=false", "belayer.monitor.probe_interval_s=0.2",
                                          "belayer.monitor.probe_timeout_s=1", "belayer.monitor.boot_grace_s=0",
                                          "belayer.recovery.stall_timeout_s=2", "belayer.engines.cpu_step_delay_ms=5",
                                          # the campaign kills the same slots again and again on purpose: the
                                          # restart budget and the repeat-fault window have their own tests
                                          "belayer.restart.max_restarts=1000000", "belayer.shadow.fault_window_s=0.001",
                                          *(overrides or [])])
    rd = run_dir or Path(tempfile.mkdtemp(prefix="belayer-soak-engines-"))
    rd.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_engine_campaign(cfg, rd, faults, seed, duration_s, concurrency, tokens, progress,
                                        tuple(phases), in_turn))


# ------------------------------------------------------------------------------------------ burst
BURST_FAULTS = ("server SIGKILL", "server SIGKILL (same slot)", "server SIGSTOP (hang)", "actor SIGKILL",
                "standby SIGKILL")
# A standby per slot and a repeat-fault window wider than the burst; unlike the engine campaign, the restart
# budget and the window stay as in production: the burst is what they must withstand.
BURST_OVERRIDES = ["belayer.use_fault_tolerance=true", "belayer.chaos.enabled=false", "belayer.engines.num_engines=2",
                   "belayer.shadow.num_standby=2", "belayer.shadow.fault_window_s=600",
                   "belayer.restart.backoff_initial_s=0.2", "belayer.restart.backoff_max_s=1",
                   "belayer.monitor.probe_interval_s=0.2", "belayer.monitor.probe_timeout_s=0.5",
                   "belayer.monitor.failure_threshold=2", "belayer.monitor.boot_grace_s=60",
                   "belayer.monitor.liveness_timeout_s=1", "belayer.recovery.stall_timeout_s=10",
                   "belayer.engines.cpu_step_delay_ms=2"]
# Real SGLang on CPU: /health_generate takes >= 1 s, starts take 15-130 s on two loaded cores.
BURST_SGLANG = ["belayer.monitor.probe_interval_s=1", "belayer.monitor.probe_timeout_s=5",
                "belayer.engines.startup_timeout_s=400", "belayer.recovery.stall_timeout_s=60",
                "belayer.router.membership_timeout_s=10"]


def _ev(kind: str, subject: Optional[str] = None) -> Any:
    return lambda e: e.kind == kind and (subject is None or e.subject == subject)


async def _ready_standby(fm: Any, timeout: float) -> Any:
    """A ready standby of the pool, awaited up to `timeout` s (its next shadow_ready); None without one."""
    if fm.shadows is None:
        return None
    deadline = time.monotonic() + timeout
    while not fm.shadows.ready:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        t = time.time()
        if fm.shadows.ready:
            break
        try:
            await fm.events.wait_for(_ev("shadow_ready"), left, since=t)
        except TimeoutError:
            return None
    return fm.shadows.ready[0]


async def burst_round(fm: Any, gen: Any, prompts: list[list[int]], tokens: int, concurrency: int,
                      golden: list[list[int]]) -> dict:
    """One burst of mixed faults on a running fleet with a standby per slot, under `concurrency` clients
    streaming greedy requests: a server SIGKILL of engine-0, again once its slot serves (same slot, inside
    the window), a hang (SIGSTOP) of engine-1 once engine-0 serves again, an actor SIGKILL of engine-1, and a
    SIGKILL of a ready standby (awaited, bounded; a fault not fired is a violation); each fired while the
    victim serves requests. Returns the figures and every
    violation (lost or changed requests, fleet or pool not back to full strength, a node excluded)."""
    events, cfg = fm.events, fm.cfg
    grace = cfg.engines.startup_timeout_s + 60
    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    busy = {sid: asyncio.Event() for sid in fm.slots}

    def progress(clog: Any, seg: Any) -> None:
        if clog.committed - seg.start >= min(10, tokens // 4) and seg.engine in busy:
            busy[seg.engine].set()

    gen.observers.append(progress)
    done = asyncio.Event()
    results: list[tuple[int, list[int]]] = []
    lost: list[str] = []
    lost_above_floor: list[str] = []  # lost while the fleet was not below its floor: never allowed
    faults: list[dict] = []
    skipped: list[str] = []  # faults of the sequence that could not be fired: violations
    t0 = time.time()
    floor = max(1, cfg.restart.min_healthy_engines)

    def above_floor() -> bool:
        """Whether the fleet is at or above restart.min_healthy_engines (its usable slots: not RETIRED, as the
        policy's floor check counts them; a slot restarting comes back) and the run has not failed on it."""
        return fm.fatal is None and sum(1 for st in fm.states().values() if st != "RETIRED") >= floor

    async def worker(i: int) -> None:
        n = 0
        while not done.is_set() or n == 0:
            k = (i + n) % len(prompts)
            try:
                _, resp = await gen.generate(f"burst-w{i}-{n}", prompts[k], sp)
                results.append((k, resp["output_ids"]))
            except Exception as e:  # a lost request: counted, never hidden
                lost.append(f"burst-w{i}-{n}: {type(e).__name__}: {str(e)[:200]}")
                if above_floor():
                    lost_above_floor.append(lost[-1])
            n += 1

    async def fire(kind: str, slot: str, pid: int, sig: int, group: bool = True) -> float:
        busy[slot].clear()
        await asyncio.wait_for(busy[slot].wait(), grace)  # strike while it serves requests
        t = time.time()
        (os.killpg if group else os.kill)(pid, sig)
        faults.append({"kind": kind, "slot": slot, "t": t})
        return t

    async def chaos() -> None:
        try:
            t = await fire(BURST_FAULTS[0], "engine-0", fm.slots["engine-0"].info.pid, signal.SIGKILL)
            await events.wait_for(_ev("registered", "engine-0"), grace, since=t)
            t = await fire(BURST_FAULTS[1], "engine-0", fm.slots["engine-0"].info.pid, signal.SIGKILL)
            # Across slots only once engine-0 serves again: with both slots down at once, requests would
            # wait for a cold restart, not for the fleet's policy.
            await events.wait_for(_ev("registered", "engine-0"), grace, since=t)
            hung = fm.slots["engine-1"].info.pid
            t = await fire(BURST_FAULTS[2], "engine-1", hung, signal.SIGSTOP)
            await events.wait_for(_ev("detected", "engine-1"), 60, since=t)
            await events.wait_for(_ev("registered", "engine-1"), grace, since=t)
            try:
                os.killpg(hung, signal.SIGCONT)  # fenced already: nothing left to resume
            except ProcessLookupError:
                pass
            t = await fire(BURST_FAULTS[3], "engine-1", fm.slots["engine-1"].info.actor_pid, signal.SIGKILL,
                           group=False)
            await events.wait_for(_ev("detected", "engine-1"), 60, since=t)
            # The standby kill waits (bounded) for a ready standby: skipping it would pass a burst of four.
            sh = await _ready_standby(fm, grace)
            if sh is None:
                skipped.append(f"the {BURST_FAULTS[4]} was not fired: no standby was ready within {grace:g} s "
                               f"of the actor kill")
            else:
                faults.append({"kind": BURST_FAULTS[4], "slot": sh.sid, "t": time.time()})
                os.killpg(sh.info.pid, signal.SIGKILL)
        finally:
            done.set()

    try:
        outs = await asyncio.gather(chaos(), *(worker(i) for i in range(concurrency)), return_exceptions=True)
    finally:
        gen.observers.remove(progress)
    bad = list(lost) + skipped
    if lost_above_floor:
        bad.append(f"{len(lost_above_floor)} request(s) lost while the fleet was above its floor "
                   f"(restart.min_healthy_engines={cfg.restart.min_healthy_engines})")
    if isinstance(outs[0], BaseException):
        bad.append(f"the burst stopped after {len(faults)} fault(s): {type(outs[0]).__name__}: {outs[0]}"[:400])
    bad += [f"a client failed: {o!r}"[:300] for o in outs[1:] if isinstance(o, BaseException)]
    burst_s = faults[-1]["t"] - faults[0]["t"] if faults else 0.0
    if burst_s >= cfg.shadow.fault_window_s:
        bad.append(f"the burst took {burst_s:.0f} s, not inside shadow.fault_window_s={cfg.shadow.fault_window_s:g}")
    inconsistent = sum(1 for k, ids in results if ids != golden[k])
    if inconsistent:
        bad.append(f"{inconsistent} request(s) differ from the fault-free run")
    t_full = standbys_s = None
    try:
        await fm.wait_all_healthy(grace)
        t_full = time.time()
        deadline = time.monotonic() + grace
        while fm.shadows is not None and len(fm.shadows.ready) < cfg.shadow.num_standby:
            t = time.time()
            if time.monotonic() >= deadline:
                bad.append(f"standbys not replaced: {len(fm.shadows.ready)} of {cfg.shadow.num_standby} ready")
                break
            try:
                await events.wait_for(_ev("shadow_ready"), max(1.0, deadline - time.monotonic()), since=t)
            except TimeoutError:
                pass
        standbys_s = round(time.time() - faults[-1]["t"], 1) if faults else None
    except Exception as e:  # below the floor (FleetBelowFloorError) or not back in time
        bad.append(f"fleet not back to full strength: {type(e).__name__}: {e}"[:400])
    if any(st != "HEALTHY" for st in fm.states().values()):
        bad.append(f"slots not HEALTHY after the burst: {fm.states()}")
    if fm.excluded_nodes:
        bad.append(f"node(s) excluded on one slot's deaths: {fm.exclusions()}")
    if events.find(lambda e: e.kind == "shadow_budget_spent" and e.t >= t0):
        bad.append("the standby pool spent its budget")
    dets = []
    for f in faults:
        if f["slot"].startswith("engine"):
            d = events.find(lambda e, f=f: e.kind == "detected" and e.subject == f["slot"] and e.t >= f["t"])
            dets.append(round(d[0].t - f["t"], 3) if d else None)
    hos = [e.figures.get("took_s") for e in events.find(lambda e: e.kind == "handover" and e.t >= t0)]
    return {"faults": [f["kind"] for f in faults], "burst_s": round(burst_s, 1), "requests": len(results) + len(lost),
            "completed": len(results), "lost": len(lost), "lost_above_floor": len(lost_above_floor),
            "inconsistent": inconsistent, "resumed": len(events.find(lambda e: e.kind == "resumed" and e.t >= t0)),
            "detection_s": dets, "handovers": len(hos), "handover_s": hos,
            "cold_restarts": len(events.find(lambda e: e.kind == "restarted" and e.t >= t0)),
            "backoffs": len(events.find(lambda e: e.kind == "backoff" and e.t >= t0)),
            "retired": len(events.find(lambda e: e.kind == "transition" and e.to_state == "RETIRED" and e.t >= t0)),
            "exclusion_refusals": len(events.find(lambda e: e.kind == "node_exclusion_refused" and e.t >= t0)),
            "full_strength_after_s": None if t_full is None or not faults else round(t_full - faults[-1]["t"], 1),
            "standbys_ready_after_s": standbys_s, "violations": bad}


async def _burst_campaign(cfg: Any, run_dir: Path, bursts: int, concurrency: int, tokens: int,
                          progress: bool) -> dict:
    import httpx

    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager
    from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
    from belayer_plugin.generation.sglang_http import generate
    from belayer_plugin.ray_cluster import init_ray

    init_ray(cfg.ray)
    events = EventLog(run_dir / "events.jsonl")
    fm = FleetManager(cfg, run_dir, events)
    t0 = time.monotonic()
    t_start = time.monotonic()
    await fm.start()
    start_s = round(time.monotonic() - t_start, 1)
    rounds: list[dict] = []
    bar = _bar(bursts, "bursts", progress)
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, events)
    try:
        sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        async with httpx.AsyncClient() as c:  # the fault-free ids, one request at a time
            golden = [(await generate(c, fm.slots["engine-1"].info.url, {"input_ids": p, "sampling_params": sp},
                                      cfg.recovery.request_timeout_s))["output_ids"] for p in PROMPT_POOL]
        for _ in range(bursts):
            rounds.append(await burst_round(fm, gen, PROMPT_POOL, tokens, concurrency, golden))
            bar.update(1)
    finally:
        bar.close()
        await gen.aclose()
        await fm.shutdown()
    failures = [{"round": i, "fault": "burst", "phase": "burst", "at": None, "violations": r["violations"]}
                for i, r in enumerate(rounds) if r["violations"]]
    stats: Counter = Counter()
    for r in rounds:
        for k in r["faults"]:
            stats[f"{k}@burst"] += 1
        stats["resumed"] += r["resumed"]
    return {"campaign": "engines", "burst": True, "engine_kind": cfg.engines.kind, "bursts": len(rounds),
            "faults": sum(len(r["faults"]) for r in rounds), "requests": sum(r["requests"] for r in rounds),
            "completed": sum(r["completed"] for r in rounds), "lost": sum(r["lost"] for r in rounds),
            "lost_above_floor": sum(r["lost_above_floor"] for r in rounds),
            "inconsistent": sum(r["inconsistent"] for r in rounds), "regenerated_tokens": None,  # not counted here
            "violations": sum(len(r["violations"]) for r in rounds), "failures": failures, "stats": dict(stats),
            "rounds": rounds, "fleet_start_s": start_s, "duration_s": round(time.monotonic() - t0, 1)}


def run_burst_campaign(bursts: int = 1, concurrency: int = 4, tokens: int = 160,
                       overrides: Optional[list[str]] = None, progress: bool = True,
                       run_dir: Optional[Path] = None) -> dict:
    """Runs `bursts` bursts of mixed faults (BURST_FAULTS) on 2 slots with 2 standbys; returns the summary.
    `belayer.engines.kind=sglang` among the overrides runs them on real SGLang."""
    from belayer_plugin.config import load_belayer_config

    ov = list(overrides or [])
    sglang = "belayer.engines.kind=sglang" in ov
    cfg, _ = load_belayer_config("demo", [*BURST_OVERRIDES, *(BURST_SGLANG if sglang else []), *ov])
    rd = run_dir or Path(tempfile.mkdtemp(prefix="belayer-soak-burst-"))
    rd.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_burst_campaign(cfg, rd, bursts, concurrency, tokens, progress))


# ------------------------------------------------------------------------------------------ output
def summary_png(summary: dict, path: Path) -> None:
    """One panel per campaign: what was hit, and the outcome figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    camps = [c for c in ("envs", "engines") if c in summary]
    fig, axes = plt.subplots(1, len(camps), figsize=(6.5 * len(camps), 4.2), squeeze=False)
    for ax, c in zip(axes[0], camps):
        s = summary[c]
        st = s.get("stats", {})
        if c == "envs":
            keys = [k for k in sorted(st) if k.startswith("killed_during_")] + [
                "corrupted", "corrupt_detected", "recoveries", "recovered_by_criu_full", "recovered_by_fs_only",
                "recovered_by_rebuild_replay", "undelivered_trials"]
            title = f"sandboxes: {s['trials']} trials, {s['violations']} violations"
        else:
            keys = [k for k in sorted(st) if "@" in k] + ["resumed", "faults_missed"]
            title = (f"engines: {s['faults']} faults, {s['requests']} requests: {s['lost']} lost, "
                     f"{s['inconsistent']} inconsistent, {s['regenerated_tokens']} regenerated tokens")
        vals = [st.get(k, 0) for k in keys]
        ax.barh(keys, vals, color="tab:blue")
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v}", va="center", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    """`belayer soak` entry point (argv after `soak`)."""
    import argparse

    ap = argparse.ArgumentParser(prog="belayer soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("campaign", choices=["envs", "engines", "all"])
    ap.add_argument("--trials", type=int, default=None,
                    help="sandbox trials and engine faults (default 1000 and 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=0.0, help="stop each campaign after this many seconds (0: none)")
    ap.add_argument("--backend", choices=["podman", "docker", "both"], default="both")
    ap.add_argument("--actions", type=int, default=5, help="actions per sandbox trial")
    ap.add_argument("--mode", choices=["full", "fs_only"], default="full")
    ap.add_argument("--concurrency", type=int, default=6, help="concurrent requests per engine round")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request")
    ap.add_argument("--phases", default="",
                    help=f"engines: the phases of the rounds, in turn, comma-separated (default: drawn at random "
                         f"from {','.join(ENGINE_PHASES)})")
    ap.add_argument("--out", default="", help="directory for soak.json and soak.png (default: a new temp dir)")
    ap.add_argument("--burst", action="store_true",
                    help="engines: bursts of mixed faults (server kills, a hang, an actor kill, a standby kill) "
                         "faster than shadow.fault_window_s on 2 slots with 2 standbys; --trials bursts (default 1); "
                         "add belayer.engines.kind=sglang for real SGLang")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the engine fleet (recipe demo)")
    a = ap.parse_intermixed_args(argv)  # options may follow the Hydra overrides
    logging.basicConfig(level=logging.ERROR)
    out = Path(a.out or tempfile.mkdtemp(prefix="belayer-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"command": "belayer soak " + " ".join(argv if argv is not None else sys.argv[2:])}
    if a.campaign in ("envs", "all"):
        summary["envs"] = run_env_campaign(a.trials or 1000, a.seed, a.duration, a.backend, a.actions, a.mode,
                                           progress=not a.no_progress)
    if a.campaign in ("engines", "all") and a.burst:
        summary["engines"] = run_burst_campaign(a.trials or 1, a.concurrency, a.tokens, a.overrides,
                                                progress=not a.no_progress, run_dir=out / "engines")
    elif a.campaign in ("engines", "all"):
        summary["engines"] = run_engine_campaign(a.trials or 200, a.seed, a.duration, a.concurrency, a.tokens,
                                                 a.overrides, progress=not a.no_progress, run_dir=out / "engines",
                                                 phases=tuple(a.phases.split(",")) if a.phases else ENGINE_PHASES,
                                                 in_turn=bool(a.phases))
    (out / "soak.json").write_text(json.dumps(summary, indent=2, default=str))
    try:
        summary_png(summary, out / "soak.png")
    except Exception as e:  # a plotting problem must not hide the result
        print(f"(soak.png not drawn: {e})")
    bad = 0
    for c in ("envs", "engines"):
        if c in summary:
            s = summary[c]
            bad += s["violations"]
            if c == "envs":
                st = s["stats"]
                print(f"RESULT envs trials={s['trials']} violations={s['violations']} "
                      f"kills_delivered={st.get('kills_delivered', 0)} "
                      f"undelivered_trials={st.get('undelivered_trials', 0)} recovered_by "
                      f"criu={st.get('recovered_by_criu_full', 0)} fs_only={st.get('recovered_by_fs_only', 0)} "
                      f"rebuild={st.get('recovered_by_rebuild_replay', 0)}")
            else:
                above = f"lost_above_floor={s['lost_above_floor']} " if "lost_above_floor" in s else ""
                bad += s.get("lost_above_floor", 0)  # a burst campaign fails on any, whatever else it counts
                print(f"RESULT engines faults={s['faults']} requests={s['requests']} lost={s['lost']} {above}"
                      f"inconsistent={s['inconsistent']} regenerated_tokens={s['regenerated_tokens']} "
                      f"violations={s['violations']}")
            for f in s["failures"][:5]:
                print(f"  VIOLATION {f}")
    print(f"summary: {out / 'soak.json'}\nfigure: {out / 'soak.png'}")
    return 1 if bad else 0
