"""Typed configuration (torch-free): the shared parts (`base`), the graph of named stages (`graph`),
YAML loading (`loading`). Each stage kind's schema lives beside its stage: `alignflow/stages/<kind>/config.py`.

A config is parsed once (YAML + `--set` overrides), validated, and then frozen: derived values live in
locals of the code that needs them.
"""

from alignflow.config.base import ConfigError, Frozen, result_fields, stable_hash
from alignflow.config.graph import GateConfig, PipelineConfig, RegisterConfig, StageKind
from alignflow.config.loading import apply_overrides, dump_config, load_config, parse_override

__all__ = ["ConfigError", "Frozen", "GateConfig", "PipelineConfig", "RegisterConfig", "StageKind", "apply_overrides",
           "dump_config", "load_config", "parse_override", "result_fields", "stable_hash"]
