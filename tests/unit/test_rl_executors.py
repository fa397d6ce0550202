"""Executors with an in-process scripted generator: the multi-turn loop, its token layout and masks,
the experience built from it, environment errors, and the environment's config."""

import pytest
import torch

from alignflow.config import ConfigError, load_config
from alignflow.stages.common.generation import Rollout, SamplingParams
from alignflow.stages.rl.data import PromptRow
from alignflow.stages.rl.executors import Episodes, MultiTurn, Scorer, SingleTurn, load_environment, reply_ids
from alignflow.stages.rl.experience import Experience
from alignflow.stages.rl.rewards import RewardError

from .test_config import ROOT

ENV = str(ROOT / "rewards" / "tiny_retry_env.py") + ":RetryWithHint"
ROWS = [PromptRow("07+45", [], {"answer": "52"}), PromptRow("rev kdfa", [], {"answer": "afdk"})]


class Scripted:
    """A generator that answers from a script keyed by the number of answers already in the context,
    with log-prob -0.5 per token; it records its calls."""

    def __init__(self, tokenizer, answers: list[str], finish: str = "stop"):
        self.tokenizer, self.answers, self.finish, self.calls = tokenizer, answers, finish, []

    def __call__(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        self.calls.append((len(prompts), params))
        assistant = self.tokenizer.convert_tokens_to_ids("<|assistant|>")
        out = []
        for p in prompts:
            turn = p.count(assistant) - 1
            ids = self.tokenizer(self.answers[turn], add_special_tokens=False)["input_ids"]
            ids = ids + [self.tokenizer.eos_token_id] if self.finish == "stop" else ids
            out += [Rollout(p, ids, [-0.5] * len(ids), self.finish)] * params.n
        return out


def multi_turn(tokenizer, answers, max_turns=3, env=ENV, **kw):
    generate = Scripted(tokenizer, answers, **kw)
    return MultiTurn(generate, load_environment(env), env, tokenizer, max_turns), generate


def chat(tokenizer, *turns: str) -> list[int]:
    """The chat template's rendering of alternating user/assistant turns, as token ids."""
    messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=len(turns) % 2 == 1, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_reply_tokens_follow_the_chat_template(tokenizer):
    assert tokenizer.convert_ids_to_tokens(reply_ids(tokenizer, "no")) == ["<|user|>", "n", "o", "<|end|>", "<|assistant|>"]


def test_wrong_then_right_is_one_token_sequence_with_the_environment_masked(tokenizer):
    executor, generate = multi_turn(tokenizer, ["51", "52"])
    episodes = executor.run(ROWS[:1], SamplingParams(8, n=2, seed=5))
    assert len(episodes.rollouts) == 2 and episodes.scores.tolist() == [1.0, 1.0]
    assert episodes.stats["turns"].tolist() == [2.0, 2.0] and episodes.stats["success"].tolist() == [1.0, 1.0]
    r = episodes.rollouts[0]
    # Token in, token out: the trajectory is exactly the chat template's rendering of the conversation.
    assert r.prompt_ids + r.response_ids == chat(tokenizer, "07+45", "51", "wrong. hint: starts with 5", "52")
    reply = len(reply_ids(tokenizer, "wrong. hint: starts with 5"))
    assert r.action_mask == [1] * 3 + [0] * reply + [1] * 3  # "51<|end|>", the reply, "52<|end|>"
    assert r.logprobs == [-0.5] * 3 + [0.0] * reply + [-0.5] * 3 and r.finish_reason == "stop"
    # One batched call per turn, one sample per episode, a new seed each turn (turn 0 keeps the step's).
    assert [(k, p.n) for k, p in generate.calls] == [(2, 1), (2, 1)]
    assert generate.calls[0][1].seed == 5 and generate.calls[1][1].seed != 5


def test_solved_episodes_stop_and_the_last_turn_gets_no_reply(tokenizer):
    executor, generate = multi_turn(tokenizer, ["52", "x", "y"], max_turns=3)
    episodes = executor.run(ROWS, SamplingParams(8, n=1))
    assert [n for n, _ in generate.calls] == [2, 1, 1]  # the addition is solved at once; the reversal never
    assert episodes.scores.tolist() == [1.0, 0.0] and episodes.stats["turns"].tolist() == [1.0, 3.0]
    assert episodes.stats["success"].tolist() == [1.0, 0.0]
    failed = episodes.rollouts[1]
    assert failed.response_ids[-1] == tokenizer.eos_token_id and failed.action_mask[-2:] == [1, 1]  # ends on an answer
    assert sum(failed.action_mask) == 3 + 2 + 2  # "52<|end|>", "x<|end|>", "y<|end|>"


def test_an_answer_cut_off_at_max_new_tokens_ends_the_episode(tokenizer):
    executor, generate = multi_turn(tokenizer, ["5", "52"], finish="length")
    episodes = executor.run(ROWS[:1], SamplingParams(1))
    assert len(generate.calls) == 1 and episodes.stats["turns"].tolist() == [1.0]
    assert episodes.rollouts[0].finish_reason == "length" and episodes.rollouts[0].action_mask == [1]


def test_overlong_penalty_applies_to_each_answer(tokenizer):
    executor, _ = multi_turn(tokenizer, ["51", "52"])
    executor.penalty = lambda lengths: -0.1 * lengths.float()  # 3 tokens per answer, two answers
    episodes = executor.run(ROWS[:1], SamplingParams(8))
    assert episodes.scores.tolist() == pytest.approx([1.0 - 0.6]) and episodes.stats["success"].tolist() == [1.0]


def test_experience_from_a_trajectory_with_holes(tokenizer):
    executor, _ = multi_turn(tokenizer, ["51", "52"])
    (r,) = executor.run(ROWS[:1], SamplingParams(8)).rollouts
    short = Rollout([1, 2], [5, 6], [-0.1, -0.2], "stop")  # a single-turn row in the same batch
    exp = Experience.from_rollouts([r, short], tokenizer.pad_token_id)
    n = len(r.response_ids)
    assert exp.mask[0, :n].tolist() == [float(m) for m in r.action_mask] and exp.mask[1].tolist() == [1, 1] + [0] * (n - 2)
    assert exp.sampled_logp[0, :n].tolist() == r.logprobs  # answers keep their sampled log-probs; 0 on the environment
    assert exp.targets[0, :n].tolist() == r.response_ids  # environment tokens are context the model reads
    assert exp.positions[0, 0] == len(r.prompt_ids) - 1
    sub = exp.rows([1, 0])
    assert sub.mask.shape[1] == n and sub.mask.sum() == exp.mask.sum()  # width from the last 1, not the count of 1s
    assert exp.rows([1]).mask.shape[1] == 2


def test_single_turn_is_generate_then_score(tokenizer):
    generate = Scripted(tokenizer, ["52"])
    rows = [PromptRow("07+45", [3, 4], {"answer": "52"})]
    scorer = Scorer(tokenizer, None, lambda seqs: torch.tensor([float(len(s)) for s in seqs]), lambda lengths: -lengths.float())
    episodes = SingleTurn(generate, scorer).run(rows, SamplingParams(8, n=2))
    assert episodes.scores.tolist() == [5.0 - 3.0] * 2 and episodes.stats == {} and generate.calls[0][0] == 1
    both = Episodes.cat([episodes, episodes.group(1, 1)])
    assert len(both.rollouts) == 3 and both.scores.tolist() == [2.0] * 3


class Broken:
    def __init__(self, fail: str):
        self.fail = fail

    def reset(self, row):
        if self.fail == "reset":
            raise KeyError("answer")
        return 42 if self.fail == "reset type" else row["prompt"]

    def step(self, answer):
        return {"step": lambda: 1 / 0, "reward": lambda: ("x", float("nan"), False), "shape": lambda: (None, 1.0),
                "observation": lambda: (None, 0.0, False), "done": lambda: ("x", 0.0, 1)}[self.fail]()


@pytest.mark.parametrize("fail, message", [
    ("reset", r"raised in reset \(turn 1\) on prompt 'rev kdfa': KeyError: 'answer'"),
    ("reset type", r"reset returned 42 for row 0 \(prompt 'rev kdfa'\): the first observation must be a string"),
    ("step", r"raised in step \(turn 1\) on prompt 'rev kdfa', answer 'afdk': ZeroDivisionError"),
    ("reward", r"step \(turn 1\) on prompt 'rev kdfa', answer 'afdk' returned reward nan: rewards must be finite numbers"),
    ("shape", r"returned \(None, 1.0\): expected \(observation, reward, done\)"),
    ("observation", r"returned observation None with done=False: expected a string"),
    ("done", r"returned done=1: expected True or False"),
])
def test_environment_errors_name_the_prompt_and_turn(tokenizer, fail, message):
    executor = MultiTurn(Scripted(tokenizer, ["afdk"]), lambda: Broken(fail), "env.py:Broken", tokenizer, 2)
    with pytest.raises(RewardError, match=message):
        executor.run(ROWS[1:], SamplingParams(8))


def test_environment_class_must_exist(tmp_path):
    path = tmp_path / "env.py"
    path.write_text("class Env:\n    pass\n")
    with pytest.raises(RewardError, match="has no environment class 'Nope'"):
        load_environment(f"{path}:Nope")


# --------------------------------------------------------------------------- config


def tiny(*overrides):
    """configs/tiny.yaml with an rl stage from its sft stage (tiny.yaml's rl defaults)."""
    return load_config(ROOT / "configs" / "tiny.yaml", ["rl.from=sft", *overrides])


def test_shipped_multiturn_config():
    cfg = load_config(ROOT / "configs" / "tiny-multiturn.yaml")
    rl = cfg.section("rl")
    assert rl.environment.path == ENV and rl.reward.function is None
    assert cfg.order() == ["sft", "rl"] and cfg.inputs_of("rl") == {"from": "sft"}
    assert cfg.section("sft") == tiny().section("sft")  # the rest comes from tiny.yaml


def test_environment_config_errors_are_named():
    with pytest.raises(ConfigError, match="give exactly one reward source: .* got reward.function, environment"):
        tiny(f"rl.environment.path={ENV}")
    with pytest.raises(ConfigError, match="give exactly one reward source: .* got none"):
        tiny("rl.reward.function=null")
    with pytest.raises(ConfigError, match="environment file not found: 'nope.py'"):
        tiny("rl.reward.function=null", "rl.environment.path=nope.py:Env")
    with pytest.raises(ConfigError, match=r"environment '.*env.py' is not of the form path/to/file.py:ClassName"):
        tiny("rl.reward.function=null", "rl.environment.path=rewards/tiny_retry_env.py")
    with pytest.raises(ConfigError, match="rl.environment.max_turns"):
        tiny("rl.reward.function=null", f"rl.environment.path={ENV}", "rl.environment.max_turns=0")


def test_environment_file_content_is_in_the_cache_key(tmp_path):
    from alignflow.lineage import data_inputs

    env = tmp_path / "env.py"
    env.write_text("class Env:\n    pass\n")
    cfg = tiny("rl.reward.function=null", f"rl.environment.path={env}:Env")
    before = data_inputs(cfg.section("rl"))["environment:Env"]
    env.write_text("class Env:\n    max = 2\n")
    assert data_inputs(cfg.section("rl"))["environment:Env"] != before
    moved = tmp_path / "moved.py"
    env.rename(moved)
    assert tiny("rl.reward.function=null", f"rl.environment.path={moved}:Env").section("rl").config_hash() == cfg.section("rl").config_hash()
    assert cfg.section("rl").config_hash() != tiny("rl.reward.function=null", f"rl.environment.path={moved}:Env",
                                        "rl.environment.max_turns=2").section("rl").config_hash()
