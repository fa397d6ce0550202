"""Preference pairs and KTO rows: tokens, masks, and bad rows named by file and line."""

import json
from pathlib import Path

import pytest
import torch

from alignflow.config.base import PreferenceDataConfig
from alignflow.stages.kto.config import KTODataConfig
from alignflow.stages.common.data import DataError
from alignflow.stages.common.pairs import collate_pairs, load_pairs
from alignflow.stages.kto.data import load_kto_rows


def jsonl(tmp_path: Path, rows: list) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pairs_cfg(path: str, **kw) -> PreferenceDataConfig:
    return PreferenceDataConfig(path=path, eval_fraction=0.0, **kw)


def test_a_pair_shares_its_prompt_and_trains_on_responses(tmp_path, tokenizer):
    (pair,), _, _ = load_pairs(pairs_cfg(jsonl(tmp_path, [{"prompt": "1+2", "chosen": "3", "rejected": "12"}])), tokenizer, 0)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2"}], add_generation_prompt=True, tokenize=False)
    for sample, response in ((pair.chosen, "3"), (pair.rejected, "12")):
        assert tokenizer.decode(sample.input_ids) == prompt + response + "<|end|>"
        assert tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]) == response + "<|end|>"
    batch = collate_pairs([pair], tokenizer.pad_token_id)
    p = pair.prompt_len
    assert tokenizer.decode(batch.input_ids[0]) == prompt + "3<|end|>12<|end|>"  # the prompt once
    assert batch.position_ids[0].tolist() == list(range(p + 2)) + list(range(p, p + 3))  # rejected continues the prompt
    assert batch.source[0, p + 2].item() == p - 1 and batch.source[0, p + 3].item() == p + 2
    mask = batch.attention_mask[0, 0]
    assert not mask[p + 2:, p:p + 2].any() and mask[p + 2:, :p].all()  # rejected sees the prompt, not the chosen
    assert batch.chosen_mask[0].tolist() == [0] * p + [1, 1, 0, 0, 0] and batch.rejected_mask[0].tolist() == [0] * (p + 2) + [1, 1, 1]
    assert (batch.chosen_end.item(), batch.rejected_end.item()) == (p + 1, p + 4)


