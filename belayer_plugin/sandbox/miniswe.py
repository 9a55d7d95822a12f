"""An environment for mini-swe-agent backed by a Belayer sandbox (mini-swe-agent itself stays optional).

mini-swe-agent's Environment protocol: `execute(command | {"command": ...}, cwd="", *, timeout=None)`
returning {"output", "returncode"} (2.x adds "exception_info"), plus `config`, `get_template_vars()` and
`serialize()`. v1 agents expect a subprocess.TimeoutExpired on timeout; 2.x expects it in the dict.

Owns: the mini-swe-agent environment adapter. Must not: import mini-swe-agent at module level.
"""

from __future__ import annotations

import platform
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from belayer_plugin.sandbox.base import Sandbox
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

SUBMIT_MARK = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class BelayerEnvironmentConfig:
    cwd: str = "/root"
    env: dict[str, str] = field(default_factory=dict)
    timeout: int = 30
    raise_on_timeout: bool = True  # mini-swe-agent 1.x: raise subprocess.TimeoutExpired

    def model_dump(self, **_: Any) -> dict:  # what pydantic configs offer: agents call it for templates
        return asdict(self)


class BelayerEnvironment:
    """Runs mini-swe-agent actions in a sandbox; with a recorder, each action becomes a committed boundary."""

    def __init__(self, sandbox: Optional[Sandbox] = None, *, recorder: Optional[TrajectoryRecorder] = None,
                 context_fn: Optional[Callable[[], tuple[list[int], list[dict]]]] = None, **kwargs: Any):
        if sandbox is None and recorder is None:
            raise ValueError("BelayerEnvironment needs a sandbox or a recorder")
        self._sandbox = sandbox
        self.recorder = recorder
        self.context_fn = context_fn or (lambda: ([], []))
        self.config = BelayerEnvironmentConfig(**kwargs)

    @property
    def sandbox(self) -> Sandbox:
        # After a recovery the recorder holds the restored sandbox.
        return self.recorder.sandbox if self.recorder is not None else self._sandbox  # type: ignore[return-value]

    def execute(self, action: Any, cwd: str = "", *, timeout: Optional[int] = None) -> dict[str, Any]:
        """Runs one command; output is stdout then stderr, as a terminal shows it."""
        v2 = isinstance(action, dict)
        command = action.get("command", "") if v2 else str(action)
        t = timeout or self.config.timeout
        if self.recorder is not None:
            self.recorder.begin_action({"command": command, "timeout": t, "cwd": cwd or self.config.cwd})
        res = self.sandbox.exec(command, timeout=t, cwd=cwd or self.config.cwd, env=self.config.env)
        if self.recorder is not None:
            toks, msgs = self.context_fn()
            self.recorder.commit(toks, msgs, {"returncode": res.exit_code})
        out: dict[str, Any] = {"output": res.output, "returncode": res.exit_code}
        if res.timed_out:
            if self.config.raise_on_timeout and not v2:
                raise subprocess.TimeoutExpired(command, t, output=res.output)
            out.update(returncode=-1, exception_info=f"command timed out after {t}s")
        elif v2:
            out["exception_info"] = ""
        if v2:
            self._check_finished(out)
        return out

    def _check_finished(self, out: dict) -> None:
        lines = out.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARK and out["returncode"] == 0:
            try:
                from minisweagent.exceptions import Submitted  # lazily: mini-swe-agent is optional
            except ImportError:
                return
            sub = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": sub, "extra": {"exit_status": "Submitted", "submission": sub}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **platform.uname()._asdict(), "sandbox_image": self.sandbox.spec.image,
                **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config.model_dump(),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def cleanup(self) -> None:
        self.sandbox.close()
