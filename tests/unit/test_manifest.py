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
    assert manifest.verify(str(root), check_hashes=False) is not None
    (root / "config.yaml").unlink()
    assert manifest.verify(str(root), check_hashes=False) is None
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
