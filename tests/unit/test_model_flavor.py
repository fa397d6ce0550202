"""The registered model's pyfunc and the code that logs it agree on what they share (hf_pyfunc.py is copied
into the model, so it cannot import alignflow)."""

import pytest


def test_the_logger_and_the_pyfunc_name_the_same_artifact_and_defaults():
    from alignflow.infra import hf_pyfunc, model_flavor

    assert model_flavor.HF_ARTIFACT == hf_pyfunc.HF_ARTIFACT
    params = {p.name: p.default for p in model_flavor.signature().params}
    assert params == hf_pyfunc.DEFAULT_PARAMS
    assert "alignflow" not in model_flavor.CODE_FILE.read_text().replace('"""', "").split("from __future__")[1]


def test_the_global_tracking_uri_is_put_back(tmp_path):
    import mlflow

    from alignflow.infra.model_flavor import global_tracking_uri

    before = mlflow.get_tracking_uri()
    with pytest.raises(RuntimeError), global_tracking_uri(f"sqlite:///{tmp_path}/x.db"):
        assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path}/x.db"
        raise RuntimeError
    assert mlflow.get_tracking_uri() == before
