"""RL inputs that must fail clearly before or at the first step: configs, prompts, reward functions."""

import json
import math
import re

import pytest

from alignflow.config import ConfigError, load_config
from alignflow.config.base import PromptDataConfig
from alignflow.stages.common.data import DataError
from alignflow.stages.rl.data import columns_of, load_prompts
from alignflow.stages.rl.rewards import FunctionReward, RewardError, overlong_penalty

from .test_config import ROOT


def tiny(*overrides):
    """configs/tiny.yaml with an rl stage from its sft stage (tiny.yaml's rl defaults)."""
    return load_config(ROOT / "configs" / "tiny.yaml", ["rl.from=sft", *overrides])


def test_rl_config_contradictions_are_named():
    with pytest.raises(ConfigError, match="estimator=group_norm baselines each sample with the other samples of its prompt: "
                                          "it needs generation.n_samples_per_prompt >= 2, not 1"):
        tiny("rl.generation.n_samples_per_prompt=1")
    with pytest.raises(ConfigError, match="advantage.estimator=gae needs a critic"):
        tiny("rl.advantage.estimator=gae")
    with pytest.raises(ConfigError, match="a `critic:` section is only used by advantage.estimator=gae, not rloo"):
        tiny("rl.advantage.estimator=rloo", "rl.critic.value_clip=0.2")
    with pytest.raises(ConfigError, match="give exactly one reward source"):
        tiny("rm.from=sft", "rl.reward.model=rm")
    with pytest.raises(ConfigError, match="reward function file not found: 'nope.py'"):
        tiny("rl.reward.function=nope.py:fn")
    with pytest.raises(ConfigError, match="responses per step must be a multiple of batch.global_batch_size"):
        tiny("rl.batch.global_batch_size=48", "rl.batch.micro_batch_size=16")
    single = tiny("rl.advantage.estimator=reinforce", "rl.generation.n_samples_per_prompt=1", "rl.batch.global_batch_size=16",
                  "rl.batch.micro_batch_size=16")
    assert single.section("rl").advantage.estimator.value == "reinforce"


def test_ppo_config_extends_tiny_and_validates():
    cfg = load_config(ROOT / "configs" / "tiny-ppo.yaml")
    rl = cfg.section("rl")
    assert rl.reward.model == "rm" and rl.reward.function is None
    assert rl.critic is not None and cfg.section("sft") == tiny().section("sft")  # the rest comes from tiny.yaml
    assert cfg.order() == ["sft", "rm", "rl"]
    assert cfg.inputs_of("rl") == {"from": "sft", "reward_model": "rm"}


