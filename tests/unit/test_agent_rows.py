"""How an agent episode's calls become one training row (`stages/rl/agents.py:episode_rollout`), by hand."""

from alignflow.stages.rl.agents import episode_rollout
from alignflow.stages.rl.openai_server import Call


def test_one_call_is_a_plain_rollout():
    r = episode_rollout([Call([1, 2], [3, 4], [-0.5, -0.25], "stop")])
    assert (r.prompt_ids, r.response_ids, r.logprobs, r.action_mask, r.position_ids) == ([1, 2], [3, 4], [-0.5, -0.25], None, None)


def test_a_call_that_extends_the_row_continues_it_with_its_new_prompt_tokens_masked():
    calls = [Call([1, 2], [3, 4], [-0.1, -0.2], "stop"), Call([1, 2, 3, 4, 7, 8], [9], [-0.3], "stop")]
    r = episode_rollout(calls)
    assert r.prompt_ids == [1, 2] and r.response_ids == [3, 4, 7, 8, 9]
    assert r.action_mask == [1, 1, 0, 0, 1] and r.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert r.position_ids is None and r.finish_reason == "stop"


def test_a_call_that_rewrites_the_history_opens_a_segment_with_positions_from_zero():
    calls = [Call([1, 2], [3, 4], [-0.1, -0.2], "stop"),
             Call([1, 2, 5, 7], [9, 6], [-0.3, -0.4], "length"),  # earlier answer re-rendered as 5: not [1, 2, 3, 4, ...]
             Call([1, 2, 5, 7, 9, 6, 8], [4], [-0.5], "stop")]  # extends the second call: continues its segment
    r = episode_rollout(calls)
    assert r.response_ids == [3, 4, 1, 2, 5, 7, 9, 6, 8, 4]
    assert r.action_mask == [1, 1, 0, 0, 0, 0, 1, 1, 0, 1]
    assert r.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3, -0.4, 0.0, -0.5]
    assert r.position_ids == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]  # prompt 1,2 + 3,4 | 1,2,5,7,9,6 + 8,4
