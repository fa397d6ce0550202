"""Nothing `alignflow run` started outlives it, even when it is killed with SIGKILL.

`alignflow run` starts this as its own process: `python -m alignflow.infra.watchdog PID CREATE_TIME`. It
notes the run's descendants every second (a private Ray head with its workers and stage jobs, Prefect's
temporary server), and when the run's process is gone, ends every one it noted that is still the same
process (SIGTERM, then SIGKILL). Then it removes the folders of private heads whose run is gone (this run's, and
any an earlier killed run left). A run that exits normally stops its head and removes its folder itself. Stage
jobs on a cluster stop themselves through their lease (`infra/lease.py`).
"""

from __future__ import annotations

import subprocess
import sys
import time


def start(pid: int, started: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "alignflow.infra.watchdog", str(pid), str(started)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # not in the run's process group: a Ctrl-C there does not end it


def watch(pid: int, started: float, every_s: float = 1.0, grace_s: float = 10.0) -> None:
    import psutil

    me = psutil.Process()
    noted: dict[int, float] = {}
    while True:
        try:
            parent = psutil.Process(pid)
            if abs(parent.create_time() - started) > 1.0:
                break
            for child in parent.children(recursive=True):
                if child.pid != me.pid:
                    noted.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            break
        time.sleep(every_s)
    left = []
    for child_pid, created in noted.items():
        try:
            proc = psutil.Process(child_pid)
            if abs(proc.create_time() - created) < 1.0:
                proc.terminate()
                left.append(proc)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    from alignflow.infra.services import sweep_private_homes

    sweep_private_homes()  # now that nothing of the run's head writes there


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]))
