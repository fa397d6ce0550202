"""Datasets the pipeline makes (generate, label, select): Parquet parts under the manifest contract.

Layout of a dataset stage's output: `data/part-00000.parquet` ... (rows in order), `DATASET_CARD.md`, `metrics.json`,
`config.yaml`, `MANIFEST.json` last. `datasets.load_dataset("parquet", data_files=".../data/*.parquet")` loads it as
is. A training stage whose `data.stage` names dataset stages reads their rows through `dataset_file`: one local
Parquet file per set of inputs, so the loaders (and their errors, which name the row) are those of any data file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from alignflow.config import dump_config
from alignflow.infra import manifest, storage
from alignflow.stages.common.checkpoint import remove_staging
from alignflow.stages.common.builtin_model import cache_root
from alignflow.stages.common.publish import finish_publish, publish_dir

DATA_DIR = "data"
SHARDS_DIR = "checkpoints/shards"  # not published: a generate run's finished shards, for resume
# What the generate stage writes for each sample, and what label adds; every other column is the prompt row's own.
GENERATED_COLUMNS = ("prompt", "completion", "prompt_ids", "completion_ids", "logprobs", "finish_reason", "prompt_index", "sample_index")
SCORE_COLUMNS = ("reward", "rm_score", "score")


def part_name(k: int) -> str:
    return f"part-{k:05d}.parquet"


def table_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def read_table_rows(uri: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    fs, path = storage.filesystem(uri)
    with fs.open(path, "rb") as f:
        return pq.read_table(f).to_pylist()


def schema_of(rows: list[dict[str, Any]]) -> dict[str, str]:
    import pyarrow as pa

    return {f.name: str(f.type) for f in pa.Table.from_pylist(rows[:256]).schema} if rows else {}


# --------------------------------------------------------------------------- shards (resume)


class ShardStore:
    """Finished shards of a run, kept with the stage's checkpoints: `part-K.parquet` and, written after it, `part-K.json`
    with its sha256, so a shard cut short by a kill is never taken for finished."""

    def __init__(self, stage_uri: str):
        self.root = storage.join(stage_uri, SHARDS_DIR)

    def _marker(self, k: int) -> str:
        return storage.join(self.root, part_name(k).replace(".parquet", ".json"))

    def done(self, k: int) -> bool:
        marker = self._marker(k)
        if not storage.exists(marker):
            return False
        data = storage.join(self.root, part_name(k))
        return storage.exists(data) and storage.sha256_of(data) == json.loads(storage.read_text(marker))["sha256"]

    def save(self, k: int, rows: list[dict[str, Any]]) -> None:
        blob = table_bytes(rows)
        fs, path = storage.filesystem(storage.join(self.root, part_name(k)))
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(blob)
        storage.write_text(self._marker(k), json.dumps({"rows": len(rows), "sha256": hashlib.sha256(blob).hexdigest()}))

    def rows(self, k: int) -> list[dict[str, Any]]:
        return read_table_rows(storage.join(self.root, part_name(k)))


# --------------------------------------------------------------------------- publish


def publish_dataset(stage_uri: str, staging: Path, parts: list[list[dict[str, Any]]], files: dict[str, str | bytes],
                    meta: dict[str, Any]) -> Path:
    """`data/part-*.parquet` (one per part, in order) plus `files`, uploaded when remote, the manifest last."""
    local = publish_dir(stage_uri, staging)
    local.mkdir(parents=True, exist_ok=True)
    (local / manifest.STAGE_MANIFEST).unlink(missing_ok=True)  # a stale one must not be uploaded with the files
    (local / DATA_DIR).mkdir(exist_ok=True)
    for old in (local / DATA_DIR).glob("part-*.parquet"):
        old.unlink()
    for k, rows in enumerate(parts):
        (local / DATA_DIR / part_name(k)).write_bytes(table_bytes(rows))
    finish_publish(stage_uri, local, files, meta)
    return local


def dataset_card(stage: str, kind: str, rows: int, schema: dict[str, str], inputs: dict[str, str], metrics: dict[str, float]) -> str:
    lines = [f"# alignflow {kind} dataset: {stage}", "", f"- rows: {rows}", "- made from:",
             *[f"  - {role}: `{uri}`" for role, uri in inputs.items()], "", "## Columns", "", "| column | type |", "|---|---|",
             *[f"| {name} | {tp} |" for name, tp in schema.items()], "", "## Figures", "", "| metric | value |", "|---|---|",
             *[f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())], "", "## Use", "", "```python", "import datasets",
             f'rows = datasets.load_dataset("parquet", data_files="<this folder>/{DATA_DIR}/*.parquet", split="train")', "```"]
    return "\n".join(lines) + "\n"


def publish_rows(run, tracking, parts: list[list[dict]], metrics: dict[str, float]) -> dict[str, Any]:
    """What every dataset stage publishes (`run`: its TrainingRun, `tracking`: its StageTracking): the parts, its card, metrics and config, the manifest last; figures and card to MLflow."""
    rows = [r for p in parts for r in p]
    schema = schema_of(rows)
    inputs = {**run.fingerprints, **{f"upstream:{n}": {"uri": u, "digest": run.input_digests[n]} for n, u in run.inputs.items()}}
    kind = run.cfg.kind(run.stage).value
    files = {"DATASET_CARD.md": dataset_card(run.stage, kind, len(rows), schema, run.inputs, metrics),
             "metrics.json": json.dumps({"summary": metrics, "schema": schema}, indent=2), "config.yaml": dump_config(run.cfg)}
    meta = {"stage": run.stage, "cache_key": run.key, "config_hash": run.section.config_hash(), "inputs": inputs,
            "metrics": metrics, "mlflow_run_id": tracking.run_id, "rows": len(rows), "schema": schema}
    tracking.log_metrics(0, metrics)
    local = publish_dataset(run.out, run.staging, parts, files, meta)
    tracking.log_artifacts([local / f for f in files])
    tracking.close()
    print(f"{run.stage}: published {len(rows)} rows to {run.out}/data", flush=True)
    remove_staging(run.staging)
    return {"stage": run.stage, "uri": run.out, "cache_key": run.key, "cached": False, "metrics": metrics}


# --------------------------------------------------------------------------- read


def published_rows(stage_uri: str) -> list[dict[str, Any]]:
    """Every row of a published dataset stage, parts in order."""
    root = storage.join(stage_uri, DATA_DIR)
    names = sorted(n for n in storage.walk_files(root) if n.endswith(".parquet"))
    return [row for name in names for row in read_table_rows(storage.join(root, name))]


def dataset_file(sources: list[tuple[str, str]], names: list[str]) -> str:
    """One local Parquet file with the rows of the published datasets (uri, manifest digest), in order, named after
    their stages (`names`: what a data error shows); written once per set of digests into the cache (ranks racing
    each write their own temp file, and the rename is atomic)."""
    digest = hashlib.sha256("|".join(d for _, d in sources).encode()).hexdigest()[:32]
    dest = cache_root() / "datasets" / digest / f"{'+'.join(names)[:200]}.parquet"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        rows = [row for uri, _ in sources for row in published_rows(uri)]
        fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", dir=dest.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(table_bytes(rows))
        os.replace(tmp, dest)
    return str(dest)
