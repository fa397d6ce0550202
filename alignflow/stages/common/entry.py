"""The one command line every stage runs by: `python -m alignflow.stages --config FILE --stage NAME`.

The stage's kind (from the config) picks its module, imported only then: a stage job imports what its
own stage needs. Exit codes are `alignflow.exit_codes`: bad input (config, data, code or model path of the
user's) is never retried.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import import_module
from typing import Any, Callable

from alignflow.config import ConfigError, PipelineConfig, load_config
from alignflow.exit_codes import BAD_INPUT, SERVICE_UNAVAILABLE
from alignflow.infra.lease import LEASE_ENV, Watcher
from alignflow.infra.secrets import load_job_secrets

StageMain = Callable[..., dict[str, Any]]  # main(cfg, stage, output_uri, inputs, expected_key)


def parse_inputs(items: list[str]) -> dict[str, str]:
    """`--input from=s3://…/sft/<key>` items -> {"from": uri}."""
    out = {}
    for item in items:
        role, sep, uri = item.partition("=")
        if not sep or not role.strip() or not uri.strip():
            raise ConfigError(f"--input {item!r} is not of the form ROLE=URI (e.g. from=outputs/tiny/sft/<cache key>)")
        out[role.strip()] = uri.strip()
    return out


def stage_main(cfg: PipelineConfig, stage: str) -> StageMain:
    return import_module(f"{cfg.kind(stage).module}.stage").main


def run_stage_cli(argv: list[str] | None = None) -> int:
    from alignflow.stages.common.data import DataError
    from alignflow.stages.rl.remote import ServiceUnavailable

    parser = argparse.ArgumentParser(prog="python -m alignflow.stages")
    parser.add_argument("--config", required=True, help="pipeline config YAML")
    parser.add_argument("--stage", required=True, help="the stage's name in the config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. sft.optim.lr=1e-4")
    parser.add_argument("--output", default=None, help="publish here instead of {storage.root}/{kind}/{cache_key}")
    parser.add_argument("--input", dest="inputs", action="append", default=[], metavar="ROLE=URI",
                        help="a published upstream output, e.g. from=outputs/tiny/sft/<cache key> (default: found from the config)")
    parser.add_argument("--cache-key", default=None, help="the key the caller computed; the stage refuses to run under another")
    parser.add_argument("--summary-json", default=None, help="write the stage summary as JSON to this path")
    args = parser.parse_args(argv)
    load_job_secrets()  # before the config is read: it may be on S3
    if os.environ.get(LEASE_ENV):  # started by a flow run: stop when that run is gone
        Watcher(os.environ[LEASE_ENV]).watch()
    try:
        cfg = load_config(args.config, args.overrides)
        summary = stage_main(cfg, args.stage)(cfg, args.stage, args.output, parse_inputs(args.inputs) or None, args.cache_key)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except ServiceUnavailable as exc:  # an outage, not the user's input: the task retries the stage
        print(f"error: {exc}", file=sys.stderr)
        return SERVICE_UNAVAILABLE
    if args.summary_json and os.environ.get("RANK", "0") == "0":  # one writer when several workers run
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