def test_shared_rows_compute_what_separate_rows_do(tmp_path, tokenizer, tiny_model_path):
    """The slow reference (each response in its own row) against the shared-prompt rows."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from alignflow.stages.common.data import collate
    from alignflow.stages.common.logprobs import forward_logprobs, sequence_logprobs
    from alignflow.stages.common.pairs import pair_logps, pair_rewards

    rows = [{"prompt": "12+34", "chosen": "46", "rejected": "4600"}, {"prompt": "rev abcd", "chosen": "dcba", "rejected": "x"},
            {"prompt": "reverse the letters of abcdefghijklmnop", "chosen": "ponmlkjihgfedcba", "rejected": "abcdefghijklmnop"}]
    pairs, _, _ = load_pairs(pairs_cfg(jsonl(tmp_path, rows)), tokenizer, 0)
    pad = tokenizer.pad_token_id
    assert collate_pairs(pairs, pad).input_ids.shape[0] == 1  # the short pairs share the long one's row (padding-free)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    shared = pair_logps(lm, pairs, pad, "cpu")
    for name in ("chosen", "rejected"):
        batch = collate([getattr(p, name) for p in pairs], pad, packed=False)
        torch.testing.assert_close(shared[name], sequence_logprobs(forward_logprobs(lm, batch), batch.loss_mask), atol=1e-4, rtol=0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).eval()
    rm.config.pad_token_id = pad
    chosen, rejected = pair_rewards(rm, rm.score, pairs, pad, "cpu")
    for name, got in (("chosen", chosen), ("rejected", rejected)):
        batch = collate([getattr(p, name) for p in pairs], pad, packed=False)
        torch.testing.assert_close(got, rm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+2", "chosen": "3", "rejected": "3"}, "'chosen' and 'rejected' are the same response ('3'): nothing to prefer"),
    ({"prompt": "1+2", "chosen": "3"}, "missing key 'rejected' (set data.rejected_key to the column that holds it; row has: chosen, prompt)"),
    ({"prompt": "1+2", "chosen": "3", "rejected": 4}, "'rejected' must be a string or a list of {role, content} messages (got int 4)"),
    ({"prompt": "1+2", "chosen": "3", "rejected": "  "}, "'rejected' is empty"),
])
def test_bad_pairs_name_file_and_line(tmp_path, tokenizer, row, message):
    path = jsonl(tmp_path, [{"prompt": "1+1", "chosen": "2", "rejected": "3"}, row])
    with pytest.raises(DataError) as err:
        load_pairs(pairs_cfg(path), tokenizer, 0)
    assert str(err.value) == f"{path}:2: {message}"


def test_pairs_identical_after_truncation_and_margins(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": "1+2", "chosen": "3" * 40 + "a", "rejected": "3" * 40 + "b"}])
    with pytest.raises(DataError, match=r"identical after truncation to data.max_len \(max_len=24\)"):
        load_pairs(pairs_cfg(path, max_len=24), tokenizer, 0)
    path = jsonl(tmp_path, [{"prompt": "1+2", "chosen": "3", "rejected": "4", "m": 1.5}, {"prompt": "1+2", "chosen": "3", "rejected": "4", "m": "big"}])
    with pytest.raises(DataError, match=r":2: 'm' must be a finite number \(got str 'big'\)"):
        load_pairs(pairs_cfg(path, margin_key="m"), tokenizer, 0)
    kept, _, stats = load_pairs(pairs_cfg(path, margin_key="m", on_bad_row="skip", max_skip_fraction=0.5), tokenizer, 0)
    assert [p.margin for p in kept] == [1.5] and stats["train"]["skipped"] == {"'m' must be a finite number": 1}


def test_bad_pairs_are_skipped_and_counted_when_asked(tmp_path, tokenizer):
    rows = [{"prompt": "1+1", "chosen": "2", "rejected": "2"}, {"prompt": "1+2", "chosen": "3"}, {"prompt": "2+2", "chosen": "4", "rejected": "5"}]
    kept, _, stats = load_pairs(pairs_cfg(jsonl(tmp_path, rows), on_bad_row="skip", max_skip_fraction=1.0), tokenizer, 0)
    assert len(kept) == 1
    assert stats["train"] == {"read": 3, "used": 1, "filtered": {}, "skipped": {
        "'chosen' and 'rejected' are the same response": 1, "missing key 'rejected'": 1}}  # reasons without row values


def test_kto_rows_need_a_boolean_label(tmp_path, tokenizer):
    good = {"prompt": "1+2", "completion": "3", "label": True}
    for bad, message in (({**good, "label": "yes"}, "'label' must be a boolean (true = desirable), got str 'yes'"),
                         ({**good, "label": 1}, "'label' must be a boolean (true = desirable), got int 1"),
                         ({"prompt": "1+2", "completion": "3"}, "missing key 'label' (set data.label_key to the column that holds it; row has: completion, prompt)")):
        path = jsonl(tmp_path, [good, bad])
        with pytest.raises(DataError) as err:
            load_kto_rows(KTODataConfig(path=path, eval_fraction=0.0), tokenizer, 0)
        assert str(err.value) == f"{path}:2: {message}"
    rows, _, _ = load_kto_rows(KTODataConfig(path=jsonl(tmp_path, [good, {**good, "completion": "4", "label": False}]), eval_fraction=0.0), tokenizer, 0)
    assert [r.desirable for r in rows] == [True, False]
    mismatched = rows[0].mismatched(rows[1])
    assert tokenizer.decode([t for t, m in zip(mismatched.input_ids, mismatched.loss_mask) if m]) == "4<|end|>"
