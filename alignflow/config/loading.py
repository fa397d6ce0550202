"""Loading a pipeline config: YAML (local or a storage URI), `base:` files, per-kind `defaults:`,
`--set` overrides, and errors that name the file line, the stage and the field.

The file's top level holds the run settings (`name`, `storage`, `ray`, `tracking`, `register`),
optional `base:` and `defaults:`, and one key per stage: its name. A stage's `kind` defaults to its name
when that is a kind (`sft:` is an sft stage), so `--set dpo.from=sft` adds a dpo stage to a graph.
`defaults: {dpo: {...}}` is merged under every stage of that kind.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from alignflow.config.base import ConfigError
from alignflow.config.graph import PipelineConfig, StageKind
from alignflow.config.rounds import expand_loop, is_loop, point_at_rounds, round_name
from alignflow.stages.common.formats import closest

SETTINGS = ("name", "storage", "ray", "tracking", "register")
# Keys that TRL or OpenRLHF users write: (the key that does their job here, what to say), said where that key is valid.
OTHER_TOOLS_KEYS = {
    "apply_chat_template": ("format", "in alignflow conversations are detected by themselves, and `format: chat` renders "
                                      "text columns as chat turns"),
    "dataset_text_field": ("input_key", "set input_key and output_key (or messages_key) to the columns"),
    "prompt_template": ("input_template", "set input_template"),
    "learning_rate": ("lr", "did you mean 'lr'?"),
}
RETIRED = {
    "pipeline": "stages are now a graph in the config: one key per stage with `from:` edges (README: writing graphs)",
    "stop_after": "use `alignflow run --until STAGE`",
}


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key.path=value")
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):
        try:
            value = float(value)  # YAML 1.1 reads `1e-4` as a string
        except ValueError:
            pass
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A new dict with overrides applied; the input is left untouched."""
    data = json.loads(json.dumps(raw))
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data



def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Parse a YAML file (local path or storage URI such as s3://…) plus `--set` overrides.
    A file may start from another with `base: other.yaml` (relative to it): its keys are
    merged key by key over the base's."""
    text = _read_config_text(str(path))
    raw = _with_base(_parse_yaml(text, str(path)), str(path), seen=(str(path),))
    data = apply_overrides(raw, overrides or [])
    lines = _yaml_lines(text)
    try:
        return PipelineConfig.model_validate(expand(data, str(path), lines))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path), lines, overrides or [])) from None


def expand(data: dict, source: str = "<config>", lines: dict[tuple, int] | None = None) -> dict:
    """The file's layout -> PipelineConfig's: stage keys gathered under `stages`, each with its kind and
    its kind's defaults merged under it."""
    lines = lines or {}
    where = lambda *loc: f"{source}:{lines[loc]}" if loc in lines else source  # noqa: E731
    for key, why in RETIRED.items():
        if key in data:
            raise ConfigError(f"{where(key)}: `{key}:` is no longer a setting: {why}")
    kinds = [k.value for k in StageKind]
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict) or any(k not in kinds for k in defaults):
        bad = [k for k in defaults if k not in kinds] if isinstance(defaults, dict) else defaults
        raise ConfigError(f"{where('defaults')}: defaults: keys are stage kinds ({', '.join(kinds)}), got {bad!r}")
    out: dict[str, Any] = {k: data[k] for k in SETTINGS if k in data}
    stages = dict(data.get("stages") or {})  # the dumped form (dump_config) already nests them
    loops: dict[str, list[str]] = {}  # loop name -> each round's model stage
    for name, section in data.items():
        if name in (*SETTINGS, "defaults", "stages"):
            continue
        if is_loop(section):
            expanded, loops[name] = expand_loop(name, section, kinds, where(name))
            for loc, line in list(lines.items()):  # errors in a round's stage point at the loop's line for it
                if loc[:2] == (name, "stages") and len(loc) > 2:
                    for k in range(1, len(loops[name]) + 1):
                        lines.setdefault((round_name(name, k, loc[2]), *loc[3:]), line)
            stages.update(expanded)
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{where(name)}: {name}: a stage is a mapping of its settings (kind, from, ...), got {section!r}; "
                              f"top-level settings are {', '.join(SETTINGS)}")
        stages[name] = section
    for name, section in stages.items():
        kind = section.get("kind", name if name in kinds else None)
        if kind not in kinds:
            shown = f"kind {kind!r} is unknown" if kind is not None else "no kind given and the name is not a kind"
            raise ConfigError(f"{where(name, 'kind') if 'kind' in section else where(name)}: stage {name!r}: {shown}; "
                              f"set `kind:` to one of {', '.join(kinds)}")
        stages[name] = _merge(_defaults_for(defaults.get(kind) or {}, section), {**section, "kind": kind})
    if loops:
        point_at_rounds(stages, loops)
        register = out.get("register")
        if isinstance(register, dict) and register.get("stage") in loops:
            out["register"] = {**register, "stage": loops[register["stage"]][-1]}
    out["stages"] = stages
    return out


