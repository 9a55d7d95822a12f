"""Runs chaos recipes at chosen trigger positions, small and seeded, in one process, and judges each run as its
functional script does (tests/functional/<recipe>.sh: EXPECT, ERROR_TYPE, MAX_DURATION) with
belayer_plugin.chaos.check; prints one `SWEEP {json}` line per run and exits 1 when any run failed its checks.

    python tests/functional/sweep_positions.py OUT_DIR --seed S chaos/learner_kill:1,2 chaos/shadow_kill:all

A run is what `belayer run RECIPE belayer.chaos.at=AT loop.seed=S <SMALL>` does, in-process: one Ray cluster
for every run (its start-up is most of a small run's time), one golden run per seed (chaos off; the scenarios
share it as run_scenario.sh's cache does). `all` is every position belayer_plugin.chaos.positions accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))

# The size of a sweep run: 2 steps of one trajectory of 3 turns of 6 tokens (every trigger has 2..5 positions)
SMALL = ["loop.num_steps=2", "loop.prompts_per_step=1", "loop.group_size=1", "loop.turns=3",
         "loop.tokens_per_turn=6"]


def script_expect(recipe: str) -> dict:
    """EXPECT, ERROR_TYPE, MAX_DURATION from the recipe's functional script (the scenario's own verdict)."""
    text = (ROOT / "tests" / "functional" / f"{Path(recipe).name}.sh").read_text()
    out = {}
    for key in ("EXPECT", "ERROR_TYPE", "MAX_DURATION"):
        m = re.search(rf"\b{key}=(\S+)", text)
        if m:
            out[key] = m.group(1)
    return out


def valid_positions(recipe: str, seed: int) -> list[int]:
    from belayer_plugin.chaos.positions import positions
    from belayer_plugin.config import load_belayer_config
    from belayer_plugin.loop import _loop_config

    cfg, raw = load_belayer_config(recipe, SMALL + [f"loop.seed={seed}"])
    return list(positions(cfg, _loop_config(raw)) or [])


def run_one(recipe: str, overrides: list[str]) -> dict:
    from belayer_plugin.config import load_belayer_config
    from belayer_plugin.loop import ReferenceLoop

    cfg, raw = load_belayer_config(recipe, overrides)
    return asyncio.run(ReferenceLoop(cfg, raw, progress=False).run())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("runs", nargs="+", help="RECIPE:AT[,AT...] or RECIPE:all")
    a = ap.parse_args(argv)
    from belayer_plugin.chaos.check import check

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = SMALL + [f"loop.seed={a.seed}"]
    golden = None
    failed = 0
    for spec in a.runs:
        recipe, _, ats = spec.partition(":")
        exp = script_expect(recipe)
        todo = valid_positions(recipe, a.seed) if ats == "all" else [int(x) for x in ats.split(",")]
        for at in todo:
            if exp["EXPECT"] == "survival" and golden is None:
                golden = run_one("demo", base + ["belayer.chaos.enabled=false", f"belayer.run_dir={out}/golden"])
                assert golden["status"] == "ok", golden.get("error")
            run_dir = out / f"{Path(recipe).name}-at{at}"
            t0 = time.monotonic()
            try:
                rep = run_one(recipe, base + [f"belayer.chaos.at={at}", f"belayer.run_dir={run_dir}"])
                bad = check(rep, exp["EXPECT"], golden=golden, error_type=exp.get("ERROR_TYPE", ""),
                            max_duration_s=float(exp.get("MAX_DURATION", 0)))
            except Exception as e:  # a refused position (ConfigError) or a crash: a failed run, named
                rep, bad = {}, [f"{type(e).__name__}: {str(e)[:600]}"]
            failed += bool(bad)
            print("SWEEP " + json.dumps({"recipe": recipe, "at": at, "seed": a.seed, "expect": exp["EXPECT"],
                                         "status": rep.get("status"), "fleet_at_end": rep.get("fleet_at_end"),
                                         "violations": bad, "wall_s": round(time.monotonic() - t0, 1)}),
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
