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
from dataclasses import dataclass, field
from typing import Any

from alignflow import __version__
from alignflow.infra import storage

STAGE_MANIFEST = "MANIFEST.json"
CHECKPOINT_MANIFEST = "CHECKPOINT_MANIFEST.json"
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


def verify(root_uri: str, name: str = STAGE_MANIFEST, check_hashes: bool = True) -> Manifest | None:
    """The manifest if it exists and every listed file has its size (and sha256); else None, with a warning."""
    try:
        manifest = read_manifest(root_uri, name)
    except (json.JSONDecodeError, KeyError, OSError) as exc:
        log.warning("unreadable manifest at %s: %s", root_uri, exc)
        return None
    if manifest is None:
        return None
    sizes = storage.walk_files(root_uri)
    for rel, info in manifest.files.items():
        if sizes.get(rel) != info["size"]:
            log.warning("manifest at %s: %s is missing or has the wrong size", root_uri, rel)
            return None
        if check_hashes and storage.sha256_of(storage.join(root_uri, rel)) != info["sha256"]:
            log.warning("manifest at %s: %s has the wrong sha256", root_uri, rel)
            return None
    return manifest
