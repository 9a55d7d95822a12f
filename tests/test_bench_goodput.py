"""The goodput bench (bench/goodput.py): its fault schedule and arithmetic; and the reference loop resumed from
an earlier run's learner checkpoint (the bench's restart-based arm restarts the job that way), which must
start after that step and train the next one to the same batch and loss as the run that was never stopped."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import goodput  # noqa: E402  (bench/goodput.py)


def test_fault_schedule_is_seeded_poisson_over_every_kind():
    a = goodput.make_schedule(7, 60.0, 60_000.0)
    assert a == goodput.make_schedule(7, 60.0, 60_000.0)
    assert a != goodput.make_schedule(8, 60.0, 60_000.0)
    times = [t for t, _ in a]
    assert times == sorted(times) and times[-1] <= 60_000.0
    gaps = [b - x for x, b in zip([0.0] + times, times)]
    assert 55.0 < statistics.fmean(gaps) < 65.0  # ~1000 exponential gaps of mean 60 s: standard error ~1.9 s
    assert 0.8 < statistics.pstdev(gaps) / statistics.fmean(gaps) < 1.2  # exponential: sd equals the mean
    assert {k for _, k in a} == set(goodput.KINDS)


def test_a_fault_due_after_its_kinds_last_chance_is_outside_the_run_and_any_other_undelivered_one_is_missed():
    d = goodput.FaultDriver([(5.0, "engine_hang"), (9.0, "sandbox_kill"), (12.0, "learner_kill")], seed=0)
    d.last_chance = {"engine": 20.0, "sandbox": 8.0, "learner": 15.0}
    d.faults[2].delivered_s = 12.5
    missed, outside = d.undelivered(t_end=30.0)
    assert [f.kind for f in missed] == ["engine_hang"]  # the engines were generating until 20 s
    assert [f.kind for f in outside] == ["sandbox_kill"]  # no action began after 8 s


def test_time_below_full_strength_counts_overlapping_outages_once():
    assert goodput._union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)


OVERRIDES = ["belayer.use_fault_tolerance=false", "belayer.chaos.enabled=false", "belayer.engines.num_engines=1",
             "loop.num_steps=2", "loop.prompts_per_step=1", "loop.group_size=2", "loop.turns=2"]


def _run(run_dir: Path, resume_from: Path | None = None) -> tuple[dict, dict]:
    """One run of the main job; (its report, each step's engine weight version as the engine server says)."""
    from belayer_plugin.config import load_belayer_config
    from belayer_plugin.loop import ReferenceLoop

    served: dict[int, list[str]] = {}

    def on_step(loop: ReferenceLoop, step: int, edge: str) -> None:
        if edge == "start":  # the engine server's own answer, not the fleet's record
            served[step] = [httpx.get(f"{s.info.url}/get_weight_version", timeout=10).json()["weight_version"]
                            for s in loop.fleet.slots.values()]

    cfg, raw = load_belayer_config("demo", OVERRIDES + [f"belayer.run_dir={run_dir}"])
    rep = asyncio.run(ReferenceLoop(cfg, raw, progress=False, on_step=on_step, resume_from=resume_from).run())
    assert rep["status"] == "ok", rep["error"]
    return rep, served


def _batch(rep: dict, step: int) -> list[tuple[str, str]]:
    return sorted((t["id"], t["digest"]) for t in rep["trajectories"] if t["step"] == step)


@pytest.mark.containers
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_resumed_from_a_checkpoint_trains_the_next_step_as_the_run_that_was_never_stopped(tmp_path):
    whole, _ = _run(tmp_path / "whole")
    # A job stopped after step 1: its run directory holds step 1's learner checkpoint and weights, no more
    stopped = tmp_path / "stopped"
    shutil.copytree(tmp_path / "whole" / "learner-ckpt" / "step-1", stopped / "learner-ckpt" / "step-1")
    shutil.copytree(tmp_path / "whole" / "weights" / "v1", stopped / "weights" / "v1")
    resumed, served = _run(tmp_path / "resumed", resume_from=stopped)
    assert [s["step"] for s in resumed["steps"]] == [2]
    assert served == {2: ["v1"]}  # the cold-started engine was given step 1's weights before step 2
    # The engine's tokens and the sandboxes' final states, and the learner's loss, as in the run never stopped
    assert _batch(resumed, 2) == _batch(whole, 2)
    assert resumed["steps"][0]["loss"] == pytest.approx(whole["steps"][1]["loss"], rel=1e-6, abs=1e-9)