def test_reward_function_file_content_is_in_the_cache_key(tmp_path):
    fn = tmp_path / "r.py"
    fn.write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    from alignflow.lineage import data_inputs

    cfg = tiny(f"rl.reward.function={fn}:f")
    before = data_inputs(cfg.section("rl"))
    fn.write_text("def f(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    assert data_inputs(cfg.section("rl"))["reward_function:f"] != before["reward_function:f"]
    moved = tmp_path / "moved.py"
    fn.rename(moved)
    moved_cfg = tiny(f"rl.reward.function={moved}:f")
    assert data_inputs(moved_cfg.section("rl"))["reward_function:f"] == data_inputs(cfg.section("rl"))["reward_function:f"] if fn.exists() else True
    assert moved_cfg.section("rl").config_hash() == cfg.section("rl").config_hash()  # the path is not in the config hash


def test_prompts_need_the_prompt_column(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n" + json.dumps({"question": "2+2", "answer": "4"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: missing key 'prompt' \(set data.prompt_key to the column that holds it; row has: answer, question\)"):
        load_prompts(PromptDataConfig(path=str(path), eval_fraction=0.0), tokenizer, 0)
    rows, _, _ = load_prompts(PromptDataConfig(path=str(path), eval_fraction=0.0, prompt_key="question", on_bad_row="skip",
                                                max_skip_fraction=0.5), tokenizer, 0)
    assert [r.text for r in rows] == ["2+2"] and columns_of(rows) == {"answer": ["4"]}


def reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(body)
    return f"{path}:score"


def call(fn: FunctionReward, completions: list[str]):
    return fn(["p"] * len(completions), completions, [[1]] * len(completions), [[2]] * len(completions), {"answer": ["a"] * len(completions)})


def test_reward_function_errors_name_the_sample(tmp_path):
    ok = FunctionReward(reward_file(tmp_path, "def score(prompts, completions, answer, **kw):\n"
                                              "    return [float(c == a) for c, a in zip(completions, answer)]\n"))
    assert call(ok, ["a", "b"]).tolist() == [1.0, 0.0]
    raises = FunctionReward(reward_file(tmp_path, "def score(prompts, completions, **kw):\n"
                                                  "    return [1.0 / len(c) for c in completions]\n"))
    with pytest.raises(RewardError, match=r"raised on sample 1 \(prompt 'p', completion ''\): ZeroDivisionError"):
        call(raises, ["a", "", "c"])
    nan = FunctionReward(reward_file(tmp_path, "def score(prompts, completions, **kw):\n"
                                               "    return [float('nan') if c == 'x' else 0.0 for c in completions]\n"))
    with pytest.raises(RewardError, match=r"returned nan for sample 2 \(prompt 'p', completion 'x'\): rewards must be finite"):
        call(nan, ["a", "b", "x"])
    short = FunctionReward(reward_file(tmp_path, "def score(prompts, completions, **kw):\n    return [0.0]\n"))
    with pytest.raises(RewardError, match="returned 1 values for 2 samples"):
        call(short, ["a", "b"])
    with pytest.raises(RewardError, match="has no function 'score'"):
        FunctionReward(reward_file(tmp_path, "x = 1\n"))
    with pytest.raises(RewardError, match=r"importing .*reward\.py \(the file of function 'score'\) failed: ModuleNotFoundError"):
        FunctionReward(reward_file(tmp_path, "import no_such_module_xyz\n"))


def test_a_reward_function_that_needs_the_main_thread_says_so_off_it(tmp_path):
    """Asynchronous rollout scores in a background thread, where `signal.signal` (math_verify's timeout) raises."""
    import threading

    alarm = FunctionReward(reward_file(tmp_path, "import signal\n"
                                                 "def score(prompts, completions, **kw):\n"
                                                 "    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))\n"
                                                 "    return [0.0 for _ in completions]\n"))
    assert call(alarm, ["a"]).tolist() == [0.0]  # the main thread
    raised: list[BaseException] = []
    thread = threading.Thread(target=lambda: raised.extend(_raises(lambda: call(alarm, ["a"]))))
    thread.start()
    thread.join()
    assert isinstance(raised[0], RewardError)
    assert re.search(r"works only in the main thread \(ValueError: signal only works in main thread.*"
                     r"rl.rollout.asynchronous: false", str(raised[0]))


def _raises(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 (handed back to the test's thread)
        return [exc]
    return []


def test_shipped_reward_and_overlong_penalty():
    exact = FunctionReward(f"{ROOT / 'rewards/tiny_tasks.py'}:exact_answer")
    assert exact(["07+45", "rev abcd"], ["52", "dcbx"], [[1], [1]], [[2], [2]], {"answer": ["52", "dcba"]}).tolist() == [1.0, 0.0]
    import torch

    penalty = overlong_penalty(torch.tensor([4, 6, 8]), max_new_tokens=8, buffer=4, penalty=1.0)
    assert penalty.tolist() == [0.0, -0.5, -1.0] and math.isclose(float(overlong_penalty(torch.tensor([8]), 8, 0, 1.0)), 0.0)


def test_rl_steps_count_prompts_per_step():
    from alignflow.stages.common.run import total_steps

    rl = load_config(ROOT / "configs" / "tiny.yaml", ["rl.from=sft", "rl.batch.max_steps=null", "rl.batch.epochs=2"]).section("rl")
    per_step = ("rollout.prompts_per_step", rl.rollout.prompts_per_step)  # 16
    assert total_steps(100, rl, "prompts", per_step) == 6 * 2
    capped = load_config(ROOT / "configs" / "tiny.yaml", ["rl.from=sft", "rl.batch.max_steps=5"]).section("rl")
    assert total_steps(100, capped, "prompts", per_step) == 5
    with pytest.raises(DataError, match="10 training prompts are fewer than rollout.prompts_per_step=16"):
        total_steps(10, rl, "prompts", per_step)
