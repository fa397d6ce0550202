"""Local services on 127.0.0.1: a Ray head, an MLflow server, a Prefect server.

Each is one child process that alignflow starts and stops by its own process id
(its process group, then any process still holding the service's private folder)
— never `ray stop`, which would kill every Ray process of the user on the
machine. Every port is chosen free on 127.0.0.1 and every server binds there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from alignflow.infra import lease, warm
from alignflow.infra.ports import free_port, free_ports
from alignflow.infra.ray_jobs import ON_DEMAND
from alignflow.infra.secrets import without_secrets

BIN = Path(sys.executable).parent  # the same venv's ray / prefect / mlflow


class ServiceError(RuntimeError):
    pass


@dataclass
class Service:
    name: str
    pid: int
    url: str
    home: str  # private folder: logs, temp dir, database
    log: str
    started_at: float = 0.0  # the process's create time: a recycled pid is never signalled

    def alive(self) -> bool:
        import psutil

        try:
            return abs(psutil.Process(self.pid).create_time() - self.started_at) < 1.0
        except psutil.NoSuchProcess:
            return False

    def stop(self, timeout: float = 20.0) -> None:
        stop_process_tree(self.pid if self.alive() else None, self.home, timeout)


def stop_process_tree(pid: int | None, home: str, timeout: float) -> None:
    """Stop a service by its own pid: SIGINT to it, SIGTERM to its process group, then SIGKILL
    to what is left of it and of any process whose command line names its private folder."""
    import psutil

    def ours() -> list[psutil.Process]:
        try:
            if pid is not None:
                os.waitpid(pid, os.WNOHANG)  # reap our own child, or it lingers as a zombie
        except ChildProcessError:
            pass
        found = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if proc.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if proc.info["pid"] == pid or any(home in part for part in proc.info["cmdline"] or []):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    # Ctrl-C first: `ray start --block` and the uvicorn servers shut down cleanly on SIGINT
    # (a Ray head ignores SIGTERM for a long while); then SIGTERM to the group; then SIGKILL.
    for send in (lambda: os.kill(pid, signal.SIGINT), lambda: os.killpg(pid, signal.SIGTERM)):
        try:
            if pid is not None:
                send()
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.time() + timeout / 2
        while time.time() < deadline and ours():
            time.sleep(0.2)
    for proc in ours():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _launch(name: str, cmd: list[str], home: Path, env: dict[str, str], url: str, health: list[str], timeout: float,
            credentials: bool = True) -> Service:
    """Start `cmd` in its own session, logging to `home`, and wait until every health path answers;
    a service that does not come up is stopped again before the error is raised. `credentials=False`:
    the process gets none of the caller's (see infra/secrets.py)."""
    log = home / f"{name}.log"
    base = dict(os.environ) if credentials else without_secrets(dict(os.environ))
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**base, **env})
    import psutil

    service = Service(name, proc.pid, url, str(home), str(log), psutil.Process(proc.pid).create_time())
    try:
        for path in health:
            _wait_http(url + path, proc, str(log), timeout, name)
    except BaseException:
        service.stop()
        raise
    return service


