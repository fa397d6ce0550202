"""Multi-turn environment for the shipped tiny tasks (data/rl): answer; if wrong, get a hint and answer again.

Config: `rl.environment.path: rewards/tiny_retry_env.py:RetryWithHint` (configs/tiny-multiturn.yaml).
The RL stage makes one instance per episode (`alignflow/stages/rl/executors.py`):

    reset(row) -> the first user message: the row's prompt (`07+45`, `rev kdfa`)
    step(answer) -> (observation, reward, done)

A right answer (checked as `rewards/tiny_tasks.py:exact_answer` does) ends the episode with reward
1.0. A wrong one gets reward 0.0 and a short reply with a hint, the first character of the answer
(`wrong. hint: starts with a`), and the policy answers again, up to `rl.environment.max_turns`
answers. So the episode's reward is that of its final answer, and `success` is the fraction of
episodes solved within the turns. Replies use only printable ASCII (the built-in tokenizer's characters).
"""

from __future__ import annotations


class RetryWithHint:
    def reset(self, row: dict) -> str:
        self.prompt, self.answer = row["prompt"], row["answer"]
        return self.prompt

    def step(self, answer: str) -> tuple[str | None, float, bool]:
        if answer.strip() == self.answer:
            return None, 1.0, True
        return f"wrong. hint: starts with {self.answer[0]}", 0.0, False
