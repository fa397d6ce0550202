"""The handoff to serving: the gate a candidate must pass, the lineage model card, the registry version.

`gate_decision` is pure: it reads the eval stage's table (model -> metric -> value) and the rule.
"""

from __future__ import annotations

import json
from typing import Any

from alignflow.config import GateConfig, PipelineConfig, stable_hash
from alignflow.infra import storage
from alignflow.infra.tracking import LINEAGE_TAG, Tracker
from alignflow.rounding import at_most
from alignflow.tasks.results import StageResult

CANDIDATE = "candidate"


def meets(value: float, bar: float, lower_is_better: bool) -> bool:
    """`value` >= `bar` (<= for lower-is-better metrics), up to rounding. The slack scales with the bar, at least 1,
    so a floor of 0 gets one too: the bar is a sum of rounded rates (`alignflow.rounding`)."""
    scale = max(1.0, abs(bar))
    return at_most(value, bar, scale) if lower_is_better else at_most(bar, value, scale)


def gate_decision(gate: GateConfig, table: dict[str, dict[str, float]], stage: str) -> tuple[bool, str]:
    """(passed, why): `metric` of `stage` against the floor and against the baseline plus the margin."""
    value = table.get(stage, {}).get(gate.metric)
    if value is None:
        return False, f"eval stage {gate.eval!r} has no {gate.metric} for {stage!r}"
    better = lambda a, b: meets(a, b, gate.lower_is_better)  # noqa: E731
    sign = -1 if gate.lower_is_better else 1
    reasons = []
    if gate.min is not None and not better(value, gate.min):
        reasons.append(f"{gate.metric}={value:.4g} misses the floor {gate.min:.4g}")
    if gate.baseline is not None:
        base = table.get(gate.baseline, {}).get(gate.metric)
        if base is None:
            return False, f"eval stage {gate.eval!r} has no {gate.metric} for the baseline {gate.baseline!r}"
        need = base + sign * gate.min_gain
        if not better(value, need):
            reasons.append(f"{gate.metric}={value:.4g} misses {gate.baseline}'s {base:.4g} {'-' if sign < 0 else '+'} "
                           f"{gate.min_gain:.4g} = {need:.4g}")
    if reasons:
        return False, "; ".join(reasons)
    return True, f"{gate.metric}={value:.4g} meets the rule"


def eval_table(result: StageResult) -> dict[str, dict[str, float]]:
    """The per-model table an eval stage published (metrics.json `models`)."""
    return json.loads(storage.read_text(storage.join(result.uri, "metrics.json"))).get("models", {})


def lineage_card(config: PipelineConfig, stage: str, results: dict[str, StageResult], tables: dict[str, dict]) -> str:
    """A model card for the registered model's whole lineage: each stage's kind, config hash, data, key metrics."""
    lines = [f"# {config.registered_name}: `{stage}`", "", "## Lineage", ""]
    for name in config.needed_for(stage):
        r = results[name]
        section = config.section(name)
        meta = json.loads(storage.read_text(storage.join(r.uri, "MANIFEST.json")))
        data = {k: v for k, v in (meta.get("inputs") or {}).items() if not k.startswith("upstream:")}
        lines += [f"### {name} ({r.kind})", "",
                  f"- from: {', '.join(f'{role} = `{up}`' for role, up in r.inputs.items()) or f'`{section.model.name_or_path}`'}",
                  f"- config hash: `{section.config_hash()}`; cache key: `{r.cache_key}`; published at `{r.uri}`",
                  *[f"- data `{k}`: sha256 `{str(v)[:16]}…`" for k, v in data.items()],
                  *[f"- {k}: {v:.4g}" for k, v in sorted(r.metrics.items()) if k.startswith("eval/") and not k.endswith("_initial")],
                  ""]
    for name, table in tables.items():
        lines += [f"## Evaluation `{name}`", "", storage.read_text(storage.join(results[name].uri, "table.md")), ""]
    return "\n".join(lines)


def register(config: PipelineConfig, tracker: Tracker, parent: str, results: dict[str, StageResult]) -> dict[str, Any] | None:
    """Register the configured stage's model; alias `candidate` only when it passes the gate."""
    stage = config.registered_stage
    if stage is None or any(n not in results for n in config.needed_for(stage)):
        return None  # not this run's (--until stopped before it), or not its whole lineage (--only)
    reg, final = config.registration, results[stage]
    tables = {n: eval_table(r) for n, r in results.items() if r.kind == "eval"}
    passed, why = True, "no gate"
    if reg.gate is not None:
        passed, why = gate_decision(reg.gate, tables.get(reg.gate.eval, {}), stage)
    lineage = [results[n] for n in config.needed_for(stage)]
    tags = {"alignflow.cache_key": final.cache_key, "alignflow.stage": stage, "alignflow.kind": final.kind,
            "alignflow.lineage": " -> ".join(f"{r.stage}:{r.cache_key}" for r in lineage),
            LINEAGE_TAG: stable_hash([r.digest for r in lineage]), "alignflow.manifest_digest": final.digest}
    name = config.registered_name
    version, created = tracker.register(name, final.uri, parent, tags, lineage_card(config, stage, results, tables))
    tracker.tag_version(name, version, {"alignflow.gate": "passed" if passed else "rejected", "alignflow.gate_reason": why})
    if passed:
        tracker.set_alias(name, CANDIDATE, version)
    return {"name": name, "version": version, "alias": CANDIDATE if passed else None, "promoted": passed, "gate": why,
            "new_version": created, "source": storage.join(final.uri, "model"), "model_uri": f"models:/{name}/{version}"}
