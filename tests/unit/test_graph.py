"""Pipelines as graphs: bad graphs get errors naming file, line, stage and field; cache keys ignore names;
--until / --only pick the stages; the gate's rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.config import ConfigError, GateConfig, load_config
from alignflow.lineage import stage_cache_key, stage_output_uri

ROOT = Path(__file__).resolve().parents[2]
TULU = ROOT / "configs" / "tiny-tulu3.yaml"


def graph(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "g.yaml"
    path.write_text(f"base: {ROOT}/configs/tiny.yaml\nname: g\n" + body)
    return path


def error(tmp_path: Path, body: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(graph(tmp_path, body), list(overrides))
    return str(err.value)


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_unknown_kind_names_line_and_stage(tmp_path):
    msg = error(tmp_path, "dpo:\n  from: sft\nbest:\n  kind: ppo\n  from: sft\n")
    assert "g.yaml:6: stage 'best': kind 'ppo' is unknown; set `kind:` to one of sft, rm, dpo, kto, rl, eval, generate, label, select" in msg


def test_stage_without_kind_whose_name_is_no_kind(tmp_path):
    msg = error(tmp_path, "polish:\n  from: sft\n")
    assert "g.yaml:3: stage 'polish': no kind given and the name is not a kind" in msg


def test_unknown_stage_name_in_from(tmp_path):
    msg = error(tmp_path, "dpo:\n  from: stf\n")
    assert "g.yaml:4: dpo: from: no stage named 'stf' (stages: sft, dpo)" in msg


def test_cycle_is_reported_with_its_path(tmp_path):
    msg = error(tmp_path, "a:\n  kind: dpo\n  from: b\nb:\n  kind: dpo\n  from: a\nregister:\n  stage: sft\n")
    assert "the stages make a cycle: a -> b -> a" in msg and "g.yaml:3: a:" in msg


def test_rl_reward_model_must_be_an_rm_stage(tmp_path):
    msg = error(tmp_path, "dpo:\n  from: sft\nrl:\n  from: dpo\n  reward:\n    function: null\n    model: dpo\n")
    assert "g.yaml:7: rl: reward.model: 'dpo' is a dpo stage, not an rm stage" in msg


def test_policy_cannot_start_from_a_reward_model(tmp_path):
    msg = error(tmp_path, "rm:\n  from: sft\ndpo:\n  from: rm\n")
    assert "g.yaml:6: dpo: from: 'rm' is a rm stage; a dpo stage starts from a policy stage (sft, dpo, kto, rl)" in msg


def test_rl_with_two_reward_sources_or_none(tmp_path):
    two = error(tmp_path, "rm:\n  from: sft\nrl:\n  from: sft\n  reward:\n    model: rm\n")
    assert "g.yaml:5: rl: Value error" not in two and "rl: give exactly one reward source" in two
    assert "got reward.function, reward.model" in two
    none = error(tmp_path, "rl:\n  from: sft\n  reward:\n    function: null\n")
    assert "rl: give exactly one reward source" in none and "got none" in none


def test_invalid_stage_name(tmp_path):
    msg = error(tmp_path, "my/dpo:\n  kind: dpo\n  from: sft\n")
    assert "g.yaml:3: my/dpo: stage name 'my/dpo' is not usable as a folder and MLflow name" in msg


def test_stage_that_cannot_be_reached_from_any_model(tmp_path):
    msg = error(tmp_path, "dpo: {}\n")
    assert "g.yaml:3: dpo: cannot be reached from any model: give `from: <stage>` or `model.name_or_path`" in msg


def test_eval_of_an_eval_stage_and_gate_mistakes(tmp_path):
    msg = error(tmp_path, "first:\n  kind: eval\n  models: [sft]\nsecond:\n  kind: eval\n  models: [first]\n")
    assert "second: models: 'first' is an eval stage; an eval compares model stages" in msg
    gate = "dpo:\n  from: sft\neval:\n  models: [sft]\nregister:\n  stage: dpo\n  gate:\n    eval: eval\n    min: 0.5\n"
    assert "register.gate: the registered stage 'dpo' is not among eval stage 'eval''s models (sft)" in error(tmp_path, gate)
    ruleless = gate.replace("models: [sft]", "models: [sft, dpo]").replace("    min: 0.5\n", "")
    assert "register.gate needs a rule" in error(tmp_path, ruleless)


def test_several_final_models_need_register_stage(tmp_path):
    msg = error(tmp_path, "dpo:\n  from: sft\nkto:\n  from: sft\n")
    assert "register: register.stage: the graph has 2 final models (dpo, kto)" in msg


def test_error_from_defaults_block_names_its_line(tmp_path):
    msg = error(tmp_path, "dpo:\n  from: sft\n", "defaults.dpo.beta=-1")
    assert "dpo.beta: Input should be greater than 0" in msg


def test_shipped_graphs():
    tulu = load_config(TULU)
    assert tulu.order() == ["sft", "dpo", "grpo", "eval"] and tulu.registered_stage == "grpo"
    assert tulu.inputs_of("grpo") == {"from": "dpo"} and tulu.kind("grpo").value == "rl"
    assert tulu.inputs_of("eval") == {"model:sft": "sft", "model:dpo": "dpo", "model:grpo": "grpo",
                                      "reference:dpo": "sft", "reference:grpo": "dpo"}
    compare = load_config(ROOT / "configs" / "tiny-compare.yaml")
    assert compare.order() == ["sft", "dpo", "ipo", "kto", "eval"] and compare.registered_stage is None
    assert compare.section("ipo").loss == "ipo" and compare.section("dpo").loss == "dpo"
    ppo = load_config(ROOT / "configs" / "tiny-ppo.yaml")
    assert ppo.inputs_of("rl") == {"from": "sft", "reward_model": "rm"} and ppo.registered_stage == "rl"
    assert list(load_config(ROOT / "configs" / "tiny.yaml").stages) == ["sft"]


def test_registered_name_is_per_recipe_unless_set():
    """Each recipe's final model has a name of its own (so one recipe's run never moves another's `candidate`)."""
    names = {f: load_config(ROOT / "configs" / f).registered_name for f in ("tiny.yaml", "tiny-grpo.yaml", "tiny-ppo.yaml", "tiny-tulu3.yaml")}
    assert names == {"tiny.yaml": "tiny-sft", "tiny-grpo.yaml": "tiny-grpo-rl", "tiny-ppo.yaml": "tiny-ppo-rl",
                     "tiny-tulu3.yaml": "tiny-tulu3-grpo"}
    assert load_config(TULU, ["register.name=tulu3-candidate"]).registered_name == "tulu3-candidate"
    assert load_config(ROOT / "configs" / "tiny-compare.yaml").registered_name is None  # registers nothing


