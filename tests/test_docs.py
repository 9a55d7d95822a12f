"""The documentation cannot drift: the site builds with no broken link or anchor, the configuration reference
is what docs/gen_config.py writes from the config dataclasses and recipes/belayer/default.yaml today, and the
README's links into docs/ resolve. No engine, Ray or container: a few seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python docs/gen_config.py"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`mkdocs build --strict` into a temporary folder (a warning, e.g. a broken link or anchor, fails it)."""
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (
        f"mkdocs build --strict failed (exit {r.returncode}; mkdocs is the `docs` extra, installed by "
        f"bash .ci/setup.sh):\n{r.stdout}\n{r.stderr}")
    return out


def test_mkdocs_build_strict_has_no_broken_link(site: Path):
    assert (site / "index.html").is_file(), "docs/index.md was not built"
    for page in ("architecture", "recovery", "configuration", "trainers/verl", "trainers/nemo-rl",
                 "reliability", "benchmarks", "operations"):
        assert (site / page / "index.html").is_file(), f"docs/{page}.md was not built"


def test_configuration_reference_is_generated_from_the_code_and_current(tmp_path: Path):
    fresh = tmp_path / "configuration.md"
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_config.py"), "--out", str(fresh)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"docs/gen_config.py failed:\n{r.stdout}\n{r.stderr}"
    committed = (ROOT / "docs" / "configuration.md").read_text()
    if fresh.read_text() != committed:
        import difflib

        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), fresh.read_text().splitlines(True),
                                                 "docs/configuration.md", "generated"))[:60])
        pytest.fail(f"docs/configuration.md is stale: run `{REGENERATE}` and commit the result.\n{diff}")


def test_configuration_reference_names_every_key_of_the_default_recipe():
    import yaml

    text = (ROOT / "docs" / "configuration.md").read_text()

    def leaves(node: dict, path: str):
        for key, value in node.items():
            dotted = f"{path}.{key}"
            if isinstance(value, dict):
                assert f"## `{dotted}`" in text, f"no section for {dotted} in docs/configuration.md"
                yield from leaves(value, dotted)
            else:
                yield dotted

    for dotted in leaves(yaml.safe_load((ROOT / "recipes" / "belayer" / "default.yaml").read_text()), "belayer"):
        section, key = dotted.rsplit(".", 1)
        body = text.split(f"## `{section}`\n", 1)[1].split("\n## ", 1)[0]
        assert f"| `{key}` |" in body, f"{dotted} missing from docs/configuration.md"


def test_readme_links_resolve(site: Path):
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links, "README.md links nowhere"
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {path}, which does not exist"
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            name = path[len("docs/"):-len(".md")]
            page = site / "index.html" if name == "index" else site / name / "index.html"
            html = page.read_text()
            assert f'id="{anchor}"' in html, f"README.md links to {link}: no such anchor in {path}"


def test_readme_is_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md is meant to be read in five minutes: move detail to docs/"
    assert "bash .ci/setup.sh --containers && .venv/bin/belayer run demo" in readme
    assert "bash .ci/setup.sh --all && bash .ci/test.sh" in readme
    assert "bash .ci/setup.sh --all && bash .ci/test.sh" in (ROOT / ".ci" / "run").read_text()
