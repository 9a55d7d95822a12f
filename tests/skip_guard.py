"""Under CI=true a skipped test fails the run unless tests/skip_allowlist.txt names it (issue 44): a missing
Podman/Docker/CRIU, SGLang venv, verl or NeMo-RL snapshot must not turn CI green by skipping the checks that
need it. tests/conftest.py imports these hooks; `pytest -p tests.skip_guard` loads them into any session
(tests/test_ci_skips.py). BELAYER_SKIP_ALLOWLIST names another allowlist file (the mechanism's own test).

Allowlist format: one entry a line, `nodeid-or-fnmatch-pattern  reason` (two or more spaces or a tab between
them); `#` starts a comment; an entry without a reason is an error."""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

ALLOWLIST = Path(__file__).resolve().parent / "skip_allowlist.txt"


def ci_on() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def allowlist_path() -> Path:
    return Path(os.environ.get("BELAYER_SKIP_ALLOWLIST") or ALLOWLIST)


def load_allowlist(path: Path) -> list[tuple[str, str]]:
    """[(pattern, reason)]; raises ValueError naming the line for an entry without its reason."""
    entries = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = re.split(r"\t+|\s{2,}", line, maxsplit=1)
        if len(parts) < 2 or not parts[1].strip():
            raise ValueError(f"{path}:{n}: allowlisted skip without a reason (`nodeid-or-pattern  reason`): {raw!r}")
        entries.append((parts[0], parts[1].strip()))
    return entries


_cache: dict[str, list[tuple[str, str]]] = {}


def _entries() -> list[tuple[str, str]]:
    p = allowlist_path()
    if str(p) not in _cache:
        _cache[str(p)] = load_allowlist(p) if p.is_file() else []
    return _cache[str(p)]


def allowed(nodeid: str) -> bool:
    return any(nodeid == pat or fnmatch.fnmatchcase(nodeid, pat) for pat, _ in _entries())


def _why(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


def _message(nodeid: str, why: str) -> str:
    return (f"skipped under CI=true and not on the skip allowlist: {nodeid}\n  skip reason: {why}\n"
            f"  CI must run it (install what it needs) or {allowlist_path()} must list it with its reason")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (ci_on() and rep.skipped) or hasattr(rep, "wasxfail") or allowed(item.nodeid):
        return
    rep.outcome = "failed"
    rep.longrepr = _message(item.nodeid, _why(rep))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped whole at import (pytest.importorskip("verl"), allow_module_level skips)."""
    outcome = yield
    rep = outcome.get_result()
    if not (ci_on() and rep.outcome == "skipped") or allowed(rep.nodeid):
        return
    rep.outcome = "failed"
    rep.longrepr = _message(rep.nodeid, _why(rep))
