"""Typed configuration: one model per stage, shared parts by composition.

A config is parsed once (YAML + `--set` overrides), validated, and then frozen:
derived values live in locals of the code that needs them. Errors name the
file, the line (when the value came from YAML), the field path and the value.

`config_hash()` covers only the fields that change a stage's result: fields
marked `result=False` (run names, logging and checkpoint cadence, where the
output goes) are left out, and so are data paths, whose content enters the
cache key as a fingerprint instead (see `stages.common.data.fingerprint`).
"""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NOT_RESULT = {"result": False}  # json_schema_extra marker: field left out of config_hash()
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class ConfigError(ValueError):
    """A config that cannot be used, with where and why."""


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


# --------------------------------------------------------------------------- shared parts


class ModelConfig(Frozen):
    name_or_path: str = Field("builtin:tiny", description="`builtin:tiny`, `builtin:small`, a local HF folder, or a hub name.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype the weights are loaded and trained in.")
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    gradient_checkpointing: bool = False


class BaseModelConfig(ModelConfig):
    """The model a later stage starts from. Unset: the output of the stage before it in the
    pipeline (or `--input sft=URI` when the stage is run by hand)."""

    name_or_path: str | None = Field(None, description="Unset: the upstream stage's published model.")


class DataSource(Frozen):
    """Where a stage's rows come from and how they are cut; every stage's data config extends it."""

    path: str = Field(..., description="JSONL/Parquet file, a local HF dataset folder, or a `datasets` name.", json_schema_extra=NOT_RESULT)
    split: str = "train"
    eval_path: str | None = Field(None, description="Held-out file; without it `eval_fraction` of the rows is held out.", json_schema_extra=NOT_RESULT)
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    max_len: int = Field(128, ge=8, description="Tokens per sample (or per packed row); longer responses are truncated.")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Bad rows stop the run, or are skipped and counted.")
    max_samples: int | None = Field(None, ge=1)

    @field_validator("path", "eval_path")
    @classmethod
    def _local_paths_exist(cls, v: str | None) -> str | None:
        # A relative local path is made absolute here, at parse time, so the resolved
        # config travels to a Ray job unchanged; a missing file fails before any work.
        if v is None or "://" in v:
            return v
        p = Path(v).expanduser()
        if p.exists():
            return str(p.resolve())
        if p.suffix in DATA_SUFFIXES or v.startswith((".", "/", "~")):
            raise ValueError(f"data file not found: {v!r} (relative paths are resolved against {Path.cwd()})")
        return v  # a `datasets` hub name


class DataConfig(DataSource):
    """SFT rows: prompt/response columns, or a chat `messages` column."""

    input_key: str = Field("prompt", description="Prompt column (input/output format).")
    output_key: str = Field("response", description="Response column (input/output format).")
    messages_key: str | None = Field(None, description="Column with a chat `messages` list; overrides input/output keys.")
    packing: bool = Field(False, description="Pack samples into rows of max_len; attention is block-diagonal per sample.")


