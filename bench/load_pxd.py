"""Load benchmark: pxd under many concurrent commands.

    .venv/bin/python bench/load_pxd.py                     # 64 clients x 20 commands, then a bwrap sandbox
    .venv/bin/python bench/load_pxd.py --clients 128 --commands 50

Two set-ups, each printed with its figures:

- ``socket``: one pxd process serving a unix socket (``--socket``, a thread per connection, as a
  sidecar would use it), ``--clients`` connections at once, each running ``--commands`` requests in
  turn: a command that prints a token unique to the request, and a file written then read back;
- ``sandbox``: a real bwrap sandbox whose one pxd connection (the stdio pipe the harness uses) is
  shared by ``--clients`` threads at once; requests queue on the pipe.

Checks: every answer is the one asked for (its own token, its own file bytes), nothing lost or crossed,
the workspace holds exactly the files written. Printed: requests, errors, crossed answers, latency
p50/p99/max per request, requests per second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sandboxes  # noqa: E402
from sandboxes.client import PxdClient  # noqa: E402


def _drive(clients: int, commands: int, client_for) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    crossed = [0]
    lock = threading.Lock()
    gate = threading.Barrier(clients)

    def one(c: int) -> None:
        pxd = client_for(c)
        gate.wait()
        for n in range(commands):
            token = f"c{c:03d}-n{n:03d}"
            t0 = time.perf_counter()
            try:
                if n % 2 == 0:
                    out = pxd.exec(["sh", "-c", f"echo {token}"], timeout_s=60).stdout
                    ok = out.strip() == token
                else:
                    pxd.write_file(f"load/{token}.txt", token * 10)
                    ok = pxd.read_file(f"load/{token}.txt").decode() == token * 10
            except Exception as exc:
                with lock:
                    errors.append(f"{token}: {exc!r}")
                continue
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
                crossed[0] += 0 if ok else 1

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as ex:
        list(ex.map(one, range(clients)))
    wall = time.perf_counter() - started
    latencies.sort()

    def q(p):
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3 if latencies else float("nan")

    return {"requests": clients * commands, "answered": len(latencies), "errors": errors, "crossed": crossed[0],
            "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": latencies[-1] * 1e3 if latencies else float("nan"),
            "per_s": len(latencies) / wall, "wall_s": wall}


def run_socket(clients: int = 64, commands: int = 20) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pxd-load-"))
    ws = work / "ws"
    ws.mkdir()
    sock = str(work / "pxd.sock")
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(ROOT / "sandboxes" / "pxd.py"), "--workspace", str(ws),
                             "--socket", sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # stdin: its lifeline
    try:
        assert proc.stdout.readline().startswith(b"PXD-READY")
        conns = {}
        r = _drive(clients, commands, lambda c: conns.setdefault(c, PxdClient.over_unix_socket(sock)))
        written = sorted(p.name for p in (ws / "load").iterdir())
        r["files_ok"] = len(written) == clients * (commands // 2)
        for c in conns.values():
            c.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return r


def run_sandbox(clients: int = 64, commands: int = 20, runtime: str = "bwrap") -> dict:
    work = Path(tempfile.mkdtemp(prefix="pxd-load-"))
    repo = work / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    (repo / "README").write_text("load\n")
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    try:
        with sandboxes.start(repo, runtime=runtime, store=sandboxes.ImageStore(work / "images"),
                             cache=sandboxes.LayerCache(work / "cache")) as sb:
            r = _drive(clients, commands, lambda c: sb.pxd)
            listed = sb.exec("ls load | wc -l").output.strip()
            r["files_ok"] = listed == str(clients * (commands // 2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r


def _print(name: str, clients: int, commands: int, r: dict) -> None:
    print(f"{name}: {clients} concurrent clients x {commands} requests: answered {r['answered']}/{r['requests']}, "
          f"errors {len(r['errors'])}, crossed answers {r['crossed']}, files as written {r['files_ok']}")
    print(f"  latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms; "
          f"{r['per_s']:.0f} requests/s over {r['wall_s']:.1f} s")
    for e in r["errors"][:3]:
        print("  error:", e)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--commands", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _print("pxd on a unix socket", args.clients, args.commands, run_socket(args.clients, args.commands))
    if shutil.which("bwrap"):
        _print("pxd in a bwrap sandbox (one stdio connection)", args.clients, args.commands,
               run_sandbox(args.clients, args.commands))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
