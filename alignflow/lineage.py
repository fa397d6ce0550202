"""What a stage's result depends on, computed without torch.

The Prefect task (which must not import torch) and the stage itself (inside the
Ray job) both call `stage_cache_key`, so they always agree on where a stage's
result lives: `{storage.root}/{pipeline}/{stage}/{cache_key}/`.
"""

from __future__ import annotations

from alignflow.config import ConfigError, PipelineConfig, Stage
from alignflow.infra import manifest, storage


def data_sources(stage_cfg) -> dict[str, str]:
    """Named files a stage section's result depends on (data, eval data, a reward function)."""
    return stage_cfg.sources()


def data_inputs(stage_cfg) -> dict[str, str]:
    """Content fingerprints of a stage's data: part of the cache key, unlike the paths."""
    return {name: storage.fingerprint(src) for name, src in data_sources(stage_cfg).items()}


def stage_cache_key(cfg: PipelineConfig, stage: Stage, upstream: dict[str, str] | None = None,
                    data: dict[str, str] | None = None) -> str:
    """hash(stage config hash, data fingerprints, upstream manifest digests, alignflow version).
    `data`: the stage's `data_inputs`, when the caller has them already (hashing data is not free)."""
    section = cfg.stage(stage)
    inputs = dict(data) if data is not None else data_inputs(section)
    inputs.update({f"upstream:{name}": digest for name, digest in (upstream or {}).items()})
    return manifest.cache_key(section.config_hash(), inputs)


def stage_output_uri(cfg: PipelineConfig, stage: Stage, key: str) -> str:
    return manifest.stage_uri(cfg.storage.root, cfg.name, stage.value, key)


def input_digests(inputs: dict[str, str]) -> dict[str, str]:
    """Manifest digest of each named upstream output; one that is not published is an error."""
    out = {}
    for name, uri in inputs.items():
        published = manifest.verify(uri, check_hashes=False)
        if published is None:
            raise ConfigError(f"input {name}={uri}: no published stage output there (no MANIFEST.json that verifies)")
        out[name] = published.digest
    return out


def locate_inputs(cfg: PipelineConfig, stage: Stage) -> dict[str, str]:
    """Where the upstream outputs `stage` consumes are published, found from the config alone:
    each upstream stage's cache key is computed (recursively) and its manifest looked up. This
    is how `alignflow stage rm --config full.yaml` finds the SFT model `alignflow stage sft` made."""
    found = {}
    for up in cfg.pipeline.inputs(stage):
        upstream = locate_inputs(cfg, up)
        uri = stage_output_uri(cfg, up, stage_cache_key(cfg, up, input_digests(upstream)))
        if manifest.verify(uri, check_hashes=False) is None:
            raise ConfigError(
                f"stage {stage.value!r} starts from the {up.value} stage's output, which is not published at {uri}: "
                f"run `alignflow stage {up.value}` (or the whole pipeline) first, or pass --input {up.value}=URI"
            )
        found[up.value] = uri
    return found
