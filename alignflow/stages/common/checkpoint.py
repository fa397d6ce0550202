"""Step checkpoints for exact resume.

A checkpoint `{stage_uri}/checkpoints/step_00000040/` holds the DeepSpeed state
(model, optimizer, scheduler), the trainer's client state (step, metric
history) and every rank's RNG states, then `CHECKPOINT_MANIFEST.json` written
last. On start, the newest checkpoint whose manifest verifies is loaded; a
truncated or corrupt one is skipped with a warning. The last K are kept.

The data position is the step number: batches are a function of (seed, step)
(see `data.global_batch`), so nothing else about the data needs saving.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from alignflow.infra import manifest, storage
from alignflow.infra.lease import claim, owner_gone, sweep_abandoned
from alignflow.stages.common.strategy import Strategy

log = logging.getLogger(__name__)
PREFIX = "step_"


def tag(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Checkpointer:
    """Saves and finds step checkpoints of one stage run under `{stage_uri}/checkpoints`."""

    def __init__(self, strategy: Strategy, stage_uri: str, keep_last: int, staging: Path, role: str | None = None):
        self.strategy, self.keep_last = strategy, keep_last
        # Stages with several trained models (RL's actor and critic) keep one folder per role.
        self.root = storage.join(stage_uri, "checkpoints", *([role] if role else []))
        # Local storage: DeepSpeed writes in place. Remote: it writes to a staging folder that is
        # uploaded. Either way ranks of one node share the folder.
        self.local_root = storage.local_path(self.root) if storage.is_local(self.root) else staging / "checkpoints" / (role or "")

    def save(self, step: int, client_state: dict[str, Any]) -> None:
        name = tag(step)
        folder = self.local_root / name
        if self.strategy.is_main and folder.exists():
            shutil.rmtree(folder)  # a leftover from a run that died before its manifest
        self.strategy.barrier()
        self.strategy.save_checkpoint(str(self.local_root), name, client_state)
        torch.save(rng_state(), folder / f"rng_rank{self.strategy.rank}.pt")
        self.strategy.barrier()
        if self.strategy.is_main:
            uri = storage.join(self.root, name)
            if not storage.is_local(self.root):
                storage.upload_dir(folder, uri)
            manifest.write_manifest(uri, name=manifest.CHECKPOINT_MANIFEST, step=step, world_size=self.strategy.world_size)
            self._prune()
        self.strategy.barrier()

    def _prune(self) -> None:
        steps = self._published_steps()
        for old in steps[: -self.keep_last]:
            uri = storage.join(self.root, tag(old))
            # Manifest first: a half-deleted folder must never look complete.
            storage.remove(storage.join(uri, manifest.CHECKPOINT_MANIFEST))
            storage.remove(uri)
            if not storage.is_local(self.root):
                shutil.rmtree(self.local_root / tag(old), ignore_errors=True)  # the staged copy too

    def _published_steps(self) -> list[int]:
        """Steps whose checkpoint has a manifest (pruning needs no hashing)."""
        names = [n for n in storage.list_dirs(self.root) if n.startswith(PREFIX)]
        return sorted(int(n[len(PREFIX):]) for n in names
                      if manifest.read_manifest(storage.join(self.root, n), manifest.CHECKPOINT_MANIFEST) is not None)

    def latest(self, among: set[int] | None = None) -> int | None:
        """Newest verified step (of `among`, when given), decided on rank 0 and shared so all ranks
        load the same one. Checked newest first, stopping at the first that verifies: older ones
        are not hashed."""
        step = None
        if self.strategy.is_main:
            names = sorted((n for n in storage.list_dirs(self.root) if n.startswith(PREFIX)), reverse=True)
            for name in names:
                if among is not None and int(name[len(PREFIX):]) not in among:
                    continue
                if manifest.verify(storage.join(self.root, name), manifest.CHECKPOINT_MANIFEST):
                    step = int(name[len(PREFIX):])
                    break
                log.warning("skipping checkpoint %s: no verified manifest (truncated or corrupt)", name)
        return self.strategy.broadcast_object(step)

    def published_steps(self) -> list[int]:
        """Steps that have a checkpoint manifest (not verified)."""
        return self._published_steps()

    def load(self, step: int) -> dict[str, Any]:
        name = tag(step)
        written_by = manifest.read_manifest(storage.join(self.root, name), manifest.CHECKPOINT_MANIFEST).meta["world_size"]
        if written_by != self.strategy.world_size:
            raise RuntimeError(
                f"checkpoint {storage.join(self.root, name)} was written by {written_by} workers; "
                f"resume it with {written_by} workers, not {self.strategy.world_size}"
            )
        local_root = self.local_root
        if not storage.is_local(self.root):
            if self.strategy.is_main:
                storage.download_dir(storage.join(self.root, name), local_root / name)
            self.strategy.barrier()
        client_state = self.strategy.load_checkpoint(str(local_root), name)
        rng_file = local_root / name / f"rng_rank{self.strategy.rank}.pt"
        set_rng_state(torch.load(rng_file, weights_only=False))
        return client_state


def staging_dir(key: str, stage_uri: str) -> Path:
    """A node-local scratch folder shared by the ranks of one stage run: one per published folder (so
    two storage roots never share one), owned by the process that made it. Folders whose owner is gone
    (a crashed run's) are swept first; the run removes its own when it has published (`remove_staging`)."""
    base = Path(tempfile.gettempdir()) / "alignflow-staging"
    sweep_abandoned(base.glob("*") if base.is_dir() else [])
    path = base / f"{key}-{hashlib.sha256(stage_uri.encode()).hexdigest()[:8]}"
    path.mkdir(parents=True, exist_ok=True)
    if owner_gone(path):
        claim(path, "staging")
    return path


def remove_staging(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
