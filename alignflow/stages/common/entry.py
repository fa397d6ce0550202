"""The command line every stage module shares: `python -m alignflow.stages.<stage> --config FILE`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from alignflow.config import ConfigError, PipelineConfig, load_config
from alignflow.stages.common.data import DataError


StageMain = Callable[[PipelineConfig, "str | None", "dict[str, str] | None"], dict[str, Any]]


def parse_inputs(items: list[str]) -> dict[str, str]:
    """`--input sft=s3://…/sft/<key>` items -> {"sft": uri}."""
    out = {}
    for item in items:
        name, sep, uri = item.partition("=")
        if not sep or not name.strip() or not uri.strip():
            raise ConfigError(f"--input {item!r} is not of the form STAGE=URI (e.g. sft=outputs/tiny/sft/<cache key>)")
        out[name.strip()] = uri.strip()
    return out


def run_stage_cli(main: StageMain, stage: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m alignflow.stages.{stage}")
    parser.add_argument("--config", required=True, help="pipeline config YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. sft.optim.lr=1e-4")
    parser.add_argument("--output", default=None, help="publish here instead of {storage.root}/{name}/{stage}/{cache_key}")
    parser.add_argument("--input", dest="inputs", action="append", default=[], metavar="STAGE=URI",
                        help="a published upstream output to start from, e.g. sft=outputs/tiny/sft/<cache key> "
                             "(default: found from the config, when that stage has been run)")
    parser.add_argument("--summary-json", default=None, help="write the stage summary as JSON to this path")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        summary = main(cfg, args.output, parse_inputs(args.inputs) or None)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.summary_json and os.environ.get("RANK", "0") == "0":  # one writer when several workers run
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
