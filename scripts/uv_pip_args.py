"""Print the `uv pip install` options that make uv install what pip would on this machine: pip's index, extra
indexes, find-links, constraints and CA bundle, read from pip's own configuration (files and PIP_* variables),
and pip's way of choosing among indexes (the best version across all of them, not the first index that has the
package). Used by the Makefile: `uv pip install $(python scripts/uv_pip_args.py) ...`."""

from __future__ import annotations

import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint", "cert": "--cert"}


def pip_config() -> dict[str, list[str]]:
    """Option -> values, later sources (environment variables) overriding earlier ones (files), as pip reads them."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    found: dict[str, list[str]] = {}
    for line in listing.stdout.splitlines():
        key, _, value = line.partition("=")
        section, _, option = key.rpartition(".")
        if option in OPTIONS and section in ("global", "install", ":env:"):
            found[option] = shlex.split(value.strip().strip("'\""))
    return found


def main() -> None:
    args = ["--index-strategy", "unsafe-best-match"]
    for option, values in pip_config().items():
        for value in values:
            args += [OPTIONS[option], value]
    print(shlex.join(args))


if __name__ == "__main__":
    main()
