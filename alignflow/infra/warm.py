"""The warm stage server: stage jobs forked from a process that has imported torch, DeepSpeed, transformers,
MLflow and alignflow's stages once, instead of each job importing them again (2-4 s a job on a CPU).

A Ray head that alignflow starts (infra/services.py `start_ray_head`) starts one beside it, on a Unix socket in
the head's private folder, and puts the socket's path in the head's environment, which every job inherits.
The job's entry point (`python -m alignflow.stages …`, unchanged) then hands itself to the server
(`delegate`): it sends its arguments, environment, working directory and stdin/stdout/stderr (SCM_RIGHTS), the
server forks, and the fork becomes the job, with the job's own files, environment and command line. The entry
point stays the job's process for Ray: it forwards the signals Ray sends (a stopped job) to the fork, and exits
with the fork's exit status. The fork dies with its entry point (SIGKILL from Ray, or a head that is gone):
it holds the connection open and ends its process group when the other end closes.

A job the server cannot make exactly as a fresh process would is started fresh (the entry point goes on as
before and says why): an environment variable that the preloaded modules or native libraries read at import
with another value, another interpreter or alignflow, or alignflow's source changed since the server started.
There is no server on a machine with a GPU (CUDA must not be initialised before a fork; a GPU stage's compute
dwarfs its imports), nor on a head alignflow did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

SOCKET_ENV = "ALIGNFLOW_WARM_SOCKET"
PRELOAD = ("alignflow.stages.common.entry", *(f"alignflow.stages.{kind}.stage" for kind in
           ("sft", "rm", "dpo", "kto", "rl", "eval", "generate", "label", "select")),
           "transformers", "transformers.models.auto.modeling_auto", "mlflow", "mlflow.tracking", "matplotlib.pyplot",
           "matplotlib.backends.backend_agg")
# Read by native libraries when they load (OpenMP, MKL, the allocator, the loader) or by the interpreter at start:
# a job whose value differs is started fresh.
NATIVE_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "MALLOC_", "CUDA", "NVIDIA_", "TORCH", "PYTORCH")
INTERPRETER_VARS = ("PYTHONHASHSEED", "PYTHONPATH", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONSAFEPATH",
                    "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONHOME")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def available() -> bool:
    """Not where a GPU is visible (checked without importing torch): CUDA is never initialised before a fork."""
    return sys.platform == "linux" and not any(name.startswith("nvidia") for name in os.listdir("/dev"))


def launch(*, socket_path: str, lifeline: str, env: dict[str, str], log: str) -> subprocess.Popen:
    """Start a server for jobs that connect to `socket_path`; it lives until the pid in the file `lifeline` is gone."""
    import subprocess

    with open(log, "ab") as out:
        server = subprocess.Popen([sys.executable, "-u", "-m", "alignflow.infra.warm", "--socket", socket_path,
                                   "--lifeline", lifeline], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    with open(socket_path + ".pid", "w") as f:  # a job that comes before the socket waits for it
        f.write(str(server.pid))
    return server


def bind(*, lifeline: str, pid: int) -> None:
    """From now on the server lives as long as process `pid` (until then, as long as the process that started it)."""
    with open(lifeline + ".new", "w") as f:
        f.write(str(pid))
    os.replace(lifeline + ".new", lifeline)


# ----------------------------------------------------------------------------------------------------- the client


def delegate(argv: list[str], module: str = "alignflow.stages") -> None:
    """Run `python -m module *argv` as a fork of the warm server, then exit with its status. Returns (having
    done nothing) when no server is configured or it declines the job: the caller starts the job itself."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return
    conn = _connect(path)
    if conn is None:
        print(f"alignflow: no warm stage server at {path}; starting the stage process fresh", file=sys.stderr, flush=True)
        return
    import alignflow

    request = {"module": module, "argv": argv, "cwd": os.getcwd(), "executable": sys.executable,
               "alignflow": alignflow.__file__, "env": {k: v for k, v in os.environ.items() if k != SOCKET_ENV}}
    body = json.dumps(request).encode()
    socket.send_fds(conn, [len(body).to_bytes(4, "big") + body], [0, 1, 2])
    reply = _read_reply(conn)
    if "pid" not in reply:
        conn.close()
        print(f"alignflow: the warm stage server declined this job ({reply.get('cold', 'no reply')}); "
              "starting the stage process fresh", file=sys.stderr, flush=True)
        return
    print(f"alignflow: stage process {reply['pid']} forked from the warm stage server", file=sys.stderr, flush=True)
    for sig in FORWARDED:  # Ray stops a job by signalling its entry point: the fork gets the signal
        signal.signal(sig, lambda signum, frame: conn.send(bytes([signum])))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # Ray's workers block SIGINT (the fork's mask is the server's)
    status = _read_reply(conn)
    if "signal" in status:  # ended by a signal: so does the entry point, by the same one
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set (nor needs to be)
            signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    if "exit" not in status:
        print("alignflow: the warm stage server ended while the stage ran", file=sys.stderr, flush=True)
    os._exit(status.get("exit", 1))


