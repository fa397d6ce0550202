"""Typed configuration (torch-free): the shared parts (`base`), the graph of named stages (`graph`),
YAML loading (`loading`). Each stage kind's schema lives beside its stage: `alignflow/stages/<kind>/config.py`.

A config is parsed once (YAML + `--set` overrides), validated, and then frozen: derived values live in
locals of the code that needs them.
"""

from importlib import import_module

from alignflow.config.base import ConfigError, Frozen, result_fields, stable_hash

# The graph imports every stage kind's schema, and those import `alignflow.config.base`: loaded on first use,
# so that a process whose first import is a stage's schema (a Ray worker) does not meet a half-built package.
_LAZY = {"GateConfig": "graph", "PipelineConfig": "graph", "RegisterConfig": "graph", "StageKind": "graph",
         "apply_overrides": "loading", "dump_config": "loading", "load_config": "loading", "parse_override": "loading"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"alignflow.config.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'alignflow.config' has no attribute {name!r}")


__all__ = ["ConfigError", "Frozen", "result_fields", "stable_hash", *_LAZY]
