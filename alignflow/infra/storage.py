"""Storage through fsspec: the same calls for a local folder and for `s3://`.

URIs without a scheme are local paths. S3 credentials and endpoint come from the
usual environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL / ALIGNFLOW_S3_ENDPOINT_URL); they are never written anywhere.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import fsspec

CHUNK = 8 * 1024 * 1024


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    options = {}
    if uri.startswith("s3://"):
        options["use_listings_cache"] = False  # checkpoints are listed right after they are written
        endpoint = os.environ.get("ALIGNFLOW_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    return fsspec.core.url_to_fs(uri, **options)


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *[p.strip("/") for p in parts]])


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def read_text(uri: str) -> str:
    fs, path = filesystem(uri)
    with fs.open(path, "r") as f:
        return f.read()


def write_text(uri: str, text: str) -> None:
    fs, path = filesystem(uri)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(text)


def list_dirs(uri: str) -> list[str]:
    """Names of the immediate sub-folders of `uri` (empty when it does not exist)."""
    fs, path = filesystem(uri)
    if not fs.exists(path):
        return []
    return sorted(Path(p["name"]).name for p in fs.ls(path, detail=True) if p["type"] == "directory")


def upload_dir(local: str | Path, uri: str) -> None:
    """Copy a local folder's files to `uri` (s3fs uploads large files in multipart)."""
    fs, path = filesystem(uri)
    local = Path(local)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        rel = file.relative_to(local).as_posix()
        dest = f"{path.rstrip('/')}/{rel}"
        fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(file), dest)


def download_dir(uri: str, local: str | Path) -> Path:
    fs, path = filesystem(uri)
    local = Path(local)
    local.mkdir(parents=True, exist_ok=True)
    fs.get(path.rstrip("/") + "/", str(local), recursive=True)
    return local


def copy_file(src: str, dest: str) -> None:
    """Stream one file between any two storages (local, s3, …)."""
    sfs, spath = filesystem(src)
    dfs, dpath = filesystem(dest)
    dfs.makedirs(dpath.rsplit("/", 1)[0], exist_ok=True)
    with sfs.open(spath, "rb") as f, dfs.open(dpath, "wb") as out:
        while chunk := f.read(CHUNK):
            out.write(chunk)


def remove(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def walk_files(uri: str) -> dict[str, int]:
    """Relative path -> size for every file under `uri`."""
    fs, path = filesystem(uri)
    root = path.rstrip("/")
    out = {}
    for name, info in fs.find(root, detail=True).items():
        out[name[len(root) + 1:]] = int(info["size"])
    return out


def sha256_of(uri: str) -> str:
    fs, path = filesystem(uri)
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(source: str) -> str:
    """Content hash of a data source: a file, a folder (every file), or a dataset name as given."""
    if "://" in source or Path(source).exists():
        fs, path = filesystem(source)
        if fs.isfile(path):
            return sha256_of(source)
        h = hashlib.sha256()
        for rel in sorted(walk_files(source)):
            h.update(rel.encode() + b"\0" + sha256_of(join(source, rel)).encode())
        return h.hexdigest()
    return hashlib.sha256(f"name:{source}".encode()).hexdigest()
