"""A sandbox command's latency on Podman: `runc exec` (sandbox.podman_exec: runc, the default) vs `podman exec`.

--procs processes (2) of --threads workers (4) each loop: create a busybox sandbox, run --execs commands (4) in it
(a write and a read, like an agent's tool call), close it: the load two concurrent rollouts of four trajectories
(two trainers' jobs, or the two arms of `overhead.py --concurrent`) put on the host's Podman.
The two ways alternate in rounds of --round-s seconds (runc, podman, runc, ...) so the machine's drift hits
both; each round builds its own sandboxes. Reported per way: commands run, p50, p99 and max seconds, and how
many took over 1 s (on this machine about 1 in 500 podman execs returned 5 s after its command ended).

Last line: RESULT runc_p50_s=.. podman_p50_s=.. ratio=.. runc_max_s=.. podman_max_s=.. runc_over_1s=..
podman_over_1s=.. n_runc=.. n_podman=..   (ratio: podman p50 / runc p50)
Usage: python bench/sandbox_exec.py [--quick] [--rounds N] [--round-s S] [--procs N] [--threads N] [--execs N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.envs.build import ensure_image  # noqa: E402
from belayer_plugin.sandbox.base import Sandbox, SandboxSpec  # noqa: E402
from belayer_plugin.sandbox.podman import PodmanBackend  # noqa: E402


def one_round(backend: PodmanBackend, image: str, seconds: float, threads: int, execs: int) -> list[float]:
    """Exec latencies of one round (seconds) on `backend`, `threads` workers looping for `seconds`."""
    out: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    end = time.monotonic() + seconds

    def worker() -> None:
        try:
            while time.monotonic() < end:
                sb = Sandbox.create(backend, SandboxSpec(image=image, memory_mb=64, pids_limit=64), exec_timeout_s=30)
                try:
                    for k in range(execs):
                        t0 = time.monotonic()
                        r = sb.exec(f"echo {k} >> /root/log && tail -n 1 /root/log")
                        d = time.monotonic() - t0
                        if r.exit_code != 0 or r.stdout.strip() != str(k):
                            raise RuntimeError(f"exec gave {r}")
                        with lock:
                            out.append(d)
                finally:
                    sb.close()
        except BaseException as e:  # noqa: BLE001  (reported by the caller)
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=seconds + 300)
    if errors:
        raise errors[0]
    return out


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
            "max": xs[-1], "over_1s": sum(1 for x in xs if x > 1.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per way (default 4; --quick 1)")
    ap.add_argument("--round-s", type=float, default=0.0, help="seconds per round (default 30; --quick 10)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4, help="workers per process")
    ap.add_argument("--execs", type=int, default=4)
    ap.add_argument("--child", nargs=3, metavar=("WAY", "STATE", "IMAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one process of a round: its latencies as JSON on stdout
        way, state, image = args.child
        xs = one_round(PodmanBackend(state_dir=state, exec_via=way), image, args.round_s, args.threads, args.execs)
        print(json.dumps(xs))
        return
    rounds = args.rounds or (1 if args.quick else 4)
    round_s = args.round_s or (10.0 if args.quick else 30.0)
    state = Path(tempfile.mkdtemp(prefix="belayer-bench-exec-"))
    ways = {"runc": PodmanBackend(state_dir=state, exec_via="runc"),
            "podman": PodmanBackend(state_dir=state, exec_via="podman")}
    image = ensure_image(ways["podman"], "busybox", str(Path.home() / ".cache" / "belayer" / "envs"))
    lat: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        order = ("runc", "podman") if r % 2 == 0 else ("podman", "runc")
        for w in order:
            procs = [subprocess.Popen([sys.executable, __file__, "--child", w, str(state), image, "--round-s",
                                       str(round_s), "--threads", str(args.threads), "--execs", str(args.execs)],
                                      stdout=subprocess.PIPE) for _ in range(args.procs)]
            xs = []
            for p in procs:
                out, _ = p.communicate(timeout=round_s + 600)
                if p.returncode != 0:
                    sys.exit(f"a {w} worker process failed (exit {p.returncode})")
                xs += json.loads(out.decode().strip().splitlines()[-1])
            s = summary(xs)
            print(f"round {r + 1}/{rounds} {w:6s}: {s['n']} commands, p50 {s['p50']:.3f} s, p99 {s['p99']:.3f} s, "
                  f"max {s['max']:.3f} s, over 1 s: {s['over_1s']}", flush=True)
            lat[w] += xs
    probe = Sandbox.create(ways["runc"], SandboxSpec(image=image, memory_mb=64, pids_limit=64))
    try:
        probe.exec("true")
    finally:
        probe.close()
    if ways["runc"]._runc_ok is not True:
        sys.exit("runc exec was not used (no runc state for podman's containers here): nothing to compare")
    a, b = summary(lat["runc"]), summary(lat["podman"])
    print(f"runc exec   : {a['n']} commands, p50 {a['p50']:.3f} s, p99 {a['p99']:.3f} s, max {a['max']:.3f} s, "
          f"over 1 s: {a['over_1s']}")
    print(f"podman exec : {b['n']} commands, p50 {b['p50']:.3f} s, p99 {b['p99']:.3f} s, max {b['max']:.3f} s, "
          f"over 1 s: {b['over_1s']}")
    print(f"RESULT runc_p50_s={a['p50']:.3f} podman_p50_s={b['p50']:.3f} ratio={b['p50'] / a['p50']:.1f} "
          f"runc_max_s={a['max']:.2f} podman_max_s={b['max']:.2f} runc_over_1s={a['over_1s']} "
          f"podman_over_1s={b['over_1s']} n_runc={a['n']} n_podman={b['n']}")


if __name__ == "__main__":
    main()
