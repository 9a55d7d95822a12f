"""Where a chaos trigger can fire in a run of the reference loop, checked against the recipe before it runs.

`belayer.chaos.at` means something different per trigger, and whether a position can be reached (and whether
a fault there can show the recoveries the scenario declares in `belayer.chaos.expect`) depends on the recipe's
`loop` section. `problems()` names every chaos key that cannot work with the recipe, each with the valid range,
all at once (as the config validation does); `ReferenceLoop` refuses such a recipe at start-up, before anything
starts, and `belayer config check` reports the same. `positions()` is the valid range itself (the position
sweep, tests/test_chaos_positions.py, runs every one of them).

Triggers (see injector.py) and their positions, for a recipe whose loop makes S steps of P prompts x G
trajectories, each of T turns of N tokens:

- step: the step 1..S; the injector fires at the phase named by victim_state (serving, paused, refit; any:
  the first of them). learner_kill must be `paused`: the step's rollouts are done and the learner's checkpoint
  of the step before is complete (a kill while serving or at the refit can land in that checkpoint's
  background write, which the loop cannot redo; a refit kill is also noticed only at the next update).
- token: a request having committed `at` tokens, 1..N-1 (at N the request has already ended: the kill hits an
  idle engine, which is the step trigger's scenario); only while serving.
- action: before turn `at` of a trajectory, 0..T-1. A kill that must be restored from a sandbox checkpoint
  (restored_from_checkpoint, criu_restore, restore_retried) needs one at or before that boundary: with
  sandbox.policy.every_n_actions = n >= 1 the first is taken at boundary n (boundary 0 is the base image and
  is never checkpointed), so n..T-1.
- none: sandbox_kill_checkpoint only: the `at`-th sandbox checkpoint call of the run, 1..C where C is the
  number of calls every run of this recipe makes (checkpoints are taken at boundaries 1..T-1 every n actions;
  with skip_unchanged a boundary without side effects reuses the last checkpoint, so only each trajectory's
  first one is certain).
- time: seconds into the run (> 0); not checked against the recipe.

Owns: the list of trigger positions and checking a recipe's triggers against it before a run. Must not: inject
faults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from belayer_plugin.chaos.injector import KINDS, SANDBOX_KINDS

_NEEDS_CHECKPOINT = ("restored_from_checkpoint", "criu_restore", "restore_retried")


@dataclass(frozen=True)
class Positions:
    """The valid range of `belayer.chaos.at` for one recipe: lo..hi inclusive (empty when hi < lo)."""

    lo: int
    hi: int
    what: str  # what a position counts, with the recipe figures the range comes from

    def __iter__(self):
        return iter(range(self.lo, self.hi + 1))

    def __len__(self) -> int:
        return max(0, self.hi - self.lo + 1)

    def describe(self) -> str:
        if self.hi < self.lo:
            return f"no position can be reached ({self.what})"
        return f"valid: {self.lo}..{self.hi} ({self.what})"


def _checkpoint_calls(cfg: Any, loop: Any) -> tuple[int, str]:
    """The sandbox checkpoint calls every run of this recipe makes, at least; and how that is counted."""
    pol = cfg.sandbox.policy
    n, k, t = pol.every_n_actions, loop.shared_prefix_turns, loop.turns
    if n < 1:
        return 0, "sandbox.policy.every_n_actions=0: the adaptive policy alone may take no checkpoint"

    def per(start: int, last: int) -> int:  # checkpoints at boundaries start+n, start+2n, ... < last
        m = max(0, (last - 1 - start) // n)
        return min(m, 1) if pol.skip_unchanged else m

    groups = loop.num_steps * loop.prompts_per_step
    if k == 0:
        c = groups * loop.group_size * per(0, t)
    else:
        c = groups * (per(0, k) + loop.group_size * per(k, t))
    how = (f"loop: {loop.num_steps} steps x {loop.prompts_per_step} prompts x {loop.group_size} trajectories of "
           f"{t} turns, a checkpoint every {n} action(s) before the last turn"
           + (", only each trajectory's first certain (skip_unchanged)" if pol.skip_unchanged else ""))
    return c, how


def positions(cfg: Any, loop: Any) -> Optional[Positions]:
    """The valid `belayer.chaos.at` range of this recipe's chaos section; None when it is not checked
    (chaos off, trigger time, or a kind/trigger pair that cannot fire: `problems()` names those)."""
    ch = cfg.chaos
    if not ch.enabled or ch.trigger == "time":
        return None
    if ch.trigger == "step":
        return Positions(1, loop.num_steps, f"the step, loop.num_steps={loop.num_steps}")
    if ch.trigger == "token":
        return Positions(1, loop.tokens_per_turn - 1,
                         f"tokens a request has committed; it makes loop.tokens_per_turn={loop.tokens_per_turn}, "
                         "and the kill must land before its last")
    if ch.trigger == "action":
        lo, why = 0, ""
        if any(e in ch.expect for e in _NEEDS_CHECKPOINT):
            n = cfg.sandbox.policy.every_n_actions
            lo = n if n >= 1 else loop.turns  # n=0: no checkpoint is certain anywhere
            needs = [e for e in ch.expect if e in _NEEDS_CHECKPOINT]
            why = (f"; {', '.join(needs)} need{'s' if len(needs) == 1 else ''} a checkpoint at or before the "
                   f"kill's boundary: the first is at boundary sandbox.policy.every_n_actions={n}")
        return Positions(lo, loop.turns - 1, f"the turn before whose action the sandbox is killed, "
                                             f"loop.turns={loop.turns}{why}")
    if ch.trigger == "none" and ch.kind == "sandbox_kill_checkpoint":
        c, how = _checkpoint_calls(cfg, loop)
        return Positions(1, c, f"the checkpoint call of the run to kill; {c} certain: {how}")
    return None


def problems(cfg: Any, loop: Any) -> list[str]:
    """Every `belayer.chaos` key that cannot work with this recipe's loop, each named with what would
    (`loop` None: an invalid loop section, named by its own validation; the position is not checked)."""
    ch = cfg.chaos
    if not ch.enabled or ch.kind not in KINDS:  # an unknown kind is the injector's error (it names the known)
        return []
    out = []
    p = "belayer.chaos"
    if ch.count < 1:
        out.append(f"{p}.count: {ch.count}: no fault would be injected (set >= 1, or chaos.enabled=false)")
    if ch.kind in ("sandbox_kill", "sandbox_kill_restore") and ch.trigger != "action":
        out.append(f"{p}.trigger: {ch.kind} kills the sandbox of a trajectory at an action: it needs trigger "
                   f"action, got {ch.trigger!r}")
    elif ch.kind == "sandbox_kill_checkpoint" and ch.trigger != "none":
        out.append(f"{p}.trigger: sandbox_kill_checkpoint kills the at-th checkpoint call itself: it needs "
                   f"trigger none, got {ch.trigger!r}")
    elif ch.trigger == "none" and ch.kind != "sandbox_kill_checkpoint":
        out.append(f"{p}.trigger: none fires nothing for {ch.kind}: use step, token, action or time")
    if ch.trigger == "token" and ch.victim_state not in ("serving", "any"):
        out.append(f"{p}.victim_state: a token trigger fires while a request generates, never while "
                   f"{ch.victim_state}: use serving or any")
    if ch.kind == "learner_kill" and ch.trigger == "step" and ch.victim_state != "paused":
        out.append(f"{p}.victim_state: learner_kill at a step must be paused (before the step's update, its "
                   f"rollouts done and the previous checkpoint complete); got {ch.victim_state!r}: a kill while "
                   f"serving or at the refit can land in the previous or this step's checkpoint write")
    if ch.trigger == "time":
        if ch.at <= 0:
            out.append(f"{p}.at: {ch.at:g}: a time trigger needs seconds > 0")
        return out
    if ch.at != int(ch.at):
        out.append(f"{p}.at: {ch.at:g}: a {ch.trigger} trigger's position is a whole number")
        return out
    if ch.kind in SANDBOX_KINDS and ch.trigger not in ("action", "none"):
        return out  # named above: no position of this trigger reaches a sandbox
    rng = positions(cfg, loop) if loop is not None else None
    if rng is not None and int(ch.at) not in range(rng.lo, rng.hi + 1):
        out.append(f"{p}.at: {ch.at:g} ({ch.trigger} trigger) is out of range for this recipe (the fault "
                   f"would not land, or not where {', '.join(ch.expect) or 'it'} can be observed): {rng.describe()}")
    return out
