"""`alignflow plan CONFIG`: each stage's memory per GPU, role by role, before anything is submitted.

The model's shape comes from its config.json alone (a built-in, a local folder, or the Hugging Face cache:
`huggingface-cli download <name> config.json` is enough); parameters are counted exactly by building the model
on PyTorch's meta device (no memory), with LoRA applied by PEFT as the stage does. Per GPU, with d the bytes of
the training dtype (bf16 2, fp32 4), P the parameters, T the trained ones and N the role's workers:

- weights: P·d, divided by N under ZeRO-3;
- gradients: T·d, divided by N under ZeRO-2/3;
- optimizer (Adam): T·12 with bf16 (fp32 master weights and two moments), T·8 with fp32, divided by N under
  ZeRO-1/2/3; in host memory with `offload_optimizer`;
- activations (an estimate, per micro-batch of b rows of s tokens): 34·(d/2)·s·b·h bytes a layer (Korthikanti et
  al. 2022, Eq. 1, without the attention-score term that sdpa/flash attention do not keep); with gradient
  checkpointing every layer keeps only its input (s·b·h·d) and one layer is recomputed at a time; plus the fp32
  logits and log-probs, 2·4·s·b·V;
- a vLLM engine takes `gpu_memory_utilization` of each of its GPUs: its weights (P·d over tensor parallel) and,
  in the rest, the KV cache (2·layers·kv_heads·head_dim·d bytes a token).

Roles that share GPUs (`workers.colocate`) add up; with `generation.sleep` the engines hold no GPU memory while
the trainers train, so the peak is the larger of the training phase and the generation phase (trainers' states
without activations, plus the engines).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from alignflow.config.base import ConfigError

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # of the model as trained (LoRA adapters included)
    trainable: int

    @property
    def kv_bytes_per_token(self) -> int:  # times d
        return 2 * self.layers * self.kv_heads * self.head_dim


@dataclass
class RoleMemory:
    role: str
    workers: int
    params: int
    trainable: int
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    optimizer_host: float = 0.0
    activations: float = 0.0
    engine: float = 0.0
    kv_tokens: int | None = None
    notes: list[str] = field(default_factory=list)  # why it cannot run as configured, whatever the total

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.engine


@dataclass
class StagePlan:
    stage: str
    kind: str
    gpus: int
    gpu_bytes: float
    roles: list[RoleMemory]
    per_gpu: float
    layout: str

    @property
    def fits(self) -> bool:
        return self.per_gpu <= self.gpu_bytes and not any(m.notes for m in self.roles)


def model_config(name: str):
    """The transformers config of a built-in, a local folder or a hub name (from the local cache only)."""
    from alignflow.stages.common.models import transformers_without_unused_extras

    transformers_without_unused_extras()
    from transformers import AutoConfig

    from alignflow.stages.common.builtin_model import is_builtin, resolve_builtin

    if is_builtin(name):
        return AutoConfig.from_pretrained(resolve_builtin(name))
    if Path(name).is_dir():
        return AutoConfig.from_pretrained(name)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    if not isinstance(cached, str):
        raise ConfigError(f"plan needs {name!r}'s config.json: `huggingface-cli download {name} config.json` fetches "
                          "just that file (a few KB), or give a local folder")
    return AutoConfig.from_pretrained(os.path.dirname(cached))


def model_shape(name: str, lora=None, reward: bool = False) -> ModelShape:
    import torch

    from alignflow.stages.common.models import parameter_counts, with_lora

    config = model_config(name)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    with torch.device("meta"):
        if reward:
            model = AutoModelForSequenceClassification.from_config(config, num_labels=1)
        else:
            model = AutoModelForCausalLM.from_config(config)
        model = with_lora(model, lora, reward=reward)
        trainable, total = parameter_counts(model)
    heads = config.num_attention_heads
    return ModelShape(name, config.hidden_size, config.num_hidden_layers, heads, getattr(config, "num_key_value_heads", heads),
                      getattr(config, "head_dim", None) or config.hidden_size // heads, config.vocab_size, total, trainable)


def root_model(cfg, stage: str) -> str:
    """The model a stage starts from: its own `model.name_or_path`, else that of the stage its `from:` names."""
    seen = []
    while stage not in seen:
        seen.append(stage)
        section = cfg.section(stage)
        if section.model.name_or_path:
            return section.model.name_or_path
        upstream = cfg.inputs_of(stage).get("from")
        if upstream is None:
            break
        stage = upstream
    raise ConfigError(f"{seen[0]}: no model to start from (no model.name_or_path up its `from:` chain)")


def dtype_bytes(section) -> int:
    return 2 if section.deepspeed.precision == "bf16" or section.model.dtype == "bfloat16" else 4


def trainer(role: str, shape: ModelShape, section, workers: int, seq: int, micro: int) -> RoleMemory:
    """A trained role: states by ZeRO stage, activations of one micro-batch."""
    ds, d = section.deepspeed, dtype_bytes(section)
    m = RoleMemory(role, workers, shape.params, shape.trainable)
    m.weights = shape.params * d / (workers if ds.zero_stage == 3 else 1)
    m.grads = shape.trainable * d / (workers if ds.zero_stage >= 2 else 1)
    optimizer = shape.trainable * (12 if d == 2 else 8) / (workers if ds.zero_stage >= 1 else 1)
    if ds.offload_optimizer:
        m.optimizer_host = optimizer
    else:
        m.optimizer = optimizer
    tokens = seq * micro
    layer = 34 * (d / 2) * tokens * shape.hidden
    kept = shape.layers * tokens * shape.hidden * d + layer if section.model.gradient_checkpointing else shape.layers * layer
    m.activations = kept + 2 * 4 * tokens * shape.vocab
    return m


def frozen(role: str, shape: ModelShape, section, workers: int) -> RoleMemory:
    d = dtype_bytes(section)
    m = RoleMemory(role, workers, shape.params, 0)
    m.weights = shape.params * d / (workers if section.deepspeed.zero_stage == 3 else 1)
    return m


def engine(shape: ModelShape, rl, gpu_bytes: float) -> RoleMemory:
    g, d = rl.generation, 2 if rl.model.dtype == "bfloat16" else 4  # the engine serves the model's dtype
    m = RoleMemory("rollout", g.engines * g.tensor_parallel_size, shape.params, 0)
    weights = shape.params * d / g.tensor_parallel_size
    if g.engine == "vllm":
        m.engine = g.gpu_memory_utilization * gpu_bytes
        m.kv_tokens = int(max(0.0, m.engine - weights) * g.tensor_parallel_size // (shape.kv_bytes_per_token * d))
        if weights >= m.engine:
            m.notes.append(f"its {weights / GB:.2f} GB of weights do not fit in gpu_memory_utilization x GPU")
    else:
        seq = rl.data.max_len + g.max_new_tokens
        m.engine = weights + g.batch_size * seq * shape.kv_bytes_per_token * d
    return m


def plan_rl(cfg, stage: str, gpu_bytes: float) -> StagePlan:
    rl = cfg.section(stage)
    w, seq, micro = rl.workers, rl.data.max_len + rl.generation.max_new_tokens, rl.batch.micro_batch_size
    base = model_shape(root_model(cfg, stage), rl.lora)
    roles = {"actor": trainer("actor", base, rl, w.actor, seq, micro)}
    if (rl.kl.coef > 0 or rl.kl.target is not None) and rl.lora is None:
        roles["reference"] = frozen("reference", model_shape(root_model(cfg, stage)), rl, w.reference)
    reward_model = root_model(cfg, rl.reward.model) if rl.reward.model else None
    if rl.critic is not None:
        roles["critic"] = trainer("critic", model_shape(reward_model or root_model(cfg, stage), reward=True), rl, w.critic, seq, micro)
    if reward_model:
        roles["reward"] = frozen("reward", model_shape(reward_model, reward=True), rl, w.reward)
    if not rl.hybrid:  # hybrid: the actor generates with its own weights (its KV cache is activation-sized)
        roles["rollout"] = engine(model_shape(root_model(cfg, stage)) if rl.lora else base, rl, gpu_bytes)  # merged weights
    groups = {"all": [list(roles)], "pairs": [["actor", "reference"], ["critic", "reward"], ["rollout"]],
              "none": [[r] for r in roles]}[w.colocate]
    if rl.generation.tensor_parallel_size > 1:  # a tensor-parallel engine gets bundles of its own
        groups = [[r for r in g if r != "rollout"] for g in groups] + [["rollout"]]
    per_gpu, gpus = 0.0, 0
    for group in (g for g in groups if any(r in roles for r in g)):
        members = [roles[r] for r in group if r in roles]
        train_phase = sum(m.total - m.engine for m in members if m.role != "rollout")
        engines = sum(m.engine for m in members)
        if rl.generation.sleep:  # engines asleep while training; trainers without activations while generating
            peak = max(train_phase, sum(m.states for m in members) + engines)
        else:
            peak = train_phase + engines
        per_gpu = max(per_gpu, peak)
        gpus += max(m.workers for m in members)
    return StagePlan(stage, "rl", gpus, gpu_bytes, list(roles.values()), per_gpu, f"colocate: {w.colocate}")


def plan_stage(cfg, stage: str, gpu_bytes: float, workers: int) -> StagePlan | None:
    kind = cfg.kind(stage).value
    if not cfg.kind(stage).makes_model:  # eval and the dataset stages train nothing (generate's engines: not yet planned)
        return None
    if kind == "rl":
        return plan_rl(cfg, stage, gpu_bytes)
    section = cfg.section(stage)
    shape = model_shape(root_model(cfg, stage), section.lora, reward=kind == "rm")
    m = trainer(kind, shape, section, workers, section.data.max_len, section.batch.micro_batch_size)
    return StagePlan(stage, kind, workers, gpu_bytes, [m], m.total, f"{workers} worker(s), one GPU each")


def plan(cfg, gpu_gb: float, workers: int) -> list[StagePlan]:
    return [p for name in cfg.order() if (p := plan_stage(cfg, name, gpu_gb * GB, workers)) is not None]


def render(plans: list[StagePlan]) -> str:
    def gb(x: float) -> str:
        return f"{x / GB:.2f}" if x else "-"

    lines = []
    for p in plans:
        lines += [f"{p.stage} ({p.kind}): {p.gpus} GPUs of {p.gpu_bytes / GB:g} GB, {p.layout}",
                  "  role        workers  params     trained    weights  grads  optimizer  activations  engine  (GB per GPU)"]
        for m in p.roles:
            host = f"  optimizer in host memory: {m.optimizer_host / GB:.2f} GB a worker" if m.optimizer_host else ""
            kv = f"  KV cache: {m.kv_tokens:,} tokens" if m.kv_tokens is not None else ""
            lines.append(f"  {m.role:<11} {m.workers:>7}  {m.params / 1e9:>7.3f}B  {m.trainable / 1e9:>7.3f}B  {gb(m.weights):>7}  "
                         f"{gb(m.grads):>5}  {gb(m.optimizer):>9}  {gb(m.activations):>11}  {gb(m.engine):>6}{host}{kv}"
                         + "".join(f"  ({n})" for n in m.notes))
        verdict = "fits" if p.fits else "does NOT fit"
        lines += [f"  peak per GPU: {p.per_gpu / GB:.2f} GB of {p.gpu_bytes / GB:g} GB: {verdict}", ""]
    return "\n".join(lines)


def as_json(plans: list[StagePlan]) -> str:
    return json.dumps([{"stage": p.stage, "kind": p.kind, "gpus": p.gpus, "per_gpu_gb": p.per_gpu / GB, "fits": p.fits,
                        "roles": [{**{k: v for k, v in vars(m).items() if k != "notes"}, "notes": m.notes} for m in p.roles]}
                       for p in plans], indent=2)