class PreferenceDataConfig(DataSource):
    """Pairs for rm and dpo: a prompt, a chosen and a rejected response (plain strings)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str | None = Field(None, description="Optional per-pair margin column (rm with the sigmoid loss).")


class KTODataConfig(DataSource):
    """Unpaired rows for kto: a prompt, a completion and a boolean label (true = desirable)."""

    prompt_key: str = "prompt"
    completion_key: str = "completion"
    label_key: str = "label"


class OptimConfig(Frozen):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 disables clipping.")


class BatchConfig(Frozen):
    global_batch_size: int = Field(32, ge=1, description="Samples (or packed rows) per optimizer step, over all workers.")
    micro_batch_size: int = Field(8, ge=1, description="Samples per forward/backward on one worker.")
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (caps epochs).")
    seed: int = 42


class DeepSpeedConfig(Frozen):
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: bool = False
    precision: Literal["fp32", "bf16"] = "fp32"


class CheckpointConfig(Frozen):
    every_steps: int = Field(50, ge=1, json_schema_extra=NOT_RESULT)
    keep_last: int = Field(2, ge=1, json_schema_extra=NOT_RESULT)


class LoggingConfig(Frozen):
    log_every: int = Field(10, ge=1, json_schema_extra=NOT_RESULT)
    eval_every: int = Field(50, ge=1, json_schema_extra=NOT_RESULT)
    progress: bool = Field(True, json_schema_extra=NOT_RESULT)


class StorageConfig(Frozen):
    root: str = Field("./outputs", description="Local folder or `s3://bucket/prefix` where stages publish.")

    @field_validator("root")
    @classmethod
    def _absolute_local_root(cls, v: str) -> str:
        return v if "://" in v else str(Path(v).expanduser().resolve())


# --------------------------------------------------------------------------- stages


class Stage(str, enum.Enum):
    SFT = "sft"
    RM = "rm"
    DPO = "dpo"
    KTO = "kto"
    RL = "rl"

    @property
    def module(self) -> str:
        return f"alignflow.stages.{self.value}"

    @property
    def implemented(self) -> bool:
        return self in IMPLEMENTED_STAGES


IMPLEMENTED_STAGES = frozenset({Stage.SFT, Stage.RM, Stage.DPO, Stage.KTO, Stage.RL})


class Pipeline(str, enum.Enum):
    """Which stages run, in order. Each stage's input is the output of the stage before it."""

    SFT = "sft"
    FULL = "full"
    GRPO = "grpo"
    DPO = "dpo"
    KTO = "kto"

    @property
    def stages(self) -> tuple[Stage, ...]:
        return {
            Pipeline.SFT: (Stage.SFT,),
            Pipeline.FULL: (Stage.SFT, Stage.RM, Stage.RL),
            Pipeline.GRPO: (Stage.SFT, Stage.RL),
            Pipeline.DPO: (Stage.SFT, Stage.DPO),
            Pipeline.KTO: (Stage.SFT, Stage.KTO),
        }[self]

    def inputs(self, stage: Stage) -> tuple[Stage, ...]:
        """The earlier stages whose published output `stage` consumes; the first is the model it starts from.
        (RL in `full` starts from SFT and scores with the reward model.)"""
        if stage not in self.stages or stage == self.stages[0]:
            return ()
        if stage == Stage.RL and self == Pipeline.FULL:
            return (Stage.SFT, Stage.RM)
        return (Stage.SFT,)


class Estimator(str, enum.Enum):
    GAE = "gae"  # PPO with a critic (Schulman et al. 2016)
    REINFORCE = "reinforce"  # REINFORCE++ (Hu et al. 2025)
    REINFORCE_BASELINE = "reinforce_baseline"  # REINFORCE++-baseline (Hu et al. 2025)
    RLOO = "rloo"  # Ahmadian et al. 2024
    GROUP_NORM = "group_norm"  # GRPO (Shao et al. 2024)
    DR_GRPO = "dr_grpo"  # Dr. GRPO (Liu et al. 2025)

    @property
    def needs_critic(self) -> bool:
        return self == Estimator.GAE

    @property
    def is_group(self) -> bool:
        """Its baseline comes from the other samples of the same prompt: n_samples_per_prompt >= 2."""
        return self in (Estimator.REINFORCE_BASELINE, Estimator.RLOO, Estimator.GROUP_NORM, Estimator.DR_GRPO)

    @property
    def whitens(self) -> bool:
        """Advantages normalised over the whole batch (REINFORCE++'s global normalisation)."""
        return self in (Estimator.REINFORCE, Estimator.REINFORCE_BASELINE)


