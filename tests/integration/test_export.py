"""`alignflow export`: copy a published model, verified against its manifest."""

from pathlib import Path

import pytest

from alignflow.infra.export import ExportError, export_model
from alignflow.stages.sft.stage import main

from .conftest import sft_config


def test_export_copies_the_verified_model_and_refuses_a_corrupt_one(tmp_path):
    result = main(sft_config(tmp_path, "sft.batch.max_steps=2"), "sft")
    files = export_model(result["uri"], str(tmp_path / "serving"))
    assert "model/model.safetensors" in files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "serving")
    assert export_model(result["uri"] + "/model", str(tmp_path / "again"))  # the model folder itself works too

    weights = Path(result["uri"]) / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ExportError, match="no verified MANIFEST.json"):
        export_model(result["uri"], str(tmp_path / "bad"))
