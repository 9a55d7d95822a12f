"""The `belayer` command: run recipes, check configs, build the tiny model and environments.

Owns: the `belayer` command line (argument parsing, dispatch to the modules that do the work). Must not: hold
logic of its own beyond printing what those modules return.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import NoReturn, Optional

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

    if args.action == "show":
        _, raw = load_belayer_config(args.recipe, args.overrides)
        print(OmegaConf.to_yaml(raw))
        return 0
    cfg = _check_recipe(args.recipe, args.overrides)
    print(f"{args.recipe}: valid (use_fault_tolerance={cfg.use_fault_tolerance})")
    return 0


def _check_recipe(recipe: str, overrides: list[str]):
    """`config check`: the belayer section, the reference loop's `loop` section when the recipe has one, and
    the chaos trigger against that loop (what `belayer run` refuses at start-up); every problem at once."""
    from belayer_plugin.config import load_recipe, validate, validate_section

    raw = load_recipe(recipe, overrides)
    if "belayer" not in raw:
        load_belayer_config(recipe, overrides)  # raises its ConfigError, which says how to add the section
    problems: list[str] = []
    cfg = lc = None
    try:
        cfg = validate(raw.belayer)
    except ConfigError as e:
        problems += e.problems
    if "loop" in raw:
        from belayer_plugin.loop import LoopConfig, chaos_problems

        try:
            lc = validate_section(LoopConfig, raw.get("loop"), "loop")
        except ConfigError as e:
            problems += e.problems
        if cfg is not None:
            problems += chaos_problems(cfg, lc)
            if lc is not None:
                from belayer_plugin.sandbox.remote import placement_problems

                problems += placement_problems(cfg, lc)
    if problems:
        raise ConfigError(problems)
    return cfg


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


def _cmd_fleet(args: argparse.Namespace) -> int:
    """Talks to a running fleet's control server (FleetManager.serve_control)."""
    import json
    import os

    import httpx

    url = args.control or os.environ.get("BELAYER_CONTROL_URL", "")
    if not url:
        print("belayer fleet: no control server: pass --control URL or set BELAYER_CONTROL_URL", file=sys.stderr)
        return 2
    calls = {"status": ("GET", "/fleet", None),
             "drain": ("POST", "/drain", lambda: {"engine": args.engine}),
             "scale-in": ("POST", "/scale_in", lambda: {"n": args.n}),
             "scale-out": ("POST", "/scale_out", lambda: {"n": args.n}),
             "upgrade": ("POST", "/rolling_upgrade", lambda: {"weights_path": args.weights_path,
                                                              "version": args.version})}
    method, path, body = calls[args.fleet_cmd]
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body() if body else None, timeout=args.timeout)
    except httpx.HTTPError as e:
        print(f"belayer fleet: {url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        out = r.json()
    except ValueError:
        out = {"ok": False, "error": {"message": r.text[:500], "code": r.status_code}}
    if r.status_code != 200:
        print(f"belayer fleet {args.fleet_cmd}: HTTP {r.status_code}: {out.get('error', {}).get('message', out)}",
              file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `belayer` console command."""
    # argv None: the process entry (console script, python -m), Belayer's own process; a caller's argv
    # (tests, a trainer) keeps its process as it is: its imports and its normal exit.
    own_process = argv is None
    if own_process:
        from belayer_plugin.lean_imports import skip_unused_imports

        skip_unused_imports()
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

    nr = sub.add_parser("nemo-rl", help="run a NeMo-RL run script unchanged with Belayer's hook installed "
                        "(recipe keys switch it on: policy.generation.sglang_cfg.use_fault_tolerance)")
    nr.add_argument("script")
    nr.add_argument("script_args", nargs=argparse.REMAINDER)
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

    f = sub.add_parser("fleet", help="a running fleet's control server: status, drain ENGINE, scale-in N, "
                                     "scale-out N, upgrade WEIGHTS VERSION")
    f.add_argument("--control", default="", help="the control server's URL (default: $BELAYER_CONTROL_URL)")
    f.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the fleet's answer")
    fsub = f.add_subparsers(dest="fleet_cmd", required=True)
    fsub.add_parser("status", help="engines, states, weight versions, requests in flight")
    fd = fsub.add_parser("drain", help="move ENGINE's requests to the others (token level), then stop it")
    fd.add_argument("engine")
    for name, what in (("scale-in", "drain and remove N engines"), ("scale-out", "add N engines (standbys first)")):
        fs = fsub.add_parser(name, help=what)
        fs.add_argument("n", type=int)
    fu = fsub.add_parser("upgrade", help="rolling weight upgrade, one engine at a time")
    fu.add_argument("weights_path")
    fu.add_argument("version")
    f.set_defaults(fn=_cmd_fleet)

    rest = sys.argv[1:] if argv is None else list(argv)
    if rest[:1] == ["soak"]:  # its own parser, options and --help included
        return _cmd_soak(argparse.Namespace(rest=rest[1:]))
    if rest[:1] == ["nemo-rl"]:  # everything after the script is the script's own (its --config, overrides)
        from belayer_plugin.hooks.nemo_rl.launch import main as nemo_rl_main

        return nemo_rl_main(rest[1:])
    args = p.parse_args(argv)
    try:
        rc = args.fn(args)
    except ConfigError as err:
        print(f"belayer: {err}", file=sys.stderr)
        return 2
    if own_process and args.cmd == "run":
        _exit_without_teardown(rc)
    return rc


def _exit_without_teardown(rc: int) -> NoReturn:
    """Ends the process once the main job is done: other threads are joined and atexit handlers run (Ray's
    shutdown, logging's flush), as at a normal exit, but the interpreter's teardown of the torch and
    transformers modules is skipped: ~2.5 s of CPU at every run's end on a 2-core VM, freeing memory the
    kernel frees anyway."""
    import atexit
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()  # what the interpreter's own shutdown would wait for
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