def _connect(path: str, wait_s: float = 60.0) -> socket.socket | None:
    """The server's socket; while the server is still importing (its pid file is there, the socket not yet),
    wait for it: no slower than importing here."""
    deadline = time.time() + wait_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError:
            conn.close()
        if time.time() > deadline or not _starting(path):
            return None
        time.sleep(0.05)


def _starting(path: str) -> bool:
    try:
        os.kill(int(open(path + ".pid").read()), 0)
        return not os.path.exists(path + ".failed")
    except (OSError, ValueError):
        return False


def _read_reply(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)  # a signal handler runs, and the call resumes (PEP 475)
        if not chunk:
            return {}
        data += chunk
    return json.loads(data)


# ----------------------------------------------------------------------------------------------------- the server


# Modules that read the whole environment at import, looking for their own prefix (their settings).
PREFIX_SCANS = {os.path.join("fsspec", "config.py"): "FSSPEC_", os.path.join("tqdm", "utils.py"): "TQDM_"}


class _ReadRecorder(os._Environ):
    """os.environ, noting every variable read (and its value then) while the preloaded modules import, and the
    prefixes of those that scan it; `listed` names a module that read all of it for an unknown purpose."""

    def __init__(self, environ: os._Environ):
        super().__init__(environ._data, environ.encodekey, environ.decodevalue, environ.encodevalue, environ.decodevalue)
        self.reads: dict[str, str | None] = {}
        self.prefixes: set[str] = set()
        self.listed: str | None = None

    def __getitem__(self, key):
        scan = self._scan()  # a scan's reads are covered by its prefix
        try:
            value = super().__getitem__(key)
        except KeyError:
            if scan is None:
                self.reads.setdefault(key, None)
            raise
        if scan is None:
            self.reads.setdefault(key, value)
        return value

    def __iter__(self):
        scan = self._scan()
        if scan is not None:
            self.prefixes.add(scan)
        elif self.listed is None:
            self.listed = self._caller()
        return super().__iter__()

    def _caller(self) -> str:
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename in
                                     (os.__file__, __file__)):
            frame = frame.f_back  # this class, and os's own: dict(), .items(), .get(), .copy()
        return frame.f_code.co_filename if frame is not None else "?"

    def _scan(self) -> str | None:
        caller = self._caller()
        return next((prefix for name, prefix in PREFIX_SCANS.items() if caller.endswith(os.sep + name)), None)


def source_stamp(package_dir: str) -> list[tuple[str, int, int]]:
    """alignflow's source files, with their sizes and modification times: a change makes later jobs start fresh."""
    stamp = []
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                stamp.append((os.path.join(folder, name), st.st_size, st.st_mtime_ns))
    return stamp


class Preloaded:
    """What the server imported, and under which environment: the test a job must pass to be forked."""

    def __init__(self, modules: tuple[str, ...] = PRELOAD) -> None:
        import importlib
        import threading

        before, running = dict(os.environ), set(threading.enumerate())
        recorder = os.environ = _ReadRecorder(os.environ)
        if "transformers" in modules:  # told first, as a job's model load tells it: no scikit-learn or SciPy (2 s here)
            from alignflow.stages.common.models import transformers_without_unused_extras

            transformers_without_unused_extras()
        for name in modules:
            importlib.import_module(name)
        os.environ = os._Environ(recorder._data, recorder.encodekey, recorder.decodevalue, recorder.encodevalue,
                                 recorder.decodevalue)
        import alignflow

        # A fork has only the thread that forked: one that a preloaded module started would be missing there.
        self.threads = [t.name for t in threading.enumerate() if t not in running]
        self.reads, self.prefixes, self.listed, self.start_env = recorder.reads, recorder.prefixes, recorder.listed, before
        # What the imports set (DeepSpeed's accelerator): a fresh job would have set it too.
        self.writes = {k: v for k, v in os.environ.items() if before.get(k) != v}
        self.alignflow = alignflow.__file__
        self.stamp = source_stamp(os.path.dirname(alignflow.__file__))

    def refusal(self, request: dict) -> str | None:
        """Why this job cannot be a fork (None: it can)."""
        env = request["env"]
        if request["executable"] != sys.executable:
            return f"another interpreter ({request['executable']}, the server's is {sys.executable})"
        if request["alignflow"] != self.alignflow:
            return f"another alignflow ({request['alignflow']}, the server's is {self.alignflow})"
        if self.threads:
            return f"a preloaded module started threads ({', '.join(self.threads)}), which a fork would not have"
        if self.listed:
            return f"{self.listed} read the whole environment when the server imported it"
        for key, value in self.reads.items():
            if env.get(key) != value:
                return f"{key} differs from the server's when it imported ({value!r} there, {env.get(key)!r} here)"
        prefixes = (*NATIVE_PREFIXES, *self.prefixes)
        for key in {*env, *self.start_env}:
            if (key.startswith(prefixes) or key in INTERPRETER_VARS) and env.get(key) != self.start_env.get(key):
                return f"{key} differs from the server's ({self.start_env.get(key)!r} there, {env.get(key)!r} here)"
        if source_stamp(os.path.dirname(self.alignflow)) != self.stamp:
            return "alignflow's source changed since the server started"
        return None


