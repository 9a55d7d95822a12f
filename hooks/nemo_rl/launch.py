"""`belayer nemo-rl SCRIPT [ARGS...]`: runs a NeMo-RL run script unchanged, with Belayer's hook installed.

As `opentelemetry-instrument` does for tracing: the launcher installs the hook in its own process, then runs the
script as `__main__` with the script's own argument list, so `examples/run_grpo.py --config ...` needs no edit.
Installing the hook changes nothing by itself: `patch_nemo_rl()` makes NeMo-RL build the fault-tolerant
SGLangGeneration subclass, which is NeMo-RL's class unchanged unless the recipe sets
`policy.generation.sglang_cfg.use_fault_tolerance: true`; `register_environments()` adds the
`belayer_sandbox` environment name. The recipe keys alone switch Belayer on and off.

    belayer nemo-rl examples/run_grpo.py --config examples/configs/grpo_math_1B_sglang.yaml \\
        policy.generation.sglang_cfg.use_fault_tolerance=true

Owns: running a NeMo-RL script with the hook installed. Must not: change the script.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Optional

__all__ = ["install", "run_script", "main"]


def install() -> None:
    """Installs Belayer's NeMo-RL hook in this process (idempotent)."""
    from belayer_plugin.hooks.nemo_rl import patch_nemo_rl, register_environments

    patch_nemo_rl()
    register_environments()


def run_script(script: str, args: list[str]) -> None:
    """Runs `script` as `__main__` with `args` as its command line, after `install()`; a script that exits
    with a status (sys.exit) passes it on."""
    path = Path(script)
    if not path.is_file():
        raise SystemExit(f"belayer nemo-rl: no such script: {script}")
    from belayer_plugin.hooks.nemo_rl.upstream import import_grpo

    try:
        import_grpo()  # NeMo-RL as the script will import it (a source checkout: BELAYER_NEMO_RL)
    except ImportError as e:
        raise SystemExit(f"belayer nemo-rl: NeMo-RL is not importable in this Python ({sys.executable}): {e}. "
                         "Run the launcher with the Python that runs NeMo-RL.") from e
    install()
    # the script sees itself as NeMo-RL's launchers run it: its own path first on sys.path, argv[0] its path
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    runpy.run_path(str(path), run_name="__main__")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    run_script(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
