"""Public dataset shapes read by config alone: conversational fields, implicit prompts, HH transcripts,
input templates, score columns, row accounting, and errors that say what to set. Rows are written
here in the public datasets' shapes (UltraFeedback-binarized, HH-RLHF, Alpaca, OpenAI chat, GSM8K)."""

import json
from pathlib import Path

import pytest

from alignflow.config import ConfigError, load_config
from alignflow.config.base import PreferenceDataConfig, PromptDataConfig
from alignflow.stages.common.data import DataError, load_rows, pack
from alignflow.stages.common.formats import hh_messages, render_template
from alignflow.stages.common.pairs import load_pairs
from alignflow.stages.kto.config import KTODataConfig
from alignflow.stages.kto.data import load_kto_rows
from alignflow.stages.rl.data import load_prompts
from alignflow.stages.sft.config import DataConfig
from alignflow.stages.sft.data import load_sft_samples

ROOT = Path(__file__).resolve().parents[2]
U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731


def jsonl(tmp_path: Path, rows: list, name: str = "d.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def pairs(tmp_path, tokenizer):
    """Pairs of rows written to a file, read with these data options."""
    return lambda rows, **kw: load_pairs(PreferenceDataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0, **kw), tokenizer, 0)


def texts(tokenizer, pair) -> tuple[str, str, str]:
    """(prompt, chosen response, rejected response) of a pair, decoded."""
    p = pair.prompt_len
    return (tokenizer.decode(pair.chosen.input_ids[:p]), tokenizer.decode(pair.chosen.input_ids[p:]),
            tokenizer.decode(pair.rejected.input_ids[p:]))


# --------------------------------------------------------------------------- preference pairs


def test_ultrafeedback_rows_train_what_the_plain_text_rows_train(tmp_path, tokenizer, pairs):
    uf = {"prompt": "12+30", "prompt_id": "a1", "chosen": [U("12+30"), A("42")], "rejected": [U("12+30"), A("1230")],
          "messages": [U("12+30"), A("42")], "score_chosen": 8.0, "score_rejected": 3.5}
    (pair,), _, _ = pairs([uf], ignore_columns=("prompt_id", "messages", "score_chosen", "score_rejected"))
    (plain,), _, _ = pairs([{"prompt": "12+30", "chosen": "42", "rejected": "1230"}])
    assert (pair.chosen, pair.rejected) == (plain.chosen, plain.rejected)
    assert texts(tokenizer, pair) == ("<bos><|user|>12+30<|end|><|assistant|>", "42<|end|>", "1230<|end|>")
    assert pair.chosen.loss_mask == [0] * pair.prompt_len + [1] * 3


def test_whole_conversations_need_no_prompt_column_and_keep_system_and_earlier_turns(tmp_path, tokenizer, pairs):
    earlier = [{"role": "system", "content": "Be brief."}, U("1+1"), A("2"), U("rev ab")]
    (pair,), _, _ = pairs([{"chosen": [*earlier, A("ba")], "rejected": [*earlier, A("ab")]}])
    assert texts(tokenizer, pair) == ("<bos><|system|>Be brief.<|end|><|user|>1+1<|end|><|assistant|>2<|end|><|user|>rev ab<|end|><|assistant|>",
                                      "ba<|end|>", "ab<|end|>")


def test_explicit_conversational_prompt_with_assistant_answers(tmp_path, tokenizer, pairs):
    (pair,), _, _ = pairs([{"prompt": [U("12+30")], "chosen": [A("42")], "rejected": [A("40")]}])
    assert texts(tokenizer, pair) == ("<bos><|user|>12+30<|end|><|assistant|>", "42<|end|>", "40<|end|>")


def test_pairs_that_differ_before_the_last_assistant_turn_are_an_error_naming_the_row(pairs):
    rows = [{"chosen": [U("1+1"), A("2")], "rejected": [U("1+1"), A("2")][:1] + [A("3")]},
            {"chosen": [U("1+1"), A("2"), U("2+2"), A("4")], "rejected": [U("1+1"), A("3"), U("2+2"), A("5")]}]
    with pytest.raises(DataError, match=r"d.jsonl:2: 'chosen' and 'rejected' differ before the last assistant turn \(at message 2\)"):
        pairs(rows)


