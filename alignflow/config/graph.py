"""The pipeline: named stages and the edges between them, checked at load.

A stage names its inputs by role: `from` (the model it starts from), `reward_model` (an rl or eval
stage's rm stage), `model:<name>` (each model an eval stage compares) and `reference:<name>` (the model
an evaluated policy started from, for its implicit DPO reward). Names never enter a cache key: the
inputs' published digests do, under their roles.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Union

from pydantic import Field, model_validator

from alignflow.config.base import (NOT_RESULT, ConfigError, Frozen, RayConfig, StorageConfig, TrackingConfig,
                                   result_fields, stable_hash)
from alignflow.stages.dpo.config import DPOConfig
from alignflow.stages.eval.config import EvalConfig
from alignflow.stages.generate.config import GenerateConfig
from alignflow.stages.kto.config import KTOConfig
from alignflow.stages.label.config import LabelConfig
from alignflow.stages.rl.config import RLConfig
from alignflow.stages.rm.config import RMConfig
from alignflow.stages.select.config import SelectConfig
from alignflow.stages.sft.config import SFTConfig

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # a folder name and an MLflow run / model name


class StageKind(str, enum.Enum):
    SFT = "sft"
    RM = "rm"
    DPO = "dpo"
    KTO = "kto"
    RL = "rl"
    EVAL = "eval"
    GENERATE = "generate"
    LABEL = "label"
    SELECT = "select"

    @property
    def module(self) -> str:
        return f"alignflow.stages.{self.value}"

    @property
    def makes_model(self) -> bool:
        return self in (StageKind.SFT, StageKind.RM, StageKind.DPO, StageKind.KTO, StageKind.RL)

    @property
    def makes_dataset(self) -> bool:
        """Publishes rows (`data/*.parquet`) that a training stage reads as its `data.stage`."""
        return self in (StageKind.GENERATE, StageKind.LABEL, StageKind.SELECT)

    @property
    def loads_model(self) -> bool:
        """Starts from a model: `from:` a stage or `model.name_or_path`."""
        return self.makes_model or self == StageKind.GENERATE

    @property
    def is_policy(self) -> bool:
        """Its model generates text: what a policy stage may start `from`."""
        return self in (StageKind.SFT, StageKind.DPO, StageKind.KTO, StageKind.RL)

    @property
    def own_workers(self) -> bool:
        """Trains in worker groups it places in Ray itself (rl), not in the job's own process."""
        return self in (StageKind.RL, StageKind.GENERATE)


StageSection = Annotated[Union[SFTConfig, RMConfig, DPOConfig, KTOConfig, RLConfig, EvalConfig, GenerateConfig, LabelConfig,
                               SelectConfig], Field(discriminator="kind")]
# What each dataset role takes: (the option that names it, the kinds it accepts)
DATASET_INPUTS = {StageKind.LABEL: ("data", (StageKind.GENERATE,)), StageKind.SELECT: ("data", (StageKind.LABEL,))}


class GraphError(ValueError):
    """A graph mistake; `loc` is the config path it is about (for the file line)."""

    def __init__(self, message: str, loc: tuple[str, ...]):
        super().__init__(message)
        self.loc = loc


class GateConfig(Frozen):
    """The rule a registered model must meet, read from an eval stage's table: `metric` >= `min`, and
    >= the `baseline` model's value + `min_gain`."""

    eval: str = Field(..., description="The eval stage whose table is read (it must list the registered stage).")
    metric: str = Field("eval/accuracy", description="A metric of that table, e.g. eval/accuracy, eval/reward, eval/nll.")
    min: float | None = Field(None, description="Absolute floor.")
    baseline: str | None = Field(None, description="A model stage of the same eval table to beat.")
    min_gain: float = Field(0.0, description="Margin over the baseline (negative: may lose at most this much).")
    lower_is_better: bool = Field(False, description="For metrics such as eval/nll.")
    fail: bool = Field(False, description="A rejected candidate fails the flow run (else it ends Completed, 'not promoted').")