def test_cache_key_ignores_stage_names_and_neighbours(tmp_path):
    digests = {"from": "d" * 64}
    base = load_config(TULU)
    renamed = load_config(graph(tmp_path, "dpo:\n  from: sft\npolicy:\n  kind: rl\n  from: dpo\nregister:\n  stage: policy\n"))
    widened = load_config(TULU, ["kto.from=sft", "eval.models=[sft, dpo, grpo, kto]"])
    key = stage_cache_key(base, "grpo", digests)
    assert stage_cache_key(renamed, "policy", digests) == key == stage_cache_key(widened, "grpo", digests)
    assert stage_output_uri(renamed, "policy", key) == stage_output_uri(base, "grpo", key)  # {root}/{kind}/{key}
    assert stage_cache_key(base, "grpo", {"from": "e" * 64}) != key  # another starting model
    assert stage_cache_key(load_config(TULU, ["grpo.optim.lr=2e-4"]), "grpo", digests) != key
    ipo = load_config(ROOT / "configs" / "tiny-compare.yaml")
    assert stage_cache_key(ipo, "ipo", digests) != stage_cache_key(ipo, "dpo", digests)


def test_until_and_only_pick_stages():
    from alignflow.flows.run_record import plan

    tulu = load_config(TULU)
    assert plan(tulu) == ["sft", "dpo", "grpo", "eval"]
    assert plan(tulu, until="dpo") == ["sft", "dpo"]
    assert plan(tulu, only="grpo") == ["grpo"]
    with pytest.raises(ConfigError, match="--until ppo: no such stage"):
        plan(tulu, until="ppo")


