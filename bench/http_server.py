"""The HTTP servers' cost per call: the capture front's overhead per ``/generate`` and requests/s,
for this tree and for a baseline revision, measured side by side in one run.

    .venv/bin/python bench/http_server.py                        # baseline: a531de2
    .venv/bin/python bench/http_server.py --baseline-rev REV --calls 2000 --clients 16 --rounds 3

What is measured (the same code for both trees, each in a subprocess of its own that imports that
tree's ``serving``): a simulated engine with no service time (``serving.sim.SimEngine``), served by
the engine server (``serving.http.serve``), and the capture front (``serving.capture.serve_sidecar``)
in front of it. One client on a kept-alive connection times ``POST /generate`` straight to the
engine server and through the front: the front's overhead is the difference, one more HTTP hop plus
its capture. Then ``--clients`` clients, a connection each, send ``--calls`` calls through the front
at once: requests/s. The baseline's tree is a ``git worktree`` of ``--baseline-rev``, removed after.
The trees are measured in turn, ``--rounds`` times; each figure is the best of its rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BODY = json.dumps({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}).encode()


def _call(conn: http.client.HTTPConnection) -> None:
    conn.request("POST", "/generate", BODY, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    assert resp.status == 200, (resp.status, data[:200])


def _ms_per_call(url: str, calls: int) -> float:
    """Median of ``calls`` sequential calls on one kept-alive connection, in ms."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    for _ in range(20):  # warm: the connection, the server's threads
        _call(conn)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        _call(conn)
        times.append(time.perf_counter() - t0)
    conn.close()
    return statistics.median(times) * 1e3


def _requests_per_s(url: str, calls: int, clients: int) -> float:
    host, port = url.removeprefix("http://").split(":")
    per_client = max(1, calls // clients)
    ready = threading.Barrier(clients + 1)

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        _call(conn)
        ready.wait()
        for _ in range(per_client):
            _call(conn)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return per_client * clients / (time.perf_counter() - t0)


def measure(root: Path, calls: int, clients: int) -> dict:
    """The figures for the tree at ``root`` (its ``serving`` is imported first)."""
    sys.path.insert(0, str(root))
    import serving  # noqa: E402  (imported here: from the tree being measured, not this one)
    from serving.capture import serve_sidecar
    from serving.http import serve
    from serving.sim import ServiceModel, SimEngine

    assert Path(serving.__file__).resolve().is_relative_to(root.resolve()), serving.__file__
    engine = serve(SimEngine(service=ServiceModel(prefill_s_per_token=0.0, decode_step_s=0.0, decode_s_per_req=0.0)))
    front = serve_sidecar(engine.url)
    try:
        direct_ms = _ms_per_call(engine.url, calls)
        front_ms = _ms_per_call(front.url, calls)
        rps = _requests_per_s(front.url, calls, clients)
    finally:
        front.shutdown()
        engine.shutdown()
    return {"direct_ms": direct_ms, "front_ms": front_ms, "overhead_ms": front_ms - direct_ms, "front_rps": rps}


def _run_measure(root: Path, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", str(root),
                          "--calls", str(args.calls), "--clients", str(args.clients)],
                         cwd=root, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"measuring {root} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="a531de2", help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per figure (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients for requests/s (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per tree (default: %(default)s)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the subprocess: one tree's figures
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.calls, args.clients)))
        return 0

    load_before = os.getloadavg()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline_rev], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="http-bench-") as tmp:
        worktree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(worktree), rev], cwd=REPO, check=True)
        try:
            for _ in range(args.rounds):  # alternated, so a busy moment of the machine hits both
                runs["old"].append(_run_measure(worktree, args))
                runs["new"].append(_run_measure(REPO, args))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    # The best round of each: the figure least disturbed by other work on the machine.
    old, new = ({key: (max if key.endswith("rps") else min)(r[key] for r in runs[side]) for key in runs[side][0]}
                for side in ("old", "new"))
    for side in (old, new):
        side["overhead_ms"] = side["front_ms"] - side["direct_ms"]

    print(f"capture front over the simulated engine: {args.calls} calls per figure, {args.clients} clients for "
          f"requests/s, best of {args.rounds} alternated rounds")
    print(f"{'':34}{'baseline ' + rev:>16}{'this tree':>14}{'new/old':>10}")
    rows = [("ms per /generate, engine direct", "direct_ms"), ("ms per /generate, through front", "front_ms"),
            ("front overhead, ms per call", "overhead_ms"), ("requests/s through front", "front_rps")]
    for label, key in rows:
        print(f"{label:34}{old[key]:>16.3f}{new[key]:>14.3f}{new[key] / old[key]:>10.2f}")
    # The machine's load beside the figures: both trees ran under it, in turns.
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f} at the start, {:.2f} {:.2f} {:.2f} at the end".format(
        *load_before, *os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
