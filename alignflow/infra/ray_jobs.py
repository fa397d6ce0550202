"""Stage jobs through Ray's Jobs API: submit, stream logs, wait, stop.

A stage's entry point is `python -m alignflow.stages --config <uri> --stage <name> --output <uri>
--cache-key <key>` with the caller's own interpreter (same venv on a local head; on a cluster, the
image must hold the same alignflow). The stage exits with `exit_codes.BAD_INPUT` for bad config
or data: such a failure is marked not retryable.
"""

from __future__ import annotations

import functools
import importlib
import re
import shlex
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from alignflow.exit_codes import BAD_INPUT

ACTIVE: dict[str, str] = {}  # job id -> Jobs API address, for jobs this process is waiting on


class StageJobError(RuntimeError):
    """A stage job that failed, with the tail of its log. `retryable` is False for bad input."""

    def __init__(self, message: str, retryable: bool, job_id: str, log: str = ""):
        super().__init__(message)
        self.retryable, self.job_id, self.log = retryable, job_id, log

    def __reduce__(self):  # survives pickling (a result store) with its kind
        return type(self), (str(self), self.retryable, self.job_id, self.log)


@dataclass
class JobOutcome:
    job_id: str
    seconds: float
    log: str
    started_at: float | None = None  # Ray's own record of the job's start and end (epoch seconds)
    ended_at: float | None = None


# The address of a private head that `alignflow run` starts at its first job (infra/services.py OnDemandHead).
ON_DEMAND = "on-demand://127.0.0.1"


def is_local_address(address: str) -> bool:
    """A Jobs API on this machine (its jobs run here, with this machine's files)."""
    from urllib.parse import urlparse

    return (urlparse(address).hostname or "") in ("127.0.0.1", "localhost", "::1")


@functools.lru_cache(maxsize=None)
def client(address: str):
    """One Jobs API client per address and process (each new one asks the head for its version)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def prewarm() -> None:
    """Import Ray's job client (0.8 s) in the background while the flow opens its runs and starts its tasks."""
    threading.Thread(target=importlib.import_module, args=("ray.job_submission",), daemon=True).start()


def stage_entrypoint(*, stage: str, config_uri: str, output_uri: str, cache_key: str, inputs: dict[str, str] | None = None) -> str:
    inputs_args = [a for role, uri in (inputs or {}).items() for a in ("--input", f"{role}={uri}")]
    return shlex.join([sys.executable, "-u", "-m", "alignflow.stages", "--config", config_uri, "--stage", stage,
                       "--output", output_uri, "--cache-key", cache_key, *inputs_args])


def run_job(
    address: str,
    entrypoint: str,
    env: dict[str, str],
    name: str,
    timeout_s: float,
    on_log: Callable[[str], None],
    on_submit: Callable[[str], None] = lambda job_id: None,
    poll_s: float = 0.1,
    log_every_s: float = 1.0,
) -> JobOutcome:
    """Submit, stream new log lines to `on_log`, and wait. The job is stopped if this call
    ends any other way than by the job finishing (timeout, exception, cancellation).

    The status is asked every `poll_s` (a small request: the end of a job is seen within it), the whole
    log only every `log_every_s` and once at the end (the Jobs API sends all of it each time)."""
    from ray.job_submission import JobStatus

    jobs = client(address)
    job_id = f"alignflow-{name}-{uuid.uuid4().hex[:8]}"
    ACTIVE[job_id] = address  # before submitting: a signal during submission still stops it
    start, finished, tail, logged_at = time.time(), False, LogTail(), 0.0
    try:
        submit_when_agent_is_up(jobs, deadline=start + min(timeout_s, AGENT_WAIT_S), entrypoint=entrypoint,
                                submission_id=job_id, runtime_env={"env_vars": env}, metadata={"alignflow.stage": name})
        on_submit(job_id)
        while True:
            status = _retried(jobs.get_job_status, job_id)
            if status.is_terminal():
                finished = True
                break
            if time.time() - logged_at >= log_every_s:
                logged_at = time.time()
                for line in tail.new_lines(_retried(jobs.get_job_logs, job_id)):
                    on_log(line)
            if time.time() - start > timeout_s:
                raise StageJobError(f"stage job {job_id} ran longer than {timeout_s:.0f}s and was stopped", True, job_id)
            time.sleep(poll_s)
    finally:
        if not finished:
            stop(jobs, job_id)
        ACTIVE.pop(job_id, None)
    log = _retried(jobs.get_job_logs, job_id)
    for line in tail.new_lines(log + "\n"):
        on_log(line)
    info = jobs.get_job_info(job_id)
    if status != JobStatus.SUCCEEDED:
        raise failure(job_id, str(status), info.message or "", log)
    seconds = lambda ms: ms / 1000 if ms else None  # noqa: E731
    return JobOutcome(job_id, time.time() - start, log, seconds(info.start_time), seconds(info.end_time))


# Ray's Jobs API answers a submission with this (HTTP 500) when the head's job agent has not registered within 10 s,
# which a busy machine's fresh head can take. Nothing was submitted, so the same submission id can be sent again.
AGENT_NOT_UP = "No available agent to submit job"
AGENT_WAIT_S = 120.0


def submit_when_agent_is_up(jobs: Any, *, deadline: float, **job: Any) -> str:
    """`jobs.submit_job(**job)`, sent again while Ray says its job agent is not up yet, until `deadline` (epoch s).
    Any other error is raised at once: a submission that may have reached the agent is never sent twice."""
    while True:
        try:
            return jobs.submit_job(**job)
        except RuntimeError as error:
            if AGENT_NOT_UP not in str(error) or time.time() >= deadline:
                raise
            time.sleep(1.0)


class LogTail:
    """Hands out each complete log line once (a partial last line waits for its newline)."""

    def __init__(self) -> None:
        self.done = 0

    def new_lines(self, log: str) -> list[str]:
        end = log.rfind("\n", self.done) + 1
        if end <= self.done:
            return []
        lines, self.done = log[self.done:end].splitlines(), end
        return lines


def _retried(call: Callable[[str], Any], job_id: str, attempts: int = 5) -> Any:
    """A Jobs API call, riding out a few transient errors (a dashboard restart, a timeout) rather than
    stopping a healthy job over them."""
    for attempt in range(attempts):
        try:
            return call(job_id)
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(2 ** attempt)


def failure(job_id: str, status: str, message: str, log: str) -> StageJobError:
    """The job's failure in a paragraph: its kind, and the stage's own `error:` lines (bad input says
    what and where) or, for a crash, the last lines of its log. The whole log rides along (`.log`)."""
    match = re.search(r"exit code (\d+)", message)
    code = int(match.group(1)) if match else None
    retryable = code != BAD_INPUT
    kind = "bad input (not retried)" if not retryable else status.lower()
    lines = log.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    detail = "\n".join(errors[-5:] if errors else lines[-15:])
    return StageJobError(f"stage job {job_id} failed: {kind}: {message.splitlines()[0] if message else ''}\n{detail}",
                         retryable, job_id, log)


def stop_active() -> None:
    """Stop every job this process is waiting on (called when the flow run is being killed)."""
    for job_id, address in list(ACTIVE.items()):
        stop(client(address), job_id)
        ACTIVE.pop(job_id, None)


def stop(jobs, job_id: str, wait_s: float = 30.0) -> None:
    try:
        jobs.stop_job(job_id)
        deadline = time.time() + wait_s
        while time.time() < deadline and not jobs.get_job_status(job_id).is_terminal():
            time.sleep(0.5)
    except Exception:  # the head may be gone already; nothing left to stop then
        pass
