"""Reward for GSM8K-style math word problems: 1.0 when the completion's final number equals the
reference answer's, else 0.0 (configs/7b-grpo.yaml).

Config: `rl.reward.function: rewards/gsm8k.py:final_number`. The prompt rows carry GSM8K's
`answer` column: a worked solution ending in `#### <number>` (a bare number works too). The
completion's number is the first after its own last `####` if it writes one, else its last number.
"""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_number(text: str) -> float | None:
    """The first number after the last `####`, else the last number of the text; commas dropped."""
    _, mark, tail = text.rpartition("####")  # without one, tail is the whole text
    found = NUMBER.findall(tail)
    return float(found[0 if mark else -1].replace(",", "")) if found else None


def final_number(prompts, completions, prompt_ids, completion_ids, answer, **columns):
    rewards = []
    for completion, truth in zip(completions, answer):
        got, want = answer_number(completion), answer_number(str(truth))
        rewards.append(1.0 if got is not None and want is not None and abs(got - want) < 1e-6 else 0.0)
    return rewards