def test_hh_transcripts_split_at_the_last_turn(tmp_path, tokenizer, pairs):
    assert hh_messages("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 1+1\n\nAssistant: 2", "w", "chosen") == [
        U("hi"), A("hello"), U("1+1"), A("2")]
    hh = {"chosen": "\n\nHuman: 1+1\n\nAssistant: 2\n\nHuman: rev ab\n\nAssistant: ba",
          "rejected": "\n\nHuman: 1+1\n\nAssistant: 2\n\nHuman: rev ab\n\nAssistant: ab"}
    (pair,), _, _ = pairs([hh], format="hh")
    assert texts(tokenizer, pair) == ("<bos><|user|>1+1<|end|><|assistant|>2<|end|><|user|>rev ab<|end|><|assistant|>", "ba<|end|>", "ab<|end|>")
    with pytest.raises(DataError, match=r"d.jsonl:1: missing key 'prompt' \(set data.prompt_key .*data.format: hh reads Human:/Assistant:"):
        pairs([hh])  # without the option, text pairs need a prompt column
    with pytest.raises(DataError, match=r"d.jsonl:1: 'chosen' has no prompt: every turn is the assistant's"):
        pairs([{"chosen": "just text", "rejected": "other"}], format="hh")  # bare answers need a prompt column
    (pair,), _, _ = pairs([{"prompt": "\n\nHuman: 1+1\n\nAssistant:", "chosen": "2", "rejected": "3"}], format="hh")
    assert texts(tokenizer, pair) == ("<bos><|user|>1+1<|end|><|assistant|>", "2<|end|>", "3<|end|>")


def test_format_text_refuses_lists_and_chat_renders_strings_as_turns(tmp_path, tokenizer, pairs):
    with pytest.raises(DataError, match=r"'chosen' must be a string when data.format is text \(got list"):
        pairs([{"prompt": "p", "chosen": [A("x")], "rejected": "y"}], format="text")
    (pair,), _, _ = pairs([{"prompt": "12+30", "chosen": "42", "rejected": "40"}], format="chat")
    assert texts(tokenizer, pair) == ("<bos><|user|>12+30<|end|><|assistant|>", "42<|end|>", "40<|end|>")


def test_score_columns_make_the_margin_and_filter_near_ties_without_counting_them_as_skipped(tmp_path, pairs):
    rows = [{"prompt": "1+1", "chosen": "2", "rejected": "3", "sc": 8.0, "sr": 5.5},
            {"prompt": "1+2", "chosen": "3", "rejected": "4", "sc": 6.0, "sr": 5.75}]
    kept, _, stats = pairs(rows, margin_from=("sc", "sr"), min_score_gap=0.5)
    assert [p.margin for p in kept] == [2.5]
    assert stats["train"] == {"read": 2, "used": 1, "skipped": {}, "filtered": {"score gap under min_score_gap=0.5": 1}}
    with pytest.raises(ValueError, match="min_score_gap filters on the gap between the margin_from score columns"):
        PreferenceDataConfig(path=rows and jsonl(tmp_path, rows), min_score_gap=1.0)


# --------------------------------------------------------------------------- sft, kto, rl


def test_sft_conversational_prompt_trains_only_the_final_assistant_turn(tmp_path, tokenizer):
    row = {"prompt": [{"role": "system", "content": "S"}, U("1+1"), A("2"), U("2+2")], "response": "4"}
    (sample,), _, _ = load_sft_samples(DataConfig(path=jsonl(tmp_path, [row]), eval_fraction=0.0), tokenizer, 0)
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tokenizer.decode(trained) == "4<|end|>"
    assert tokenizer.decode(sample.input_ids).startswith("<bos><|system|>S<|end|><|user|>1+1<|end|><|assistant|>2<|end|>")


def test_openai_messages_column_is_found_without_options(tmp_path, tokenizer):
    row = {"messages": [{"role": "system", "content": "S"}, U("1+1"), A("2"), U("rev ab"), A("ba")]}
    (sample,), _, _ = load_sft_samples(DataConfig(path=jsonl(tmp_path, [row]), eval_fraction=0.0), tokenizer, 0)
    assert tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]) == "2<|end|>ba<|end|>"


