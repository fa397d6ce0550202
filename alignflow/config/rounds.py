"""Rounds: K copies of a sub-graph, each starting from the model the round before made, written once.

    online:                  # the loop's name
      rounds: 3
      from: sft              # what round 1 starts from
      mix_previous: false    # true: a training stage's `data.stage` takes that stage's rows of every round so far
      stages:
        generate: {from: previous, prompts: {...}}
        label: {data: generate, reward: rewards/tiny_tasks.py:exact_answer}
        select: {data: label, mode: best_vs_worst}
        dpo: {from: previous, data: {stage: select}}

expands at load into plain stages `online.1.generate` ... `online.3.dpo`, so every round is a stage of its own in the
flow (and in Prefect's UI), cached apart. Inside a round a stage name means that round's stage and `previous` the
model of the round before (round 1: the loop's `from`). Outside the loop, `online` means the last round's model and,
in an eval stage's `models`, `online.*` every round's model. A round's stages depend only on the rounds before it,
so raising `rounds` re-runs none of the rounds already made.
"""

from __future__ import annotations

import copy
from typing import Any

from alignflow.config.base import ConfigError

PREVIOUS = "previous"
MODEL_KINDS = ("sft", "rm", "dpo", "kto", "rl")
LOOP_KEYS = {"rounds", "from", "mix_previous", "stages"}


def is_loop(section: Any) -> bool:
    return isinstance(section, dict) and "rounds" in section and "kind" not in section


def round_name(loop: str, k: int, stage: str) -> str:
    return f"{loop}.{k}.{stage}"


def _kind(name: str, section: dict, kinds: list[str]) -> str | None:
    return section.get("kind", name if name in kinds else None)


def _refs(section: dict) -> list[tuple[tuple[str, ...], Any]]:
    """(path, value) of every field of a stage section that names another stage."""
    out = []
    for path in (("from",), ("reward_model",), ("reward", "model"), ("data",), ("data", "stage"), ("models",)):
        node: Any = section
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            out.append((path, node))
    return out


def _set(section: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        section = section[part]
    section[path[-1]] = value


def _names(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


def expand_loop(loop: str, spec: dict, kinds: list[str], where: str) -> tuple[dict[str, dict], list[str]]:
    """The loop's stages, named by round, and each round's model stage (in round order)."""
    unknown = sorted(set(spec) - LOOP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: {loop}: unknown key(s) {unknown} of a loop (valid: {', '.join(sorted(LOOP_KEYS))})")
    rounds, sub = spec.get("rounds"), spec.get("stages")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ConfigError(f"{where}: {loop}.rounds: a whole number of rounds >= 1, got {rounds!r}")
    if not isinstance(sub, dict) or not sub or not all(isinstance(v, dict) for v in sub.values()):
        raise ConfigError(f"{where}: {loop}.stages: the stages of one round, a mapping of name -> stage settings")
    used = {n for s in sub.values() for _, v in _refs(s) for n in _names(v) if n in sub}
    finals = [n for n, s in sub.items() if _kind(n, s, kinds) in MODEL_KINDS and n not in used]
    if len(finals) != 1:
        raise ConfigError(f"{where}: {loop}.stages: a round makes one model that the next round starts from (a model stage "
                          f"no other stage of the round uses); found {len(finals)}: {finals}")
    start = spec.get("from")
    out: dict[str, dict] = {}
    for k in range(1, rounds + 1):
        previous = start if k == 1 else round_name(loop, k - 1, finals[0])
        for name, section in sub.items():
            section = copy.deepcopy(section)
            kind = _kind(name, section, kinds)
            if kind is not None:
                section["kind"] = kind
            for path, value in _refs(section):
                section_value = [_resolve(loop, k, n, sub, previous, where, spec.get("mix_previous") and path == ("data", "stage"))
                                 for n in _names(value)]
                flat = [n for group in section_value for n in group]
                _set(section, path, flat if isinstance(value, list) or len(flat) > 1 else flat[0])
            out[round_name(loop, k, name)] = section
    return out, [round_name(loop, k, finals[0]) for k in range(1, rounds + 1)]


def _resolve(loop: str, k: int, name: Any, sub: dict, previous: str | None, where: str, mix: bool) -> list:
    if name == PREVIOUS:
        if previous is None:
            raise ConfigError(f"{where}: {loop}: a stage starts from `previous`, which in round 1 is the loop's `from`: set {loop}.from")
        return [previous]
    if name in sub:
        return [round_name(loop, j, name) for j in range(1, k + 1)] if mix else [round_name(loop, k, name)]
    return [name]  # a stage outside the loop


def point_at_rounds(stages: dict[str, dict], models: dict[str, list[str]]) -> None:
    """Outside a loop, `loop` means its last round's model and, in an eval's models, `loop.*` every round's (in place)."""
    for section in stages.values():
        for path, value in _refs(section):
            names = []
            for n in _names(value):
                if isinstance(n, str) and n.endswith(".*") and n[:-2] in models and path == ("models",):
                    names += models[n[:-2]]
                else:
                    names.append(models[n][-1] if isinstance(n, str) and n in models else n)
            _set(section, path, names if isinstance(value, list) else names[0])
