from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def sft_config(tmp_path: Path, *overrides: str):
    """configs/tiny.yaml, quiet, publishing under tmp_path."""
    base = [f"storage.root={tmp_path / 'out'}", "sft.logging.progress=false", "sft.logging.log_every=1000"]
    return load_config(ROOT / "configs" / "tiny.yaml", base + list(overrides))


def weights(stage_uri: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(stage_uri) / "model" / "model.safetensors"))


def losses(stage_uri: str) -> list[float]:
    import json

    history = json.loads((Path(stage_uri) / "metrics.json").read_text())["history"]
    return [r["loss"] for r in history if "loss" in r]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
