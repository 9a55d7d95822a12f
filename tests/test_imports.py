"""Imports go one way: no circle among Belayer's modules, and no import of a layer above the importer's own;
and every module says what it owns and what it must not do.

The layers and what each may import are read from the table in docs/architecture.md ("Layers and imports"),
so the doc and the code cannot drift apart. Every import counts: at module level, inside functions (a lazy
import is still a dependency) and under TYPE_CHECKING (a circle of types is still a circle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for belayer_plugin/ and hooks/ (hooks ship as belayer_plugin.hooks)."""
    out = {}
    for pkg in ("belayer_plugin", "hooks"):
        base = root / pkg
        for p in base.rglob("*.py"):
            if p.resolve() != p:  # a symlinked copy (e.g. a dev checkout's belayer_plugin/hooks -> ../hooks)
                continue
            parts = [pkg, *p.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The Belayer module an imported dotted name lands in (its longest known prefix), or None."""
    if name == "belayer_plugin.hooks" or name.startswith("belayer_plugin.hooks."):
        name = "hooks" + name[len("belayer_plugin.hooks"):]
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _edges(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """{module: {imported Belayer module: line of the first such import}}."""
    edges: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import submodule` imports the submodule; `from module import name`, the module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                target = _resolve(n, mods)
                if target is not None and target != mod:
                    out.setdefault(target, node.lineno)
        edges[mod] = out
    return edges


def _layers() -> tuple[list[tuple[str, str]], dict[str, set[str]]]:
    """From docs/architecture.md: ([(path prefix, layer)], {layer: layers it may import})."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers and imports", 1)[1].split("\n## ", 1)[0]
    paths: list[tuple[str, str]] = []
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        layer, modules, may = cells
        allowed[layer] = {m.strip() for m in may.split(",") if m.strip()}
        paths += [(p, layer) for p in re.findall(r"`([^`]+)`", modules)]
    assert paths and allowed, "docs/architecture.md has no 'Layers and imports' table"
    return paths, allowed


def _layer_of(path: Path, paths: list[tuple[str, str]], root: Path = ROOT) -> str | None:
    rel = path.relative_to(root).as_posix()
    hits = [(len(p), layer) for p, layer in paths if rel == p or (p.endswith("/") and rel.startswith(p))]
    return max(hits)[1] if hits else None


def _circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _upward(root: Path = ROOT) -> list[str]:
    mods = _modules(root)
    paths, allowed = _layers()
    layer = {m: _layer_of(p, paths, root) for m, p in mods.items()}
    return [f"{m} ({layer[m]}) imports {t} ({layer[t]}) at line {line}"
            for m, targets in sorted(_edges(mods).items()) for t, line in sorted(targets.items())
            if layer[m] and layer[t] and layer[t] != layer[m] and layer[t] not in allowed[layer[m]]]


def test_no_module_imports_itself_through_a_circle():
    mods = _modules()
    edges = _edges(mods)
    circles = _circles(edges)
    described = []
    for comp in circles:
        inside = set(comp)
        described.append("; ".join(f"{a} -> {b} (line {edges[a][b]})" for a in comp for b in sorted(edges[a])
                                   if b in inside))
    assert not circles, "import circles:\n" + "\n".join(described)


def test_every_module_belongs_to_one_layer_of_the_architecture_doc():
    paths, allowed = _layers()
    for _, layer in paths:
        assert layer in allowed
    for layer, may in allowed.items():
        assert may <= set(allowed), f"layer {layer} may import unknown layers {may - set(allowed)}"
    missing = sorted(m for m, p in _modules().items() if _layer_of(p, paths) is None)
    assert not missing, f"modules in no layer of docs/architecture.md's 'Layers and imports' table: {missing}"


def test_no_module_imports_a_layer_above_its_own():
    upward = _upward()
    assert not upward, "imports against docs/architecture.md's layers:\n" + "\n".join(upward)


def test_the_walk_finds_a_circle_through_a_lazy_or_type_only_import_and_an_upward_import(tmp_path: Path):
    """The checks catch what they must on a tree made for it: fleet/x.py imports generation/y.py inside a
    function (upward), which imports fleet/x.py under TYPE_CHECKING (a circle)."""
    for pkg in ("belayer_plugin", "belayer_plugin/fleet", "belayer_plugin/generation", "hooks"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "belayer_plugin/fleet/x.py").write_text("def f():\n    from belayer_plugin.generation import y\n")
    (tmp_path / "belayer_plugin/generation/y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from belayer_plugin.fleet.x import f\n")
    edges = _edges(_modules(tmp_path))
    assert _circles(edges) == [["belayer_plugin.fleet.x", "belayer_plugin.generation.y"]]
    assert "belayer_plugin.fleet.x (fleet) imports belayer_plugin.generation.y (generation) at line 2" \
        in _upward(tmp_path)
    assert _layer_of(ROOT / "belayer_plugin" / "sandbox" / "config.py", _layers()[0]) == "base"


def test_every_module_docstring_says_what_it_owns_and_what_it_must_not_do():
    """Each module opens by saying what it owns and what it must not do (the stand-ins SGLang imports under
    other packages' names, engines/sglang_standins/, are not Belayer modules and are left out)."""
    lacking = []
    for mod, path in sorted(_modules().items()):
        if ".sglang_standins" in mod:
            continue
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())  # wrapped lines joined
        if "Owns:" not in doc or "Must not:" not in doc:
            lacking.append(str(path.relative_to(ROOT)))
    assert not lacking, f"module docstrings without 'Owns:' and 'Must not:': {lacking}"
