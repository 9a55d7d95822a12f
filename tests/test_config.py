"""Recipe loading and start-up validation."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from belayer_plugin.config import BelayerConfig, ConfigError, load_belayer_config, load_recipe, validate


def _raw() -> dict:
    return OmegaConf.to_container(load_recipe("fleet_demo").belayer)


def test_default_recipe_is_valid_and_fault_tolerance_is_off_by_default():
    cfg, _ = load_belayer_config("fleet_demo")
    assert isinstance(cfg, BelayerConfig)
    assert cfg.use_fault_tolerance is False
    assert cfg.router.host == "" and cfg.engines.host == ""  # "": the node's own address (loopback locally)
    assert cfg.sandbox.network == "none"
    assert cfg.chaos.enabled is False


def test_one_override_toggles_fault_tolerance():
    cfg, _ = load_belayer_config("fleet_demo", ["belayer.use_fault_tolerance=true"])
    assert cfg.use_fault_tolerance is True


def test_every_missing_key_is_named_at_once_with_its_dotted_path():
    raw = _raw()
    del raw["monitor"]["probe_timeout_s"]
    del raw["restart"]  # a whole section: each of its keys must be named
    del raw["engines"]["sglang"]["python"]
    del raw["use_fault_tolerance"]
    with pytest.raises(ConfigError) as ei:
        validate(raw)
    msg = str(ei.value)
    for key in ["belayer.monitor.probe_timeout_s", "belayer.engines.sglang.python", "belayer.use_fault_tolerance",
                "belayer.restart.max_restarts", "belayer.restart.window_s", "belayer.restart.min_healthy_engines"]:
        assert f"{key}: missing" in msg, key
    from belayer_plugin.config import RestartConfig

    # the three keys deleted one by one, plus every key of the deleted section
    assert len(ei.value.problems) == 3 + len(dataclasses.fields(RestartConfig))


def test_an_empty_section_names_all_leaf_keys():
    with pytest.raises(ConfigError) as ei:
        validate({})
    missing = {p.split(":")[0] for p in ei.value.problems}
    assert "belayer.engines.sglang.device" in missing
    assert "belayer.chaos.seed" in missing
    assert len(missing) == len(ei.value.problems) > 60


def test_invalid_values_and_unknown_keys_are_all_reported():
    raw = _raw()
    raw["engines"]["kind"] = "gpu"
    raw["router"]["port"] = "eighty"
    raw["monitor"]["failure_threshold"] = 0
    raw["restart"]["backoff_multiplier"] = 0.5
    raw["use_fault_tolerance"] = "yes"
    raw["engines"]["num_enignes"] = 3
    raw["shadow"]["standby_nice"] = 20
    with pytest.raises(ConfigError) as ei:
        validate(raw)
    msg = str(ei.value)
    assert "belayer.engines.kind: must be one of ['cpu', 'sglang'], got 'gpu'" in msg
    assert "belayer.router.port: expected an integer" in msg
    assert "belayer.monitor.failure_threshold: must be >= 1" in msg
    assert "belayer.restart.backoff_multiplier: must be >= 1" in msg
    assert "belayer.use_fault_tolerance: expected true/false" in msg
    assert "belayer.engines.num_enignes: unknown key" in msg
    assert "belayer.shadow.standby_nice: must be in 0..19" in msg


def test_cross_section_problem_is_reported():
    raw = _raw()
    raw["restart"]["min_healthy_engines"] = 5
    raw["engines"]["num_engines"] = 2
    with pytest.raises(ConfigError, match="min_healthy_engines: larger than engines.num_engines"):
        validate(raw)


def test_engines_host_is_never_a_wildcard_and_defaults_to_the_nodes_own_address():
    from belayer_plugin.engines.launch import engine_host

    raw = _raw()
    raw["engines"]["host"] = "0.0.0.0"
    with pytest.raises(ConfigError, match="belayer.engines.host: '0.0.0.0' is a wildcard"):
        validate(raw)
    assert engine_host("198.18.0.2") == "198.18.0.2"
    assert engine_host("") == "127.0.0.1"  # outside Ray; inside, the node's address (tests/test_netns_multinode.py)


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError, match="fleet_demo"):
        load_belayer_config("no_such_recipe")


def test_schema_is_registered_in_hydra_config_store():
    from hydra.core.config_store import ConfigStore

    from belayer_plugin.config import register_configs

    register_configs()
    assert "schema.yaml" in ConfigStore.instance().list("belayer")


def test_cli_config_check_exits_2_and_names_problems(tmp_path, capsys):
    from belayer_plugin.cli import main

    recipe = tmp_path / "broken.yaml"
    recipe.write_text("defaults:\n  - belayer: default\n  - _self_\nbelayer:\n  engines:\n    kind: tpu\n"
                      "  monitor:\n    failure_threshold: -1\n")
    assert main(["config", "check", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "belayer.engines.kind" in err and "belayer.monitor.failure_threshold" in err
    assert main(["config", "check", "fleet_demo", "belayer.use_fault_tolerance=true"]) == 0


def test_a_run_dir_holding_an_earlier_run_is_refused_before_anything_starts(tmp_path, capsys):
    from belayer_plugin.cli import main

    used = tmp_path / "used"
    (used / "learner-ckpt" / "step-2").mkdir(parents=True)
    # Refused before Ray or any engine starts: the new run would resume the old run's learner at step 2
    assert main(["run", "demo", f"belayer.run_dir={used}"]) == 2
    err = capsys.readouterr().err
    assert "belayer.run_dir" in err and "learner-ckpt/" in err and str(used) in err
    assert sorted(p.name for p in used.iterdir()) == ["learner-ckpt"], "nothing written into the earlier run"
    (used / "learner-ckpt" / "step-2").rmdir()
    (used / "report.json").write_text("{}")
    assert main(["run", "demo", f"belayer.run_dir={used}"]) == 2
    assert "report.json" in capsys.readouterr().err
    import sys

    # main(argv) from a caller leaves the caller's process alone: scikit-learn is not marked unavailable
    assert sys.modules.get("sklearn", "absent") is not None