class KLEstimator(str, enum.Enum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class RayConfig(Frozen):
    address: str | None = Field(None, description="Ray dashboard/Jobs API URL (http://host:8265) of an existing cluster; "
                                                  "unset: alignflow starts a local head on 127.0.0.1 (or uses ALIGNFLOW_RAY_ADDRESS).")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local head (default: all).")
    job_timeout_s: int = Field(6 * 3600, ge=1, description="A stage job running longer is stopped and failed.")
    retries: int = Field(2, ge=0, description="Retries of a stage whose job died for a reason a retry can fix.")
    retry_delay_s: int = Field(5, ge=0)


class TrackingConfig(Frozen):
    uri: str | None = Field(None, description="MLflow tracking URI; unset: MLFLOW_TRACKING_URI, else a local sqlite store.")
    experiment: str = "alignflow"
    register_model: bool = Field(True, description="Register the final model in the MLflow Model Registry (alias `candidate`).")


class TrainingSection(Frozen):
    """What every training stage has: model, optimizer, batch, DeepSpeed, checkpoints, logging."""

    model: ModelConfig = ModelConfig()
    data: DataSource  # each stage narrows it to its own rows
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _batch_divides(self) -> "TrainingSection":
        if self.batch.global_batch_size % self.batch.micro_batch_size:
            raise ValueError(
                f"batch.global_batch_size ({self.batch.global_batch_size}) must be a multiple of "
                f"batch.micro_batch_size ({self.batch.micro_batch_size})"
            )
        return self

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    def sources(self) -> dict[str, str]:
        """Named files the result depends on (their content enters the cache key, not their paths)."""
        return {"data": self.data.path, **({"eval_data": self.data.eval_path} if self.data.eval_path else {})}


class SFTConfig(TrainingSection):
    data: DataConfig


class RMConfig(TrainingSection):
    """Reward model: a causal LM backbone with a scalar head, trained on preference pairs."""

    model: BaseModelConfig = BaseModelConfig()
    data: PreferenceDataConfig
    loss: Literal["sigmoid", "logexp"] = Field("sigmoid", description="-log σ(r_c - r_r - margin) or log(1 + exp(r_r - r_c)).")

    @model_validator(mode="after")
    def _margin_needs_sigmoid(self) -> "RMConfig":
        if self.data.margin_key and self.loss != "sigmoid":
            raise ValueError(f"data.margin_key={self.data.margin_key!r} needs loss: sigmoid, not {self.loss!r}")
        return self


class DPOConfig(TrainingSection):
    """DPO / cDPO / IPO against a frozen reference (the starting model)."""

    model: BaseModelConfig = BaseModelConfig()
    data: PreferenceDataConfig
    loss: Literal["dpo", "ipo"] = "dpo"
    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL constraint.")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="cDPO: assumed probability that a label is flipped (dpo only).")
    nll_weight: float = Field(0.0, ge=0.0, description="Weight of a token-mean NLL term on the chosen response (0 = off).")

    @model_validator(mode="after")
    def _smoothing_needs_dpo(self) -> "DPOConfig":
        if self.label_smoothing and self.loss != "dpo":
            raise ValueError(f"label_smoothing={self.label_smoothing} is cDPO: it needs loss: dpo, not {self.loss!r}")
        return self


class KTOConfig(TrainingSection):
    """KTO on unpaired desirable / undesirable completions."""

    model: BaseModelConfig = BaseModelConfig()
    data: KTODataConfig
    beta: float = Field(0.1, gt=0)
    desirable_weight: float = Field(1.0, gt=0, description="λ_D; the paper advises λ_D·n_D / (λ_U·n_U) in [1, 4/3].")
    undesirable_weight: float = Field(1.0, gt=0, description="λ_U")

    @model_validator(mode="after")
    def _batch_has_a_mismatch(self) -> "KTOConfig":
        if self.batch.global_batch_size < 2:
            raise ValueError("batch.global_batch_size must be >= 2: the KL reference point pairs each prompt with another row's completion")
        return self


class PromptDataConfig(DataSource):
    """Prompts for the rl stage. Every other column of a row (e.g. `answer`) reaches the reward function."""

    prompt_key: str = "prompt"


class GenerationConfig(Frozen):
    """Rollout generation. `hf` is the default: it needs no extra install and is the faster engine for the
    tiny model every CPU config uses; `vllm` is faster from ~25M parameters on, on CPU too, and is the
    engine for GPUs (benchmarks/RESULTS.md)."""

    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout backend: `hf` (transformers, KV cache) or `vllm`.")
    engines: int = Field(1, ge=1, description="Rollout engines (Ray actors); prompts are sharded over them.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine.", json_schema_extra=NOT_RESULT)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM's share of each GPU (weights + KV cache).",
                                          json_schema_extra=NOT_RESULT)
    sleep: bool = Field(False, description="vLLM engines free their GPU memory while the colocated roles train "
                                           "(needs GPUs and workers.colocate: all).", json_schema_extra=NOT_RESULT)
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    stop_token_ids: tuple[int, ...] = Field((), description="Tokens that end a response besides EOS (kept in it).")
    n_samples_per_prompt: int = Field(1, ge=1, description="Responses sampled per prompt (a group, for group estimators).")
    batch_size: int = Field(64, ge=1, description="Sequences per generation call (hf).", json_schema_extra=NOT_RESULT)
    importance_cap: float | None = Field(
        None, gt=0, description="Truncated importance sampling: weight each token's policy loss by "
                                "min(π_trainer/π_engine, cap) when the engine's kernels differ from the trainer's (off: None).")

    @model_validator(mode="after")
    def _engine_options(self) -> "GenerationConfig":
        if self.engine == "hf" and (self.tensor_parallel_size > 1 or self.sleep):
            raise ValueError("generation.tensor_parallel_size and generation.sleep are vLLM options: set generation.engine: vllm")
        return self


