"""The warm stage server (infra/warm.py) with real processes: a server preloading a small module, and entry points
that hand their job to it as `python -m alignflow.stages` does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.infra import warm

ROOT = Path(__file__).resolve().parents[2]
PROBE = '''
import os, signal, sys, time
import preloaded  # imported by the server already: the fork does not import it again
print("argv", sys.argv[1:], "cwd", os.getcwd(), "X", os.environ.get("X"), "server", warm_env())
print("to stderr", file=sys.stderr)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "term":
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), os._exit(3)))
if sys.argv[1] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
open("pid", "w").write(str(os.getpid()))
print("waiting", flush=True)
time.sleep(60)
'''.replace("warm_env()", "os.environ.get('ALIGNFLOW_WARM_SOCKET')")
PRELOADED = 'import os\nIMPORTED_IN = os.getpid()\nSETTING = os.environ.get("AF_PROBE_SETTING")\nos.environ.setdefault("AF_PROBE_WRITTEN", "yes")\n' \
            'import atexit, sys\nSERVER = sys.argv[0].endswith(os.path.join("infra", "warm.py"))  # not a test importing it\n' \
            'atexit.register(lambda: SERVER and os.getpid() == IMPORTED_IN and print("server finalized", flush=True))\n'
CLIENT = "import sys; from alignflow.infra import warm; warm.delegate(sys.argv[1:], module='probe'); print('fresh'); " \
         "import runpy; runpy.run_module('probe', run_name='__main__', alter_sys=True)"


@pytest.fixture
def server(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "preloaded.py").write_text(PRELOADED)
    lifeline = subprocess.Popen(["sleep", "600"])
    (tmp_path / "head").write_text(str(lifeline.pid))
    sock = tmp_path / "warm.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AF_PROBE_SETTING": "a"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "alignflow.infra.warm", "--socket", str(sock), "--lifeline",
                             str(tmp_path / "head"), "--preload", "preloaded"], cwd=tmp_path, env=env,
                            stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while not sock.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert sock.exists(), (tmp_path / "server.log").read_text()
    yield {"socket": str(sock), "proc": proc, "lifeline": lifeline, "dir": tmp_path, "env": env}
    for p in (proc, lifeline):
        p.kill()
        p.wait()


def entry_point(server, *args: str, wait: bool = True, **env: str):
    """`python -c CLIENT args`: the entry point, in the probe's folder, with the server's environment."""
    full = {**server["env"], warm.SOCKET_ENV: server["socket"], "X": "1", **env}
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, *args], cwd=server["dir"], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_the_fork_is_the_job_with_its_arguments_directory_environment_files_and_exit_code(server):
    code, out, err = entry_point(server, "exit", "7")
    assert code == 7, err
    assert "forked from the warm stage server" in err and "to stderr" in err and "fresh" not in out
    assert f"argv ['exit', '7'] cwd {server['dir']} X 1 server None" in out  # the socket's variable is not the job's


def test_a_signal_to_the_entry_point_reaches_the_job_and_its_death_by_signal_is_the_entry_points(server):
    proc = entry_point(server, "term", wait=False)
    assert proc.stdout.readline().startswith("argv") and proc.stdout.readline() == "waiting\n"
    proc.send_signal(signal.SIGTERM)  # how Ray stops a job
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "got SIGTERM" in out, err
    code, _, err = entry_point(server, "sigkill")
    assert code == -signal.SIGKILL, err


def test_the_job_dies_with_its_entry_point(server):
    proc = entry_point(server, "sleep", wait=False)
    assert proc.stdout.readline().startswith("argv") and proc.stdout.readline() == "waiting\n"
    job = int((server["dir"] / "pid").read_text())
    assert job != proc.pid
    proc.kill()  # SIGKILL, as Ray's last resort or a head that is gone: nothing is forwarded
    proc.wait()
    deadline = time.time() + 10
    while _alive(job) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(job)


def test_a_job_the_server_cannot_make_exactly_starts_fresh_and_says_why(server):
    code, out, err = entry_point(server, "exit", "0", AF_PROBE_SETTING="b")  # read by a preloaded module at import
    assert code == 0 and "fresh" in out and "AF_PROBE_SETTING differs" in err, err
    code, out, err = entry_point(server, "exit", "0", OMP_NUM_THREADS="7")  # read by OpenMP when it loads
    assert code == 0 and "OMP_NUM_THREADS differs" in err, err
    code, out, err = entry_point(server, "exit", "0", **{warm.SOCKET_ENV: str(server["dir"] / "nothing.sock")})
    assert code == 0 and "no warm stage server" in err and "fresh" in out


def test_the_server_ends_with_its_head(server):
    server["lifeline"].kill()
    server["lifeline"].wait()
    assert server["proc"].wait(timeout=10) == 0
    assert not os.path.exists(server["socket"])
    # It ends at once: what it preloaded is not finalized (torch and the rest held up the head's stop by 2 s).
    assert "server finalized" not in (server["dir"] / "server.log").read_text()


def test_the_preloaded_state_says_what_a_job_must_match(monkeypatch, tmp_path):
    (tmp_path / "af_warm_preloaded.py").write_text(PRELOADED)
    monkeypatch.setenv("AF_PROBE_SETTING", "a")
    monkeypatch.setenv("AF_PROBE_WRITTEN", "")
    monkeypatch.delenv("AF_PROBE_WRITTEN")  # removed again after the test, once the import has set it
    monkeypatch.syspath_prepend(str(tmp_path))
    job_env = dict(os.environ)
    preloaded = warm.Preloaded(("af_warm_preloaded",))
    assert preloaded.reads["AF_PROBE_SETTING"] == "a" and preloaded.writes == {"AF_PROBE_WRITTEN": "yes"}
    request = {"executable": sys.executable, "alignflow": preloaded.alignflow, "env": job_env}
    assert preloaded.refusal(request) is None
    assert "another interpreter" in preloaded.refusal({**request, "executable": "/usr/bin/python3"})
    preloaded.stamp = preloaded.stamp[1:]
    assert "alignflow's source changed" in preloaded.refusal(request)
    (tmp_path / "af_warm_threaded.py").write_text("import threading, time\n"
                                                 "threading.Thread(target=time.sleep, args=(5,), daemon=True, name='poller').start()\n")
    assert "started threads (poller)" in warm.Preloaded(("af_warm_threaded",)).refusal(request)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")
    except OSError:
        return False
