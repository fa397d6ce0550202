"""Rounds and dataset stages in the graph: expansion into plain stages, `previous`, mixing earlier rounds' data,
cache keys that let K grow without re-running, and errors that name the file line."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.config import ConfigError, load_config
from alignflow.lineage import stage_cache_key

ROOT = Path(__file__).resolve().parents[2]
ITERATIVE = ROOT / "configs" / "tiny-iterative-dpo.yaml"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def keys(cfg) -> dict[str, str]:
    """Every stage's cache key, with each upstream's key standing in for its manifest digest."""
    out: dict[str, str] = {}
    for name in cfg.order():
        out[name] = stage_cache_key(cfg, name, {role: out[up] for role, up in cfg.inputs_of(name).items()},
                                    data={k: "d" * 64 for k in cfg.section(name).sources()})
    return out


def test_rounds_expand_into_plain_stages_each_starting_from_the_round_before():
    cfg = load_config(ITERATIVE)
    assert cfg.order() == ["sft"] + [f"online.{k}.{s}" for k in (1, 2, 3) for s in ("generate", "label", "select", "dpo")] + ["eval"]
    assert cfg.inputs_of("online.1.generate") == {"from": "sft"} and cfg.inputs_of("online.1.dpo") == {"from": "sft", "data": "online.1.select"}
    assert cfg.inputs_of("online.3.generate") == {"from": "online.2.dpo"}
    assert cfg.inputs_of("online.3.label") == {"data": "online.3.generate"}
    assert cfg.section("eval").models == ("sft", "online.1.dpo", "online.2.dpo", "online.3.dpo")
    assert cfg.final_models() == ["online.3.dpo"] and cfg.registered_stage == "online.3.dpo"
    assert cfg.section("online.2.dpo").data.eval_path.endswith("data/preference/eval.jsonl")  # defaults still apply
    assert cfg.section("online.2.dpo").data.path is None  # the stage's own `data.stage` replaces the default's path


def test_raising_the_rounds_changes_no_key_of_the_rounds_already_made():
    two, three = keys(load_config(ITERATIVE, ["online.rounds=2"])), keys(load_config(ITERATIVE))
    assert all(three[name] == key for name, key in two.items() if name != "eval")
    assert two["eval"] != three["eval"]  # it now compares three rounds
    assert len({three[f"online.{k}.dpo"] for k in (1, 2, 3)}) == 3


def test_mix_previous_gives_each_round_the_data_of_every_round_so_far():
    cfg = load_config(ITERATIVE, ["online.mix_previous=true"])
    assert cfg.inputs_of("online.1.dpo") == {"from": "sft", "data": "online.1.select"}  # round 1 as without mixing
    assert cfg.inputs_of("online.3.dpo") == {"from": "online.2.dpo", "data:1": "online.1.select", "data:2": "online.2.select",
                                             "data:3": "online.3.select"}


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "g.yaml"
    path.write_text(f"base: {ROOT}/configs/tiny.yaml\nname: g\n" + body)
    return path


def error(tmp_path: Path, body: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, body))
    return str(err.value)


LOOP = "loop:\n  rounds: 2\n  stages:\n    generate:\n      from: previous\n    label:\n      data: generate\n"


def test_loop_errors_name_what_is_wrong(tmp_path):
    assert "loop.rounds: a whole number of rounds >= 1, got 0" in error(tmp_path, "loop:\n  rounds: 0\n  stages: {}\n")
    assert "a round makes one model" in error(tmp_path, LOOP)
    msg = error(tmp_path, LOOP + "    sft:\n      from: previous\n      data: {stage: label}\n")
    assert "starts from `previous`, which in round 1 is the loop's `from`: set loop.from" in msg
    msg = error(tmp_path, "loop:\n  rounds: 1\n  from: sft\n  stages:\n    generate:\n      from: previous\n"
                          "    label:\n      data: generate\n    dpo:\n      from: previous\n      data: {stage: label}\n"
                          "    select:\n      data: generate\n      mode: best_of_n\n")
    assert "g.yaml:15: loop.1.select: data: 'loop.1.generate' is a generate stage; a select stage reads a label stage" in msg


def test_dataset_inputs_are_checked(tmp_path):
    msg = error(tmp_path, "dpo:\n  from: sft\n  data:\n    stage: sft\n")
    assert "g.yaml:5: dpo: data.stage: 'sft' is a sft stage; a training stage's rows come from a dataset stage" in msg
    msg = error(tmp_path, "dpo:\n  from: sft\n  data:\n    stage: nothing\n")
    assert "data.stage: no stage named 'nothing'" in msg
    msg = error(tmp_path, "generate:\n  from: sft\nlabel:\n  data: generate\n  reward: null\n")
    assert "a label stage scores with `reward: file.py:function`, `reward_model: <rm stage>`, or both" in msg
    msg = error(tmp_path, "eval:\n  models: [sft]\n  prompts:\n    path: null\n    stage: sft\n")
    assert "prompts.stage: this section reads a file" in msg
    msg = error(tmp_path, "generate:\n  from: sft\nselect:\n  data: generate\n  mode: best_vs_worst\n  threshold: 1\n")
    assert "threshold is a best_of_n / kto option" in msg