def _wait_http(url: str, proc: subprocess.Popen, log: str, timeout: float, name: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{name} exited with code {proc.returncode} while starting; log: {log}\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise ServiceError(f"{name} at {url} is up but refuses requests without credentials (HTTP {exc.code}); "
                                   f"for Ray, set RAY_AUTH_MODE and RAY_AUTH_TOKEN consistently; log: {log}") from None
            time.sleep(0.5)
        except OSError:
            time.sleep(0.5)
    raise ServiceError(f"{name} did not answer at {url} within {timeout:.0f}s; log: {log}\n{_tail(log)}")


def _tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


HOMES = "/tmp"  # short paths: Ray puts unix sockets under its temp dir, limited to ~107 bytes
HOME_PREFIX = "af-"


def _home(kind: str, base: str | None, keep: str | None = None, claim: bool = False) -> Path:
    """The service's private folder: `keep/kind` when its store is to persist (`alignflow services up`), else a
    new temporary one. `claim`: the service lives no longer than this process, whose folder it then is
    (`sweep_private_homes` removes it once the process is gone)."""
    if keep:
        home = Path(keep).resolve() / kind
        home.mkdir(parents=True, exist_ok=True)
        return home
    home = Path(tempfile.mkdtemp(prefix=f"{HOME_PREFIX}{kind}-", dir=base or HOMES))
    if claim:
        lease.claim(home, f"{kind}-home")
    return home


def sweep_private_homes() -> None:
    """Remove the temporary service folders whose owning process is gone: a run killed with SIGKILL cannot remove
    its own private head's (Ray's logs and sockets). Folders no process claimed are left alone: `alignflow services
    up` leaves its services running after it exits."""
    lease.sweep_abandoned(Path(HOMES).glob(f"{HOME_PREFIX}*"))


def start_all(*starts: Callable[[], Service]) -> list[Service]:
    """Start services at once (each start waits on its own health checks, so a Prefect server's 10-25 s
    overlap the others'); in the order given. If one fails, those that came up are stopped again."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    up, errors = [], []
    for future in futures:
        try:
            up.append(future.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for service in up:
            service.stop()
        raise errors[0]
    return up


# Intel MKL (torch's BLAS on x86) chooses among code paths at run time, so two processes can multiply the same
# matrices 1e-7 apart: a resumed RL run then ended 1e-6 off the uninterrupted run's weights. Its conditional numerical
# reproducibility mode, AUTO (this CPU's fastest path, chosen the same way every time), keeps every process of a
# Ray alignflow starts on one path. A value the user set wins.
REPRODUCIBLE_MATH = {"MKL_CBWR": "AUTO"}


def reproducible_math_env() -> dict[str, str]:
    """The variables that make the native math libraries give the same bits in every process (see above)."""
    return {key: os.environ.get(key, value) for key, value in REPRODUCIBLE_MATH.items()}


def start_ray_head(num_cpus: int | None = None, base: str | None = None, timeout: float = 120,
                   ready_for_jobs: bool = True, claim: bool = False) -> Service:
    """A private Ray head; `url` is its dashboard / Jobs API on 127.0.0.1. `ready_for_jobs`: it has run one job
    (see `_run_first_job`), so a head that outlives its start-up (`alignflow services up`, a test session) gives
    its first stage the same start as its later ones. `claim`: its folder is this process's (see `_home`)."""
    started = time.time()
    home = _home("ray", base, claim=claim)
    gcs, dashboard, client, agent, agent_grpc, env_agent, metrics, node, objects = free_ports(9)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
           "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard}", "--include-dashboard=true", f"--temp-dir={home}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
           f"--metrics-export-port={metrics}", f"--node-manager-port={node}",
           f"--object-manager-port={objects}", f"--num-cpus={num_cpus or os.cpu_count() or 1}"]
    # The venv's bin first on PATH: a job's bare `python` is then this interpreter.
    env = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
           # Ray 2.60 turns token auth on by itself when ~/.ray/auth_token exists (any local `ray.init()`
           # writes one), and then our Jobs API client and health checks would be refused. The mode is set
           # explicitly instead; set RAY_AUTH_MODE=token (with RAY_AUTH_TOKEN) to run the head with auth.
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **reproducible_math_env()}
    server = _start_warm_server(home, env) if warm.available() else None
    if server is not None:
        env[warm.SOCKET_ENV] = str(home / "warm.sock")  # every job inherits it: its entry point hands itself over
    # No credentials on the head: its jobs get them from each run (infra/secrets.py), so a head started once
    # (`alignflow services up`) holds none, and none can leak into its logs.
    try:
        head = _launch("ray", cmd, home, env, f"http://127.0.0.1:{dashboard}", ["/api/version", "/api/jobs/"], timeout,
                       credentials=False)
    except BaseException:
        if server is not None:
            server.kill()
        raise
    if server is not None:
        warm.bind(lifeline=str(home / "warm.head"), pid=head.pid)
    if ready_for_jobs:
        try:
            _run_first_job(head, timeout - (time.time() - started))
        except BaseException:
            head.stop()
            raise
    return head


FIRST_JOB = "alignflow-head-ready"