def test_kto_and_rl_read_conversations(tmp_path, tokenizer):
    (row,), _, _ = load_kto_rows(KTODataConfig(path=jsonl(tmp_path, [{"prompt": [U("1+1")], "completion": [A("2")], "label": True}]),
                                               eval_fraction=0.0), tokenizer, 0)
    assert tokenizer.decode(row.prompt_ids) == "<bos><|user|>1+1<|end|><|assistant|>" and tokenizer.decode(row.completion_ids) == "2<|end|>"
    path = jsonl(tmp_path, [{"prompt": [{"role": "system", "content": "S"}, U("7+1")], "answer": "8"}])
    (prompt,), _, _ = load_prompts(PromptDataConfig(path=path, eval_fraction=0.0), tokenizer, 0)
    assert tokenizer.decode(prompt.ids) == "<bos><|system|>S<|end|><|user|>7+1<|end|><|assistant|>"
    assert prompt.text == "7+1" and prompt.columns == {"answer": "8"}


# --------------------------------------------------------------------------- templates and columns


@pytest.mark.parametrize("template, row, expected", [
    ("{instruction}\n\n{input}", {"instruction": "Add.", "input": "1+2"}, "Add.\n\n1+2"),
    ("{instruction}\n\n{input}", {"instruction": "rev ab", "input": ""}, "rev ab"),
    ("{instruction}\n\n{input}", {"instruction": "rev ab", "input": None}, "rev ab"),
    ("### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:", {"instruction": "I", "input": " "},
     "### Instruction:\nI\n\n### Response:"),
    ("Instruction: {instruction}\nInput: {input}", {"instruction": "I", "input": ""}, "Instruction: I"),
    ("{a} and {b}", {"a": 1, "b": 2.5}, "1 and 2.5"),
])
def test_template_leaves_out_what_an_empty_column_would_dangle(template, row, expected):
    assert render_template(template, row, "f:1", "data.input_template") == expected


def test_alpaca_rows_by_template_and_errors_that_name_the_row_and_option(tmp_path, tokenizer, capsys):
    rows = [{"instruction": "Add.", "input": "1+2", "output": "3"}, {"instruction": "rev ab", "input": "", "output": "ba"}]
    cfg = DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0, input_template="{instruction}\n\n{input}", output_key="output")
    samples, _, stats = load_sft_samples(cfg, tokenizer, 0, "sft.data")
    prompts = [tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask) if not m]) for s in samples]
    assert prompts == ["<bos><|user|>Add.\n\n1+2<|end|><|assistant|>", "<bos><|user|>rev ab<|end|><|assistant|>"]
    assert "warning" not in capsys.readouterr().out  # every column is read
    broken = jsonl(tmp_path, [rows[0], {"instruction": "x", "output": "y"}], "broken.jsonl")
    with pytest.raises(DataError, match=r"broken.jsonl:2: missing key 'input' \(a placeholder of sft.data.input_template; did you mean 'output'\?"):
        load_sft_samples(cfg.model_copy(update={"path": broken}), tokenizer, 0, "sft.data")
    # Without the template the `input` column would be dropped: that is said once, at load.
    load_sft_samples(DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0, input_key="instruction", output_key="output"),
                     tokenizer, 0, "sft.data")
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and "column(s) 'input' are not used by sft.data" in out


def test_missing_column_suggests_the_closest_name(tmp_path, pairs):
    with pytest.raises(DataError, match=r"missing key 'prompt' \(set data.prompt_key to the column that holds it; did you mean 'prompts'\?"):
        pairs([{"prompts": "x", "chosen": "a", "rejected": "b"}])


# --------------------------------------------------------------------------- accounting


def test_blank_lines_are_counted_and_too_many_skips_fail_with_the_counts(tmp_path, tokenizer, capsys):
    rows = [{"prompt": f"{i}+1", "response": str(i + 1)} for i in range(18)] + ["", {"prompt": "x"}]
    path = jsonl(tmp_path, rows)
    _, _, stats = load_sft_samples(DataConfig(path=path, eval_fraction=0.0, on_bad_row="skip", max_skip_fraction=0.1), tokenizer, 0)
    assert stats["train"] == {"read": 20, "used": 18, "skipped": {"blank line": 1, "missing key 'response'": 1}, "filtered": {}}
    assert "20 rows read, 18 used, 2 skipped (blank line: 1; missing key 'response': 1)" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"1 of 19 rows skipped \(5.3%\), more than sft.data.max_skip_fraction=0.05 \(20 rows read"):
        load_sft_samples(DataConfig(path=path, eval_fraction=0.0, on_bad_row="skip"), tokenizer, 0, "sft.data")
    # Blank lines are counted, not held against the limit: one stray empty line does not fail a small file.
    small = jsonl(tmp_path, [{"prompt": "1+1", "response": "2"}] * 9 + [""], "small.jsonl")
    _, _, stats = load_sft_samples(DataConfig(path=small, eval_fraction=0.0), tokenizer, 0)
    assert stats["train"]["skipped"] == {"blank line": 1}


