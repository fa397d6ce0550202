import json
from pathlib import Path

import pytest
import torch

from alignflow.stages.sft.config import DataConfig
from alignflow.stages.common.data import (
    DataError, Sample, collate, global_batch, pack, rank_micro_batches, read_rows, split_holdout, steps_per_epoch,
)
from alignflow.stages.sft.data import load_sft_samples

ROOT = Path(__file__).resolve().parents[2]


def jsonl(tmp_path: Path, rows: list, name: str = "d.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def cfg(path: str, **kw) -> DataConfig:
    return DataConfig(path=path, eval_fraction=0.0, **kw)


def test_prompt_is_masked_response_and_eos_are_trained(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": "1+2", "response": "3"}])
    (sample,), _, _ = load_sft_samples(cfg(path), tokenizer, seed=0)
    text = tokenizer.decode(sample.input_ids)
    assert text == "<bos><|user|>1+2<|end|><|assistant|>3<|end|>"
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tokenizer.decode(trained) == "3<|end|>"
    assert sample.loss_mask == [0] * (len(sample) - 2) + [1, 1]


def test_messages_train_every_assistant_turn_only(tmp_path, tokenizer):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2"},
                        {"role": "assistant", "content": "4"}, {"role": "user", "content": "rev ab"},
                        {"role": "assistant", "content": "ba"}]}
    path = jsonl(tmp_path, [row])
    (sample,), _, _ = load_sft_samples(cfg(path, messages_key="messages"), tokenizer, seed=0)
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tokenizer.decode(trained) == "4<|end|>ba<|end|>"


def test_truncation_cuts_the_response(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": "rev abcdefghij", "response": "jihgfedcba"}])
    (sample,), _, _ = load_sft_samples(cfg(path, max_len=24), tokenizer, seed=0)
    assert len(sample) == 24 and sum(sample.loss_mask) == 24 - 18  # 18 prompt tokens: <bos><|user|>, 14 chars, <|end|><|assistant|>


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1+2"}, "missing key 'response' (set data.output_key to the column that holds it; row has: prompt)"),
        ({"prompt": "1+2", "response": 3}, "'response' must be a string or a list of {role, content} messages (got int 3)"),
        ({"prompt": "1+2", "response": "  "}, "'response' is empty"),
        ({"prompt": "x" * 40, "response": "y"}, "prompt not shorter than data.max_len (44 tokens, max_len=32)"),
        ("{not json", "not valid JSON"),
        ([1, 2], "a row must be a JSON object, got list"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, tokenizer, row, message):
    path = jsonl(tmp_path, [{"prompt": "1+1", "response": "2"}, row])
    with pytest.raises(DataError) as err:
        load_sft_samples(cfg(path, max_len=32), tokenizer, seed=0)
    assert f"{path}:2: " in str(err.value) and message in str(err.value)


def test_bad_messages_rows(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=":1: empty response"):
        load_sft_samples(cfg(path, messages_key="messages"), tokenizer, seed=0)
    path = jsonl(tmp_path, [{"messages": "hi"}])
    with pytest.raises(DataError, match="must be a list of"):
        load_sft_samples(cfg(path, messages_key="messages"), tokenizer, seed=0)


def test_bad_rows_skipped_and_counted_when_asked(tmp_path, tokenizer):
    rows = [{"prompt": "1+1", "response": "2"}, {"prompt": "1+2"}, {"prompt": "1+3"}, {"prompt": 5, "response": "x"}, "{bad"]
    train, _, stats = load_sft_samples(cfg(jsonl(tmp_path, rows), on_bad_row="skip", max_skip_fraction=1.0), tokenizer, seed=0)
    assert len(train) == 1
    assert stats["train"]["read"] == 5 and stats["train"]["used"] == 1
    assert stats["train"]["skipped"] == {"missing key 'response'": 2, "'prompt' must be a string or a list of {role, content} messages": 1,
                                         "not valid JSON": 1}


def test_empty_dataset_is_an_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="no usable rows"):
        load_sft_samples(cfg(jsonl(tmp_path, [])), tokenizer, seed=0)
    with pytest.raises(DataError, match="no usable rows .*skipped"):
        load_sft_samples(cfg(jsonl(tmp_path, [{"prompt": "a"}]), on_bad_row="skip"), tokenizer, seed=0)


