import hashlib
from pathlib import Path

import pytest

from alignflow.stages.common.builtin_model import BUILTINS, build_builtin, resolve_builtin


def test_builtin_is_deterministic(tmp_path, tiny_model_path):
    build_builtin(BUILTINS["tiny"], tmp_path)
    sha = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    assert sha(tmp_path / "model.safetensors") == sha(Path(tiny_model_path) / "model.safetensors")


def test_tokenizer_round_trips_text_and_has_chat_template(tokenizer):
    text = "rev Hello, World!\n 12+34=46"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><|user|>1+1<|end|><|assistant|>"
    assert tokenizer.eos_token == "<|end|>" and tokenizer.pad_token_id != tokenizer.eos_token_id



def test_the_large_vocabulary_preset_tokenizes_as_small_and_only_pads_the_vocabulary(tokenizer):
    from alignflow.stages.common.builtin_model import build_tokenizer, vocabulary

    big = build_tokenizer(BUILTINS["small-32k"].vocab_size)
    assert len(big) == len(vocabulary(32768)) == 32768
    text = "rev Hello, World!\n 12+34=46 <|reserved_7|>"  # a reserved token's spelling is still characters
    assert big(text)["input_ids"] == tokenizer(text)["input_ids"]
    # the presets without it keep the spec they were built under, so their cached folders stay valid
    assert "vocab_size" not in BUILTINS["small"].key() and BUILTINS["small-32k"].key()["vocab_size"] == 32768

def test_unknown_builtin_names_the_choices():
    import pytest

    with pytest.raises(ValueError, match="builtin:tiny, builtin:small"):
        resolve_builtin("builtin:huge")


def test_a_hub_model_offline_and_not_cached_is_bad_input(tmp_path, monkeypatch):
    from alignflow.config import ConfigError
    from alignflow.stages.common.models import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match="model 'org/not-downloaded' is neither a local folder nor in the Hugging Face cache"):
        resolve_model_path("org/not-downloaded")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a folder is taken as it is
