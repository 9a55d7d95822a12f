"""Keeps Belayer's own processes from importing libraries they never use.

transformers imports scikit-learn whenever it is installed (and with it scipy and pandas: ~1.8 s of CPU per
process on this VM), only to filter candidates in assisted generation, which no Belayer process runs. The
reference learner, the main job's driver and CPU engines serving a non-Qwen2 checkpoint load transformers
(a Qwen2 checkpoint is served by engines.native_lm without it), and such engines start often (restarts,
shadows, every test fleet), so that import is a large share of a start-up on a few cores.

Owns: the list of imports skipped and how. Must not: import any Belayer module.
"""

from __future__ import annotations

import os
import sys


def skip_unused_imports() -> None:
    """Marks scikit-learn unavailable in this process, before transformers is imported.

    Call only in processes Belayer owns (engine server, learner actor, the CLI as a process entry), never in a
    trainer's process, where user code may need scikit-learn. No-op when `BELAYER_KEEP_SKLEARN=1`, or when
    scikit-learn or transformers is already imported (its availability checks have already run).
    """
    if os.environ.get("BELAYER_KEEP_SKLEARN") == "1" or "transformers" in sys.modules:
        return
    # A None entry makes `import sklearn` raise ImportError and importlib.util.find_spec return None, which is
    # how transformers decides a package is missing.
    sys.modules.setdefault("sklearn", None)  # type: ignore[arg-type]