def test_eval_split_comes_after_skipping_and_its_error_says_so(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": "1+1", "response": "2"}, {"prompt": "bad"}, {"prompt": "bad"}])
    with pytest.raises(DataError, match=r"no training rows left after holding out eval_fraction=0.5 of the 1 usable rows "
                                        r"\(3 rows read, 1 used, 2 skipped"):
        load_sft_samples(DataConfig(path=path, eval_fraction=0.5, on_bad_row="skip", max_skip_fraction=1.0), tokenizer, 0)


# --------------------------------------------------------------------------- sources


def test_a_folder_or_an_unknown_format_is_refused_at_load(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl").write_text("{}\n")
    (tmp_path / "rows.txt").write_text("x\n")
    with pytest.raises(ValueError, match="is a folder; give one data file"):
        DataConfig(path=str(tmp_path / "dir"))
    with pytest.raises(ValueError, match=r"unknown data format '.txt'; use .jsonl, .json, .parquet, .csv"):
        DataConfig(path=str(tmp_path / "rows.txt"))


def test_parquet_and_csv_take_the_same_mapping_options(tmp_path, tokenizer, pairs):
    import datasets

    uf = [{"prompt": "1+2", "chosen": [U("1+2"), A("3")], "rejected": [U("1+2"), A("12")], "score_chosen": 9.0, "score_rejected": 2.0}]
    datasets.Dataset.from_list(uf).to_parquet(str(tmp_path / "uf.parquet"))
    cfg = PreferenceDataConfig(path=str(tmp_path / "uf.parquet"), eval_fraction=0.0, margin_from=("score_chosen", "score_rejected"))
    (pair,), _, _ = load_pairs(cfg, tokenizer, 0)
    assert pair.margin == 7.0 and texts(tokenizer, pair)[1:] == ("3<|end|>", "12<|end|>")
    (tmp_path / "a.csv").write_text('instruction,input,output\nAdd.,1+2,3\nrev ab,,ba\n')
    cfg = DataConfig(path=str(tmp_path / "a.csv"), eval_fraction=0.0, input_template="{instruction}\n\n{input}", output_key="output")
    samples, _, _ = load_sft_samples(cfg, tokenizer, 0)
    assert [tokenizer.decode(s.input_ids) for s in samples][1] == "<bos><|user|>rev ab<|end|><|assistant|>ba<|end|>"


def test_an_unreachable_hub_dataset_is_bad_input_that_says_it_must_be_local():
    cfg = DataConfig.model_construct(path="nobody/no-such-dataset", split="train", eval_path=None, eval_fraction=0.0,
                                     on_bad_row="error", max_samples=None)
    with pytest.raises(DataError, match=r"nobody/no-such-dataset: cannot load this `datasets` dataset .*must be a local file or already in"):
        load_rows(cfg, lambda where, row: row, 0)


def test_unknown_config_keys_suggest_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"--set sft.optim.lrr=1: sft.optim.lrr: unknown key; did you mean 'lr'\?"):
        load_config(ROOT / "configs" / "tiny.yaml", ["sft.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"sft.data.apply_chat_template: unknown key; in alignflow conversations are detected by "
                                          r"themselves, and `format: chat` renders text columns as chat turns"):
        load_config(ROOT / "configs" / "tiny.yaml", ["sft.data.apply_chat_template=true"])


# --------------------------------------------------------------------------- the shipped examples


@pytest.mark.parametrize("name", ["ultrafeedback", "hh_rlhf", "alpaca", "openai_chat", "gsm8k"])
def test_each_example_config_reads_its_public_shape_with_no_row_lost(name, tokenizer, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "examples" / f"{name}.yaml")
    loaders = {"sft": load_sft_samples, "rm": load_pairs, "dpo": load_pairs, "kto": load_kto_rows, "rl": load_prompts}
    for stage, section in cfg.stages.items():
        train, held, stats = loaders[section.kind](section.data, tokenizer, 0, f"{stage}.data")
        assert stats["train"]["skipped"] == {} and len(train) > 40 and held, (stage, stats)
        rows = len(pack(train, section.data.max_len)) if getattr(section.data, "packing", False) else len(train)
        assert section.kind == "rl" or rows >= section.batch.global_batch_size, (stage, rows)  # at least one step
    assert "warning" not in capsys.readouterr().out


# --------------------------------------------------------------------------- edges found in review


def test_a_response_that_is_a_whole_conversation_needs_no_prompt_column(tmp_path, tokenizer):
    row = {"chosen": [{"role": "system", "content": "S"}, U("1+1"), A("2")]}
    (sample,), _, _ = load_sft_samples(DataConfig(path=jsonl(tmp_path, [row]), eval_fraction=0.0, output_key="chosen"), tokenizer, 0)
    assert tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]) == "2<|end|>"
    kto = {"completion": [U("1+1"), A("2")], "label": False}
    (item,), _, _ = load_kto_rows(KTODataConfig(path=jsonl(tmp_path, [kto], "k.jsonl"), eval_fraction=0.0), tokenizer, 0)
    assert tokenizer.decode(item.prompt_ids) == "<bos><|user|>1+1<|end|><|assistant|>" and not item.desirable


