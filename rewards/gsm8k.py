"""Reward for GSM8K-shaped rows: 1.0 when the completion's final number is the answer's, else 0.0.

GSM8K answers end in `#### <number>`; a completion is read the same way when it has `####`, else
its last number counts. Commas in numbers are ignored (`1,000` is 1000).
Config: `rl.reward.function: rewards/gsm8k.py:final_answer` with the `answer` column in the prompt rows.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> str | None:
    text = text.replace(",", "")
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = NUMBER.findall(tail)
    return (found[0] if "####" in text else found[-1]) if found else None


def final_answer(prompts, completions, prompt_ids, completion_ids, answer, **columns):
    return [1.0 if (got := final_number(c)) is not None and got == final_number(truth) else 0.0
            for c, truth in zip(completions, answer)]