def python_object_spec(v: str, what: str, form: str) -> str:
    """`path/to/file.py:name` whose file exists, made absolute (relative paths: against the working directory)."""
    path, sep, name = v.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ValueError(f"{what} {v!r} is not of the form path/to/file.py:{form}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{what} file not found: {path!r} (relative paths are resolved against {Path.cwd()})")
    return f"{file.resolve()}:{name}"


class RewardConfig(Frozen):
    """Where single-turn rewards come from: exactly one of `function` and `model`, unless `rl.environment`
    gives the rewards (then neither)."""

    function: str | None = Field(None, description="`path/to/file.py:name`: called with prompts, completions, their token "
                                                   "ids and the rows' other columns; returns one float per sample.",
                                 json_schema_extra=NOT_RESULT)  # enters the cache key as the file's content hash
    model: bool = Field(False, description="Score with the reward model of the rm stage (pipeline `full`).")
    normalize: bool = Field(True, description="Reward-model scores as (s - mean) / std with the rm stage's stored figures.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's soft overlong penalty: the last N tokens before max_new_tokens.")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty at max_new_tokens, linear over the buffer.")

    @field_validator("function")
    @classmethod
    def _function_file_exists(cls, v: str | None) -> str | None:
        return v if v is None else python_object_spec(v, "reward function", "function_name")


class EnvironmentConfig(Frozen):
    """A multi-turn environment (`stages/rl/executors.py`): the policy answers, the environment replies with an
    observation, a reward and whether the episode is done, for up to `max_turns` answers. Its rewards replace
    `reward.function` / `reward.model`; `reward.overlong_*` still applies, to each answer."""

    path: str = Field(..., description="`path/to/file.py:ClassName`: a class with reset(row) -> observation and "
                                       "step(action) -> (observation, reward, done); one instance per episode.",
                      json_schema_extra=NOT_RESULT)  # enters the cache key as the file's content hash
    max_turns: int = Field(3, ge=1, description="Policy answers per episode at most; the episode ends after the last.")

    @field_validator("path")
    @classmethod
    def _file_exists(cls, v: str) -> str:
        return python_object_spec(v, "environment", "ClassName")


class AdvantageConfig(Frozen):
    estimator: Estimator = Field(Estimator.GROUP_NORM, description="gae | reinforce | reinforce_baseline | rloo | group_norm | dr_grpo")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")


class KLConfig(Frozen):
    coef: float = Field(0.0, ge=0, description="β of the KL to the reference policy (0 = no reference model).")
    placement: Literal["reward", "loss"] = Field("loss", description="Per-token penalty in the reward, or a loss term.")
    estimator: KLEstimator = KLEstimator.K3
    target: float | None = Field(None, gt=0, description="Adapt β toward this KL (Ziegler et al. 2019); unset = fixed.")
    horizon: int = Field(10000, ge=1)


class PolicyLossConfig(Frozen):
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.2, gt=0, description="> clip_low: clip-higher (DAPO).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip bound c for negative advantages.")
    aggregation: Literal["token", "sequence"] = "token"
    entropy_coef: float = Field(0.0, ge=0)
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")