def _defaults_for(defaults: dict, section: dict) -> dict:
    """A kind's defaults under one stage: a stage that says where its rows come from (`data.path` or `data.stage`)
    does not also get the other from the defaults."""
    own = section.get("data") if isinstance(section.get("data"), dict) else {}
    given = [k for k in ("path", "stage") if k in own]
    if not given or not isinstance(defaults.get("data"), dict):
        return defaults
    return {**defaults, "data": {k: v for k, v in defaults["data"].items() if k not in ("path", "stage")}}


def _parse_yaml(text: str, path: str) -> dict:
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def _with_base(raw: dict, path: str, seen: tuple[str, ...]) -> dict:
    if "base" not in raw:
        return raw
    base = raw.pop("base")
    base_path = base if "://" in base or Path(base).is_absolute() else str(Path(path.removeprefix("file://")).parent / base)
    if base_path in seen:
        raise ConfigError(f"{path}: `base: {base}` makes a cycle ({' -> '.join(seen)})")
    parent = _with_base(_parse_yaml(_read_config_text(base_path), base_path), base_path, seen + (base_path,))
    return _merge(parent, raw)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_config_text(path: str) -> str:
    if "://" in path and not path.startswith("file://"):
        from alignflow.infra import storage

        if not storage.exists(path):
            raise ConfigError(f"config file not found: {path}")
        return storage.read_text(path)
    local = Path(path.removeprefix("file://"))
    if not local.exists():
        raise ConfigError(f"config file not found: {local}")
    return local.read_text()



def format_validation_error(exc: ValidationError, source: str, lines: dict[tuple, int], overrides: list[str]) -> str:
    msgs = []
    overridden = {tuple(parse_override(o)[0]): o for o in overrides}
    kinds = {k.value for k in StageKind}
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        graph_loc = getattr((err.get("ctx") or {}).get("error"), "loc", None)
        if graph_loc is not None:  # a graph check: it knows which stage and field it is about
            loc = tuple(graph_loc)
        elif loc[:1] == ("stages",):  # the file has stages at the top level; pydantic adds the union's tag
            loc = loc[1:2] + loc[3:] if len(loc) > 2 and loc[2] in kinds else loc[1:]
        field = ".".join(loc) or "<root>"
        where = source
        from_override = [o for path, o in overridden.items() if path[: len(loc)] == loc or loc[: len(path)] == path]
        if from_override:
            where = f"--set {from_override[-1]}"
        else:
            for n in range(len(loc), 0, -1):  # nearest enclosing key that has a line
                if loc[:n] in lines:
                    where = f"{source}:{lines[loc[:n]]}"
                    break
        value = err.get("input")
        # A whole section (or the whole file, at the root) is no value worth repeating.
        shown = "" if graph_loc is not None or err["type"] == "missing" or not loc or isinstance(value, dict) else f" (got {value!r})"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            valid = _valid_keys(tuple(str(p) for p in err["loc"]))
            target, said = OTHER_TOOLS_KEYS.get(loc[-1], (None, ""))
            hint = f"; {said}" if target in valid else closest(loc[-1], valid)
            msg = f"unknown key{hint}" if hint else f"unknown key (valid here: {', '.join(valid)})"
        msgs.append(f"{where}: {field}: {msg}{shown}" if graph_loc is None else f"{where}: {loc[0]}: {msg}")
    return "invalid config:\n  " + "\n  ".join(msgs)


def _valid_keys(loc: tuple[str, ...]) -> list[str]:
    """The keys a config section allows, for the section that holds the last part of a pydantic error location."""
    current: list = [PipelineConfig]
    for part in loc[:-1]:
        found: list = []
        for c in current:
            if isinstance(c, tuple):  # a dict key: any name, its value's type
                found += _members(c[1])
            elif part in c.model_fields:
                found += _members(c.model_fields[part].annotation)
            elif "kind" in c.model_fields and c.model_fields["kind"].default == part:  # a tagged union's tag
                found.append(c)
        current = found
    return sorted({f.alias or k for c in current if not isinstance(c, tuple) for k, f in c.model_fields.items()})


def _members(tp: Any) -> list:
    """The config classes an annotation allows (through Optional, unions, Annotated); a dict as ("dict", value type)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in _members(arg)]
    if origin is dict:
        return [("dict", get_args(tp)[1])]
    return [tp] if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _yaml_lines(text: str) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line number."""
    out: dict[tuple, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return out

    def walk(node: Any, prefix: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = prefix + (str(k.value),)
                out[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[prefix + (str(i),)] = v.start_mark.line + 1
                walk(v, prefix + (str(i),))

    walk(root, ())
    return out



def dump_config(cfg: PipelineConfig) -> str:
    """The resolved config as YAML that `load_config` reads back: stages at the top level, kinds explicit."""
    data = cfg.model_dump(mode="json", by_alias=True)
    stages = data.pop("stages")
    return yaml.safe_dump({**data, **stages}, sort_keys=False)
