"""The `belayer` command: run recipes, check configs, build the tiny model and environments."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Optional

from belayer_plugin.config import ConfigError, load_belayer_config


def _cmd_demo(args: argparse.Namespace) -> int:
    from belayer_plugin.demo import run_fleet_demo

    cfg, raw = load_belayer_config(args.recipe, args.overrides)
    report = asyncio.run(run_fleet_demo(cfg, raw))
    return 0 if report["deterministic"] else 1


def _cmd_run(args: argparse.Namespace) -> int:
    from belayer_plugin.loop import ReferenceLoop

    cfg, raw = load_belayer_config(args.recipe, args.overrides)
    loop = ReferenceLoop(cfg, raw)
    report = asyncio.run(loop.run())
    return 0 if report["status"] == "ok" else 1


def _cmd_config(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    cfg, raw = load_belayer_config(args.recipe, args.overrides)
    if args.action == "show":
        print(OmegaConf.to_yaml(raw))
    else:
        print(f"{args.recipe}: valid (use_fault_tolerance={cfg.use_fault_tolerance})")
    return 0


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from belayer_plugin.engines.tiny_model import make_tiny

    path = make_tiny(args.dir, seed=args.seed)
    print(f"tiny model written to {path}")
    return 0


def _cmd_envs(args: argparse.Namespace) -> int:
    try:
        from belayer_plugin.envs.build import main as envs_main
    except ImportError as e:
        print(f"environment builds are not available: {e}", file=sys.stderr)
        return 2
    return int(envs_main(args.rest) or 0)


def _cmd_soak(args: argparse.Namespace) -> int:
    from belayer_plugin.soak import main as soak_main

    return soak_main(args.rest)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `belayer` console command."""
    p = argparse.ArgumentParser(prog="belayer", description="Fault tolerance for agentic LLM RL training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="start a fleet of engines behind the router and send greedy requests")
    d.add_argument("--recipe", default="fleet_demo")
    d.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. belayer.engines.num_engines=3")
    d.set_defaults(fn=_cmd_demo)

    r = sub.add_parser("run", help="run the reference agentic RL loop on a recipe (the main job)")
    r.add_argument("recipe", nargs="?", default="demo", help="a name under recipes/ or a YAML path")
    r.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. belayer.use_fault_tolerance=false")
    r.set_defaults(fn=_cmd_run)

    c = sub.add_parser("config", help="show or check a recipe (validation names every problem at once)")
    c.add_argument("action", choices=["show", "check"])
    c.add_argument("recipe")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=_cmd_config)

    m = sub.add_parser("models", help="models for tests and demos")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    mt = msub.add_parser("make-tiny", help="build the tiny Qwen2 model and its tokenizer in DIR")
    mt.add_argument("dir")
    mt.add_argument("--seed", type=int, default=0)
    mt.set_defaults(fn=_cmd_make_tiny)

    e = sub.add_parser("envs", help="sandbox environments (build NAME, list)")
    e.add_argument("rest", nargs=argparse.REMAINDER)
    e.set_defaults(fn=_cmd_envs)

    so = sub.add_parser("soak", help="randomized fail-stop campaigns: soak envs|engines|all [--trials N --seed S "
                                     "--duration SECONDS] (writes soak.json and soak.png)", add_help=False)
    so.add_argument("rest", nargs=argparse.REMAINDER)
    so.set_defaults(fn=_cmd_soak)

    rest = sys.argv[1:] if argv is None else list(argv)
    if rest[:1] == ["soak"]:  # its own parser, options and --help included
        return _cmd_soak(argparse.Namespace(rest=rest[1:]))
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"belayer: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