def _run_first_job(head: Service, timeout: float) -> None:
    """Run a no-op job. A fresh head's first job waits for the job agent to come up, connect to the cluster and
    start its job manager (1-1.7 s on two CPU cores, measured in RESULTS): paid here, once per head, instead of
    by the first stage. A head that cannot run this job is reported now, with the job's log. The job stays in
    the head's list (deleting it just after it ends races Ray's job monitor, which then records it again as
    failed)."""
    from ray.job_submission import JobStatus

    from alignflow.infra import ray_jobs

    jobs = ray_jobs.client(head.url)  # the process's client for this head: a run's first stage reuses it
    timeout = max(timeout, 10.0)  # what is left of the head's start-up time, but never too little for one job
    deadline = time.time() + timeout
    job_id = ray_jobs.submit_when_agent_is_up(jobs, deadline=deadline, entrypoint="true", submission_id=FIRST_JOB,
                                              metadata={"alignflow": "head start-up check"})
    while not (status := jobs.get_job_status(job_id)).is_terminal():
        if time.time() > deadline:
            raise ServiceError(f"the Ray head at {head.url} did not run a no-op job within {timeout:.0f}s; log: {head.log}")
        time.sleep(0.05)
    if status != JobStatus.SUCCEEDED:
        raise ServiceError(f"the Ray head at {head.url} could not run a no-op job ({status}): "
                           f"{jobs.get_job_info(job_id).message}\n{jobs.get_job_logs(job_id)[-2000:]}")


def _start_warm_server(home: Path, head_env: dict[str, str]) -> subprocess.Popen:
    """The head's warm stage server (infra/warm.py), importing while the head starts. Its environment is the
    one Ray gives a job before the job's own variables: the head's, with Ray's OMP_NUM_THREADS=1."""
    env = {**without_secrets(dict(os.environ)), **head_env, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    # Its command line names the head's folder: stopping the head stops it (stop_process_tree).
    return warm.launch(socket_path=str(home / "warm.sock"), lifeline=str(home / "warm.head"), env=env, log=str(home / "warm.log"))


class OnDemandHead:
    """A private Ray head that `alignflow run` starts when its first stage job is submitted, or earlier, beside
    Prefect's temporary server, once the run is known to need a job (`start_early`): a run whose every stage is a
    cache hit starts no Ray. Thread-safe (branches submit at once); `stop` ends it if it was started."""

    def __init__(self, num_cpus: int | None = None) -> None:
        self.num_cpus, self.head = num_cpus, None
        self._lock = threading.Lock()
        self._stopped = False

    def start_early(self) -> None:
        """Start the head in the background now; the first stage's `url()` waits for it. A head that fails to
        start here is started again at the first job, which then fails with the cause."""
        print("starting a local Ray head on 127.0.0.1 (beside the run's other start-up) ...", file=sys.stderr, flush=True)
        threading.Thread(target=self._start_early, name="alignflow-ray-head", daemon=True).start()

    def _start_early(self) -> None:
        with self._lock:
            if self.head is not None or self._stopped:
                return
            try:  # it has the time to run its start-up job too (start_ray_head)
                self._start(ready_for_jobs=True)
            except Exception as exc:
                print(f"alignflow: the local Ray head did not start ({exc}); trying again at the first job",
                      file=sys.stderr, flush=True)

    def url(self, ready_for_jobs: bool = False) -> str:
        """The head's address, started now if it is not yet. `ready_for_jobs`: as in `start_ray_head`; by default
        not, as the caller's first stage is submitted at once and a start-up job would only add its own run."""
        with self._lock:
            if self.head is None:
                print("starting a local Ray head on 127.0.0.1 ...", file=sys.stderr, flush=True)
                self._start(ready_for_jobs=ready_for_jobs)
            return self.head.url

    def _start(self, ready_for_jobs: bool) -> None:
        # Claimed by this process: if it is killed, its watchdog removes the folder too (`sweep_private_homes`).
        self.head = start_ray_head(self.num_cpus, ready_for_jobs=ready_for_jobs, claim=True)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self.head is not None:
                self.head.stop()
                remove_home(self.head)
                self.head = None


_on_demand: OnDemandHead | None = None


@contextlib.contextmanager
def ray_head_on_demand(num_cpus: int | None = None) -> Iterator[OnDemandHead]:
    """Within it, the address `ray_jobs.ON_DEMAND` means this head, started by the first `ray_address` call (or
    `.url()`) in this process, stopped at the end."""
    global _on_demand
    _on_demand = OnDemandHead(num_cpus)
    try:
        yield _on_demand
    finally:
        _on_demand.stop()
        _on_demand = None


def ray_address(address: str) -> str:
    """The Jobs API to submit to: `address`, or the on-demand head (started now if it is not yet)."""
    if address != ON_DEMAND:
        return address
    if _on_demand is None:
        raise ServiceError(f"{ON_DEMAND} is only an address inside `alignflow run` (services.ray_head_on_demand)")
    return _on_demand.url()


JOB_EXECUTION_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def start_mlflow_server(artifacts: str, base: str | None = None, timeout: float = 120, keep: str | None = None) -> Service:
    """MLflow tracking + registry on a sqlite store, proxying artifacts to `artifacts` (folder or s3://).
    `keep`: a folder whose `mlflow/` holds the store across restarts."""
    home = _home("mlflow", base, keep)
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--artifacts-destination", artifacts,
           "--serve-artifacts", "--workers", "1"]
    endpoint = os.environ.get("ALIGNFLOW_S3_ENDPOINT_URL")
    env = {"MLFLOW_S3_ENDPOINT_URL": endpoint} if endpoint else {}
    # MLflow 3's job runner (seven huey worker processes, polling) serves GenAI evaluation jobs, which training
    # runs never start: off unless the user turns it on.
    env[JOB_EXECUTION_ENV] = os.environ.get(JOB_EXECUTION_ENV, "false")
    return _launch("mlflow", cmd, home, env, f"http://127.0.0.1:{port}", ["/health"], timeout)


