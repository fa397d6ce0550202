"""Executors: how the RL stage turns prompt rows into scored token trajectories.

An executor runs `n` samples (episodes) per prompt row and returns them as `Episodes`: one
`Rollout` per sample (token ids in, token ids and sampled log-probs out: no text round trip
between generation and training), one score per sample, and per-sample figures to log. The
RL algorithm (estimator, losses) never sees which executor made them.

- `SingleTurn`: one response per sample, scored by the reward function or the reward model,
  plus DAPO's overlong penalty. What the stage did before executors existed.
- `MultiTurn`: an environment (`rl.environment.path: file.py:ClassName`, one instance per
  episode) talks with the policy:

      obs = env.reset(row)                       # row: {"prompt": str, **other columns}
      obs, reward, done = env.step(answer_text)  # after each policy answer

  up to `rl.environment.max_turns` answers. The first observation is rendered as the user turn
  of the chat template; every later one as a user reply followed by the opening of the next
  assistant turn (`reply_ids`). Each turn generates for every active episode in one batch
  through the same `generate` callable as `SingleTurn`. The trajectory is one token sequence:
  the answers keep the log-probs they were sampled with and `action_mask` 1; the environment's
  tokens get 0 (no loss, no advantage: see `advantages.py`). The episode's score is the sum of
  its rewards (plus the overlong penalty of each answer); it sits on the last answer token.
  An answer cut off at max_new_tokens ends the episode: nothing can follow it in the chat format.

Environment errors are bad input, like a failing reward function: a `RewardError` naming the
row and the turn (the stage exits with code 2 and is not retried).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from alignflow.stages.common.data import chat_prompt_text, encode
from alignflow.stages.common.formats import finite_number
from alignflow.stages.common.generation import Rollout, SamplingParams
from alignflow.stages.rl.data import PromptRow, columns_of
from alignflow.stages.rl.rewards import FunctionReward, RewardError, load_function

Generate = Callable[[list[list[int]], SamplingParams], list[Rollout]]  # prompts -> len(prompts) * n rollouts
Penalty = Callable[[torch.Tensor], torch.Tensor]  # (N,) answer lengths -> (N,) reward shaping


@dataclass
class Episodes:
    """`rollouts` of len(rows) * n samples (the n of a row consecutive), their scores, and per-sample
    figures logged as means (`turns`, `success` for multi-turn)."""

    rollouts: list[Rollout]
    scores: torch.Tensor  # (N,)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (N,); NaN = no value for that sample
    present: torch.Tensor | None = None  # (N,) bool: False for a dropped agent episode (no tokens, out of the baseline)

    def group(self, g: int, n: int) -> "Episodes":
        """The n samples of row g."""
        cut = slice(g * n, (g + 1) * n)
        return Episodes(self.rollouts[cut], self.scores[cut], {k: v[cut] for k, v in self.stats.items()},
                        None if self.present is None else self.present[cut])

    @staticmethod
    def cat(parts: list["Episodes"]) -> "Episodes":
        present = None if parts[0].present is None else torch.cat([p.present for p in parts])
        return Episodes([r for p in parts for r in p.rollouts], torch.cat([p.scores for p in parts]),
                        {k: torch.cat([p.stats[k] for p in parts]) for k in parts[0].stats}, present)

    @property
    def kept_scores(self) -> torch.Tensor:
        """The scores of the episodes that count (all, unless some were dropped)."""
        return self.scores if self.present is None else self.scores[self.present]


def action_tokens(rollout: Rollout) -> int:
    """Tokens the policy sampled (a multi-turn trajectory also holds the environment's)."""
    return len(rollout.response_ids) if rollout.action_mask is None else sum(rollout.action_mask)


class Executor(Protocol):
    def run(self, rows: list[PromptRow], params: SamplingParams) -> Episodes:
        """params.n samples per row, the n of a row consecutive."""


# --------------------------------------------------------------------------- single turn


class Scorer:
    """One reward per response: the reward function (or service: the same call), or the reward model (`score_ids`),
    plus the penalty."""

    def __init__(self, tokenizer, function: FunctionReward | None, score_ids: Callable[[list[list[int]]], torch.Tensor] | None,
                 penalty: Penalty):
        self.tokenizer, self.function, self.score_ids, self.penalty = tokenizer, function, score_ids, penalty

    def __call__(self, rows: list[PromptRow], rollouts: list[Rollout]) -> torch.Tensor:
        per_sample = [rows[i // (len(rollouts) // len(rows))] for i in range(len(rollouts))]
        if self.function is not None:
            completions = [self.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rollouts]
            scores = self.function([p.text for p in per_sample], completions, [r.prompt_ids for r in rollouts],
                                   [r.response_ids for r in rollouts], columns_of(per_sample))
        else:
            scores = self.score_ids([r.prompt_ids + r.response_ids for r in rollouts])
        return scores + self.penalty(torch.tensor([len(r.response_ids) for r in rollouts]))


class SingleTurn:
    def __init__(self, generate: Generate, scorer: Scorer):
        self.generate, self.scorer = generate, scorer

    def run(self, rows: list[PromptRow], params: SamplingParams) -> Episodes:
        rollouts = self.generate([r.ids for r in rows], params)
        return Episodes(rollouts, self.scorer(rows, rollouts))


# --------------------------------------------------------------------------- multi turn


def load_environment(spec: str) -> Callable[[], Any]:
    """The environment class named `path/to/file.py:ClassName` (called with no arguments per episode)."""
    return load_function(spec, kind="environment class")


def reply_ids(tokenizer, text: str) -> list[int]:
    """Tokens that follow an assistant answer (which ends with EOS) when the user replies `text`: the
    chat template's rendering of [user, assistant, user] + the assistant header, minus its rendering of
    [user, assistant] up to the EOS that closes the answer. Without a chat template: the text itself."""
    if not tokenizer.chat_template:
        return encode(tokenizer, text)
    head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    before = tokenizer.apply_chat_template(head, tokenize=False)
    after = tokenizer.apply_chat_template(head + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    eos = tokenizer.eos_token or ""
    cut = before.rindex(eos) + len(eos) if eos and eos in before else len(before)  # e.g. a newline after the EOS is the reply's
    if not after.startswith(before[:cut]):
        raise ValueError("the chat template renders earlier turns differently once a reply follows: cannot append a reply")
    return encode(tokenizer, after[cut:])


@dataclass
class Episode:
    """One conversation in progress: the first observation as the prompt, then answers and replies."""

    row: int  # index into the executor's rows, for error messages
    env: Any
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    answer_lengths: list[int] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = "stop"
    done: bool = False

    def add(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Policy tokens with their sampled log-probs, or (logprobs None) environment tokens."""
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.action_mask += [1 if logprobs is not None else 0] * len(ids)

    def rollout(self) -> Rollout:
        return Rollout(self.prompt_ids, self.ids, self.logprobs, self.finish_reason, self.action_mask)


class MultiTurn:
    def __init__(self, generate: Generate, environment: Callable[[], Any], spec: str, tokenizer, max_turns: int,
                 penalty: Penalty | None = None):
        self.generate, self.environment, self.spec, self.tokenizer = generate, environment, spec, tokenizer
        self.max_turns, self.penalty = max_turns, penalty

    def run(self, rows: list[PromptRow], params: SamplingParams) -> Episodes:
        episodes = [self._start(i, row) for i, row in enumerate(rows) for _ in range(params.n)]
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            # One sample per episode; each turn its own sampling seed (turn 0 samples as SingleTurn would).
            turn_params = dataclasses.replace(params, n=1, seed=(params.seed + turn * 1_000_000_007) % 2**63)
            for episode, out in zip(active, self.generate([e.prompt_ids + e.ids for e in active], turn_params)):
                self._act(episode, out, turn, rows[episode.row])
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        lengths = torch.tensor([length for e in episodes for length in e.answer_lengths])
        owner = torch.tensor([k for k, e in enumerate(episodes) for _ in e.answer_lengths])
        shaping = torch.zeros(len(episodes)).index_add(0, owner, self.penalty(lengths)) if self.penalty else 0.0
        return Episodes([e.rollout() for e in episodes], rewards + shaping,
                        {"turns": torch.tensor([len(e.answer_lengths) for e in episodes], dtype=torch.float32),
                         "success": (rewards > 0).float()})  # with 0/1 rewards: solved within max_turns

    def _start(self, i: int, row: PromptRow) -> Episode:
        episode = Episode(i, self.environment())
        obs = self._call(episode.env.reset, ({"prompt": row.text, **row.columns},), "reset", 0, row, None)
        if not isinstance(obs, str):
            raise RewardError(f"environment {self.spec}: reset returned {obs!r} for row {i} (prompt {row.text!r}): "
                              "the first observation must be a string")
        episode.prompt_ids = encode(self.tokenizer, chat_prompt_text(self.tokenizer, obs))
        return episode

    def _act(self, episode: Episode, out: Rollout, turn: int, row: PromptRow) -> None:
        episode.add(out.response_ids, out.logprobs)
        episode.answer_lengths.append(len(out.response_ids))
        episode.finish_reason = out.finish_reason
        text = self.tokenizer.decode(out.response_ids, skip_special_tokens=True)
        result = self._call(episode.env.step, (text,), "step", turn, row, text)
        obs, reward, done = self._check(result, turn, row, text)
        episode.reward += reward
        episode.done = done or out.finish_reason != "stop" or turn + 1 == self.max_turns
        if not episode.done:
            episode.add(reply_ids(self.tokenizer, obs))

    def _call(self, method, args: tuple, name: str, turn: int, row: PromptRow, action: str | None):
        try:
            return method(*args)
        except Exception as exc:
            raise RewardError(f"environment {self.spec} raised in {name} (turn {turn + 1}) on prompt {row.text!r}"
                              f"{'' if action is None else f', answer {action!r}'}: {type(exc).__name__}: {exc}") from exc

    def _check(self, result: Any, turn: int, row: PromptRow, action: str) -> tuple[str | None, float, bool]:
        where = f"environment {self.spec}: step (turn {turn + 1}) on prompt {row.text!r}, answer {action!r}"
        if not (isinstance(result, tuple) and len(result) == 3):
            raise RewardError(f"{where} returned {result!r}: expected (observation, reward, done)")
        obs, reward, done = result
        if not finite_number(reward):
            raise RewardError(f"{where} returned reward {reward!r}: rewards must be finite numbers")
        if not isinstance(done, bool):
            raise RewardError(f"{where} returned done={done!r}: expected True or False")
        if not done and not isinstance(obs, str):
            raise RewardError(f"{where} returned observation {obs!r} with done=False: expected a string")
        return obs, float(reward), done
