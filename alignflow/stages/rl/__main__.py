"""`python -m alignflow.stages.rl --config FILE [--input sft=URI] [--input rm=URI] [--set KEY=VALUE ...]`: see stage.py."""

import sys

from alignflow.stages.common.entry import run_stage_cli
from alignflow.stages.rl.stage import main

if __name__ == "__main__":
    sys.exit(run_stage_cli(main, "rl"))
