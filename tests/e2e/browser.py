"""A real browser on the UIs: Debian's headless Chromium renders a page (its scripts run, its API calls answer)
and gives back the page's text, or a screenshot. `make test` installs the `chromium` package."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from pathlib import Path

WINDOW = "1440,900"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "no chromium on PATH: `make test` installs Debian's chromium package (apt-get install chromium)"
    return found


def _run(url: str, *args: str, wait_s: int, timeout_s: int) -> subprocess.CompletedProcess:
    # Virtual time: the page's timers and fetches run until it has been idle for wait_s of its own clock.
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", f"--window-size={WINDOW}", f"--virtual-time-budget={wait_s * 1000}", *args, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "HOME": os.environ.get("HOME", "/tmp")})
    assert done.returncode == 0, f"chromium failed on {url}: {done.stderr[-2000:]}"
    return done


def page_text(url: str, wait_s: int = 15, timeout_s: int = 240) -> str:
    """The rendered page's visible text (scripts and styles dropped), whitespace folded."""
    dom = _run(url, "--dump-dom", wait_s=wait_s, timeout_s=timeout_s).stdout
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text))).strip()


def screenshot(url: str, path: Path, wait_s: int = 15, timeout_s: int = 240) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(url, f"--screenshot={path}", wait_s=wait_s, timeout_s=timeout_s)
    assert path.stat().st_size > 10_000, f"{path}: an empty page?"
    return path