def serve(path: str, lifeline: str, modules: tuple[str, ...] = PRELOAD) -> dict:
    """Accept jobs until the head is gone. Returns only in a fork, with the job's request (the fork runs it at
    the module's top level, so that it ends as a fresh process would: atexit handlers, finalizers)."""
    pid_file = path + ".pid"
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    try:
        preloaded = Preloaded(modules)
    except BaseException:
        open(path + ".failed", "w").close()
        raise
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # connectable only once it is ready
    print(f"warm stage server ready on {path} (pid {os.getpid()}), env read at import: {sorted(preloaded.reads)}", flush=True)
    selector, jobs = selectors.DefaultSelector(), {}
    selector.register(listener, selectors.EVENT_READ, "accept")
    watched = _Lifeline(lifeline)
    try:
        while watched.alive():
            for key, _ in selector.select(timeout=0.5):
                if key.data != "accept":
                    _reap(key.data, selector, jobs)
                    continue
                request = _accept(listener, preloaded, selector, jobs)
                if request is not None:  # in the fork: the server's files are its parent's
                    selector.close()
                    listener.close()
                    return request
    except BaseException:
        open(path + ".failed", "w").close()
        raise
    listener.close()
    for name in (path, pid_file):
        with contextlib.suppress(OSError):
            os.unlink(name)
    return {}


class _Lifeline:
    """The server lives as long as the head: until its pid file names a process, as long as the process that
    started the server (it is starting the head)."""

    def __init__(self, pid_file: str) -> None:
        self.pid_file, self.parent, self.pid = pid_file, os.getppid(), None

    def alive(self) -> bool:
        if self.pid is None:
            try:
                self.pid = int(open(self.pid_file).read())
            except (OSError, ValueError):
                return os.getppid() == self.parent  # an orphan is adopted by another process
        return _exists(self.pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _accept(listener: socket.socket, preloaded: Preloaded, selector: selectors.BaseSelector, jobs: dict) -> dict | None:
    """Take one job: fork it (returns its request, in the fork) or decline it (None)."""
    conn, _ = listener.accept()
    conn.settimeout(10)  # a client that connects and sends nothing does not stall the server
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError) as exc:
        print(f"dropped a request: {exc}", flush=True)
        conn.close()
        return None
    refusal = preloaded.refusal(request)
    if refusal:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"cold": refusal}).encode() + b"\n")
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become_job(conn, fds, request, preloaded, jobs)
        return request
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    pidfd = os.pidfd_open(pid)  # readable when the fork ends
    jobs[pidfd] = (pid, conn)
    selector.register(pidfd, selectors.EVENT_READ, pidfd)
    return None


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request needs its length and three file descriptors")
    size = int.from_bytes(data[:4], "big")
    data = data[4:]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("the request ended early")
        data += chunk
    return json.loads(data), fds


def _reap(pidfd: int, selector, jobs: dict) -> None:
    pid, conn = jobs.pop(pidfd)
    selector.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    reply = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:  # the entry point is gone (killed): nobody to tell
        pass
    conn.close()


def _become_job(conn: socket.socket, fds: list[int], request: dict, preloaded: Preloaded, jobs: dict) -> None:
    """In the fork: take the job's files, environment, directory and command line, and die with its entry point."""
    import threading

    for pidfd, (_, other) in jobs.items():  # the other jobs' are the server's
        os.close(pidfd)
        other.close()
    os.setsid()  # its own process group, ended as a whole when its entry point is gone
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts it
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in preloaded.writes.items():
        os.environ.setdefault(key, value)
    sys.argv = [sys.argv[0], *request["argv"]]
    _fresh_random_state()
    _set_title(request)
    conn.settimeout(None)
    threading.Thread(target=_follow_entry_point, args=(conn,), daemon=True, name="warm-lifeline").start()


def _follow_entry_point(conn: socket.socket) -> None:
    """Signals the entry point forwards, and its end: then this process group ends too."""
    while True:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if not data:
            os.killpg(0, signal.SIGKILL)
        for signum in data:
            os.kill(os.getpid(), signum)


def _fresh_random_state() -> None:
    """A fresh process draws fresh seeds (Python's `random` reseeds itself at fork); stages seed what they need."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _set_title(request: dict) -> None:
    """`ps` shows the job's own command line, not the server's."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join([request["executable"], "-u", "-m", request["module"], *request["argv"]]))


def run_job(request: dict) -> None:
    """The job itself, in the fork: `python -m module` (its exit is the interpreter's, as for a fresh process)."""
    import runpy

    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m alignflow.infra.warm")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--lifeline", required=True, help="a file that will hold the pid of the process to live as long as")
    parser.add_argument("--preload", default=",".join(PRELOAD), help="the modules to import, comma-separated")
    args = parser.parse_args()
    job = serve(args.socket, args.lifeline, tuple(filter(None, args.preload.split(","))))
    if job:
        run_job(job)
    else:  # the head is gone. Finalizing what was preloaded (torch, transformers, MLflow) would hold up the
        # head's stop by 2 s here, and nothing of it needs finalizing: its socket and pid file are removed.
        sys.stdout.flush()
        os._exit(0)