def test_gate_rule():
    from alignflow.flows.handoff import gate_decision

    table = {"sft": {"eval/accuracy": 0.40, "eval/nll": 1.0}, "grpo": {"eval/accuracy": 0.47, "eval/nll": 1.2}}
    passed, why = gate_decision(GateConfig(eval="eval", baseline="sft", min_gain=0.05), table, "grpo")
    assert passed, why
    passed, why = gate_decision(GateConfig(eval="eval", baseline="sft", min_gain=0.10), table, "grpo")
    assert not passed and "misses sft's 0.4 + 0.1 = 0.5" in why
    passed, why = gate_decision(GateConfig(eval="eval", min=0.5), table, "grpo")
    assert not passed and "misses the floor 0.5" in why
    passed, _ = gate_decision(GateConfig(eval="eval", metric="eval/nll", baseline="sft", min_gain=0.1, lower_is_better=True), table, "grpo")
    assert not passed  # 1.2 > 1.0 - 0.1
    passed, why = gate_decision(GateConfig(eval="eval", metric="eval/reward", min=0.0), table, "grpo")
    assert not passed and "has no eval/reward for 'grpo'" in why


def test_gate_counts_a_gain_of_exactly_the_margin_as_met():
    """Rates of 200 episodes: 0.40 + 0.07 > 0.47 in float64, and float32's 0.45 < float32's 0.40 + 0.05. A gain of
    exactly the margin passes in either; one episode less does not; the same for floors and lower-is-better."""
    import numpy as np

    from alignflow.flows.handoff import gate_decision

    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert 0.47 < 0.40 + 0.07 and f32(0.45) < f32(0.40) + 0.05  # what a plain comparison would refuse
    for cast in (float, f32):
        for gain, episodes in ((0.07, 14), (0.05, 10), (0.10, 20)):
            rate = lambda right: cast(right / 200)  # noqa: E731  (the eval stage's mean of 0/1 verdicts)
            table = {"sft": {"eval/accuracy": rate(80)}, "grpo": {"eval/accuracy": rate(80 + episodes)},
                     "short": {"eval/accuracy": rate(80 + episodes - 1)}}
            rule = GateConfig(eval="eval", baseline="sft", min_gain=gain)
            assert gate_decision(rule, table, "grpo")[0], (cast, gain)
            assert not gate_decision(rule, table, "short")[0], (cast, gain)
        floor = {"m": {"eval/accuracy": cast(0.7), "eval/nll": cast(1.3)}, "n": {"eval/accuracy": cast(0.695), "eval/nll": cast(1.2)}}
        assert gate_decision(GateConfig(eval="eval", min=0.7), floor, "m")[0]
        assert not gate_decision(GateConfig(eval="eval", min=0.7), floor, "n")[0]
        # lower is better: n's 1.2 is exactly m's 1.3 - 0.1
        assert gate_decision(GateConfig(eval="eval", metric="eval/nll", baseline="m", min_gain=0.1, lower_is_better=True), floor, "n")[0]
        assert not gate_decision(GateConfig(eval="eval", metric="eval/nll", baseline="m", min_gain=0.1001, lower_is_better=True), floor, "n")[0]