class RegisterConfig(Frozen):
    """The handoff: which stage's model becomes a Model Registry version, with alias `candidate` when it passes the gate."""

    enabled: bool = True
    stage: str | None = Field(None, description="Unset: the graph's one final model (a model stage no other model stage uses).")
    name: str | None = Field(None, pattern=NAME_PATTERN, description="Registered model name; unset: `<config name>-<stage>`, "
                             "so each recipe's final model has a name (and a `candidate`) of its own.")
    gate: GateConfig | None = None


class PipelineConfig(Frozen):
    name: str = Field("alignment", pattern=NAME_PATTERN, json_schema_extra=NOT_RESULT)
    storage: StorageConfig = Field(default_factory=StorageConfig, json_schema_extra=NOT_RESULT)
    ray: RayConfig = Field(default_factory=RayConfig, json_schema_extra=NOT_RESULT)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, json_schema_extra=NOT_RESULT)
    registration: RegisterConfig = Field(default_factory=RegisterConfig, alias="register", json_schema_extra=NOT_RESULT)
    stages: dict[str, StageSection] = Field(..., min_length=1)

    # ------------------------------------------------------------------ queries

    def section(self, name: str) -> Any:
        if name not in self.stages:
            raise ConfigError(f"no stage named {name!r} in this config (stages: {', '.join(self.stages)})")
        return self.stages[name]

    def kind(self, name: str) -> StageKind:
        return StageKind(self.section(name).kind)

    def inputs_of(self, name: str) -> dict[str, str]:
        """Input role -> upstream stage name."""
        section = self.section(name)
        edges = dict(section.edges())
        if isinstance(section, EvalConfig) and section.pairs is not None:
            for model in section.models:  # a policy's implicit reward is measured against the model it started from
                up = self.stages.get(model)
                if up is not None and StageKind(up.kind).is_policy and up.from_:
                    edges[f"reference:{model}"] = up.from_
        return edges

    def order(self) -> list[str]:
        """Stages in dependency order (declaration order among stages that are ready together)."""
        done: list[str] = []
        while len(done) < len(self.stages):
            ready = [n for n in self.stages if n not in done and set(self.inputs_of(n).values()) <= set(done)]
            done.append(ready[0])  # a cycle was refused at load
        return done

    def needed_for(self, target: str) -> list[str]:
        """`target` and every stage it needs, in dependency order."""
        need, todo = set(), [target]
        while todo:
            name = todo.pop()
            if name not in need:
                need.add(name)
                todo.extend(self.inputs_of(name).values())
        return [n for n in self.order() if n in need]

    def final_models(self) -> list[str]:
        """Model stages that no other stage but an eval starts from, scores with or samples from."""
        used = {up for n in self.stages if self.kind(n) != StageKind.EVAL for up in self.inputs_of(n).values()}
        return [n for n in self.stages if self.kind(n).makes_model and n not in used]

    @property
    def registered_stage(self) -> str | None:
        if not self.registration.enabled:
            return None
        return self.registration.stage or self.final_models()[0]

    @property
    def registered_name(self) -> str | None:
        stage = self.registered_stage
        return None if stage is None else self.registration.name or f"{self.name}-{stage}"

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    # ------------------------------------------------------------------ checks

    @model_validator(mode="after")
    def _valid_graph(self) -> "PipelineConfig":
        for name in self.stages:
            if not re.match(NAME_PATTERN, name) or name in ("stages", "kind"):
                raise GraphError(f"stage name {name!r} is not usable as a folder and MLflow name: letters, digits, "
                                 "`_`, `.` and `-`, starting with a letter or digit, at most 64", (name,))
        for name in self.stages:
            self._check_edges(name)
        self._check_cycles()
        self._check_register()
        return self

    def _check_edges(self, name: str) -> None:
        section, kind = self.stages[name], StageKind(self.stages[name].kind)
        for role, up in section.edges().items():
            field = {"from": "from", "reward_model": "reward.model" if kind == StageKind.RL else "reward_model"}.get(role, "models")
            if role.split(":")[0] == "data":
                field = "data" if kind in DATASET_INPUTS else "data.stage"
            if up not in self.stages:
                raise GraphError(f"{field}: no stage named {up!r} (stages: {', '.join(self.stages)})", (name, field.split(".")[0]))
            up_kind = StageKind(self.stages[up].kind)
            if field == "data.stage" and not up_kind.makes_dataset:
                raise GraphError(f"data.stage: {up!r} is a {up_kind.value} stage; a training stage's rows come from a dataset "
                                 "stage (generate, label, select) or a file (`data.path`)", (name, "data"))
            if field == "data" and up_kind not in DATASET_INPUTS[kind][1]:
                wants = " or ".join(k.value for k in DATASET_INPUTS[kind][1])
                raise GraphError(f"data: {up!r} is a {up_kind.value} stage; a {kind.value} stage reads a {wants} stage", (name, "data"))
            samples = kind.is_policy or kind == StageKind.GENERATE  # its model generates text
            if role == "from" and not (up_kind.is_policy if samples else up_kind.makes_model):
                wants = "a policy stage (sft, dpo, kto, rl)" if samples else "a model stage"
                raise GraphError(f"from: {up!r} is a {up_kind.value} stage; a {kind.value} stage starts from {wants}", (name, "from"))
            if role == "reward_model" and up_kind != StageKind.RM:
                raise GraphError(f"{field}: {up!r} is a {up_kind.value} stage, not an rm stage", (name, field.split(".")[0]))
            if role.startswith("model:") and not up_kind.makes_model:
                raise GraphError(f"models: {up!r} is an eval stage; an eval compares model stages", (name, "models"))
        if kind.loads_model:
            if section.from_ and section.model.name_or_path:
                raise GraphError(f"two starting models: from: {section.from_!r} and model.name_or_path="
                                 f"{section.model.name_or_path!r}; give one", (name, "model"))
            if not section.from_ and not section.model.name_or_path:
                raise GraphError("cannot be reached from any model: give `from: <stage>` or `model.name_or_path`", (name,))

    def _check_cycles(self) -> None:
        state: dict[str, str] = {}

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "open":
                cycle = path[path.index(name):] + [name]
                raise GraphError(f"the stages make a cycle: {' -> '.join(cycle)}", (name,))
            state[name] = "open"
            for up in self.inputs_of(name).values():
                visit(up, path + [name])
            state[name] = "done"

        for name in self.stages:
            visit(name, [])

    def _check_register(self) -> None:
        reg = self.registration
        if not reg.enabled:
            return
        if reg.stage is not None:
            if reg.stage not in self.stages or not self.kind(reg.stage).makes_model:
                raise GraphError(f"register.stage: {reg.stage!r} is not a model stage of this config", ("register", "stage"))
        elif len(self.final_models()) != 1:
            raise GraphError(f"register.stage: the graph has {len(self.final_models())} final models "
                             f"({', '.join(self.final_models()) or 'none'}); say which is registered, or set register.enabled: "
                             "false", ("register",))
        gate, stage = reg.gate, reg.stage or self.final_models()[0]
        if gate is None:
            return
        evaluated = self.stages.get(gate.eval)
        if not isinstance(evaluated, EvalConfig):
            raise GraphError(f"register.gate.eval: {gate.eval!r} is not an eval stage of this config", ("register", "gate", "eval"))
        for what, model in (("the registered stage", stage), ("gate.baseline", gate.baseline)):
            if model is not None and model not in evaluated.models:
                raise GraphError(f"register.gate: {what} {model!r} is not among eval stage {gate.eval!r}'s models "
                                 f"({', '.join(evaluated.models)})", ("register", "gate"))
        if gate.min is None and gate.baseline is None:
            raise GraphError("register.gate needs a rule: `min` (a floor), `baseline` (a stage to beat), or both", ("register", "gate"))
