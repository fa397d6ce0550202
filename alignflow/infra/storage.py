"""Storage through fsspec: the same calls for a local folder and for `s3://`.

URIs without a scheme are local paths. S3 credentials and endpoint come from the
usual environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL / ALIGNFLOW_S3_ENDPOINT_URL); they are never written anywhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

CHUNK = 8 * 1024 * 1024
MIN_FREE_ENV = "ALIGNFLOW_MIN_FREE_MB"  # preflight: a local storage root needs this much free space
MIN_FREE_MB = 200
_BUCKET = re.compile(r"^(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class StorageError(RuntimeError):
    """A storage root that cannot work: a missing or misnamed bucket, a folder that cannot be written, a full
    disk. The user's to fix (bad input), found before the first job."""


def preflight(root: str) -> None:
    """Check, before any job, that `root` can take the run's outputs; alignflow never creates buckets."""
    if root.startswith("s3://"):
        _preflight_bucket(root)
    elif is_local(root):
        _preflight_folder(root)


def _preflight_bucket(root: str) -> None:
    bucket = root.removeprefix("s3://").split("/", 1)[0]
    if not _BUCKET.match(bucket):
        raise StorageError(f"storage.root {root}: {bucket!r} is not a valid S3 bucket name (3-63 characters: lowercase "
                           "letters, digits, dots and hyphens, starting and ending with a letter or digit)")
    fs, _ = filesystem(root)
    try:
        fs.ls(bucket, refresh=True)
    except FileNotFoundError:
        raise StorageError(f"storage.root {root}: the bucket {bucket!r} does not exist (alignflow never creates buckets: "
                           "create it, or fix storage.root)") from None
    except PermissionError as exc:
        raise StorageError(f"storage.root {root}: access to the bucket {bucket!r} is denied ({exc}); check the "
                           "credentials (AWS_* variables or the instance role)") from None


def _preflight_folder(root: str) -> None:
    path = local_path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".alignflow-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise StorageError(f"storage.root {root} cannot be written: {exc.strerror or exc} ({exc.filename or path})") from None
    free_mb = shutil.disk_usage(path).free // 2**20
    need = int(os.environ.get(MIN_FREE_ENV, MIN_FREE_MB))
    if free_mb < need:
        raise StorageError(f"storage.root {root}: only {free_mb} MiB free on its disk, less than the {need} MiB a run "
                           f"needs at least (free some space, or set {MIN_FREE_ENV})")


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    options = {}
    if uri.startswith("s3://"):
        options["use_listings_cache"] = False  # checkpoints are listed right after they are written
        endpoint = s3_endpoint()
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    return fsspec.core.url_to_fs(uri, **options)


def s3_endpoint() -> str | None:
    return os.environ.get("ALIGNFLOW_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")


def export_s3_endpoint() -> None:
    """Give libraries with their own S3 client (MLflow's artifact store) the endpoint storage uses."""
    if s3_endpoint():
        os.environ.setdefault("MLFLOW_S3_ENDPOINT_URL", s3_endpoint())


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
    """Readers never see a half-written file: on disk it is written aside and renamed; an S3 PUT is atomic."""
    fs, path = filesystem(uri)
    _make_parent(fs, path)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return
    with fs.open(path, "w") as f:
        f.write(text)


def create_exclusive(uri: str, text: str) -> None:
    """Create `uri` with `text` unless it exists (FileExistsError): O_EXCL on disk, `If-None-Match: *` on S3."""
    fs, path = filesystem(uri)
    _make_parent(fs, path)
    if isinstance(fs, LocalFileSystem):
        with open(path, "x") as f:
            f.write(text)
        return
    fs.pipe_file(path, text.encode(), IfNoneMatch="*")


def _make_parent(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Folders exist on disk only: on an object store `makedirs` would create a missing *bucket*
    (s3fs does), so a misspelt bucket would be created and written to. There, a write to a missing
    bucket fails instead."""
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)


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
        _make_parent(fs, dest)
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
    _make_parent(dfs, dpath)
    with sfs.open(spath, "rb") as f, dfs.open(dpath, "wb") as out:
        while chunk := f.read(CHUNK):
            out.write(chunk)


def remove(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def walk_files(uri: str) -> dict[str, int]:
    """Relative path -> size for every file under `uri`."""
    return {rel: size for rel, (size, _) in walk_stats(uri).items()}


def walk_stats(uri: str) -> dict[str, tuple[int, str | None]]:
    """Relative path -> (size, stamp) for every file under `uri`. The stamp changes whenever the file is
    rewritten (local: mtime, ctime and inode; S3: ETag and last-modified); None where the store has none."""
    fs, path = filesystem(uri)
    root = path.rstrip("/")
    return {name[len(root) + 1:]: (int(info["size"]), _stamp(info)) for name, info in fs.find(root, detail=True).items()}


def _stamp(info: dict) -> str | None:
    if "ino" in info and "mtime" in info:  # ctime ("created" in fsspec) cannot be set back by a user
        return f"{info['mtime']}:{info.get('created')}:{info['ino']}"
    etag = info.get("ETag") or info.get("etag")
    return f"{etag}:{info.get('LastModified')}" if etag else None


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
