"""A headless Chromium driven over the Chrome DevTools protocol: the viewer's browser tests and the
screenshots in the docs go through it.

Debian's ``chromium`` (installed by ``scripts/setup.sh``) runs with a fresh profile and no network
beyond loopback; the protocol is spoken over a websocket (``websocket-client``, which the Kubernetes
client already brings), so no driver binary or browser download is needed::

    with Browser() as browser:
        browser.goto("http://127.0.0.1:3001/")
        browser.click("a[href^='/runs/']")
        print(browser.text("h1"))
        browser.screenshot("page.png")
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--hide-scrollbars", "--remote-allow-origins=*", "--remote-debugging-port=0")


class BrowserError(RuntimeError):
    """Chromium did not start, a page did not load, or a script on the page failed."""


class Browser:
    """One headless Chromium and one page of it; ``with Browser() as b`` stops it (and its profile) at the end."""

    def __init__(self, executable: str | None = None, *, width: int = 1280, height: int = 900,
                 timeout_s: float = 60.0) -> None:
        self.executable = executable or shutil.which("chromium") or "/usr/bin/chromium"
        self.width, self.height, self.timeout_s = width, height, timeout_s
        self._ids = itertools.count(1)
        self._events: list[dict[str, Any]] = []  # protocol events read while waiting for an answer
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Browser":
        import websocket

        if not Path(self.executable).is_file():
            raise BrowserError(f"no chromium at {self.executable} (scripts/setup.sh installs Debian's)")
        self.profile = Path(tempfile.mkdtemp(prefix="posttrain-chromium-"))
        self.proc = subprocess.Popen(
            [self.executable, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={self.width},{self.height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while not (port_file.is_file() and len(port_file.read_text().splitlines()) >= 2):
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited ({self.proc.returncode}): {self.proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                self.close()
                raise BrowserError(f"chromium wrote no {port_file} within {self.timeout_s:g} s")
            time.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=self.timeout_s) as resp:
            pages = [t for t in json.load(resp) if t.get("type") == "page"]
        if not pages:
            self.close()
            raise BrowserError("chromium opened no page")
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=self.timeout_s,
                                              suppress_origin=True)
        self.send("Page.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
            self.ws = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(getattr(self, "profile", ""), ignore_errors=True) if getattr(self, "profile", None) else None

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One protocol command; returns its result once answered (events that come first are kept)."""
        call_id = next(self._ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            message = json.loads(self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._events.append(message)
        raise BrowserError(f"{method}: no answer within {self.timeout_s:g} s")

    def _wait_event(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for i, event in enumerate(self._events):
                if event.get("method") == method:
                    del self._events[: i + 1]
                    return
            self._events.append(json.loads(self.ws.recv()))
        raise BrowserError(f"no {method} within {self.timeout_s:g} s")

    def goto(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        self._events = []
        result = self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"{url}: {result['errorText']}")
        self._wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression on the page (a promise's, once it settles)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails'].get('text')} "
                               f"{result['exceptionDetails'].get('exception', {}).get('description', '')}")
        return result.get("result", {}).get("value")

    def text(self, selector: str = "body") -> str:
        """The rendered text of the first element matching ``selector``."""
        value = self.evaluate(f"(document.querySelector({json.dumps(selector)}) || {{}}).innerText")
        if value is None:
            raise BrowserError(f"no element {selector!r} on {self.url()}")
        return value

    def url(self) -> str:
        return self.evaluate("location.href")

    def click(self, selector: str) -> None:
        """Click the first element matching ``selector`` (a link: wait for the page it opens)."""
        self._events = []
        found = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                              "if (!e) return false; e.click(); return true; })()")
        if not found:
            raise BrowserError(f"no element {selector!r} to click on {self.url()}")
        self._wait_event("Page.loadEventFired")

    def screenshot(self, path: str | Path, *, full_page: bool = True, max_height: int = 2400) -> Path:
        """A PNG of the page (its whole height up to ``max_height`` pixels with ``full_page``)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            height = min(int(self.evaluate("document.documentElement.scrollHeight")), max_height)
            width = int(self.evaluate("document.documentElement.scrollWidth"))
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        data = self.send("Page.captureScreenshot", **params)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