def start_prefect_server(base: str | None = None, timeout: float = 180, keep: str | None = None) -> Service:
    """A Prefect server with its own database; `url` is its API URL (…/api). `keep`: a folder whose
    `prefect/` holds the database across restarts."""
    home = _home("prefect", base, keep)
    port = free_port()
    env = {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
           # The UI asks the server where its API is; without these it answers 127.0.0.1:4200, whatever the port.
           "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{port}/api"}
    cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return _launch("prefect", cmd, home, env, f"http://127.0.0.1:{port}/api", ["/health"], timeout)


# ------------------------------------------------------------------ persistent services (`alignflow services up/down`)


SERVICES_HOME_ENV = "ALIGNFLOW_SERVICES_HOME"
DEFAULT_SERVICES_HOME = "outputs/services"  # in the project: a run from another checkout never finds them


def services_home(home: str | None = None) -> Path:
    """Where `services up` keeps its stores and state file: `home`, else $ALIGNFLOW_SERVICES_HOME, else
    ./outputs/services of the project (the current directory)."""
    return Path(home or os.environ.get(SERVICES_HOME_ENV) or DEFAULT_SERVICES_HOME).resolve()


def state_file(home: str | None = None) -> Path:
    return services_home(home) / "services.json"


def save_services(services: list[Service], home: str | None = None) -> None:
    path = state_file(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(s) for s in services], indent=2))


def load_services(home: str | None = None) -> list[Service]:
    path = state_file(home)
    if not path.exists():
        return []
    return [Service(**d) for d in json.loads(path.read_text())]


def forget_services(home: str | None = None) -> None:
    path = state_file(home)
    if path.exists():
        path.unlink()


def env_lines(up: list[Service]) -> list[str]:
    """`export` lines that point the `prefect` CLI, MLflow's client and alignflow at these services."""
    names = {"prefect": "PREFECT_API_URL", "mlflow": "MLFLOW_TRACKING_URI", "ray": "ALIGNFLOW_RAY_ADDRESS"}
    return [f"export {names[s.name]}={s.url}" for s in up if s.name in names]


def remove_home(service: Service) -> None:
    shutil.rmtree(service.home, ignore_errors=True)
