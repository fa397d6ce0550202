import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.config import ConfigError, PipelineConfig, apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


BASE = f"""\
name: t
sft:
  model:
    name_or_path: builtin:tiny
  data:
    path: {ROOT}/data/sft/train.jsonl
  optim:
    lr: 1.0e-3
"""
SFT_LR_LINE = 8


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    assert cfg.order() and all(len(cfg.section(n).config_hash()) == 64 for n in cfg.stages)


def test_hash_is_stable_across_processes(tmp_path):
    path = write(tmp_path, BASE)
    here = load_config(path).section('sft').config_hash()
    code = f"from alignflow.config import load_config; print(load_config({str(path)!r}).section(\"sft\").config_hash())"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there


def test_hash_changes_with_result_fields_only(tmp_path):
    path = write(tmp_path, BASE)
    base = load_config(path).section('sft').config_hash()
    assert load_config(path, ["sft.optim.lr=2e-3"]).section('sft').config_hash() != base
    assert load_config(path, ["sft.data.max_len=64"]).section('sft').config_hash() != base
    assert load_config(path, ["sft.batch.seed=7"]).section('sft').config_hash() != base
    # Names, logging, checkpoint cadence and where things are stored do not change the result.
    for same in ["name=other", "sft.logging.log_every=3", "sft.checkpoint.every_steps=7",
                 f"storage.root={tmp_path}/elsewhere", f"sft.data.eval_path={ROOT}/data/sft/eval.jsonl"]:
        assert load_config(path, [same]).section('sft').config_hash() == base, same


def test_lora_settings_are_checked_at_load_and_unset_keep_the_cache_key(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = write(tmp_path, BASE)
    # BASE's hash before the `lora:` and `reference:` options existed: results published then stay cache hits.
    assert load_config(path).section("sft").config_hash() == "56bf56f39c322cbc5b61f9e6e0b1634fff2a5d30be9e4c6d4600f05527f4a58f"
    assert load_config(path, ["sft.lora.rank=8"]).section("sft").config_hash() != load_config(path).section("sft").config_hash()
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(path, ["sft.lora.rank=0"])
    with pytest.raises(ConfigError, match="target_modules is empty"):
        load_config(path, ["sft.lora.target_modules=[]"])
    tiny = ROOT / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError, match="on_the_fly computes the reference .* needs a `lora:` section"):
        load_config(tiny, ["dpo.from=sft", "dpo.reference=on_the_fly"])
    dpo = load_config(tiny, ["dpo.from=sft"]).section("dpo").config_hash()
    assert load_config(tiny, ["dpo.from=sft", "dpo.reference=precomputed"]).section("dpo").config_hash() == dpo


def test_overrides_parse_yaml_values_and_leave_input_alone():
    raw = {"sft": {"optim": {"lr": 1.0}}}
    out = apply_overrides(raw, ["sft.optim.lr=1e-4", "sft.batch.epochs=3", "sft.data.packing=true"])
    assert out["sft"]["optim"]["lr"] == 1e-4 and out["sft"]["batch"]["epochs"] == 3 and out["sft"]["data"]["packing"] is True
    assert raw == {"sft": {"optim": {"lr": 1.0}}}