def test_parquet_and_hf_dataset_folders(tmp_path, tokenizer):
    import datasets

    rows = [{"q": f"{i}+1", "a": str(i + 1)} for i in range(10)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hfdict"))
    expected = load_sft_samples(cfg(jsonl(tmp_path, rows), input_key="q", output_key="a"), tokenizer, 0)[0]
    for source in ("d.parquet", "hf", "hfdict"):
        got = load_sft_samples(cfg(str(tmp_path / source), input_key="q", output_key="a"), tokenizer, 0)[0]
        assert [s.input_ids for s in got] == [s.input_ids for s in expected], source
    with pytest.raises(DataError, match=r"d.parquet:row 1: missing key 'prompt'"):
        load_sft_samples(cfg(str(tmp_path / "d.parquet")), tokenizer, 0)


def test_holdout_split_is_deterministic_and_disjoint():
    items = list(range(100))
    a, b = split_holdout(items, 0.1, seed=3)
    assert (a, b) == split_holdout(items, 0.1, seed=3)
    assert len(b) == 10 and sorted(a + b) == items


def test_packing_keeps_every_token_and_restarts_positions():
    samples = [Sample(list(range(n)), [0] * (n // 2) + [1] * (n - n // 2)) for n in (5, 9, 3, 7, 2, 6)]
    packed = pack(samples, max_len=12)
    assert all(len(p) <= 12 for p in packed)
    assert sorted(sum(len(p) for p in packed) for _ in [0]) == [sum(len(s) for s in samples)]
    assert len(packed) == 3  # 32 tokens in rows of 12: best fit needs 3
    for row in packed:
        starts = [i for i, p in enumerate(row.position_ids) if p == 0]
        lengths = [b - a for a, b in zip(starts, starts[1:] + [len(row)])]
        assert sorted(lengths) == sorted(lengths)  # one run per sample
        assert all(row.position_ids[s:s + n] == list(range(n)) for s, n in zip(starts, lengths))
    assert sorted(n for row in packed for n in _runs(row)) == sorted(len(s) for s in samples)


def _runs(row: Sample) -> list[int]:
    starts = [i for i, p in enumerate(row.position_ids) if p == 0]
    return [b - a for a, b in zip(starts, starts[1:] + [len(row)])]


def test_collate_pads_right_and_masks():
    batch = collate([Sample([5, 6, 7], [0, 1, 1]), Sample([8], [1])], pad_id=0, packed=False)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.num_tokens == 4
    packed = collate([Sample([5, 6, 7], [0, 1, 1], [0, 1, 0])], pad_id=0, packed=True)
    assert packed.attention_mask is None and packed.position_ids.tolist() == [[0, 1, 0]]


def test_batches_depend_on_seed_and_step_only():
    n, gb = 100, 32
    assert steps_per_epoch(n, gb) == 3
    first = [global_batch(n, gb, s, seed=1) for s in range(6)]
    assert first == [global_batch(n, gb, s, seed=1) for s in range(6)]
    epoch0 = sum(first[:3], [])
    assert len(set(epoch0)) == 96  # no repeats within an epoch
    assert first[3] != first[0]  # a new order each epoch


def test_rank_micro_batches_partition_the_global_batch():
    indices = list(range(16))
    lengths = [(i * 7) % 11 for i in range(16)]
    parts = [rank_micro_batches(indices, lengths, micro=4, world=2, rank=r) for r in range(2)]
    assert all(len(p) == 2 for p in parts)
    flat = sorted(i for p in parts for m in p for i in m)
    assert flat == indices


def test_non_utf8_data_is_a_bad_row_naming_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_sft_samples(cfg(str(path)), tokenizer, seed=0)
    whole = tmp_path / "latin1.json"
    whole.write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(DataError, match=rf"{whole}: not UTF-8 text \(byte 0xe9 at offset 16\)"):
        list(read_rows(str(whole)))


def test_read_rows_reports_lines_and_blank_ones(tmp_path):
    path = jsonl(tmp_path, [{"a": 1}, "", {"b": 2}])
    assert [(w, r) for w, r in read_rows(path)] == [(f"{path}:1", {"a": 1}), (f"{path}:2", "blank line"), (f"{path}:3", {"b": 2})]


def test_packed_rows_compute_what_separate_rows_compute(tiny_model_path):
    """Block-diagonal attention: a packed row's logits equal each sample's own forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    a, b = Sample([1, 20, 30, 40, 50], [0, 0, 1, 1, 1]), Sample([1, 60, 70], [0, 1, 1])
    (row,) = pack([a, b], max_len=16)
    packed = collate([row], pad_id=0, packed=True)
    padded = collate([a, b], pad_id=0, packed=False)
    with torch.no_grad():
        lp = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        lq = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, position_ids=padded.position_ids).logits
    # pack() orders a row's members by index: a then b.
    torch.testing.assert_close(lp[0, :5], lq[0, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp[0, 5:8], lq[1, :3], atol=1e-5, rtol=1e-5)
