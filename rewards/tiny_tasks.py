"""Reward function for the shipped tiny tasks (data/rl): 1.0 for the exact answer, else 0.0.

Config: `rl.reward.function: rewards/tiny_tasks.py:exact_answer`. The prompt rows carry the
ground truth in their `answer` column, which arrives here as `answer=[...]`.
"""


def exact_answer(prompts, completions, prompt_ids, completion_ids, answer, **columns):
    return [1.0 if completion.strip() == truth else 0.0 for completion, truth in zip(completions, answer)]


def partial_credit(prompts, completions, prompt_ids, completion_ids, answer, **columns):
    """A graded reward: the share of the answer's characters the completion has in the right place (1.0: exact),
    so samples of a weak model still differ in score (`select: best_vs_worst` needs two different scores)."""
    def credit(completion: str, truth: str) -> float:
        completion = completion.strip()
        return sum(a == b for a, b in zip(completion, truth)) / max(len(completion), len(truth), 1)

    return [credit(c, t) for c, t in zip(completions, answer)]
