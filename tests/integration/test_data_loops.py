"""Dataset stages on the session's tiny SFT model: generate resumes by shard with the rows of an uninterrupted run,
label names a bad row (or skips it), and select's output trains an sft stage through `data.stage`."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from alignflow.config import load_config
from alignflow.stages.common.data import DataError
from alignflow.stages.common.datasets import SHARDS_DIR, published_rows
from alignflow.stages.common.run import FAIL_AT_STEP_ENV, InjectedFailure

from .conftest import QUIET, ROOT

SMALL = ["generate.prompts.max_samples=24", "generate.shard_size=8", "generate.generation.n_samples_per_prompt=4"]


def loop_config(root: str, *extra: str):
    return load_config(ROOT / "configs" / "tiny-rejection-sampling.yaml",
                       [f"storage.root={root}", *QUIET, *SMALL, "rs_sft.logging.progress=false", *extra])


@pytest.fixture(scope="module")
def generated(tiny_sft, ray_session, tmp_path_factory):
    """generate killed after its 2nd of 3 shards, then run again; and the same stage run through in another folder."""
    from alignflow.stages.generate.stage import main

    cfg = loop_config(tiny_sft[0].storage.root)
    sft = {"from": tiny_sft[1]["uri"]}
    os.environ[FAIL_AT_STEP_ENV] = "2"
    try:
        with pytest.raises(InjectedFailure):
            main(cfg, "generate", inputs=sft)
    finally:
        del os.environ[FAIL_AT_STEP_ENV]
    shards = Path(cfg.storage.root) / "generate"
    [folder] = list(shards.iterdir())
    stored = {p.name: p.stat().st_mtime_ns for p in (folder / SHARDS_DIR).iterdir()}
    resumed = main(cfg, "generate", inputs=sft)
    through = main(cfg, "generate", output_uri=str(tmp_path_factory.mktemp("through") / "generate"), inputs=sft)
    return cfg, folder, stored, resumed, through


def test_generate_resumes_at_the_next_shard_with_the_rows_of_an_uninterrupted_run(generated):
    cfg, folder, stored, resumed, through = generated
    assert sorted(stored) == ["part-00000.json", "part-00000.parquet", "part-00001.json", "part-00001.parquet"]
    after = {p.name: p.stat().st_mtime_ns for p in (folder / SHARDS_DIR).iterdir()}
    assert all(after[name] == stamp for name, stamp in stored.items())  # finished shards were not generated again
    rows, again = published_rows(resumed["uri"]), published_rows(through["uri"])
    assert len(rows) == 24 * 4 and rows == again
    assert [(r["prompt_index"], r["sample_index"]) for r in rows[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    first = rows[0]
    assert set(first) >= {"prompt", "completion", "prompt_ids", "completion_ids", "logprobs", "finish_reason", "answer"}
    assert len(first["logprobs"]) == len(first["completion_ids"]) and first["finish_reason"] in ("stop", "length")
    assert sorted(p.name for p in (Path(resumed["uri"]) / "data").iterdir()) == [f"part-0000{k}.parquet" for k in range(3)]
    import datasets

    loaded = datasets.load_dataset("parquet", data_files=str(Path(resumed["uri"]) / "data" / "*.parquet"), split="train")
    assert loaded.num_rows == 96 and loaded[5]["completion"] == rows[5]["completion"]
    from alignflow.infra.export import export_model

    exported = export_model(resumed["uri"], str(Path(through["uri"]).parent / "exported"))
    assert exported == ["DATASET_CARD.md", *(f"data/part-0000{k}.parquet" for k in range(3))]


def reward_file(tmp_path: Path) -> str:
    path = tmp_path / "picky.py"
    path.write_text("def score(prompts, completions, prompt_ids, completion_ids, answer, **columns):\n"
                    "    if any(p == prompts_to_fail for p in prompts):\n"
                    "        raise ValueError('cannot score this one')\n"
                    "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    return str(path)


def test_label_names_the_row_it_cannot_score_or_skips_it(generated, tmp_path):
    from alignflow.stages.label.stage import main

    cfg, _, _, resumed, _ = generated
    rows = published_rows(resumed["uri"])
    bad = rows[9]["prompt"]  # prompt 2: rows 9..12 of the dataset
    spec = reward_file(tmp_path)
    Path(spec).write_text(Path(spec).read_text().replace("prompts_to_fail", repr(bad)))
    data = {"data": resumed["uri"]}
    broken = loop_config(cfg.storage.root, f"label.reward={spec}:score")
    with contextlib.chdir(ROOT), pytest.raises(DataError) as err:
        main(broken, "label", inputs=data)
    assert f"{resumed['uri']}/data row 9 (prompt {bad!r}, completion {rows[8]['completion']!r}): " in str(err.value)
    assert "raised" in str(err.value) and "ValueError: cannot score this one" in str(err.value) and "4 bad row(s) of 96" in str(err.value)
    skipping = loop_config(cfg.storage.root, f"label.reward={spec}:score", "label.on_bad_row=skip", "label.max_skip_fraction=0.1")
    result = main(skipping, "label", inputs=data)
    assert result["metrics"]["label/skipped"] == 4 and len(published_rows(result["uri"])) == 92


def test_selected_rows_train_an_sft_stage_that_names_them_as_its_data(generated):
    from alignflow.stages.label.stage import main as label
    from alignflow.stages.select.stage import main as select
    from alignflow.stages.sft.stage import main as sft

    cfg, _, _, resumed, _ = generated
    cfg = loop_config(cfg.storage.root, "select.threshold=null", "rs_sft.batch.max_steps=2", "rs_sft.batch.global_batch_size=8",
                      "rs_sft.batch.micro_batch_size=8")
    labelled = label(cfg, "label", inputs={"data": resumed["uri"]})
    scores = [r["score"] for r in published_rows(labelled["uri"])]
    assert set(scores) <= {0.0, 1.0} and labelled["metrics"]["label/reward_mean"] == sum(scores) / len(scores)
    chosen = select(cfg, "select", inputs={"data": labelled["uri"]})
    rows = published_rows(chosen["uri"])
    assert len(rows) == 24 - chosen["metrics"]["select/prompts_without_rows"] and set(rows[0]) >= {"prompt", "response", "score"}
    trained = sft(cfg, "rs_sft", inputs={"from": _sft_uri(cfg), "data": chosen["uri"]})
    manifest = json.loads((Path(trained["uri"]) / "MANIFEST.json").read_text())
    assert manifest["inputs"]["upstream:data"]["uri"] == chosen["uri"]
    assert trained["metrics"]["data/train/used"] + trained["metrics"].get("data/train/skipped", 0) == len(rows)


def _sft_uri(cfg) -> str:
    from alignflow.lineage import published_uri

    return published_uri(cfg, "sft")


def test_label_with_a_reward_model_scores_the_generated_token_ids(generated, tiny_rm):
    import torch

    from alignflow.stages.label.stage import main
    from alignflow.stages.rm.scoring import RewardScorer

    cfg, _, _, resumed, _ = generated
    rm_uri = tiny_rm[1]["uri"]
    both = loop_config(cfg.storage.root, "label.reward_model=rm", "rm.from=sft", "label.reward_model_weight=0.5")
    result = main(both, "label", inputs={"data": resumed["uri"], "reward_model": rm_uri})
    rows = published_rows(result["uri"])
    expected = RewardScorer(str(Path(rm_uri) / "model")).score_ids([r["prompt_ids"] + r["completion_ids"] for r in rows])
    assert torch.allclose(torch.tensor([r["rm_score"] for r in rows]), expected, atol=1e-5)
    assert all(abs(r["score"] - (r["reward"] + 0.5 * r["rm_score"])) < 1e-9 for r in rows)
