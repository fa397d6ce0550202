"""What the full integrity check costs a cache answer (issue: faults and secrets).

A published folder with one weights file of `--mb` MiB (plus a few small files) is verified three times:
the first check hashes every file and records each file's store stamp; the second finds every stamp
unchanged and hashes nothing; then 16 bytes of the weights are flipped in place (same size) and the third
check hashes that file again and refuses the folder. Local disk by default; `--root s3://bucket/prefix`
for an S3 store (stamps are ETags there).

    .venv/bin/python benchmarks/manifest_verify.py --mb 1024
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from alignflow.infra import manifest, storage


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    os.environ.setdefault("ALIGNFLOW_HOME", tempfile.mkdtemp(prefix="af-verify-home-"))
    root = args.root or tempfile.mkdtemp(prefix="af-verify-")
    weights = storage.join(root, "model", "model.safetensors")
    fs, path = storage.filesystem(weights)
    if storage.is_local(root):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    chunk = os.urandom(1 << 20)
    with fs.open(path, "wb") as f:
        for _ in range(args.mb):
            f.write(chunk)
    for name in ("config.json", "tokenizer.json", "MODEL_CARD.md"):
        storage.write_text(storage.join(root, name), "{}")
    manifest.write_manifest(root)
    for label in ("first check (hashes all)", "second check (stamps unchanged)"):
        start = time.perf_counter()
        assert manifest.verify(root) is not None
        print(f"{label}: {time.perf_counter() - start:.3f} s")
    with fs.open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 16)
    start = time.perf_counter()
    assert manifest.verify(root) is None
    print(f"after a same-size flip (re-hashes that file, refuses): {time.perf_counter() - start:.3f} s")
    storage.remove(root)


if __name__ == "__main__":
    main()