def test_config_is_frozen(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    with pytest.raises(Exception):
        cfg.section('sft').optim.lr = 5.0


def test_error_names_file_line_field_and_value(tmp_path):
    path = write(tmp_path, BASE.replace("lr: 1.0e-3", "lr: -1"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:{SFT_LR_LINE}" in msg and "sft.optim.lr" in msg and "greater than 0" in msg and "-1" in msg


def test_error_for_unknown_field_and_bad_choice(tmp_path):
    path = write(tmp_path, BASE + "  deepspeed:\n    zero_stage: 4\n    zero_stag: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:10: sft.deepspeed.zero_stage" in msg and "0, 1, 2 or 3" in msg and "(got 4)" in msg
    assert f"{path}:11: sft.deepspeed.zero_stag: unknown key; did you mean 'zero_stage'? (got 3)" in msg


def test_error_from_override_names_the_override(tmp_path):
    with pytest.raises(ConfigError, match=r"--set sft.batch.micro_batch_size=0: sft.batch.micro_batch_size"):
        load_config(write(tmp_path, BASE), ["sft.batch.micro_batch_size=0"])


def test_batch_sizes_must_divide(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size \\(30\\) must be a multiple of batch.micro_batch_size \\(8\\)"):
        load_config(write(tmp_path, BASE), ["sft.batch.global_batch_size=30"])


def test_missing_data_file_fails_at_load(tmp_path):
    with pytest.raises(ConfigError, match="data file not found: 'nope/train.jsonl'"):
        load_config(write(tmp_path, BASE), ["sft.data.path=nope/train.jsonl"])


def test_relative_data_path_is_resolved_at_parse_time(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(write(tmp_path, BASE), ["sft.data.path=data/sft/train.jsonl"])
    assert cfg.section('sft').data.path == str(ROOT / "data/sft/train.jsonl")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "sft: [unclosed"))


def test_retired_pipeline_keys_say_what_replaced_them(tmp_path):
    with pytest.raises(ConfigError, match="`pipeline:` is no longer a setting: stages are now a graph"):
        load_config(write(tmp_path, BASE + "pipeline: full\n"))
    with pytest.raises(ConfigError, match="`stop_after:` is no longer a setting: use `alignflow run --until STAGE`"):
        load_config(write(tmp_path, BASE), ["stop_after=rm"])


def test_stage_lookup_names_the_missing_stage(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    with pytest.raises(ConfigError, match="no stage named 'rm' in this config \\(stages: sft\\)"):
        cfg.section("rm")


def test_later_stages_start_from_upstream_and_reject_contradictions(tmp_path):
    pref, kto = ROOT / "data/preference/train.jsonl", ROOT / "data/kto/train.jsonl"
    cfg = load_config(write(tmp_path, BASE), ["dpo.from=sft", f"dpo.data.path={pref}", "register.stage=dpo"])
    assert cfg.section("dpo").model.name_or_path is None and cfg.inputs_of("dpo") == {"from": "sft"}
    with pytest.raises(ConfigError, match="dpo: two starting models: from: 'sft' and model.name_or_path='builtin:tiny'"):
        load_config(write(tmp_path, BASE), ["dpo.from=sft", f"dpo.data.path={pref}", "dpo.model.name_or_path=builtin:tiny"])
    rm = ["rm.from=sft", f"rm.data.path={pref}", "register.stage=sft"]
    with pytest.raises(ConfigError, match=r"a margin \(data.margin_key or data.margin_from\) needs loss: sigmoid, not 'logexp'"):
        load_config(write(tmp_path, BASE), [*rm, "rm.data.margin_key=m", "rm.loss=logexp"])
    with pytest.raises(ConfigError, match="label_smoothing=0.1 is cDPO: it needs loss: dpo, not 'ipo'"):
        load_config(write(tmp_path, BASE), ["dpo.from=sft", f"dpo.data.path={pref}", "dpo.loss=ipo", "dpo.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="global_batch_size must be >= 2"):
        load_config(write(tmp_path, BASE), ["kto.from=sft", f"kto.data.path={kto}", "kto.batch.global_batch_size=1",
                                            "kto.batch.micro_batch_size=1"])


def test_model_typos_fail_at_load_naming_the_model(tmp_path):
    with pytest.raises(ConfigError, match=r"sft.model.name_or_path.*unknown built-in model 'builtin:tiniest'; choose one of builtin:tiny"):
        load_config(write(tmp_path, BASE), ["sft.model.name_or_path=builtin:tiniest"])
    with pytest.raises(ConfigError, match=r"local model folder '/no/such/model' does not exist"):
        load_config(write(tmp_path, BASE), ["sft.model.name_or_path=/no/such/model"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no config.json \(not a Hugging Face model folder\)"):
        load_config(write(tmp_path, BASE), [f"sft.model.name_or_path={tmp_path / 'empty'}"])
    assert load_config(write(tmp_path, BASE), ["sft.model.name_or_path=org/some-hub-model"])  # checked where it loads


def test_reward_file_with_a_syntax_error_fails_at_load_with_its_line(tmp_path):
    bad = tmp_path / "r.py"
    bad.write_text("def score(completions, **kw):\n    return [1.0 for c in completions\n")
    with pytest.raises(ConfigError, match=rf"rl.reward.function.*{bad}:2: '\[' was never closed"):
        load_config("configs/tiny.yaml", ["rl.from=sft", f"rl.reward.function={bad}:score"])
