"""The eval stage's config (torch-free): which model stages to compare, on what held-out data, by which metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import (NOT_RESULT, Frozen, GenerationConfig, PreferenceDataConfig, PromptDataConfig,
                                   file_only, python_object_spec, result_fields, stable_hash)
from alignflow.stages.rl.config import AgentConfig
from alignflow.stages.sft.config import DataConfig


class EvalConfig(Frozen):
    """Evaluates model stages side by side. Every row of each data file is a held-out row (`eval_path` and
    `eval_fraction` are not used); `max_samples` caps the rows. Each metric runs when its section is set:
    - `verifier`: accuracy of the reward function (1 = right) over greedy answers to `prompts`, and over
      `samples` sampled answers per prompt when > 0, generated with `generation` (engine hf or vllm);
    - `reward_model`: mean score of the greedy answers under that rm stage;
    - `pairs`: pairwise accuracy on held-out preference pairs: a reward model's scores for rm stages,
      a policy's implicit DPO reward log π(y|x) - log π_ref(y|x) against the model it started from;
    - `nll`: held-out NLL per response token on SFT-format rows;
    - `agent`: the RL stage's agent function, one greedy episode per prompt against an OpenAI-compatible endpoint
      in front of the model: the mean reward, and the means of the metrics the agent returns.
    The models' names label the table, so they are part of this stage's cache key."""

    kind: Literal["eval"] = "eval"
    models: tuple[str, ...] = Field(..., min_length=1, description="The model stages to evaluate, in table order.")
    prompts: PromptDataConfig | None = Field(None, description="Held-out prompts for `verifier` and `reward_model`.")
    verifier: str | None = Field(None, description="`path/to/file.py:name`: the RL reward-function contract; a sample is "
                                                   "right when it returns >= 1.", json_schema_extra=NOT_RESULT)
    samples: int = Field(0, ge=0, description="Sampled answers per prompt besides the greedy one (temperature from `generation`).")
    generation: GenerationConfig = GenerationConfig()
    reward_model: str | None = Field(None, description="An rm stage that scores the greedy answers.", json_schema_extra=NOT_RESULT)
    pairs: PreferenceDataConfig | None = None
    nll: DataConfig | None = None
    agent: AgentConfig | None = Field(None, description="An agent function (the rl stage's `agent` contract) run once per "
                                                        "prompt against each model, greedy.")
    micro_batch_size: int = Field(16, ge=1, description="Rows per forward pass.", json_schema_extra=NOT_RESULT)
    seed: int = 42

    @field_validator("verifier")
    @classmethod
    def _verifier_file_exists(cls, v: str | None) -> str | None:
        return v if v is None else python_object_spec(v, "verifier", "function_name")

    @model_validator(mode="after")
    def _something_to_measure(self) -> "EvalConfig":
        for option in ("prompts", "pairs", "nll"):
            file_only(getattr(self, option), option)
        if not (self.verifier or self.reward_model or self.pairs or self.nll or self.agent):
            raise ValueError("an eval stage needs at least one metric: `verifier`, `reward_model`, `pairs`, `nll` or `agent`")
        if self.answers and self.prompts is None:
            raise ValueError("`verifier`, `reward_model` and `agent` answer held-out prompts: set `prompts: {path: ...}`")
        if self.samples and not self.verifier:
            raise ValueError(f"samples={self.samples} are scored by the verifier: set `verifier: file.py:function`")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"models lists a stage twice: {list(self.models)}")
        return self

    @property
    def answers(self) -> bool:
        """Whether the models generate (answers to `prompts`, or an agent's episodes)."""
        return bool(self.verifier or self.reward_model or self.agent)

    def edges(self) -> dict[str, str]:
        """Input role -> stage: each evaluated model (`model:<name>`) and the scoring reward model."""
        return {**{f"model:{m}": m for m in self.models}, **({"reward_model": self.reward_model} if self.reward_model else {})}

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    def sources(self) -> dict[str, str]:
        out = {}
        for name, section in (("prompts", self.prompts), ("pairs", self.pairs), ("nll", self.nll)):
            if section is not None:
                out[name] = section.path
        if self.verifier:
            path, _, name = self.verifier.rpartition(":")
            out[f"verifier:{name}"] = path
        if self.agent:
            path, _, name = self.agent.path.rpartition(":")
            out[f"agent:{name}"] = path  # its content, not its path, is in the cache key
        return out
