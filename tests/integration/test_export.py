"""`alignflow export`: copy a published model, verified against its manifest."""

from pathlib import Path

import pytest

from alignflow.infra.export import ExportError, export_model
from alignflow.stages.sft.stage import main

from .conftest import sft_config


def test_export_copies_the_verified_model_and_refuses_a_corrupt_one(tmp_path):
    result = main(sft_config(tmp_path, "sft.batch.max_steps=2"), "sft")
    files = export_model(result["uri"], str(tmp_path / "serving"))
    assert "model.safetensors" in files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "serving")
    assert export_model(result["uri"] + "/model", str(tmp_path / "again"))  # the model folder itself works too

    weights = Path(result["uri"]) / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ExportError, match="no verified MANIFEST.json"):
        export_model(result["uri"], str(tmp_path / "bad"))


def test_export_carries_card_licence_and_a_manifest_that_verifies(tmp_path, tiny_model_path):
    import shutil

    from alignflow.infra import manifest

    base = tmp_path / "licensed-base"
    shutil.copytree(tiny_model_path, base)
    (base / "LICENSE").write_text("Apache-2.0, for the test\n")
    result = main(sft_config(tmp_path, "sft.batch.max_steps=2", f"sft.model.name_or_path={base}"), "sft")
    files = export_model(result["uri"], str(tmp_path / "serving"))
    assert {"model.safetensors", "tokenizer.json", "MODEL_CARD.md", "LICENSE"} <= set(files)
    assert (tmp_path / "serving" / "LICENSE").read_text() == "Apache-2.0, for the test\n"
    import json

    from transformers import AutoTokenizer

    config = json.loads((tmp_path / "serving" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in config  # a class transformers 4.x knows
    ours, theirs = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(tmp_path / "serving")
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "rev abcd"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(chat, add_generation_prompt=True)
    assert ours.all_special_tokens == theirs.all_special_tokens
    exported = manifest.verify(str(tmp_path / "serving"))  # a serving team can check the folder as it was handed over
    assert exported is not None and set(exported.files) == set(files) and exported.meta["source"] == result["uri"]


def test_export_by_registry_name_uses_the_projects_store_and_a_wrong_name_is_one_line(tmp_path):
    import subprocess
    import sys

    from mlflow import MlflowClient

    from .conftest import ROOT

    cli = lambda *a, cwd=tmp_path: subprocess.run([sys.executable, "-m", "alignflow.cli", "export", *a], cwd=cwd,  # noqa: E731
                                                  capture_output=True, text=True, timeout=300)
    missing = cli("models:/nope@candidate", "out")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "there is no MLflow store at sqlite:///" in missing.stderr
    assert not list(tmp_path.rglob("mlflow.db"))  # and none was made on the way

    root = tmp_path / "project"
    result = main(sft_config(tmp_path, "sft.batch.max_steps=2", f"storage.root={root}"), "sft")
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")  # where `alignflow run` keeps the registry of local storage
    client.create_registered_model("tiny")
    version = client.create_model_version("tiny", source=result["uri"] + "/model")
    client.set_registered_model_alias("tiny", "candidate", version.version)
    config = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", f"storage.root={root}"]
    ok = cli("models:/tiny@candidate", str(tmp_path / "serving"), *config, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "serving" / "model.safetensors").exists()
    wrong = cli("models:/tiny@champion", str(tmp_path / "x"), *config, cwd=ROOT)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert "models:/tiny@champion: not in the model registry at sqlite:///" in wrong.stderr
