"""The parts every stage config shares, and config hashing (torch-free).

Each stage kind's own schema lives beside its stage (`alignflow/stages/<kind>/config.py`);
the graph of named stages is `alignflow/config/graph.py`; YAML loading is
`alignflow/config/loading.py`.

`config_hash()` covers only the fields that change a stage's result: fields
marked `result=False` (run names, logging and checkpoint cadence, where the
output goes, the names of other stages) are left out, and so are data paths,
whose content enters the cache key as a fingerprint instead.
"""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NOT_RESULT = {"result": False}  # json_schema_extra marker: field left out of config_hash()
# Marker of an option added after stages were published: left out of config_hash() while it has its default, so
# existing cached results stay valid; set, it changes the hash like any other field.
HASHED_WHEN_SET = {"result": "when_set"}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class ConfigError(ValueError):
    """A config that cannot be used, with where and why."""


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False, populate_by_name=True)


# --------------------------------------------------------------------------- shared parts


class ModelConfig(Frozen):
    name_or_path: str | None = Field(None, description="`builtin:tiny`, `builtin:small`, `builtin:small-32k`, a local HF folder, or a hub name; "
                                                       "unset: the model of the stage named by `from:`.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype the weights are loaded and trained in.")
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    gradient_checkpointing: bool = False

    @field_validator("name_or_path")
    @classmethod
    def _model_exists(cls, v: str | None) -> str | None:
        # Checked at load, so a typo fails before any job (and is never retried): a built-in that does not
        # exist, or a local folder (a name starting with / . or ~) that is not there. Hub names are
        # checked where they load (offline and not in the cache is bad input too).
        from alignflow.stages.common.builtin_model import BUILTIN_PREFIX, BUILTINS

        if v is None or "://" in v:
            return v
        if v.startswith(BUILTIN_PREFIX):
            if v.removeprefix(BUILTIN_PREFIX) not in BUILTINS:
                raise ValueError(f"unknown built-in model {v!r}; choose one of {', '.join(BUILTIN_PREFIX + k for k in BUILTINS)}")
            return v
        p = Path(v).expanduser()
        if (p / "config.json").is_file():
            return str(p.resolve())
        if v.startswith((".", "/", "~")):
            what = "has no config.json (not a Hugging Face model folder)" if p.is_dir() else "does not exist"
            raise ValueError(f"local model folder {v!r} {what} (relative paths are resolved against {Path.cwd()})")
        return v


