"""`python -m alignflow.stages --config FILE --stage NAME [--set KEY=VALUE ...]`: see stages/common/entry.py."""

import sys

from alignflow.stages.common.entry import run_stage_cli

if __name__ == "__main__":
    sys.exit(run_stage_cli())
