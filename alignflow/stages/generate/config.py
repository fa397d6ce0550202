"""The generate stage's config (torch-free): N sampled completions per prompt from a model, published as a dataset."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import (NOT_RESULT, Frozen, GenerationConfig, ModelConfig, PromptDataConfig, file_only, result_fields,
                                   stable_hash)


class GenerateConfig(Frozen):
    """Samples `generation.n_samples_per_prompt` completions for every row of `prompts` (none held out; `max_samples` caps
    the rows) from the model of a policy stage (`from:`) or `model.name_or_path`, with `generation.engines` rollout engines
    (`hf` or `vllm`) as Ray actors. Prompts are cut into shards of `shard_size`; each finished shard is stored at once,
    so a killed job resumes at the first unfinished shard. Shard k samples with seed `seed + k` (its prompts spread over
    the engines as the RL stage spreads them), so a resumed run publishes the rows an uninterrupted one would."""

    kind: Literal["generate"] = "generate"
    from_: str | None = Field(None, alias="from", description="The policy stage whose model samples.", json_schema_extra=NOT_RESULT)
    model: ModelConfig = ModelConfig()
    prompts: PromptDataConfig
    generation: GenerationConfig = GenerationConfig()
    shard_size: int = Field(64, ge=1, description="Prompts per shard: what a killed job resumes at.")
    seed: int = 42
    cpus_per_engine: float = Field(1, gt=0, description="Ray CPUs each engine takes.", json_schema_extra=NOT_RESULT)

    @model_validator(mode="after")
    def _prompts_from_a_file(self) -> "GenerateConfig":
        file_only(self.prompts, "prompts")
        if self.generation.weight_sync != "full":
            raise ValueError("generation.weight_sync is an rl option (a generate stage trains nothing)")
        return self

    def edges(self) -> dict[str, str]:
        return {"from": self.from_} if self.from_ else {}

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    def sources(self) -> dict[str, str]:
        return {"prompts": self.prompts.path}