class DataSource(Frozen):
    """Where a stage's rows come from and how they are cut; every stage's data config extends it."""

    path: str | None = Field(None, description="JSONL/Parquet file, a local HF dataset folder, or a `datasets` name.", json_schema_extra=NOT_RESULT)
    stage: str | tuple[str, ...] | None = Field(
        None, description="Instead of `path`: a dataset stage (generate, label or select) of this graph whose published rows "
                          "are the data; a list: their rows one after another. Its digest enters the cache key.",
        json_schema_extra=NOT_RESULT)
    split: str = "train"
    eval_path: str | None = Field(None, description="Held-out file; without it `eval_fraction` of the rows is held out.", json_schema_extra=NOT_RESULT)
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    max_len: int = Field(128, ge=8, description="Tokens per sample (or per packed row); longer responses are truncated.")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Bad rows stop the run, or are skipped and counted.")
    max_skip_fraction: float = Field(0.05, ge=0.0, le=1.0, description="The stage fails, with the counts, when more of the rows "
                                     "read were skipped (bad rows under `on_bad_row: skip`, blank lines).", json_schema_extra=NOT_RESULT)
    max_samples: int | None = Field(None, ge=1)
    format: Literal["auto", "text", "chat", "hh"] = Field("auto", description="How text fields are read: `auto` (strings are text, "
                                                          "lists of {role, content} are conversations), `text`, `chat` (strings become "
                                                          "chat turns), `hh` (HH-RLHF `Human:`/`Assistant:` transcripts).")
    input_template: str | None = Field(None, description="The prompt built from columns, e.g. `{instruction}` and `{input}` "
                                                         "joined by a blank line; replaces the prompt column. A paragraph or line "
                                                         "whose columns are all empty is left out.")
    ignore_columns: tuple[str, ...] = Field((), description="Columns known to be unused: no warning for them.", json_schema_extra=NOT_RESULT)

    # Columns that reach the stage beyond the `*_key` ones (the rl stage hands every column to its reward function).
    PASSES_EVERY_COLUMN: ClassVar[bool] = False

    @field_validator("input_template")
    @classmethod
    def _template_parses(cls, v: str | None) -> str | None:
        from alignflow.stages.common.formats import placeholders

        if v is None:
            return v
        import string

        try:
            fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(v) if name is not None]
        except ValueError as exc:
            raise ValueError(f"input_template {v!r} does not parse ({exc}); write a literal brace as {{{{ or }}}}") from None
        if not fields or any(not name.isidentifier() or spec or conv for name, spec, conv in fields):
            raise ValueError(f"input_template {v!r} needs column placeholders such as {{instruction}} (names only: no "
                             "format specs, conversions or indexing)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "DataSource":
        if (self.path is None) == (self.stage is None):
            raise ValueError("give the rows as `path` (a file or a `datasets` name) or as `stage` (a dataset stage of this "
                             "graph), exactly one" + (f"; got path={self.path!r} and stage={self.stage!r}" if self.path else ""))
        return self

    def stages(self) -> tuple[str, ...]:
        """The dataset stages whose rows this is, in order (none: a file)."""
        return (self.stage,) if isinstance(self.stage, str) else tuple(self.stage or ())

    def used_columns(self) -> set[str] | None:
        """The columns this config reads (None: every column); the others are reported once, at load."""
        if self.PASSES_EVERY_COLUMN:
            return None
        from alignflow.stages.common.formats import placeholders

        keys = {v for k, v in self if k.endswith("_key") and isinstance(v, str)}
        return keys | set(placeholders(self.input_template or "")) | set(self.ignore_columns)

    @field_validator("path", "eval_path")
    @classmethod
    def _local_paths_exist(cls, v: str | None) -> str | None:
        # A relative local path is made absolute here, at parse time, so the resolved
        # config travels to a Ray job unchanged; a missing file fails before any work.
        if v is None or "://" in v:
            return v
        p = Path(v).expanduser()
        if p.is_dir() and not any((p / f).is_file() for f in ("dataset_dict.json", "dataset_info.json")):
            raise ValueError(f"{v!r} is a folder; give one data file ({', '.join(DATA_SUFFIXES)}) or a dataset saved "
                             "with `datasets`' save_to_disk (a folder of several files is not merged)")
        if p.is_file() and p.suffix not in DATA_SUFFIXES:
            raise ValueError(f"{v!r}: unknown data format {p.suffix or '(no suffix)'!r}; use {', '.join(DATA_SUFFIXES)}")
        if p.exists():
            return str(p.resolve())
        if p.suffix in DATA_SUFFIXES or v.startswith((".", "/", "~")):
            raise ValueError(f"data file not found: {v!r} (relative paths are resolved against {Path.cwd()})")
        return v  # a `datasets` hub name




class PreferenceDataConfig(DataSource):
    """Pairs for rm and dpo: a prompt, a chosen and a rejected response (plain strings)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str | None = Field(None, description="Optional per-pair margin column (rm with the sigmoid loss).")
    margin_from: tuple[str, str] | None = Field(None, description="Score columns `[chosen, rejected]`: the margin is their "
                                                                  "difference (UltraFeedback's `[score_chosen, score_rejected]`).")
    min_score_gap: float | None = Field(None, ge=0, description="Leave out pairs whose `margin_from` scores differ by less "
                                                                "(counted as filtered, not skipped).")

    @model_validator(mode="after")
    def _one_margin(self) -> "PreferenceDataConfig":
        if self.margin_from and self.margin_from[0] == self.margin_from[1]:
            raise ValueError(f"margin_from names one column twice ({self.margin_from[0]!r}): give [chosen score, rejected score]")
        if self.margin_key and self.margin_from:
            raise ValueError("set margin_key (a margin column) or margin_from (two score columns), not both")
        if self.min_score_gap is not None and not self.margin_from:
            raise ValueError("min_score_gap filters on the gap between the margin_from score columns: set margin_from: [chosen, rejected]")
        return self

    def used_columns(self) -> set[str] | None:
        return super().used_columns() | set(self.margin_from or ())



class PromptDataConfig(DataSource):
    """Prompts for the rl stage. Every other column of a row (e.g. `answer`) reaches the reward function."""

    prompt_key: str = "prompt"

    PASSES_EVERY_COLUMN: ClassVar[bool] = True


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




class RayConfig(Frozen):
    address: str | None = Field(None, description="Ray dashboard/Jobs API URL (http://host:8265) of an existing cluster; "
                                                  "unset: alignflow starts a local head on 127.0.0.1 (or uses ALIGNFLOW_RAY_ADDRESS).")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local head (default: all).")
    job_timeout_s: int = Field(6 * 3600, ge=1, description="A stage job running longer is stopped and failed.")
    retries: int = Field(2, ge=0, description="Retries of a stage whose job died for a reason a retry can fix.")
    retry_delay_s: int = Field(5, ge=0)
    max_parallel_stages: int = Field(3, ge=1, description="Stage jobs of one run that may run at once (independent branches "
                                                          "of the graph); torch threads are shared out between them.")
    lease_timeout_s: float = Field(60, ge=5, description="A stage job stops itself when the run that started it has not "
                                   "renewed the stage's lease for this long (that run was killed).")
    wait_for_running_stage: bool = Field(True, description="A stage another live run is writing: wait for it and take its "
                                         "result (true), or fail at once (false).")


class TrackingConfig(Frozen):
    uri: str | None = Field(None, description="MLflow tracking URI; unset: MLFLOW_TRACKING_URI, else a local sqlite store.")
    experiment: str = "alignflow"
    artifact_location: str | None = Field(None, description="Where a new experiment keeps its MLflow artifacts; unset: "
                                          "`{storage.root}/mlflow-artifacts` (a tracking server: its own artifact root).")


class LoraConfig(Frozen):
    """Low-rank adapters (PEFT's LoRA) instead of training every weight: only the adapters, and `modules_to_save`,
    are trained, checkpointed and in the optimizer state; the stage publishes the merged model and the adapter."""

    rank: int = Field(16, ge=1, description="r: the rank of each adapter.")
    alpha: float = Field(32, gt=0, description="Scale: the adapter's update is multiplied by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: Literal["all-linear"] | tuple[str, ...] = Field(
        "all-linear", description="Module names (suffixes, e.g. [q_proj, v_proj]) that get adapters, or `all-linear` "
                                  "(every linear layer but the output head).")
    modules_to_save: tuple[str, ...] = Field((), description="Modules trained in full besides the adapters (e.g. "
                                             "embed_tokens); a reward model's score head always is.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v):
        if not v:
            raise ValueError("lora.target_modules is empty: name modules such as [q_proj, v_proj], or use all-linear")
        return v


class TrainingSection(Frozen):
    """What every training stage has: its starting model (`from:` another stage, or `model.name_or_path`),
    optimizer, batch, DeepSpeed, checkpoints, logging."""

    from_: str | None = Field(None, alias="from", description="The stage whose published model this one starts from.",
                              json_schema_extra=NOT_RESULT)  # a name: its output's digest enters the cache key instead
    model: ModelConfig = ModelConfig()
    data: DataSource  # each stage narrows it to its own rows
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight (unset: full training).",
                                    json_schema_extra=HASHED_WHEN_SET)

    @model_validator(mode="after")
    def _batch_divides(self) -> "TrainingSection":
        if self.batch.global_batch_size % self.batch.micro_batch_size:
            raise ValueError(
                f"batch.global_batch_size ({self.batch.global_batch_size}) must be a multiple of "
                f"batch.micro_batch_size ({self.batch.micro_batch_size})"
            )
        return self

    def edges(self) -> dict[str, str]:
        """Input role -> the stage it names: `from` is the model this stage starts from, `data` (or `data:1`, `data:2`, ...
        for a list) the dataset stages its rows come from."""
        return {**({"from": self.from_} if self.from_ else {}), **data_edges(self.data)}

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    def sources(self) -> dict[str, str]:
        """Named files the result depends on (their content enters the cache key, not their paths)."""
        return {**({"data": self.data.path} if self.data.path else {}),
                **({"eval_data": self.data.eval_path} if self.data.eval_path else {})}


DATA_ROLE = "data"


def data_edges(data: DataSource) -> dict[str, str]:
    """Input roles of a data section's dataset stages: `data` for one, `data:1`, `data:2`, ... for a list (in order)."""
    names = data.stages()
    if len(names) == 1 and isinstance(data.stage, str):
        return {DATA_ROLE: names[0]}
    return {f"{DATA_ROLE}:{i + 1}": name for i, name in enumerate(names)}


def file_only(section: DataSource | None, option: str) -> DataSource | None:
    """A data section read by a stage that takes files only (eval, generate): `stage` is refused, naming the option."""
    if section is not None and section.stage is not None:
        raise ValueError(f"{option}.stage: this section reads a file (`{option}.path`); dataset stages are the data of "
                         "training stages (sft, rm, dpo, kto, rl)")
    return section


class ReferenceTraining(TrainingSection):
    """A stage compared with a frozen reference, the model it starts from (dpo, kto)."""

    reference: Literal["precomputed", "on_the_fly"] = Field(
        "precomputed", description="The reference's log-probs: computed once before the first step and stored with the "
                                   "stage (`precomputed`), or in each step by the policy with its adapter off "
                                   "(`on_the_fly`: needs `lora`; no stored file and no up-front pass).",
        json_schema_extra=HASHED_WHEN_SET)

    @model_validator(mode="after")
    def _on_the_fly_needs_lora(self) -> "ReferenceTraining":
        if self.reference == "on_the_fly" and self.lora is None:
            raise ValueError("reference: on_the_fly computes the reference as the policy with its LoRA adapter off: it "
                             "needs a `lora:` section (full training has no adapter to switch off; use precomputed)")
        return self


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
    importance_floor: float | None = Field(None, gt=0, description="Lower bound of that weight (needs importance_cap; off: None).")
    weight_sync: Literal["full", "adapter"] = Field(
        "full", description="What the actor pushes to the engines after each step: its full weights (with LoRA, the adapter "
                            "merged in), or with LoRA on vLLM only the adapter, which vLLM serves as a LoRA adapter.",
        json_schema_extra=HASHED_WHEN_SET)

    @model_validator(mode="after")
    def _engine_options(self) -> "GenerationConfig":
        if self.engine == "hf" and (self.tensor_parallel_size > 1 or self.sleep):
            raise ValueError("generation.tensor_parallel_size and generation.sleep are vLLM options: set generation.engine: vllm")
        if self.weight_sync == "adapter" and self.engine != "vllm":
            raise ValueError("generation.weight_sync: adapter serves the LoRA adapter with vLLM: set generation.engine: vllm")
        if self.importance_floor is not None and (self.importance_cap is None or self.importance_floor >= self.importance_cap):
            raise ValueError(f"generation.importance_floor={self.importance_floor} needs an importance_cap above it "
                             f"(importance_cap={self.importance_cap})")
        return self


def python_object_spec(v: str, what: str, form: str) -> str:
    """`path/to/file.py:name` whose file exists, made absolute (relative paths: against the working directory)."""
    path, sep, name = v.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ValueError(f"{what} {v!r} is not of the form path/to/file.py:{form}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{what} file not found: {path!r} (relative paths are resolved against {Path.cwd()})")
    try:  # a syntax error fails here, at load, not in a job (errors while importing it are the job's to report)
        compile(file.read_bytes(), str(file), "exec")
    except SyntaxError as exc:
        raise ValueError(f"{what} file {path}:{exc.lineno}: {exc.msg}") from None
    return f"{file.resolve()}:{name}"



# --------------------------------------------------------------------------- hashing


def result_fields(model: BaseModel) -> dict[str, Any]:
    """The model as plain JSON data, without the fields marked `result=False`."""
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        value = getattr(model, name)
        if extra.get("result") is False or (extra.get("result") == "when_set" and value == field.default):
            continue
        out[name] = result_fields(value) if isinstance(value, BaseModel) else _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return result_fields(value)
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


