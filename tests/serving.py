"""What a serving team does with a registered version: load it with MLflow alone, in a fresh process, and generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHAT = [{"role": "user", "content": "rev abcd"}]
PROMPT = "13+54"
MAX_TOKENS = 8
# Only MLflow (and the torch and transformers the model's requirements name): nothing of alignflow is imported.
LOAD = """
import json, sys, mlflow, pandas as pd
out = {}
for uri, ref in json.loads(sys.argv[1]):
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(ref)
    rows = pd.DataFrame({"messages": [%r, None], "prompt": [None, %r]})
    out[ref] = {"text": model.predict(rows, params={"max_tokens": %d}),
                "inputs": [c.name for c in model.metadata.signature.inputs.inputs],
                "params": [p.name for p in model.metadata.signature.params.params]}
out["alignflow imported"] = any(m.split(".")[0] == "alignflow" for m in sys.modules)
print(json.dumps(out))
""" % (CHAT, PROMPT, MAX_TOKENS)


def predict_in_fresh_process(refs: list[tuple[str, str]], env: dict | None = None) -> dict[str, dict]:
    """(tracking URI, models:/ reference) -> what `mlflow.pyfunc.load_model(ref).predict` gave for CHAT and PROMPT.
    A model on the tests' S3 server is read as a serving team reads one off AWS: MLflow's own MLFLOW_S3_ENDPOINT_URL."""
    env = dict(env or os.environ)
    if env.get("ALIGNFLOW_S3_ENDPOINT_URL"):
        env.setdefault("MLFLOW_S3_ENDPOINT_URL", env["ALIGNFLOW_S3_ENDPOINT_URL"])
    done = subprocess.run([sys.executable, "-c", LOAD, json.dumps(refs)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("alignflow imported") is False  # the model carries its own code
    for ref, got in out.items():
        assert got["inputs"] == ["messages", "prompt"] and got["params"] == ["max_tokens", "temperature", "top_p"], (ref, got)
    return out


def greedy(folder: str) -> list[str]:
    """What the HF folder itself generates for CHAT and PROMPT, greedily, with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    out = []
    for ids in (list(chat["input_ids"] if hasattr(chat, "keys") else chat), tok(PROMPT)["input_ids"]):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, len(ids):], skip_special_tokens=True))
    return out


def logged_model(client, version):
    """The MLflow logged model behind a registered version (a sqlite registry leaves `model_id` unset on it;
    its source is `models:/<model id>` either way)."""
    return client.get_logged_model(version.model_id or version.source.removeprefix("models:/"))