class CriticConfig(Frozen):
    """The value model of PPO (estimator gae): starts from the reward model when there is one, else the SFT model."""

    optim: OptimConfig = OptimConfig()
    value_clip: float | None = Field(0.2, gt=0)


class RolloutConfig(Frozen):
    prompts_per_step: int = Field(16, ge=1, description="Prompts sampled per RL step.")
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal; sample more prompts to refill.")
    max_sampling_rounds: int = Field(3, ge=1, description="Cap on sampling rounds per step with dynamic sampling.")


class WorkersConfig(Frozen):
    """Ray worker groups inside the rl job. `colocate`: `all` roles share every bundle, `pairs` puts actor +
    reference and critic + reward together (rollout apart), `none` gives each role its own bundles."""

    actor: int = Field(1, ge=1)
    critic: int = Field(1, ge=1)
    reference: int = Field(1, ge=1)
    reward: int = Field(1, ge=1)
    cpus_per_worker: float = Field(1, gt=0, json_schema_extra=NOT_RESULT)
    gpus_per_worker: float = Field(0, ge=0, json_schema_extra=NOT_RESULT)
    colocate: Literal["all", "pairs", "none"] = Field("all", json_schema_extra=NOT_RESULT)


class RLConfig(TrainingSection):
    """RL on prompts: PPO (gae, with a critic), GRPO, Dr. GRPO, REINFORCE++(-baseline), RLOO.
    `batch.global_batch_size` counts responses per optimizer step; `batch.max_steps` and `epochs` count RL steps."""

    model: BaseModelConfig = BaseModelConfig()
    data: PromptDataConfig
    generation: GenerationConfig = GenerationConfig()
    reward: RewardConfig = RewardConfig()
    environment: EnvironmentConfig | None = Field(None, description="Multi-turn episodes with this environment; unset: "
                                                                    "one response per sample, scored by `reward`.")
    advantage: AdvantageConfig = AdvantageConfig()
    kl: KLConfig = KLConfig()
    policy: PolicyLossConfig = PolicyLossConfig()
    critic: CriticConfig | None = None
    rollout: RolloutConfig = RolloutConfig()
    workers: WorkersConfig = WorkersConfig()

    @model_validator(mode="after")
    def _one_reward_source(self) -> "RLConfig":
        given = [name for name, on in (("reward.function", bool(self.reward.function)), ("reward.model", self.reward.model),
                                       ("environment", self.environment is not None)) if on]
        if len(given) != 1:
            raise ValueError(f"give exactly one reward source: `reward.function: file.py:name`, `reward.model: true` or "
                             f"`environment: {{path: file.py:ClassName}}` (an environment gives its own rewards); "
                             f"got {', '.join(given) if given else 'none'}")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "RLConfig":
        estimator, n = self.advantage.estimator, self.generation.n_samples_per_prompt
        if estimator.is_group and n < 2:
            raise ValueError(f"advantage.estimator={estimator.value} baselines each sample with the other samples of its "
                             f"prompt: it needs generation.n_samples_per_prompt >= 2, not {n}")
        if estimator.needs_critic and self.critic is None:
            raise ValueError("advantage.estimator=gae needs a critic: add a `critic:` section (or pick a critic-free "
                             "estimator such as group_norm)")
        if self.critic is not None and not estimator.needs_critic:
            raise ValueError(f"a `critic:` section is only used by advantage.estimator=gae, not {estimator.value}")
        samples = self.rollout.prompts_per_step * n
        if samples % self.batch.global_batch_size:
            raise ValueError(f"rollout.prompts_per_step x generation.n_samples_per_prompt = {samples} responses per step "
                             f"must be a multiple of batch.global_batch_size ({self.batch.global_batch_size})")
        if self.generation.sleep and (not self.workers.gpus_per_worker or self.workers.colocate != "all"):
            raise ValueError("generation.sleep frees the vLLM engines' GPU memory while colocated roles train: it needs "
                             f"workers.gpus_per_worker > 0 and workers.colocate: all (got {self.workers.gpus_per_worker} "
                             f"and {self.workers.colocate}); on CPU leave it off")
        return self

    def sources(self) -> dict[str, str]:
        sources = super().sources()
        if self.reward.function:
            path, _, name = self.reward.function.rpartition(":")
            sources[f"reward_function:{name}"] = path  # its content, not its path, is in the cache key
        if self.environment:
            path, _, name = self.environment.path.rpartition(":")
            sources[f"environment:{name}"] = path
        return sources


