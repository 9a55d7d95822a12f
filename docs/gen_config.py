#!/usr/bin/env python3
"""Writes docs/configuration.md from the config dataclasses and the recipe that holds their defaults.

Sources, read as text (nothing of belayer_plugin is imported, so the page is the same on any machine):
- ``belayer_plugin/config.py`` and ``belayer_plugin/sandbox/config.py``: the typed dataclasses (section names,
  keys, types, allowed values, class docstrings and the comments on or above each field);
- ``recipes/belayer/default.yaml``: every default value and its comment;
- ``belayer_plugin/loop.py`` (``LoopConfig``) and ``recipes/demo.yaml`` (its ``loop:`` section): the main
  job's own knobs.

A key in the dataclasses without a default in the recipe (or the other way round) is an error: the page and
the schema cannot disagree. ``tests/test_docs.py`` regenerates the page and fails when the committed one differs.

    .venv/bin/python docs/gen_config.py            # rewrite docs/configuration.md
    .venv/bin/python docs/gen_config.py --out F    # write elsewhere (the test does this)
    .venv/bin/python docs/gen_config.py --root DIR # read the sources from another checkout
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"
SCHEMA_FILES = ("belayer_plugin/config.py", "belayer_plugin/sandbox/config.py")
DEFAULTS = "recipes/belayer/default.yaml"
LOOP_FILE, LOOP_CLASS, LOOP_RECIPE = "belayer_plugin/loop.py", "LoopConfig", "recipes/demo.yaml"
ROOT_CLASS = "BelayerConfig"


# --------------------------------------------------------------------------------------------- dataclasses
@dataclass
class Field:
    name: str
    type: str
    choices: tuple[str, ...] = ()
    comment: str = ""


@dataclass
class Klass:
    name: str
    source: str
    doc: str = ""
    fields: list[Field] = field(default_factory=list)


def _comments(text: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without '#', whether the line holds nothing else)."""
    out: dict[int, tuple[str, bool]] = {}
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            alone = lines[line - 1].strip().startswith("#")
            out[line] = (tok.string[1:].strip(), alone)
    return out


def _field_comment(lineno: int, comments: dict[int, tuple[str, bool]]) -> str:
    """The comment block right above a field, then the one at the end of its line."""
    above: list[str] = []
    n = lineno - 1
    while n in comments and comments[n][1]:
        above.insert(0, comments[n][0])
        n -= 1
    parts = [" ".join(above)] if above else []
    if lineno in comments and not comments[lineno][1]:
        parts.append(comments[lineno][0])
    return " ".join(p for p in parts if p)


def _choices(value: Optional[ast.expr]) -> tuple[str, ...]:
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "_one_of":
        return tuple(a.value for a in value.args if isinstance(a, ast.Constant))
    return ()


def read_dataclasses(rel: str, only: Optional[str] = None) -> dict[str, Klass]:
    text = (ROOT / rel).read_text()
    comments = _comments(text)
    out: dict[str, Klass] = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef) or (only and node.name != only):
            continue
        if not any(getattr(d, "id", "") == "dataclass" for d in node.decorator_list):
            continue
        k = Klass(node.name, rel, " ".join((ast.get_docstring(node) or "").split()))
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                k.fields.append(Field(st.target.id, ast.unparse(st.annotation), _choices(st.value),
                                      _field_comment(st.lineno, comments)))
        out[node.name] = k
    return out


def read_tuple_comments(rel: str, name: str) -> list[tuple[str, str]]:
    """(value, end-of-line comment) for each string of a module-level tuple, e.g. CHAOS_EXPECTATIONS."""
    text = (ROOT / rel).read_text()
    comments = _comments(text)
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name for t in node.targets):
            assert isinstance(node.value, ast.Tuple)
            return [(e.value, comments.get(e.lineno, ("", False))[0]) for e in node.value.elts
                    if isinstance(e, ast.Constant)]
    raise SystemExit(f"gen_config: {name} not found in {rel}")


# --------------------------------------------------------------------------------------------- YAML comments
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")


def _split_comment(rest: str) -> tuple[str, str]:
    """Splits a YAML value from its trailing comment (a '#' outside quotes, after a space)."""
    quote = ""
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].rstrip(), rest[i + 1:].strip()
    return rest.rstrip(), ""


