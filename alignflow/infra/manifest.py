"""Manifests: the record that makes a published folder complete.

A manifest lists every file it vouches for with size and sha256, plus inputs,
cache key, code version and a metrics summary. It is written LAST, after every
file it lists is in place, so "manifest exists and verifies" means "complete".
Step checkpoints use the same format under another file name.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignflow import __version__
from alignflow.infra import storage

STAGE_MANIFEST = "MANIFEST.json"
CHECKPOINT_MANIFEST = "CHECKPOINT_MANIFEST.json"
# Not part of a stage's result: step checkpoints (their own manifests), and the run's bookkeeping under job/
# (the config the job read, its lease, a failed attempt's log), which changes while the result stands.
NOT_PUBLISHED = ("checkpoints/", "job/")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Manifest:
    uri: str
    files: dict[str, dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """Identity of the content: changes iff some listed file's bytes change."""
        blob = json.dumps(sorted((k, v["sha256"]) for k, v in self.files.items()))
        return hashlib.sha256(blob.encode()).hexdigest()


def cache_key(config_hash: str, inputs: dict[str, str], version: str = __version__) -> str:
    """hash(stage config hash, digests of upstream manifests and data, alignflow version)."""
    blob = json.dumps({"config": config_hash, "inputs": inputs, "version": version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_uri(storage_root: str, kind: str, key: str) -> str:
    """`{root}/{kind}/{key}`: content-addressed, so every config that computes the same key (any pipeline
    name, any stage name) finds the same result."""
    return storage.join(storage_root, kind, key)


def write_manifest(root_uri: str, name: str = STAGE_MANIFEST, exclude: tuple[str, ...] = (), **meta: Any) -> Manifest:
    """Hash every file under root_uri (but earlier manifests and `exclude` prefixes) and write the manifest."""
    files = {}
    for rel, size in sorted(storage.walk_files(root_uri).items()):
        if rel in (STAGE_MANIFEST, CHECKPOINT_MANIFEST) or rel.startswith(exclude):
            continue
        files[rel] = {"size": size, "sha256": storage.sha256_of(storage.join(root_uri, rel))}
    meta = {"created_at": dt.datetime.now(dt.timezone.utc).isoformat(), "alignflow_version": __version__, **meta}
    manifest = Manifest(uri=root_uri, files=files, meta=meta)
    storage.write_text(storage.join(root_uri, name), json.dumps({"files": files, **meta}, indent=2, sort_keys=True))
    return manifest


def read_manifest(root_uri: str, name: str = STAGE_MANIFEST) -> Manifest | None:
    uri = storage.join(root_uri, name)
    if not storage.exists(uri):
        return None
    data = json.loads(storage.read_text(uri))
    files = data.pop("files")
    return Manifest(uri=root_uri, files=files, meta=data)


def verify(root_uri: str, name: str = STAGE_MANIFEST) -> Manifest | None:
    """The manifest if it exists and every listed file has its size and sha256; else None, with a
    warning naming the file."""
    found, problem = check(root_uri, name)
    if problem:
        log.warning("%s", problem)
    return found


def check(root_uri: str, name: str = STAGE_MANIFEST) -> tuple[Manifest | None, str | None]:
    """(the manifest if it verifies, else None; what is wrong, if anything). No manifest is no problem.

    Every file is hashed the first time, and again whenever the store's stamp of it (size, mtime, ctime and
    inode on disk; ETag and last-modified on S3) differs from the one recorded when it last matched: so
    the full check is cheap enough to run on every cache answer, and a same-size rewrite is still caught."""
    try:
        manifest = read_manifest(root_uri, name)
    except (json.JSONDecodeError, KeyError, OSError) as exc:
        return None, f"unreadable manifest at {root_uri}: {exc}"
    if manifest is None:
        return None, None
    stats = storage.walk_stats(root_uri)
    record = _verified(root_uri, name)
    fresh = {}
    for rel, info in manifest.files.items():
        size, stamp = stats.get(rel, (None, None))
        if size != info["size"]:
            return None, f"manifest at {root_uri}: {rel} is missing or has the wrong size"
        if stamp is not None and record.get(rel) == [size, stamp, info["sha256"]]:
            continue
        if storage.sha256_of(storage.join(root_uri, rel)) != info["sha256"]:
            return None, f"manifest at {root_uri}: {rel} does not match its sha256 (changed after it was published)"
        if stamp is not None:
            fresh[rel] = [size, stamp, info["sha256"]]
    if fresh:
        _record_verified(root_uri, name, {**record, **fresh})
    return manifest, None


# ------------------------------------------------------------------ what was verified, and when


def _record_path(root_uri: str, name: str) -> Path:
    home = Path(os.environ.get("ALIGNFLOW_HOME", Path.home() / ".alignflow"))
    return home / "verified" / f"{hashlib.sha256(f'{root_uri}|{name}'.encode()).hexdigest()[:32]}.json"


def _verified(root_uri: str, name: str) -> dict[str, list]:
    try:
        return json.loads(_record_path(root_uri, name).read_text())
    except (OSError, ValueError):
        return {}


def _record_verified(root_uri: str, name: str, record: dict[str, list]) -> None:
    """Best effort (a read-only home only costs a re-hash next time); atomic, as several jobs may verify at once."""
    path = _record_path(root_uri, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("could not record verified files of %s: %s", root_uri, exc)