def test_prefect_yaml_deploys_every_shipped_graph_by_path():
    import yaml

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    paths = {d["parameters"]["config"] for d in spec["deployments"]}
    assert paths == {f"configs/{p.name}" for p in (ROOT / "configs").glob("tiny*.yaml")}
    for d in spec["deployments"]:  # a path and overrides, never an inline copy that could drift from configs/
        assert set(d["parameters"]) == {"config", "overrides"} and d["name"] == Path(d["parameters"]["config"]).stem
        load_config(ROOT / d["parameters"]["config"], d["parameters"]["overrides"])


def test_only_needs_published_inputs_and_names_the_missing(tmp_path):
    from alignflow.flows.run_record import published_inputs

    cfg = load_config(TULU, [f"storage.root={tmp_path}"])
    with pytest.raises(ConfigError, match="--only grpo: its inputs dpo are not published for this config; run them first "
                                          r"\(alignflow run CONFIG --until dpo\)"):
        published_inputs(cfg, "grpo")
    with pytest.raises(ConfigError, match="--only eval: its inputs sft, dpo, grpo are not published"):
        published_inputs(cfg, "eval")
    assert published_inputs(cfg, "sft") == {}


def test_a_job_refuses_a_cache_key_other_than_the_flows():
    from alignflow.stages.common.run import check_cache_key

    check_cache_key("dpo", "abc", None)  # run by hand: nothing to compare
    check_cache_key("dpo", "abc", "abc")
    with pytest.raises(ConfigError, match="dpo: this job's cache key abc differs from the one the flow computed \\(abd\\)"):
        check_cache_key("dpo", "abc", "abd")


def test_job_exit_code_for_bad_input_is_the_one_the_task_reads():
    from alignflow.exit_codes import BAD_INPUT
    from alignflow.infra.ray_jobs import failure

    assert not failure("j", "FAILED", f"Job entrypoint command failed with exit code {BAD_INPUT}", "").retryable
    assert failure("j", "FAILED", f"Job entrypoint command failed with exit code {BAD_INPUT + 1}", "").retryable


def test_graph_as_mermaid():
    from alignflow.flows.run_record import mermaid

    text = mermaid(load_config(TULU), ["sft", "dpo", "grpo"])
    assert 'grpo["grpo (rl)"]' in text and "dpo -->|from| grpo" in text and "eval" not in text


@pytest.mark.parametrize("module", ["alignflow.stages.rl.config", "alignflow.stages.eval.config", "alignflow.stages.kto.data"])
def test_a_stage_module_imports_first_in_a_fresh_process(module):
    """A Ray worker's first import is its stage's module (unpickling a worker class): no import cycle through the graph."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_prefect_server_is_found_wherever_prefect_reads_its_url(tmp_path, monkeypatch):
    """The fully cached fast path is taken only where the flow would start Prefect's temporary server."""
    from alignflow.flows.run_record import prefect_server_configured

    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert not prefect_server_configured()  # nothing anywhere: the temporary server
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert prefect_server_configured()
    monkeypatch.delenv("PREFECT_API_URL")
    (tmp_path / "home").mkdir()
    profiles = tmp_path / "home" / "profiles.toml"
    profiles.write_text('active = "local"\n[profiles.local]\nPREFECT_API_URL = "http://h:4200/api"\n[profiles.ephemeral]\n')
    assert prefect_server_configured()
    monkeypatch.setenv("PREFECT_PROFILE", "ephemeral")
    assert not prefect_server_configured()
    for name, text in (("prefect.toml", '[api]\nurl = "http://h:4200/api"\n'),
                       ("pyproject.toml", '[tool.prefect.api]\nurl = "http://h:4200/api"\n'),
                       (".env", "PREFECT_API_URL=http://h:4200/api\n"), ("prefect.toml", "[api\n")):  # unreadable: the flow
        (tmp_path / name).write_text(text)
        assert prefect_server_configured(), name
        (tmp_path / name).unlink()
    assert not prefect_server_configured()