def yaml_comments(rel: str) -> tuple[str, dict[str, str]]:
    """(the file's leading comment block, dotted key -> comment) for a block-style YAML file.

    A key's comment is the comment block directly above it (same indentation, no blank line between), then
    the comment at the end of its line, then comment-only lines right below it indented deeper (continuations).
    """
    lines = (ROOT / rel).read_text().splitlines()
    header: list[str] = []
    i = 0
    while i < len(lines) and lines[i].lstrip().startswith("#"):
        header.append(lines[i].lstrip()[1:].strip())
        i += 1
    stack: list[tuple[int, str]] = []
    out: dict[str, str] = {}
    above: list[str] = []
    last: Optional[tuple[str, int]] = None  # (dotted key, indent) that a continuation comment extends
    for line in lines[i:]:
        stripped = line.strip()
        if not stripped:
            above, last = [], None
            continue
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("#"):
            text = stripped[1:].strip()
            if last and indent > last[1]:
                out[last[0]] = (out.get(last[0], "") + " " + text).strip()
            else:
                above.append(text)
                last = None
            continue
        m = _KEY.match(line)
        if not m:
            above, last = [], None
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([s[1] for s in stack] + [m.group(2)])
        _, trailing = _split_comment(m.group(3))
        text = " ".join(above + ([trailing] if trailing else []))
        if text:
            out[key] = text
        above = []
        last = (key, indent) if trailing else None
        stack.append((indent, m.group(2)))
    return " ".join(header), out


# --------------------------------------------------------------------------------------------- rendering
def _md(text: str) -> str:
    """Plain text safe in a Markdown table cell (code spans kept as they are)."""
    parts = re.split(r"(`[^`]*`)", text)
    for n, p in enumerate(parts):
        if not p.startswith("`"):
            p = p.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")
            p = p.replace("<", "&lt;")
        else:
            p = p.replace("|", "\\|")
        parts[n] = p
    return "".join(parts)


def _anchor(title: str) -> str:
    """The id MkDocs (toc's slugify) and GitHub both give a heading "`a.b.c`": "abc"."""
    return re.sub(r"[^\w-]", "", title.lower())


def _value(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, str):
        s = '""' if v == "" else v
    elif isinstance(v, list):
        s = "[" + ", ".join(_value(x).strip("`") for x in v) + "]"
    elif v is None:
        s = "null"
    else:
        s = repr(v)
    return f"`{s}`"


def _type(f: Field) -> str:
    t = f.type
    if f.choices:
        return f"`{t}`: " + " \\| ".join(f"`{c}`" for c in f.choices)
    return f"`{t}`"


def _describe(yaml_c: str, schema_c: str) -> str:
    """The recipe's comment on a key and the dataclass's, one above the other; a near-copy is shown once."""
    a, b = " ".join(yaml_c.split()), " ".join(schema_c.split())
    if not a or not b or difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio() >= 0.8:
        return _md(a if len(a) >= len(b) else b)
    return _md(a) + "<br>" + _md(b)


def _section(title: str, anchor: str, k: Klass, values: dict, ycom: dict[str, str], prefix: str,
             classes: dict[str, Klass], extra: str = "") -> tuple[list[str], list[tuple[str, str, Klass]]]:
    """One section's lines, and the nested sections (path, anchor, class) to render after it."""
    lines = [f"## `{title}`", "", f"Dataclass `{k.name}` in `{k.source}`."]
    if k.doc:
        lines += ["", _md(k.doc)]
    if ycom.get(prefix) and ycom[prefix] != k.doc:
        lines += ["", f"In the recipe: {_md(ycom[prefix])}."]
    lines += ["", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested: list[tuple[str, str, Klass]] = []
    for f in k.fields:
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.type in classes:
            sub = f"{title}.{f.name}"
            a = _anchor(sub)
            lines.append(f"| `{f.name}` | section | see [`{sub}`](#{a}) | {_describe(ycom.get(path, ''), f.comment)} |")
            nested.append((sub, path, classes[f.type]))
            continue
        if f.name not in values:
            raise SystemExit(f"gen_config: {title}.{f.name} has no default in the recipe")
        lines.append(f"| `{f.name}` | {_type(f)} | {_value(values[f.name])} | "
                     f"{_describe(ycom.get(path, ''), f.comment)} |")
    if extra:
        lines += ["", extra]
    known = {f.name for f in k.fields}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"gen_config: {title}: keys in the recipe but not in {k.name}: {', '.join(unknown)}")
    return lines, nested