class PipelineConfig(Frozen):
    name: str = Field("alignment", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", json_schema_extra=NOT_RESULT)
    pipeline: Pipeline = Field(Pipeline.SFT, description="sft | full (SFT -> RM -> PPO) | grpo | dpo | kto")
    storage: StorageConfig = Field(default_factory=StorageConfig, json_schema_extra=NOT_RESULT)
    ray: RayConfig = Field(default_factory=RayConfig, json_schema_extra=NOT_RESULT)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, json_schema_extra=NOT_RESULT)
    stop_after: Stage | None = Field(None, description="Run the pipeline up to and including this stage.", json_schema_extra=NOT_RESULT)
    sft: SFTConfig | None = None
    rm: RMConfig | None = None
    dpo: DPOConfig | None = None
    kto: KTOConfig | None = None
    rl: RLConfig | None = None

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages this config runs: the pipeline's, cut at `stop_after`."""
        stages = self.pipeline.stages
        return stages[: stages.index(self.stop_after) + 1] if self.stop_after in stages else stages

    @model_validator(mode="after")
    def _stages_available(self) -> "PipelineConfig":
        if self.stop_after is not None and self.stop_after not in self.pipeline.stages:
            raise ValueError(f"stop_after={self.stop_after.value!r} is not a stage of pipeline {self.pipeline.value!r} "
                             f"({' -> '.join(s.value for s in self.pipeline.stages)})")
        for stage in self.stages:
            if not stage.implemented:
                done = ", ".join(s.value for s in Stage if s.implemented)
                raise ValueError(
                    f"pipeline {self.pipeline.value!r} needs stage {stage.value!r}, which this version of alignflow "
                    f"does not implement yet (implemented: {done}); `stop_after` runs the stages before it"
                )
            section = getattr(self, stage.value, None)
            if section is None:
                raise ValueError(f"pipeline {self.pipeline.value!r} needs a `{stage.value}` section")
            inputs = self.pipeline.inputs(stage)
            if inputs and section.model.name_or_path is not None:
                raise ValueError(
                    f"{stage.value}.model.name_or_path={section.model.name_or_path!r}: in pipeline {self.pipeline.value!r} "
                    f"the {stage.value} stage starts from the {inputs[0].value} stage's output; leave it unset "
                    f"(set it only to run `alignflow stage {stage.value}` on its own from another model)"
                )
        return self

    def stage(self, stage: Stage) -> Any:
        section = getattr(self, stage.value, None)
        if section is None:
            raise ConfigError(f"the config has no `{stage.value}` section, which stage {stage.value!r} needs")
        return section

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))


# --------------------------------------------------------------------------- hashing


def result_fields(model: BaseModel) -> dict[str, Any]:
    """The model as plain JSON data, without the fields marked `result=False`."""
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("result") is False:
            continue
        value = getattr(model, name)
        out[name] = result_fields(value) if isinstance(value, BaseModel) else _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def stable_hash(data: Any) -> str:
    """sha256 of canonical JSON: sorted keys, no whitespace, floats as repr."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# --------------------------------------------------------------------------- loading


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
    A file may start from another with `base: other.yaml` (relative to it): its sections are
    merged key by key over the base's."""
    text = _read_config_text(str(path))
    raw = _with_base(_parse_yaml(text, str(path)), str(path), seen=(str(path),))
    data = apply_overrides(raw, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path), _yaml_lines(text), overrides or [])) from None


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
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
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
        shown = "" if err["type"] == "missing" or not loc or isinstance(value, dict) else f" (got {value!r})"
        msgs.append(f"{where}: {field}: {err['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(msgs)


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


def dump_config(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
