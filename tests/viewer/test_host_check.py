"""The viewer answers only requests addressed to its own names: a guard against DNS rebinding.

While ``posttrain ui`` runs, the viewer serves every rollout, transcript and the home's path on
127.0.0.1:3001. A web page the researcher opens on ``http://evil.example:3001`` can have its DNS name
answer 127.0.0.1 a moment later (DNS rebinding); the browser then sends the page's requests to the
viewer and, the origin being unchanged, lets the page read the answers. The one thing the page
cannot change is the Host header: the browser sends ``evil.example:3001``. So the viewer refuses
any request whose Host is not one of its own names (127.0.0.1, localhost, [::1], the ``--host`` it
serves on and each ``--allow-host``), on any port.

Each test serves the viewer for real with uvicorn on 127.0.0.1 and speaks HTTP to it with
``http.client``, which sends the Host header it is given.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def request(port: int, host: str, method: str = "GET", path: str = "/", headers: dict | None = None) -> tuple[int, str]:
    """``method path`` to 127.0.0.1:``port`` with the Host header ``host``: (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, headers={"Host": host, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.fixture
def home(tmp_path):
    """An empty posttrain home: the viewer's pages over it list nothing, which is enough here."""
    path = tmp_path / "home"
    path.mkdir()
    return path


def test_a_request_for_another_host_is_refused_and_its_own_names_are_served(home):
    from viewer.app import serve_in_thread

    with serve_in_thread(home) as url:
        port = int(url.rsplit(":", 1)[1])
        for own in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LocalHost:{port}"):
            status, page = request(port, own)
            assert status == 200 and "runs" in page, (own, status, page[:200])
        # what a rebinding page sends, on the viewer's port or any other, with or without one
        for evil in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"evil.example:{port + 1}"):
            status, body = request(port, evil)
            assert (status, body) == (400, "Invalid host header"), (evil, status, body[:200])
        status, body = request(port, f"evil.example:{port}", path="/tensorboard")
        assert status == 400
        # there is nothing to post to, from any origin: every route is read-only
        status, _ = request(port, f"127.0.0.1:{port}", "POST", "/", {"Origin": "http://evil.example"})
        assert status == 405


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_python_m_viewer_answers_its_host_and_allowed_names_only(home):
    """``python -m viewer`` as ``posttrain ui`` starts it, with ``--allow-host`` for a name of this
    machine: that name and the loopback names are served, another name is refused."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "viewer", "--home", str(home), "--port", str(port),
                             "--allow-host", "gpu-box.lan"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # until it listens
            assert proc.poll() is None, proc.stdout.read()
            try:
                status, _ = request(port, f"127.0.0.1:{port}")
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "python -m viewer did not listen"
                time.sleep(0.1)
        assert status == 200
        assert request(port, f"gpu-box.lan:{port}")[0] == 200
        assert request(port, f"localhost:{port}")[0] == 200
        assert request(port, f"evil.example:{port}") == (400, "Invalid host header")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_host_that_is_not_a_name_is_refused_at_start(home):
    done = subprocess.run([sys.executable, "-m", "viewer", "--home", str(home), "--port", "1",
                           "--allow-host", "*"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "python -m viewer: host '*': expected a host name or an IP address" in done.stderr