INTRO = """\
# Configuration reference

<!-- Generated by docs/gen_config.py from {schema} and {defaults}. Do not edit by hand:
     run `.venv/bin/python docs/gen_config.py` (tests/test_docs.py fails when this page is stale). -->

Every Belayer key lives under `belayer:`. The dataclasses in `belayer_plugin/config.py` and
`belayer_plugin/sandbox/config.py` declare each key's name, type and allowed values but no default; the
defaults live once, in `recipes/belayer/default.yaml`. A recipe composes that file with
`defaults: [belayer: default, _self_]` and overrides only what it needs; switching Belayer on or off per
experiment is one override, `belayer.use_fault_tolerance=true|false`. The trainer hooks merge their own
`belayer` section over the same defaults (see [verl](trainers/verl.md) and [NeMo-RL](trainers/nemo-rl.md)).

Validation (`belayer_plugin.config.validate`, also `belayer config check RECIPE [overrides]`, exit 2 on a
problem) reports every missing, unknown, wrongly typed or out-of-range key at once, each with its dotted
path. Bad input elsewhere loses nothing either: engines and the front answer a malformed request with 400 and
a reason, and a corrupt or partial sandbox checkpoint is detected by its manifest and never restored.

Secure by default: every server (engines, router, its Prometheus endpoint, the front, the fleet's control
server, Ray) binds 127.0.0.1 unless configured; fault injection lives only in `belayer_plugin.chaos`, imported
only when `belayer.chaos.enabled`; sandboxes get `--network none` unless a recipe sets `sandbox.network`.

In the tables, *default* is the value in `recipes/belayer/default.yaml` (for `loop`: `recipes/demo.yaml`),
and *meaning* is the comment on the key there, then (on its own line, where it says something else) the
comment on the field in its dataclass. With
`use_fault_tolerance: false` (the default) engines run but nothing watches, restarts, hands over, resumes or
checkpoints: a recipe switches Belayer on with `belayer.use_fault_tolerance: true`.

The recipe's own header: {header}

Sections: {toc}
"""


def generate() -> str:
    classes: dict[str, Klass] = {}
    for rel in SCHEMA_FILES:
        classes.update(read_dataclasses(rel))
    if ROOT_CLASS not in classes:
        raise SystemExit(f"gen_config: {ROOT_CLASS} not found in {SCHEMA_FILES}")
    defaults = yaml.safe_load((ROOT / DEFAULTS).read_text())
    header, ycom = yaml_comments(DEFAULTS)

    body: list[str] = []
    titles: list[tuple[str, str]] = []
    queue: list[tuple[str, str, Klass]] = [("belayer", "", classes[ROOT_CLASS])]
    while queue:
        title, path, k = queue.pop(0)
        values: Any = defaults
        for part in [p for p in path.split(".") if p]:
            values = values[part]
        anchor = _anchor(title)
        extra = ""
        if title == "belayer.chaos":
            extra = "Names allowed in `expect` (`CHAOS_EXPECTATIONS` in `belayer_plugin/config.py`; " \
                    "`belayer_plugin/chaos/check.py` asserts each from the run's report and event log):\n\n" + \
                    "\n".join(f"- `{v}`: {_md(c)}" for v, c in read_tuple_comments(SCHEMA_FILES[0],
                                                                                   "CHAOS_EXPECTATIONS"))
        lines, nested = _section(title, anchor, k, values, ycom, path, classes, extra)
        body += lines + [""]
        titles.append((title, anchor))
        queue = nested + queue  # depth first: a section's subsections follow it

    loop = read_dataclasses(LOOP_FILE, LOOP_CLASS)[LOOP_CLASS]
    loop_values = yaml.safe_load((ROOT / LOOP_RECIPE).read_text())["loop"]
    _, loop_com = yaml_comments(LOOP_RECIPE)
    lines, _ = _section("loop", "loop", loop, loop_values, loop_com, "loop", {},
                        extra=f"The main job's own knobs (`belayer run`), outside `belayer:`; there is no "
                              f"shared default file for them: *default* here is `{LOOP_RECIPE}`'s value.")
    body += lines + [""]
    titles.append(("loop", "loop"))

    toc = ", ".join(f"[`{t}`](#{a})" for t, a in titles) + "."
    intro = INTRO.format(schema=" and ".join(SCHEMA_FILES), defaults=DEFAULTS, header=_md(header), toc=toc)
    return (intro + "\n" + "\n".join(body)).rstrip() + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    global ROOT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="read the sources from this checkout instead (e.g. an export of a commit)")
    args = ap.parse_args(argv)
    ROOT = args.root.resolve()
    args.out.write_text(generate())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
