"""Built-in base models, made locally so nothing is downloaded at run time.

`builtin:tiny` (about 0.8M parameters) and `builtin:small` (about 25M) are
Llama-architecture causal LMs with seeded random weights and a character-level
tokenizer that carries a chat template. `builtin:small-32k` is `small` with a
32,768-entry vocabulary, as large as a real tokenizer's: the characters plus
reserved ids the tokenizer never produces. Only its LM head and embedding
differ (tied, 17M more parameters), which is what it is for: measuring what the
head costs. They are written once, in HF format,
to a cache folder keyed by their spec, and loaded from there by the same code
that loads a hub model or a local folder, so vLLM and transformers read them
with no conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<unk>"]
EOS_TOKEN = "<|end|>"
# Each message is `<|role|>content<|end|>`; a generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class BuiltinSpec:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 512
    seed: int = 0
    vocab_size: int = 0  # 0: the characters alone; more: padded with reserved ids

    def key(self) -> dict:
        """The fields that name the build (an unset vocab_size is left out, so older builds keep their folder)."""
        return {k: v for k, v in asdict(self).items() if k != "vocab_size" or v}


BUILTINS = {
    "tiny": BuiltinSpec(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "small": BuiltinSpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    "small-32k": BuiltinSpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                             vocab_size=32768),
}


def vocabulary(size: int = 0) -> list[str]:
    """Special tokens, then every printable ASCII character but the vertical whitespace; then, up to `size`,
    reserved tokens that no text splits into."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    base = SPECIAL_TOKENS + chars
    return base + [f"<|reserved_{i}|>" for i in range(max(0, size - len(base)))]


def is_builtin(name: str) -> bool:
    return name.startswith(BUILTIN_PREFIX)


def cache_root() -> Path:
    return Path(os.environ.get("ALIGNFLOW_CACHE", Path.home() / ".cache" / "alignflow"))


def resolve_builtin(name: str) -> str:
    """Path of the HF folder for `builtin:<kind>`, built on first use."""
    kind = name.removeprefix(BUILTIN_PREFIX)
    if kind not in BUILTINS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join('builtin:' + k for k in BUILTINS)}")
    spec = BUILTINS[kind]
    digest = hashlib.sha256(json.dumps([spec.key(), vocabulary(spec.vocab_size), CHAT_TEMPLATE]).encode()).hexdigest()[:12]
    dest = cache_root() / "builtin" / f"{kind}-{digest}"
    if not (dest / "config.json").exists():
        _build_atomically(spec, dest)
    return str(dest)


def _build_atomically(spec: BuiltinSpec, dest: Path) -> None:
    # Several ranks may ask at once: each builds in its own temp folder and the first rename wins.
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        build_builtin(spec, tmp)
        os.rename(tmp, dest)
    except OSError:
        if not (dest / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tokenizer(vocab_size: int = 0):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary(vocab_size))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token=EOS_TOKEN,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=BUILTINS["tiny"].max_position_embeddings,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_builtin(spec: BuiltinSpec, dest: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(vocabulary(spec.vocab_size)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    fork = torch.random.fork_rng(devices=[])
    with fork:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
