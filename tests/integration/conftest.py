from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]


# The sft stage's own logging, and every other training kind's through `defaults:` (a `--set rl.…` would add an
# rl stage to tiny.yaml's graph). Eval stages have no `logging:` section.
QUIET = [f"{s}.logging.{k}" for s in ("sft", *(f"defaults.{kind}" for kind in ("rm", "dpo", "kto", "rl")))
         for k in ("progress=false", "log_every=1000")]


def sft_config(tmp_path: Path, *overrides: str):
    """configs/tiny.yaml, quiet, publishing under tmp_path."""
    return load_config(ROOT / "configs" / "tiny.yaml", [f"storage.root={tmp_path / 'out'}", *QUIET, *overrides])


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory):
    """configs/tiny.yaml's SFT stage as shipped (what `make demo` trains), run once per session:
    (its config, its result). The preference stages start from it."""
    from alignflow.stages.sft.stage import main

    with contextlib.chdir(ROOT):
        cfg = sft_config(tmp_path_factory.mktemp("tiny-sft"))
        return cfg, main(cfg, "sft")


def weights(stage_uri: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(stage_uri) / "model" / "model.safetensors"))


def losses(stage_uri: str) -> list[float]:
    import json

    history = json.loads((Path(stage_uri) / "metrics.json").read_text())["history"]
    return [r["train/loss"] for r in history if "train/loss" in r]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="session")
def tiny_rm(tiny_sft):
    """configs/tiny.yaml's reward model, trained from `tiny_sft` in the same storage root, once per session."""
    from alignflow.stages.rm.stage import main

    sft_cfg, _ = tiny_sft
    with contextlib.chdir(ROOT):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"storage.root={sft_cfg.storage.root}", *QUIET, "rm.from=sft"])
        return cfg, main(cfg, "rm")


@pytest.fixture(scope="package")
def ray_session():
    """One private Ray instance for the integration tier's modules that run worker groups: each stage run starts
    its own groups in it and removes them (and their placement groups) when it ends. Shared, not one per module: a
    private instance takes 5-7 s to start and stop on a 2-core machine. Stopped with the tier's last test, so that
    the unit tier does not run beside it idling."""
    import ray

    from alignflow.stages.common.workers import connect_ray

    disconnect = connect_ray()
    yield
    left = {pg_id: pg["bundles"] for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}
    disconnect()
    assert not left, f"placement groups that a stage run did not remove: {left}"


def history(stage_uri: str) -> list[dict]:
    """The per-step records of a published stage's metrics.json."""
    import json

    return json.loads((Path(stage_uri) / "metrics.json").read_text())["history"]
