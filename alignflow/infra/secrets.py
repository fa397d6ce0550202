"""Credentials for stage jobs, kept out of Ray's job records.

Ray stores a job's `runtime_env` (env vars included) and serves it unauthenticated at
`GET /api/jobs/`; its runtime-env agent writes it to a log on the head. So a credential never
travels there, nor in the entry point. Instead:

- a head on this machine (a loopback Jobs API address): the caller writes its credentials to a
  0600 file in a 0700 folder of its own, the job gets that file's path (`SECRETS_FILE_ENV`) and
  reads it at start, and the caller deletes the folder when the job ends (the next run deletes those of
  runs killed before they could);
- a remote cluster: nothing is sent; the nodes provide their own credentials (instance roles,
  or the variables set on every node), and the job gets only the names it was started with
  (`SECRET_NAMES_ENV`), so a node lacking one says so in the job's log (an instance role needs
  no variable, so it is a warning, not an error).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from alignflow.infra.lease import claim, sweep_abandoned

SECRETS_FILE_ENV = "ALIGNFLOW_SECRETS_FILE"
SECRET_NAMES_ENV = "ALIGNFLOW_SECRET_NAMES"
FOLDER_PREFIX = "alignflow-secrets-"
# Credential-shaped names: AWS keys, HF/MLflow/API tokens, passwords.
_SECRET = re.compile(r"(^AWS_ACCESS_KEY_ID$|SECRET|TOKEN|PASSWORD|API_KEY|CREDENTIAL)")


class MissingSecrets(RuntimeError):
    """A job on a node that lacks credentials the caller had."""


def is_secret(name: str) -> bool:
    # RAY_* is Ray's own setup (a head started with RAY_AUTH_MODE=token needs its RAY_AUTH_TOKEN).
    return bool(_SECRET.search(name.upper())) and not name.startswith("RAY_") and name not in (SECRETS_FILE_ENV, SECRET_NAMES_ENV)


def split(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) parts of an environment."""
    plain = {k: v for k, v in env.items() if not is_secret(k)}
    return plain, {k: v for k, v in env.items() if is_secret(k)}


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    return split(env)[0]


@contextmanager
def job_env(env: dict[str, str], local: bool) -> Iterator[dict[str, str]]:
    """The environment to submit with a job: `env` minus its credentials, plus how the job gets them."""
    plain, secret = split(env)
    if not secret:
        yield plain
        return
    if not local:
        yield {**plain, SECRET_NAMES_ENV: ",".join(sorted(secret))}
        return
    # Credentials folders of runs that are gone; one with no owner yet is being made, abandoned only when old.
    sweep_abandoned(Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"), unowned_after_s=600)
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))  # 0700 by mkdtemp
    try:
        claim(folder, "secrets")
        path = folder / "env.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(secret, f)
        yield {**plain, SECRETS_FILE_ENV: str(path)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_job_secrets() -> None:
    """In a stage job (and each of its Ray workers): take the credentials the caller made available."""
    path = os.environ.get(SECRETS_FILE_ENV)
    if path:
        try:
            os.environ.update(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise MissingSecrets(f"the credentials file {path} is gone (its run ended?); this job cannot reach storage") from None
    names = [n for n in os.environ.get(SECRET_NAMES_ENV, "").split(",") if n]
    missing = [n for n in names if n not in os.environ]
    if missing:
        print(f"warning: this Ray node lacks {', '.join(missing)}, which the run's caller had; on a cluster credentials "
              "come from the nodes (instance roles, or variables set on every node), never from the job", flush=True)
