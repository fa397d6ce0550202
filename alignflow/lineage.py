"""What a stage's result depends on, computed without torch.

The Prefect task (which must not import torch) and the stage itself (inside the Ray job) both call
`stage_cache_key`, so they agree on where a stage's result lives: `{storage.root}/{kind}/{cache_key}/`.
Neither the stage's name nor the pipeline's is in either: renaming a stage, or adding one beside it, re-runs
nothing, two stages with the same key share one result, and configs share the stages they have in common.
"""

from __future__ import annotations

from alignflow.config import ConfigError, PipelineConfig
from alignflow.infra import manifest, storage


def data_sources(stage_cfg) -> dict[str, str]:
    """Named files a stage section's result depends on (data, eval data, a reward function)."""
    return stage_cfg.sources()


def data_inputs(stage_cfg) -> dict[str, str]:
    """Content fingerprints of a stage's data: part of the cache key, unlike the paths."""
    return {name: storage.fingerprint(src) for name, src in data_sources(stage_cfg).items()}


def stage_cache_key(cfg: PipelineConfig, stage: str, upstream: dict[str, str] | None = None,
                    data: dict[str, str] | None = None) -> str:
    """hash(kind and result fields of the stage's section, data fingerprints, upstream manifest digests
    by input role, alignflow version). `data`: the stage's `data_inputs`, when the caller has them already."""
    section = cfg.section(stage)
    inputs = dict(data) if data is not None else data_inputs(section)
    inputs.update({f"upstream:{role}": digest for role, digest in (upstream or {}).items()})
    return manifest.cache_key(section.config_hash(), inputs)


def stage_output_uri(cfg: PipelineConfig, stage: str, key: str) -> str:
    return manifest.stage_uri(cfg.storage.root, cfg.kind(stage).value, key)


def input_digests(inputs: dict[str, str]) -> dict[str, str]:
    """Manifest digest of each input role's published output; one that is not published is an error."""
    out = {}
    for role, uri in inputs.items():
        published = manifest.verify(uri)
        if published is None:
            raise ConfigError(f"input {role}={uri}: no published stage output there (no MANIFEST.json that verifies)")
        out[role] = published.digest
    return out


def locate_inputs(cfg: PipelineConfig, stage: str) -> dict[str, str]:
    """Where the upstream outputs `stage` consumes are published (input role -> URI), found from the config
    alone: each upstream stage's cache key is computed (recursively) and its manifest looked up. This is
    how `alignflow stage rm --config tiny-ppo.yaml` finds the SFT model `alignflow stage sft` made."""
    found, missing = {}, []
    for role, up in cfg.inputs_of(stage).items():
        uri = published_uri(cfg, up)
        if uri is None:
            missing.append(up)
        else:
            found[role] = uri
    if missing:
        raise ConfigError(f"stage {stage!r} needs the output of {', '.join(repr(m) for m in missing)}, which is not "
                          f"published: run those stages first (`alignflow run CONFIG --until {missing[0]}`), or pass "
                          f"--input ROLE=URI")
    return found


def published_uri(cfg: PipelineConfig, stage: str) -> str | None:
    """The stage's published output for this config, if there is one (its inputs found the same way)."""
    try:
        upstream = locate_inputs(cfg, stage)
    except ConfigError:
        return None
    uri = stage_output_uri(cfg, stage, stage_cache_key(cfg, stage, input_digests(upstream)))
    return uri if manifest.verify(uri) is not None else None
