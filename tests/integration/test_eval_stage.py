"""The eval stage on configs/tiny.yaml's SFT model: the published table, numbers a reader can check against
the SFT stage's own held-out loss, the cache, and a policy measured against itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignflow.config import ConfigError, load_config
from alignflow.infra import manifest
from alignflow.stages.eval.stage import main, markdown_table

from .conftest import QUIET, ROOT

pytestmark = pytest.mark.integration

# tiny.yaml's `defaults: eval:` (data/rl/eval.jsonl + exact_answer, data/preference/eval.jsonl, data/sft/eval.jsonl),
# capped where the cap costs no check: the NLL keeps all 200 rows, to equal the SFT stage's own held-out loss.
CAPS = ["eval.prompts.max_samples=100", "eval.pairs.max_samples=64"]


def eval_config(root: str, *overrides: str):
    return load_config(ROOT / "configs" / "tiny.yaml", [f"storage.root={root}", *QUIET, "eval.models=[sft]", *CAPS, *overrides])


def test_eval_of_the_tiny_sft_model(tiny_sft):
    sft_cfg, sft = tiny_sft
    cfg = eval_config(sft_cfg.storage.root)
    result = main(cfg, "eval")
    out = Path(result["uri"])
    assert not result["cached"]
    for name in ("metrics.json", "table.md", "table.csv", "chart.png", "config.yaml"):
        assert (out / name).is_file(), name
    published = manifest.verify(result["uri"])
    assert published is not None and published.meta["stage"] == "eval" and published.meta["cache_key"] == result["cache_key"]
    assert published.meta["metrics"] == result["metrics"]
    assert published.meta["inputs"]["upstream:model:sft"]["uri"] == sft["uri"]

    row = json.loads((out / "metrics.json").read_text())["models"]["sft"]
    assert set(row) == {"eval/accuracy", "eval/pairwise_accuracy", "eval/nll"}  # no samples, no reward model
    assert result["metrics"] == {f"sft/{k}": v for k, v in row.items()}
    # Exact-answer accuracy of greedy answers: a count out of 100 prompts; the trained model gets 40 of 200 right in full.
    assert 0.2 < row["eval/accuracy"] <= 1 and round(row["eval/accuracy"] * 100, 6).is_integer()
    # NLL per response token on data/sft/eval.jsonl: the SFT stage's own held-out loss on the same file (it packs
    # rows, this does not: the same sums), far below the untrained base's (its step-0 loss, ~4.7).
    assert row["eval/nll"] == pytest.approx(sft["metrics"]["eval/loss"], rel=1e-4)
    assert row["eval/nll"] < sft["metrics"]["eval/loss_initial"] / 2
    # Implicit reward against builtin:tiny (the model SFT started from): SFT learned to prefer the chosen answers.
    assert 0.5 < row["eval/pairwise_accuracy"] <= 1

    assert (out / "table.md").read_text().splitlines()[:3] == [
        "| model | eval/accuracy | eval/pairwise_accuracy | eval/nll |", "|---|---|---|---|",
        f"| sft | {row['eval/accuracy']:.4g} | {row['eval/pairwise_accuracy']:.4g} | {row['eval/nll']:.4g} |"]
    assert (out / "table.csv").read_text().splitlines()[0] == "model,eval/accuracy,eval/pairwise_accuracy,eval/nll"
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = main(cfg, "eval")
    assert again["cached"] and again["uri"] == result["uri"] and again["metrics"] == result["metrics"]
    with pytest.raises(ConfigError, match="cache key"):
        main(cfg, "eval", expected_key="0" * 16)


def test_a_policy_against_itself_prefers_nothing(tiny_sft, tmp_path):
    """Reference = the policy: both implicit rewards are exactly 0 for every pair, and a tie is not right."""
    sft_cfg, sft = tiny_sft
    cfg = eval_config(sft_cfg.storage.root, "eval.verifier=null", "eval.nll=null", "eval.pairs.max_samples=16")
    result = main(cfg, "eval", str(tmp_path / "eval"), {"model:sft": sft["uri"], "reference:sft": sft["uri"]})
    assert result["metrics"] == {"sft/eval/pairwise_accuracy": 0.0}


def test_markdown_table_marks_what_does_not_apply():
    table = {"sft": {"eval/accuracy": 0.5, "eval/nll": 1.23456}, "rm": {"eval/pairwise_accuracy": 0.75}}
    columns = ["eval/accuracy", "eval/pairwise_accuracy", "eval/nll"]
    assert markdown_table(table, columns).splitlines() == [
        "| model | eval/accuracy | eval/pairwise_accuracy | eval/nll |", "|---|---|---|---|",
        "| sft | 0.5 | – | 1.235 |", "| rm | – | 0.75 | – |"]


ONE_CALL_AGENT = '''
def run(client, row):
    """One chat call, no max_tokens (the endpoint caps it at generation.max_new_tokens), scored as exact_answer scores."""
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return {"reward": float(reply.choices[0].message.content.strip() == row["answer"]), "tokens": reply.usage.completion_tokens}
'''


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_an_agent_through_the_endpoint_scores_as_the_stages_own_answers(tiny_sft, tmp_path, engine):
    """The agent's greedy episode is one chat call, judged as the verifier judges: through the endpoint in front of
    either engine, its mean reward equals the eval stage's own greedy accuracy on the same prompts, exactly."""
    sft_cfg, sft = tiny_sft
    agent = tmp_path / "one_call_agent.py"
    agent.write_text(ONE_CALL_AGENT)
    cfg = eval_config(sft_cfg.storage.root, "eval.pairs=null", "eval.nll=null", "eval.prompts.max_samples=50",
                      f"eval.generation.engine={engine}", f"eval.agent.path={agent}:run", "eval.agent.concurrency=8")
    result = main(cfg, "eval", str(tmp_path / "eval"), {"model:sft": sft["uri"]})
    row = json.loads((tmp_path / "eval" / "metrics.json").read_text())["models"]["sft"]
    assert set(row) == {"eval/accuracy", "eval/agent/reward", "eval/agent/tokens", "eval/agent/calls", "eval/agent/dropped_fraction"}
    assert row["eval/agent/reward"] == row["eval/accuracy"] > 0.2  # the SFT model gets some right, greedy, both ways
    assert row["eval/agent/calls"] == 1 and row["eval/agent/dropped_fraction"] == 0 and 1 <= row["eval/agent/tokens"] <= 8
    assert "eval/agent/reward" in (tmp_path / "eval" / "table.md").read_text()
    assert result["metrics"]["sft/eval/agent/reward"] == row["eval/agent/reward"]
