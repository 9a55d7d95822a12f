"""The reference loop's GRPO group built from sandbox forks equals the same group built by replaying the
shared prefix (token ids, final sandbox state, rewards), and its members still diverge after the prefix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.containers, pytest.mark.slow]

OVERRIDES = ["belayer.chaos.enabled=false", "loop.num_steps=1", "loop.prompts_per_step=1", "loop.group_size=3",
             "loop.turns=3", "loop.shared_prefix_turns=2"]


def run(tmp: Path, fork: bool) -> tuple[dict, list[dict]]:
    d = tmp / ("fork" if fork else "replay")
    p = subprocess.run([sys.executable, "-m", "belayer_plugin.cli", "run", "demo", f"belayer.run_dir={d}",
                        f"loop.fork_groups={str(fork).lower()}", *OVERRIDES],
                       capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    events = [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((d / "report.json").read_text()), events


@pytest.mark.timeout(900)
def test_forked_group_equals_replayed_group(tmp_path):
    forked, fev = run(tmp_path, fork=True)
    replayed, rev = run(tmp_path, fork=False)
    key = lambda r: [(t["id"], t["digest"], t["reward"], t["final_state"]) for t in r["trajectories"]]  # noqa: E731
    assert forked["status"] == replayed["status"] == "ok"
    assert key(forked) == key(replayed)
    assert len({t["digest"] for t in forked["trajectories"]}) > 1  # members diverged after the shared prefix
    forks = [e for e in fev if e["kind"] == "fork"]
    assert len(forks) == 1 and forks[0]["figures"]["branches"] == ["s1-p0-g0", "s1-p0-g1", "s1-p0-g2"]
    assert not [e for e in rev if e["kind"] == "fork"]
    modes = [e["figures"]["mode"] for e in fev + rev if e["kind"] == "group_prefix"]
    assert modes == ["fork", "replay"]
    # the step's recovery metrics (what a trainer's logger gets): the fork's prefix checkpoint was counted
    m = forked["steps"][0]["belayer"]
    assert m["belayer/checkpoints"] + m["belayer/checkpoints_unchanged"] >= 1 and m["belayer/chaos_faults"] == 0
    # the step's phases and the CPU it cost (bench/overhead.py reads these)
    s = forked["steps"][0]
    assert 0 < s["gen_s"] < s["step_s"] and 0 < s["barrier_s"] < s["step_s"]
    assert s["gen_s"] + s["barrier_s"] <= s["step_s"] + 0.01
    assert s["cpu_driver_s"] > 0 and s["cpu_host_s"] >= s["cpu_driver_s"] - 0.05
    # the barrier's parts add up to it; a trajectory's parts fit inside its wall time
    parts = [s[k] for k in ("pause_s", "train_s", "refit_s", "resume_s")]
    assert min(parts) >= 0 and s["refit_s"] > 0 and abs(sum(parts) - s["barrier_s"]) <= 0.01
    # (a member's gen_s also carries its share of the shared prefix's generation, which ran before it)
    for t in forked["trajectories"]:
        assert t["wall_s"] > 0 and t["env_s"] + t["setup_s"] + t["finish_s"] <= t["wall_s"] + 0.01
    # a forked member starts from its group's sandbox: no fresh sandbox of its own
    assert any(t["setup_s"] < 0.01 for t in forked["trajectories"])
