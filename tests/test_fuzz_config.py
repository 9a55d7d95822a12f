"""Fuzzing recipe validation (hypothesis): every key of the Belayer section (and the reference loop's) given
a value of the wrong type, a number far out of range, or an unknown key next to it, alone or several at
once: validation raises ConfigError naming each problem with its dotted path, and never anything else.
"""

from __future__ import annotations

import copy
import dataclasses
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from belayer_plugin.config import BelayerConfig, ConfigError, load_recipe, validate, validate_section

FUZZ_EXAMPLES = {"wrong_type": 300, "range": 200, "unknown": 100}


def _leaves(cls: type, prefix: str) -> list[tuple[str, typing.Any]]:
    """(dotted path, declared type) of every leaf key of a config dataclass."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, f"{prefix}.{f.name}")
        else:
            out.append((f"{prefix}.{f.name}", tp))
    return out


def _sections(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = [prefix]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _sections(hints[f.name], f"{prefix}.{f.name}")
    return out


LEAVES = _leaves(BelayerConfig, "belayer")
SECTIONS = _sections(BelayerConfig, "belayer")
_BASE = OmegaConf.to_container(load_recipe("demo").belayer)


def _set(raw: dict, dotted: str, value) -> None:
    keys = dotted.split(".")[1:]
    for k in keys[:-1]:
        raw = raw[k]
    raw[keys[-1]] = value


def _wrong_value(tp) -> st.SearchStrategy:
    """Values that are not of type `tp` (a bool is not an int here; an int is a valid float)."""
    if typing.get_origin(tp) is list:
        return st.one_of(st.integers(), st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), min_size=1))
    bad = {
        bool: st.one_of(st.integers(), st.text(max_size=5), st.floats(allow_nan=False), st.lists(st.booleans(), max_size=2)),
        int: st.one_of(st.booleans(), st.text(max_size=5), st.floats(allow_nan=False).filter(lambda x: x != int(x) if x == x and abs(x) < 1e300 else True),
                       st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), min_size=1)),
        float: st.one_of(st.booleans(), st.text(max_size=5), st.lists(st.floats(), max_size=2), st.none()),
        str: st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False), st.lists(st.text(max_size=3), max_size=2)),
    }
    return bad.get(tp, st.just(object()))


@st.composite
def wrong_types(draw):
    picks = draw(st.lists(st.sampled_from([p for p, tp in LEAVES if tp in (bool, int, float, str)
                                           or typing.get_origin(tp) is list]), min_size=1, max_size=4, unique=True))
    types = dict(LEAVES)
    return [(p, draw(_wrong_value(types[p]))) for p in picks]


@settings(max_examples=FUZZ_EXAMPLES["wrong_type"], deadline=None, derandomize=True)
@given(mutations=wrong_types())
def test_wrong_types_anywhere_are_all_named_with_their_dotted_paths(mutations):
    raw = copy.deepcopy(_BASE)
    for path, value in mutations:
        _set(raw, path, value)
    with pytest.raises(ConfigError) as ei:
        validate(raw)
    named = {p.split(":")[0] for p in ei.value.problems}
    for path, value in mutations:
        assert path in named, f"{path}={value!r} not named: {ei.value.problems}"


@settings(max_examples=FUZZ_EXAMPLES["range"], deadline=None, derandomize=True)
@given(path=st.sampled_from([p for p, tp in LEAVES if tp in (int, float)]),
       value=st.one_of(st.integers(-(2**70), -1), st.integers(2**40, 2**70), st.sampled_from([-1e300, 1e300, -0.5])))
def test_numbers_far_out_of_range_pass_or_are_named_never_crash(path, value):
    """A huge or negative number is either a legal value or a ConfigError naming its key (or the keys it
    conflicts with); validation itself never raises anything else."""
    raw = copy.deepcopy(_BASE)
    _set(raw, path, value)
    try:
        validate(raw)
    except ConfigError as e:
        section, leaf = path.rsplit(".", 1)
        assert any(p.startswith(section + ".") and leaf in p for p in e.problems) or \
            any("min_healthy_engines" in p for p in e.problems), (path, value, e.problems)


@settings(max_examples=FUZZ_EXAMPLES["unknown"], deadline=None, derandomize=True)
@given(section=st.sampled_from(SECTIONS),
       key=st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True), value=st.one_of(st.integers(), st.text(max_size=4)))
def test_unknown_keys_in_any_section_are_named(section, key, value):
    raw = copy.deepcopy(_BASE)
    node = raw
    for k in section.split(".")[1:]:
        node = node[k]
    if key in node:
        return  # a real key: covered by the other tests
    node[key] = value
    with pytest.raises(ConfigError) as ei:
        validate(raw)
    assert any(p.startswith(f"{section}.{key}: unknown key") for p in ei.value.problems), ei.value.problems


def test_loop_section_wrong_values_are_named():
    from belayer_plugin.loop import LoopConfig

    raw = OmegaConf.to_container(load_recipe("demo").loop)
    raw.update(num_steps="two", turns=0, lr=-1.0, extra=1)
    with pytest.raises(ConfigError) as ei:
        validate_section(LoopConfig, raw, "loop")
    text = "\n".join(ei.value.problems)
    assert "loop.num_steps: expected an integer" in text and "loop.extra: unknown key" in text
