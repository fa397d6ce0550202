"""A real browser on the UIs: Debian's headless Chromium, driven over its DevTools protocol (a websocket), renders
a page (its scripts run, its API calls answer) and gives back the page's visible text, or a screenshot.

Pages are read in real time and polled until the text a test waits for is there: the UIs draw their charts and
tables after their own fetches, which a fixed wait (or Chromium's virtual-time budget) cuts short on a loaded
machine. `make test` installs the `chromium` package."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

WIDTH, HEIGHT = 1440, 900


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "no chromium on PATH: `make test` installs Debian's chromium package (apt-get install chromium)"
    return found


class Page:
    """One tab of a headless Chromium of its own, spoken to with DevTools commands."""

    def __init__(self, ws):
        self._ws, self._ids = ws, itertools.count(1)

    def call(self, method: str, **params) -> dict:
        sent = next(self._ids)
        self._ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:  # events arrive in between; only our answer counts
            message = json.loads(self._ws.recv(timeout=60))
            if message.get("id") == sent:
                assert "error" not in message, f"{method}: {message['error']}"
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def text(self) -> str:
        return re.sub(r"\s+", " ", self.evaluate("document.body ? document.body.innerText : ''") or "").strip()

    def wait_text(self, *until: str, timeout_s: float = 120, settle_s: float = 2.0) -> str:
        """The visible text, whitespace folded: once every string in `until` shows and the text has stopped
        changing for `settle_s` (or the time is up: the caller's assertion then says what is missing)."""
        deadline, last, since = time.time() + timeout_s, None, time.time()
        while time.time() < deadline:
            text = self.text()
            if text != last:
                last, since = text, time.time()
            elif all(s in text for s in until) and time.time() - since >= settle_s:
                break
            time.sleep(0.5)
        return last or ""

    def type_into(self, placeholder: str, value: str) -> None:
        """Type into the input with this placeholder, as a person would (React sees an input event)."""
        found = self.evaluate(f"""(() => {{
            const box = document.querySelector({json.dumps(f'input[placeholder="{placeholder}"]')});
            if (!box) return false;
            Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, "value").set.call(box, {json.dumps(value)});
            box.dispatchEvent(new Event("input", {{bubbles: true}}));
            return true;
        }})()""")
        assert found, f"no input with placeholder {placeholder!r}"

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        assert path.stat().st_size > 10_000, f"{path}: an empty page?"
        return path


@contextlib.contextmanager
def open_page(url: str):
    # Chromium's helper processes may still write to the profile for a moment after the browser is gone.
    with tempfile.TemporaryDirectory(prefix="alignflow-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                 "--hide-scrollbars", "--no-first-run", f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
                                 "--remote-debugging-port=0", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            port = _devtools_port(proc, Path(profile))
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT"),
                                        timeout=30) as r:
                target = json.loads(r.read())
            with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
                page = Page(ws)
                page.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
                page.call("Page.navigate", url=url)
                yield page
        finally:  # the browser and its renderer, GPU and crash-handler processes: its whole process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _devtools_port(proc: subprocess.Popen, profile: Path, timeout: float = 60) -> int:
    deadline = time.time() + timeout
    port_file = profile / "DevToolsActivePort"  # Chromium writes its chosen port here
    while time.time() < deadline:
        assert proc.poll() is None, f"chromium exited: {proc.stderr.read()[-2000:]}"
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text().split()[0])
        time.sleep(0.2)
    raise AssertionError("chromium did not open its DevTools port")
