"""The same stage code against a real S3 API server on loopback: publish, checkpoints, resume."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors

from alignflow.infra import manifest, storage
from alignflow.stages.common.checkpoint import tag
from alignflow.stages.sft.stage import FAIL_AT_STEP_ENV, InjectedFailure, main

from .conftest import sft_config, weights


def test_sft_on_s3_publishes_and_resumes_from_s3_checkpoints(tmp_path, s3_server, monkeypatch):
    steps = ("sft.batch.max_steps=6", "sft.checkpoint.every_steps=2")
    local = main(sft_config(tmp_path, *steps), "sft")
    cfg = sft_config(tmp_path, *steps, "storage.root=s3://alignflow-test/runs")

    monkeypatch.setenv(FAIL_AT_STEP_ENV, "5")
    with pytest.raises(InjectedFailure):
        main(cfg, "sft")
    monkeypatch.delenv(FAIL_AT_STEP_ENV)
    uri = f"s3://alignflow-test/runs/sft/{local['cache_key']}"
    assert storage.list_dirs(storage.join(uri, "checkpoints")) == [tag(2), tag(4)]
    assert manifest.verify(uri) is None

    resumed = main(cfg, "sft")
    assert resumed["uri"] == uri and resumed["resumed_from_step"] == 4
    published = manifest.verify(uri)
    assert published is not None and published.meta["cache_key"] == local["cache_key"]
    fs, path = storage.filesystem(uri)
    remote = load_safetensors(fs.cat_file(f"{path}/model/model.safetensors"))
    for name, tensor in weights(local["uri"]).items():
        assert torch.equal(remote[name], tensor), name
