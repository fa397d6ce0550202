"""Reward function for the shipped tiny tasks (data/rl): 1.0 for the exact answer, else 0.0.

Config: `rl.reward.function: rewards/tiny_tasks.py:exact_answer`. The prompt rows carry the
ground truth in their `answer` column, which arrives here as `answer=[...]`.
"""


def exact_answer(prompts, completions, prompt_ids, completion_ids, answer, **columns):
    return [1.0 if completion.strip() == truth else 0.0 for completion, truth in zip(completions, answer)]
