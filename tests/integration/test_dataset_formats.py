"""rm and dpo train from files shaped like UltraFeedback-binarized and HH-RLHF, by config alone
(configs/examples/), on the tiny model started from the shipped SFT stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.config import load_config

from .conftest import QUIET, ROOT

ACCURACY = {"rm": "eval/accuracy", "dpo": "eval/rewards/accuracy"}


# HH-RLHF's reading is the unit tier's (tests/unit/test_formats.py); one stage of it trains here, to hold CI's time.
@pytest.mark.parametrize(("example", "kind"), [("ultrafeedback", "rm"), ("ultrafeedback", "dpo"), ("hh_rlhf", "rm")])
def test_public_preference_shapes_train_by_config_alone(tiny_sft, tmp_path, example, kind):
    _, sft = tiny_sft
    cfg = load_config(ROOT / "configs" / "examples" / f"{example}.yaml", [f"storage.root={tmp_path}", *QUIET])
    main = __import__(f"alignflow.stages.{kind}.stage", fromlist=["main"]).main
    result = main(cfg, kind, None, {"from": sft["uri"]})
    m, acc = result["metrics"], ACCURACY[kind]
    print(f"\n{example} {kind}: held-out accuracy {m[acc + '_initial']:.3f} -> {m[acc]:.3f} "
          f"({m['data/train/used']:.0f} of {m['data/train/read']:.0f} rows used)")
    assert m[acc] >= 0.75 and m[acc] > m[acc + "_initial"] + 0.15
    if example == "ultrafeedback":  # near ties are filtered out, not skipped, and the card says so
        assert (m["data/train/filtered"], m["data/train/skipped"]) == (50, 0)
        card = (Path(result["uri"]) / "MODEL_CARD.md").read_text()
        assert "train rows: 1000 rows read, 950 used, 50 filtered (score gap under min_score_gap=0.5: 50)" in card
