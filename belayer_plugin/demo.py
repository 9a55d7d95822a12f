"""The fleet demo: CPU engines on local Ray behind the real sglang-router, greedy requests, a table.

Owns: the fleet demo's run and its table. Must not: be imported by library code.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from omegaconf import DictConfig

from belayer_plugin.config import BelayerConfig
from belayer_plugin.fleet.launch import Fleet, make_run_dir
from belayer_plugin.generation.sglang_http import generate, generate_stream, get_json
from belayer_plugin.ray_cluster import init_ray


def _printable(text: str) -> str:
    """The text with control and undecodable characters shown as dots (the tiny model babbles bytes)."""
    return "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "+".join("-" * (w + 2) for w in widths)
    fmt = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(headers), line, *(fmt(r) for r in cells)])


async def run_fleet_demo(cfg: BelayerConfig, recipe: DictConfig) -> dict:
    """Starts the fleet, sends the recipe's prompts (greedy; half streamed) twice, prints a report."""
    demo = recipe.get("demo", {})
    n_req = int(demo.get("num_requests", 8))
    max_new = int(demo.get("max_new_tokens", 32))
    prompts = list(demo.get("prompts", ["Hello"]))
    run_dir = make_run_dir(cfg)
    init_ray(cfg.ray)
    fleet = Fleet(cfg, run_dir)
    t0 = time.monotonic()
    try:
        await fleet.start()
        started = time.monotonic() - t0
        assert fleet.url, "the demo needs router.mode=sglang_router"
        async with httpx.AsyncClient() as client:
            async def one(i: int, stream: bool) -> dict:
                payload = {"text": prompts[i % len(prompts)], "rid": f"demo-{i}-{'s' if stream else 'n'}",
                           "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
                t = time.monotonic()
                if stream:
                    last: dict = {}
                    async for chunk in generate_stream(client, fleet.url, payload, 120.0):
                        last = chunk
                    out = last
                else:
                    out = await generate(client, fleet.url, payload, 120.0)
                return {"i": i, "stream": stream, "ids": out["output_ids"], "rid": out["meta_info"]["id"],
                        "text": out["text"], "s": time.monotonic() - t, "version": out["meta_info"]["weight_version"]}

            first = await asyncio.gather(*(one(i, i % 2 == 1) for i in range(n_req)))
            second = await asyncio.gather(*(one(i, i % 2 == 0) for i in range(n_req)))
            counters = {}
            for eid, h in fleet.engines.items():
                info = await get_json(client, h.info.url, "/get_server_info", 10.0)
                counters[eid] = info.get("belayer_counters", {})
        deterministic = all(a["ids"] == b["ids"] for a, b in zip(first, second))
        print(f"\nBelayer fleet demo: {len(fleet.engines)} {cfg.engines.kind} engines behind sglang-router "
              f"at {fleet.url} (up in {started:.1f} s)\n")
        print(_table(["engine", "url", "server pid", "weights", "start s", "requests served"],
                     [[eid, h.info.url, h.info.pid, h.info.weight_version, f"{h.info.started_s:.1f}",
                       counters[eid].get("requests", "?")] for eid, h in fleet.engines.items()]))
        print()
        print(_table(["request", "mode", "tokens", "latency s", "same ids on repeat", "text (first 40 chars)"],
                     [[a["rid"], "stream" if a["stream"] else "plain", len(a["ids"]), f"{a['s']:.2f}",
                       "yes" if a["ids"] == b["ids"] else "NO", _printable(a["text"][:40])]
                      for a, b in zip(first, second)]))
        verdict = "PASS" if deterministic else "FAIL"
        print(f"\ngreedy determinism across engines and modes (stream vs plain): {verdict}")
        report = {"engines": {eid: h.info.__dict__ for eid, h in fleet.engines.items()},
                  "requests": first, "deterministic": deterministic, "fleet_start_s": started}
        (run_dir / "report.json").write_text(json.dumps(report, indent=2))
        print(f"report: {run_dir / 'report.json'}")
        return report
    finally:
        await fleet.shutdown()
