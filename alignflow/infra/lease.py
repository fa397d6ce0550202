"""One writer per stage output: a lease in storage, renewed by the run that holds it.

`{stage folder}/job/LEASE.json` is created exclusively (O_EXCL on disk; `If-None-Match: *` on S3, which
refuses a second create) by the task before it submits the stage's job, renewed while it waits on the
job, and deleted when the task ends. So:
- a second run of the same stage finds it held and waits for it to go (then takes the published result
  as a cache hit), or fails at once (`ray.wait_for_running_stage: false`);
- the job watches it, and stops itself when it is not renewed for `timeout_s` or another run holds it:
  a flow process killed with SIGKILL leaves no job training on;
- a lease whose holder is gone (its process, on this host; or no renewal within `timeout_s`, measured
  by the watcher's own clock, so hosts' clocks need not agree) is taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from alignflow.infra import storage

LEASE_FILE = "job/LEASE.json"
LEASE_ENV = "ALIGNFLOW_LEASE"  # "<lease uri>|<holder>|<timeout s>", for the job to watch


class LeaseHeld(RuntimeError):
    """Another live run holds the stage."""


def process_holder(tag: str) -> str:
    """`host:pid:create time:tag`: names this process so that `holder_gone` can tell, later and from any
    process on this host, whether it still runs (a recycled pid has another create time)."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time()}:{tag}"


@dataclass
class Lease:
    uri: str
    timeout_s: float
    holder: str = field(default_factory=lambda: process_holder(uuid.uuid4().hex[:8]))
    renewals: int = 0
    last_renewed: float = 0.0

    def _body(self) -> str:
        return json.dumps({"holder": self.holder, "renewals": self.renewals, "timeout_s": self.timeout_s})

    def renew(self, every_s: float | None = None) -> None:
        """Write a new renewal count (at most once per `every_s`, default a quarter of the timeout)."""
        if time.time() - self.last_renewed < (every_s if every_s is not None else self.timeout_s / 4):
            return
        self.renewals += 1
        try:
            storage.write_text(self.uri, self._body())
        except Exception:  # a storage hiccup: the next poll tries again (the job waits timeout_s before it gives up)
            return
        self.last_renewed = time.time()

    @contextmanager
    def renewing(self) -> Iterator[None]:
        """Renew from a thread of its own while the body runs (a slow Jobs API must not starve the lease)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.timeout_s / 4):
                self.renew(every_s=0)

        thread = threading.Thread(target=loop, name="alignflow-lease-renew", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def release(self) -> None:
        if read(self.uri).get("holder") == self.holder:
            storage.remove(self.uri)

    def env(self) -> str:
        return f"{self.uri}|{self.holder}|{self.timeout_s}"


def read(uri: str) -> dict:
    try:
        return json.loads(storage.read_text(uri))
    except (FileNotFoundError, ValueError):
        return {}


def acquire(stage_uri: str, timeout_s: float, wait: bool, on_wait=lambda holder: None, poll_s: float = 1.0) -> Lease:
    """The stage's lease, once no live run holds it; `wait=False`: LeaseHeld at once instead."""
    lease = Lease(storage.join(stage_uri, LEASE_FILE), timeout_s)
    seen, since, told = None, time.monotonic(), False
    while True:
        try:
            storage.create_exclusive(lease.uri, lease._body())
            lease.last_renewed = time.time()
            return lease
        except FileExistsError:
            pass
        current = read(lease.uri)
        if current != seen:  # renewed (or replaced): the holder is alive as of now
            seen, since = current, time.monotonic()
        if holder_gone(current.get("holder", "")) or time.monotonic() - since > timeout_s:
            storage.remove(lease.uri)  # stale; racing takers both retry the exclusive create, one wins
            continue
        if not wait:
            raise LeaseHeld(f"{stage_uri} is being written by another run ({current.get('holder')}); "
                            "set ray.wait_for_running_stage: true to wait for it")
        if not told:
            on_wait(current.get("holder"))
            told = True
        time.sleep(poll_s)


OWNER_FILE = ".owner"  # in a folder owned by a process: its `process_holder`


def claim(folder: Path, tag: str) -> None:
    """Mark `folder` as this process's, so that a later run can tell when it is abandoned."""
    (folder / OWNER_FILE).write_text(process_holder(tag))


def owner_gone(folder: Path) -> bool:
    """True when the folder's owner process is gone, or it has no (readable) owner."""
    try:
        return holder_gone((folder / OWNER_FILE).read_text())
    except OSError:
        return True


def sweep_abandoned(folders: Iterable[Path], unowned_after_s: float | None = None) -> None:
    """Remove the folders whose owner is gone (a run killed with SIGKILL cannot remove its own). A folder
    with no owner file is being made: it is abandoned only once older than `unowned_after_s` (never if None)."""
    for folder in folders:
        if (folder / OWNER_FILE).exists():
            gone = owner_gone(folder)
        else:
            gone = unowned_after_s is not None and folder.is_dir() and time.time() - folder.stat().st_mtime > unowned_after_s
        if gone:
            shutil.rmtree(folder, ignore_errors=True)


def holder_gone(holder: str) -> bool:
    """True when the holder ran on this host and its process is gone (else only its renewals tell)."""
    import psutil

    try:
        host, pid, started, _ = holder.rsplit(":", 3)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(started)) > 1.0
    except psutil.NoSuchProcess:
        return True
    except ValueError:
        return False


class Watcher:
    """The job's side: `lost()` says why the job should stop, or None while its run holds the lease."""

    def __init__(self, spec: str):
        self.uri, self.holder, timeout = spec.rsplit("|", 2)
        self.timeout_s = float(timeout)
        self.seen, self.since = None, time.monotonic()

    def watch(self, every_s: float | None = None) -> None:
        """In a daemon thread: when the lease is lost, say why and end the process (its run is gone). Looks every
        `every_s` (default: half the timeout, at most 5 s)."""
        every_s = every_s if every_s is not None else min(5.0, self.timeout_s / 2)
        from alignflow.exit_codes import ORPHANED

        def loop() -> None:
            while True:
                time.sleep(every_s)
                reason = self.lost()
                if reason:
                    print(f"error: stopping this stage job: {reason}", flush=True)
                    os._exit(ORPHANED)

        threading.Thread(target=loop, name="alignflow-lease", daemon=True).start()

    def lost(self) -> str | None:
        try:
            current = read(self.uri)
        except Exception:  # storage unreachable for now: no verdict (a long outage fails the job by itself)
            return None
        if current.get("holder") != self.holder:
            return f"another run now holds {self.uri}, or the run that started this job released it"
        if current != self.seen:
            self.seen, self.since = current, time.monotonic()
        elif time.monotonic() - self.since > self.timeout_s:
            return f"the run that started this job stopped renewing {self.uri} {self.timeout_s:.0f}s ago (it was killed?)"
        return None