def test_bad_messages_and_empty_prompts_are_bad_rows_not_crashes(tmp_path, tokenizer):
    rows = [{"messages": [{"role": 1, "content": "a"}, A("b")]}, {"instruction": "", "input": None, "response": "x"},
            {"prompt": "  ", "response": "x"}, {"prompt": "1+1", "response": "2"}]
    cfg = DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0, on_bad_row="skip", max_skip_fraction=1.0)
    _, _, stats = load_sft_samples(cfg, tokenizer, 0)
    assert stats["train"]["skipped"] == {"'messages' must be a list of {role, content} objects": 1, "missing key 'prompt'": 1,
                                         "'prompt' is empty": 1}
    templated = cfg.model_copy(update={"input_template": "{instruction}\n\n{input}"})
    with pytest.raises(DataError, match=r"d.jsonl:1: empty prompt \(every column of data.input_template is empty\)"):
        load_sft_samples(templated.model_copy(update={"on_bad_row": "error", "path": jsonl(tmp_path, rows[1:2])}), tokenizer, 0)


def test_skip_reasons_add_up_without_row_values(tmp_path, tokenizer):
    rows = [{"prompt": "x" * 40, "response": "y"}, {"prompt": "z" * 50, "response": "y"}, {"prompt": "1", "response": "2"}]
    cfg = DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0, max_len=32, on_bad_row="skip", max_skip_fraction=1.0)
    assert load_sft_samples(cfg, tokenizer, 0)[2]["train"]["skipped"] == {"prompt not shorter than data.max_len": 2}


def test_csv_text_columns_stay_text_and_scores_read_as_numbers(tmp_path, tokenizer):
    (tmp_path / "n.csv").write_text("prompt,response\n1+1,2\n2+2,4\n")
    samples, _, _ = load_sft_samples(DataConfig(path=str(tmp_path / "n.csv"), eval_fraction=0.0), tokenizer, 0)
    assert tokenizer.decode(samples[1].input_ids) == "<bos><|user|>2+2<|end|><|assistant|>4<|end|>"
    (tmp_path / "p.csv").write_text("prompt,chosen,rejected,sc,sr\n1+1,2,3,8,5.5\n")
    (pair,), _, _ = load_pairs(PreferenceDataConfig(path=str(tmp_path / "p.csv"), eval_fraction=0.0, margin_from=("sc", "sr")), tokenizer, 0)
    assert pair.margin == 2.5


def test_config_checks_of_the_new_options(tmp_path):
    path = jsonl(tmp_path, [{}])
    for template in ("{a!r}", "{a:>3}", "{a[0]}", "no placeholder"):
        with pytest.raises(ValueError, match="needs column placeholders"):
            DataConfig(path=path, input_template=template)
    with pytest.raises(ValueError, match="margin_from names one column twice"):
        PreferenceDataConfig(path=path, margin_from=("s", "s"))
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "tiny.yaml", ["sft.data.learning_rate=1"])
    assert "did you mean 'lr'" not in str(err.value)  # lr is not a data key
