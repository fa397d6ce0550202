"""The registered version as an MLflow model: a pyfunc around the published HF folder.

`mlflow.pyfunc.load_model("models:/NAME@candidate").predict(rows, params={"max_tokens": 64})` generates,
with nothing of alignflow installed: the model is logged from code (`hf_pyfunc.py`, copied into the
model), its artifacts are the HF folder itself, in the run's artifact store (S3 when MLflow's artifacts
are there). Not the transformers flavor: saving with it builds a pipeline, so the flow process (which never
imports torch) would load the weights (17 s for the tiny model here), and its requirement inference needs
torchvision, which this install leaves out.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import tempfile
import threading
import warnings
from pathlib import Path

from alignflow.infra import storage

CODE_FILE = Path(__file__).with_name("hf_pyfunc.py")
HF_ARTIFACT = "hf_model"  # the key hf_pyfunc.py reads
MODEL_NAME = "model"
_GLOBAL_URI = threading.Lock()  # one flow at a time may point MLflow's global URI elsewhere (flows served in threads)


def signature():
    """Chat (`messages`: a list of {role, content}) or text (`prompt`) in, the generated text out."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema

    message = Object([Property("role", "string"), Property("content", "string")])
    return ModelSignature(
        inputs=Schema([ColSpec(Array(message), "messages", required=False), ColSpec("string", "prompt", required=False)]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_tokens", "long", 64), ParamSpec("temperature", "double", 0.0),
                            ParamSpec("top_p", "double", 1.0)]))


def requirements() -> list[str]:
    """What loading needs, at the versions it was tested with (a local `+cpu` build tag dropped)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in ("mlflow", "torch", "transformers")]


@contextlib.contextmanager
def global_tracking_uri(uri: str):
    """MLflow's process-wide tracking URI, for the calls that read it (logging a model; registering one from a
    `models:/<model id>` source looks the model up there), put back afterwards."""
    import mlflow

    with _GLOBAL_URI:
        before = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(before)


def log_hf_model(client, experiment_id: str, run_id: str, model_uri: str, tags: dict[str, str]):
    """Log the HF folder at `model_uri` (local or S3) as a logged model of `run_id`; returns MLflow's ModelInfo.
    Call it under global_tracking_uri(client's URI)."""
    import mlflow
    from mlflow.models import Model

    logged = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id, tags=tags)
    with tempfile.TemporaryDirectory(prefix="alignflow-model-") as tmp:
        folder = storage.local_path(model_uri) if storage.is_local(model_uri) else storage.download_dir(model_uri, Path(tmp) / "hf")
        with warnings.catch_warnings():  # an input example would make MLflow run the model here, in the flow process
            warnings.filterwarnings("ignore", message=".*input example was not provided.*")
            return Model.log(artifact_path=None, name=MODEL_NAME, flavor=mlflow.pyfunc, run_id=run_id, model_id=logged.model_id,
                             python_model=str(CODE_FILE), artifacts={HF_ARTIFACT: str(folder)}, signature=signature(),
                             pip_requirements=requirements())
