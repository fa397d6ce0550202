import json

from alignflow.infra import manifest, storage


def make(tmp_path):
    root = tmp_path / "stage"
    (root / "model").mkdir(parents=True)
    (root / "model" / "w.bin").write_bytes(b"\x00" * 100)
    (root / "config.yaml").write_text("a: 1\n")
    (root / "checkpoints" / "step_1").mkdir(parents=True)
    (root / "checkpoints" / "step_1" / "x").write_text("ckpt")
    return root


def test_manifest_written_last_and_verifies(tmp_path):
    root = make(tmp_path)
    m = manifest.write_manifest(str(root), exclude=("checkpoints/",), cache_key="k", metrics={"loss": 1.0})
    assert set(m.files) == {"model/w.bin", "config.yaml"}
    data = json.loads((root / "MANIFEST.json").read_text())
    assert data["cache_key"] == "k" and data["files"]["model/w.bin"]["size"] == 100
    assert manifest.verify(str(root)).digest == m.digest


def test_corrupt_or_missing_file_fails_verification(tmp_path, caplog):
    root = make(tmp_path)
    manifest.write_manifest(str(root), exclude=("checkpoints/",))
    (root / "model" / "w.bin").write_bytes(b"\x01" * 100)  # same size, other bytes
    assert manifest.verify(str(root)) is None
    assert "model/w.bin does not match its sha256" in caplog.text
    (root / "model" / "w.bin").write_bytes(b"\x00" * 100)
    assert manifest.verify(str(root)) is not None
    (root / "config.yaml").unlink()
    assert manifest.verify(str(root)) is None
    assert "config.yaml is missing" in caplog.text


def test_no_manifest_means_incomplete(tmp_path):
    assert manifest.verify(str(make(tmp_path))) is None
    (tmp_path / "stage" / "MANIFEST.json").write_text("{trunc")
    assert manifest.verify(str(tmp_path / "stage")) is None


def test_cache_key_depends_on_config_inputs_and_version():
    base = manifest.cache_key("h", {"data": "d1"}, "1")
    assert base == manifest.cache_key("h", {"data": "d1"}, "1")
    assert base != manifest.cache_key("h2", {"data": "d1"}, "1")
    assert base != manifest.cache_key("h", {"data": "d2"}, "1")
    assert base != manifest.cache_key("h", {"data": "d1"}, "2")


def test_fingerprint_follows_content_not_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("x\n")
    b.write_text("x\n")
    assert storage.fingerprint(str(a)) == storage.fingerprint(str(b))
    b.write_text("y\n")
    assert storage.fingerprint(str(a)) != storage.fingerprint(str(b))


def test_full_check_hashes_once_until_a_file_changes_then_names_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "home"))
    root = make(tmp_path)
    manifest.write_manifest(str(root), exclude=("checkpoints/",))
    hashed = []
    real = storage.sha256_of
    monkeypatch.setattr(storage, "sha256_of", lambda uri: hashed.append(uri) or real(uri))
    assert manifest.verify(str(root)) is not None and len(hashed) == 2
    assert manifest.verify(str(root)) is not None and len(hashed) == 2  # recorded: nothing re-hashed
    with open(root / "model" / "w.bin", "r+b") as f:  # a same-size flip of 16 bytes
        f.seek(40)
        f.write(b"\xff" * 16)
    assert manifest.verify(str(root)) is None and len(hashed) == 3  # only the changed file is hashed again
    assert "model/w.bin does not match its sha256" in caplog.text


def test_prefect_cache_answers_only_for_a_model_whose_bytes_match(tmp_path, monkeypatch):
    from alignflow.config import load_config
    from alignflow.lineage import stage_output_uri
    from alignflow.tasks.stage import prefect_cache_key

    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "home"))
    config = load_config("configs/tiny.yaml", [f"storage.root={tmp_path / 'out'}"])
    out = tmp_path / "out" / "sft" / "k1"
    (out / "model").mkdir(parents=True)
    (out / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    manifest.write_manifest(str(out), mlflow_run_id="r")
    assert stage_output_uri(config, "sft", "k1") == str(out)
    params = {"config": config, "stage": "sft", "key": "k1"}
    assert prefect_cache_key(None, params) is not None
    with open(out / "model" / "model.safetensors", "r+b") as f:
        f.write(b"\x00" * 16)
    assert prefect_cache_key(None, params) is None
