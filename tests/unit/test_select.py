"""The select modes on hand-made groups: what each keeps, ties, thresholds and margins."""

from __future__ import annotations

from alignflow.stages.select.modes import all_pairs, best_of_n, best_vs_worst, kto, select


def group(*scores: float, prompt_index: int = 0, answer: str = "7") -> list[dict]:
    return [{"prompt": "3+4", "completion": f"c{i}", "score": s, "prompt_index": prompt_index, "sample_index": i,
             "prompt_ids": [1], "completion_ids": [2], "logprobs": [-0.5], "finish_reason": "stop", "reward": s,
             "rm_score": None, "answer": answer} for i, s in enumerate(scores)]


def test_best_of_n_keeps_the_best_sample_the_earlier_on_a_tie_and_applies_the_threshold():
    assert best_of_n(group(0.0, 1.0, 1.0, 0.5)) == [{"prompt": "3+4", "response": "c1", "score": 1.0, "prompt_index": 0, "answer": "7"}]
    assert best_of_n(group(0.2, 0.9), threshold=1.0) == []
    assert best_of_n(group(0.2, 1.0), threshold=1.0)[0]["response"] == "c1"


def test_best_vs_worst_pairs_the_extremes_above_the_margin():
    [p] = best_vs_worst(group(0.5, 1.0, 0.0, 0.0, 1.0))
    assert (p["chosen"], p["rejected"], p["margin"], p["score_chosen"], p["score_rejected"]) == ("c1", "c2", 1.0, 1.0, 0.0)
    assert p["answer"] == "7" and "completion_ids" not in p and "score" not in p
    assert best_vs_worst(group(1.0, 1.0, 1.0)) == []  # every sample alike: no preference
    assert best_vs_worst(group(0.0, 0.5), min_margin=0.5) == []  # the gap must exceed the margin
    assert len(best_vs_worst(group(0.0, 0.6), min_margin=0.5)) == 1


def test_a_gap_equal_to_the_margin_does_not_exceed_it_whatever_its_rounding():
    """0.8 - 0.6 > 0.2 and 0.7 - 0.5 < 0.2 in float64: both gaps are the margin, and neither pair is kept."""
    assert 0.8 - 0.6 > 0.2 > 0.7 - 0.5  # what a plain comparison would decide
    for low, high in ((0.6, 0.8), (0.5, 0.7), (0.7, 0.9), (0.1, 0.3)):
        assert best_vs_worst(group(low, high), min_margin=0.2) == [], (low, high)
        assert all_pairs(group(low, high), min_margin=0.2) == [], (low, high)
    assert len(best_vs_worst(group(0.6, 0.801), min_margin=0.2)) == 1
    assert len(best_vs_worst(group(0.6, 0.6 + 1e-9))) == 1  # with no margin any difference counts


def test_best_vs_worst_leaves_out_a_pair_of_one_text_unless_asked():
    same = group(1.0, 0.0)
    same[1]["completion"] = "c0"
    assert best_vs_worst(same) == [] and len(best_vs_worst(same, dedupe=False)) == 1


def test_all_pairs_orders_each_pair_by_score():
    pairs = all_pairs(group(0.0, 1.0, 0.5))
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("c1", "c0"), ("c2", "c0"), ("c1", "c2")]
    assert [round(p["margin"], 6) for p in pairs] == [1.0, 0.5, 0.5]
    assert [(p["chosen"], p["rejected"]) for p in all_pairs(group(0.0, 1.0, 0.5), min_margin=0.5)] == [("c1", "c0")]


def test_kto_by_threshold_labels_every_sample_and_by_rank_the_top_and_bottom():
    labelled = kto(group(0.0, 1.0, 0.5), threshold=0.5)
    assert [(r["completion"], r["label"]) for r in labelled] == [("c0", False), ("c1", True), ("c2", True)]
    ranked = kto(group(0.0, 1.0, 0.5, 0.7), top=1)
    assert [(r["completion"], r["label"]) for r in ranked] == [("c1", True), ("c0", False)]
    assert [(r["completion"], r["label"]) for r in kto(group(0.0, 1.0, 0.5, 0.7), top=2)] == [
        ("c1", True), ("c3", True), ("c2", False), ("c0", False)]
    assert kto(group(1.0, 1.0, 1.0, 0.0), top=2) == []  # the second best ties the second worst: no clean split


def test_select_groups_by_prompt_counts_empty_prompts_and_skips_empty_completions():
    rows = group(0.0, 1.0, prompt_index=0) + group(1.0, 1.0, prompt_index=1) + group(0.0, 1.0, prompt_index=2)
    rows[5]["completion"] = " "  # prompt 2's right answer is empty text: left out, so prompt 2 has one sample
    out, empty = select(rows, "best_vs_worst")
    assert [(r["prompt_index"], r["chosen"]) for r in out] == [(0, "c1")] and empty == 2
    out, empty = select(rows, "best_of_n", threshold=1.0)
    assert [(r["prompt_index"], r["response"]) for r in out] == [(0, "c1"), (1, "c0")] and empty == 1
