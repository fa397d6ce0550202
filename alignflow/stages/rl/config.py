"""The rl stage's config (torch-free): PPO, GRPO, Dr. GRPO, REINFORCE++(-baseline), RLOO."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import HASHED_WHEN_SET, NOT_RESULT, Frozen, GenerationConfig, OptimConfig, PromptDataConfig, TrainingSection, python_object_spec


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



class RemoteRewardConfig(Frozen):
    """How `reward.url` is called (`stages/rl/remote.py`): none of it changes the scores, so none is in the cache key."""

    timeout_s: float = Field(60.0, gt=0, description="Seconds to wait for one batch's reply.", json_schema_extra=NOT_RESULT)
    retries: int = Field(4, ge=0, description="Retries of a batch after a refused connection, a timeout, HTTP 5xx/408/429.",
                         json_schema_extra=NOT_RESULT)
    backoff_s: float = Field(1.0, ge=0, description="Wait before the first retry; doubles per retry (at most 30 s).",
                             json_schema_extra=NOT_RESULT)
    batch_size: int = Field(64, ge=1, description="Samples per request.", json_schema_extra=NOT_RESULT)
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.", json_schema_extra=NOT_RESULT)
    auth_env: str | None = Field(None, description="Environment variable holding a bearer token, sent as "
                                                   "`Authorization: Bearer <value>`; never logged.", json_schema_extra=NOT_RESULT)


class RewardConfig(Frozen):
    """Where single-turn rewards come from: exactly one of `function`, `model` and `url`, unless `rl.environment`
    gives the rewards (then none)."""

    function: str | None = Field(None, description="`path/to/file.py:name`: called with prompts, completions, their token "
                                                   "ids and the rows' other columns; returns one float per sample.",
                                 json_schema_extra=NOT_RESULT)  # enters the cache key as the file's content hash
    model: str | None = Field(None, description="The rm stage to score with (its name); a PPO critic starts from it too.",
                              json_schema_extra=NOT_RESULT)  # a name: its output's digest enters the cache key instead
    url: str | None = Field(None, description="A reward service (http:// or https://): POSTs batches of samples as JSON, "
                                              "reads one score per sample (`stages/rl/remote.py`; `alignflow reward-server` "
                                              "serves an rm stage so).")  # in the cache key: another service, other scores
    http: RemoteRewardConfig = RemoteRewardConfig()
    normalize: bool = Field(True, description="Reward-model scores as (s - mean) / std with the rm stage's stored figures.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's soft overlong penalty: the last N tokens before max_new_tokens.")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty at max_new_tokens, linear over the buffer.")

    @field_validator("function")
    @classmethod
    def _function_file_exists(cls, v: str | None) -> str | None:
        return v if v is None else python_object_spec(v, "reward function", "function_name")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith(("http://", "https://")) and len(v.split("://", 1)[1]) > 0):
            raise ValueError(f"reward.url must be an http:// or https:// URL, got {v!r}")
        return v


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


class AgentConfig(Frozen):
    """An agent in the user's code (`stages/rl/agents.py`): `run(client, row)` with an `openai.OpenAI` client on the
    stage's OpenAI-compatible endpoint (the API key is the episode id), returning the episode's reward. Its rewards
    replace `reward.*`; `reward.overlong_*` does not apply."""

    path: str = Field(..., description="`path/to/file.py:run`: run(client, row) -> float | {'reward': float, **metrics}; "
                                       "`async def` gets an openai.AsyncOpenAI client.", json_schema_extra=NOT_RESULT)
    concurrency: int = Field(32, ge=1, description="Episodes running at once.", json_schema_extra=NOT_RESULT)
    timeout_s: float = Field(120.0, gt=0, description="An episode still running after this is dropped.", json_schema_extra=NOT_RESULT)
    max_dropped_fraction: float = Field(0.1, ge=0, le=1, description="Dropped episodes (raised, timed out, no model "
                                        "call, bad return) per step past which the stage fails.", json_schema_extra=NOT_RESULT)
    model_name: str = Field("policy", description="The model name the endpoint serves (`model=` in the agent's calls).",
                            json_schema_extra=NOT_RESULT)
    host: str = Field("127.0.0.1", description="Address the endpoint binds (the node's address for agents elsewhere).",
                      json_schema_extra=NOT_RESULT)

    @field_validator("path")
    @classmethod
    def _file_exists(cls, v: str) -> str:
        return python_object_spec(v, "agent", "function_name")


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
    reward_clip: tuple[float, float] | None = Field(None, description="[low, high] bound of each shaped per-token reward "
                                                    "(score and -β·KL) with placement: reward; unset = no bound.")

    @model_validator(mode="after")
    def _reward_clip(self) -> "KLConfig":
        if self.reward_clip is not None:
            if self.placement != "reward":
                raise ValueError("kl.reward_clip bounds the reward the KL is placed in: set kl.placement: reward")
            if not self.reward_clip[0] < self.reward_clip[1]:
                raise ValueError(f"kl.reward_clip: [low, high] with low < high, got {list(self.reward_clip)}")
        return self


class PolicyLossConfig(Frozen):
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.2, gt=0, description="> clip_low: clip-higher (DAPO).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip bound c for negative advantages.")
    aggregation: Literal["token", "sequence"] = "token"
    entropy_coef: float = Field(0.0, ge=0)
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto", description="`auto`: the generator's log-probs of the tokens it sampled are the old log-probs, with no "
                            "pass over the batch, while they are the actor's: each step's first micro-batch (before any "
                            "update) measures the gap, and past `old_logprob_tolerance` the pass runs after all, over "
                            "the rows no first micro-batch has scored. "
                            "`recompute`: a no-grad pass with the actor every step (always, with importance_cap or a KL "
                            "placed in the reward).", json_schema_extra=HASHED_WHEN_SET)
    old_logprob_tolerance: float = Field(1e-3, gt=0, description="Mean |log π_engine - log π_actor| per token above "
                                                                 "which `auto` runs the old-log-prob pass.",
                                         json_schema_extra=HASHED_WHEN_SET)


class CriticConfig(Frozen):
    """The value model of PPO (estimator gae): starts from the reward model when there is one, else the SFT model."""

    optim: OptimConfig = OptimConfig()
    value_clip: float | None = Field(0.2, gt=0)


class RolloutConfig(Frozen):
    prompts_per_step: int = Field(16, ge=1, description="Prompts sampled per RL step.")
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal; sample more prompts to refill.")
    max_sampling_rounds: int = Field(3, ge=1, description="Cap on sampling rounds per step with dynamic sampling.")
    asynchronous: bool = Field(
        False, description="One step off-policy (OpenRLHF's async training): the rollout workers generate step t+1's "
                           "samples with the weights of step t while the actor trains on step t's; the old-log-prob "
                           "pass runs every step, and with `generation.importance_cap` truncated importance sampling "
                           "corrects for the staleness. Needs rollout workers on devices of their own "
                           "(`workers.colocate: pairs` or `none`). Pays where the devices would otherwise wait; on a "
                           "small CPU it splits the cores.", json_schema_extra=HASHED_WHEN_SET)


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
    hybrid: bool | Literal["auto"] = Field(
        "auto", description="The actor workers generate from their own weights (no rollout workers, no weight push). "
                            "`auto`: when it can, i.e. with generation.engine hf, colocate all, one engine per actor "
                            "worker and whole weights on each (deepspeed.zero_stage < 3); `true` insists; `false`: "
                            "separate rollout workers, the layout for vLLM and GPUs.", json_schema_extra=NOT_RESULT)


class RLConfig(TrainingSection):
    """RL on prompts: PPO (gae, with a critic), GRPO, Dr. GRPO, REINFORCE++(-baseline), RLOO.
    `batch.global_batch_size` counts responses per optimizer step; `batch.max_steps` and `epochs` count RL steps."""

    kind: Literal["rl"] = "rl"
    data: PromptDataConfig
    generation: GenerationConfig = GenerationConfig()
    reward: RewardConfig = RewardConfig()
    environment: EnvironmentConfig | None = Field(None, description="Multi-turn episodes with this environment; unset: "
                                                                    "one response per sample, scored by `reward`.")
    agent: AgentConfig | None = Field(None, description="Episodes run by an agent function in the user's code against an "
                                                        "OpenAI-compatible endpoint; unset: `reward` or `environment`.")
    advantage: AdvantageConfig = AdvantageConfig()
    kl: KLConfig = KLConfig()
    policy: PolicyLossConfig = PolicyLossConfig()
    critic: CriticConfig | None = None
    rollout: RolloutConfig = RolloutConfig()
    workers: WorkersConfig = WorkersConfig()

    @model_validator(mode="after")
    def _one_reward_source(self) -> "RLConfig":
        given = [name for name, on in (("reward.function", bool(self.reward.function)), ("reward.model", bool(self.reward.model)),
                                       ("reward.url", bool(self.reward.url)), ("environment", self.environment is not None),
                                       ("agent", self.agent is not None)) if on]
        if len(given) != 1:
            raise ValueError(f"give exactly one reward source: `reward.function: file.py:name`, `reward.model: <rm stage>`, "
                             f"`reward.url: http://…`, `agent: {{path: file.py:run}}` or "
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
        if self.agent is not None and self.rollout.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling with an agent is not supported: an agent's episodes cannot be re-drawn "
                             "group by group")
        if self.generation.weight_sync == "adapter" and self.lora is None:
            raise ValueError("generation.weight_sync: adapter pushes the actor's LoRA adapter: it needs a `lora:` section")
        if self.workers.hybrid is True and self.hybrid_blocker():
            raise ValueError(f"workers.hybrid: true generates in the actor workers, which needs {self.hybrid_blocker()}; "
                             "set workers.hybrid: auto or false")
        if self.rollout.asynchronous and self.reward.model and self.workers.colocate == "pairs":
            raise ValueError("rollout.asynchronous scores the next step's samples with the reward model while the critic "
                             "trains, and workers.colocate: pairs puts the two in one bundle: set workers.colocate: none")
        if self.rollout.asynchronous and self.workers.colocate == "all":
            raise ValueError("rollout.asynchronous generates while the trainers train: give the rollout workers CPUs or GPUs "
                             "of their own with workers.colocate: pairs or none (with `all` they share the trainers' and "
                             "slow each other down, 4x on a 2-core CPU; generation.sleep, which needs `all`, is for "
                             "engines that wait while the trainers train)")
        if self.generation.sleep and (not self.workers.gpus_per_worker or self.workers.colocate != "all"):
            raise ValueError("generation.sleep frees the vLLM engines' GPU memory while colocated roles train: it needs "
                             f"workers.gpus_per_worker > 0 and workers.colocate: all (got {self.workers.gpus_per_worker} "
                             f"and {self.workers.colocate}); on CPU leave it off")
        return self

    def hybrid_blocker(self) -> str | None:
        """What keeps the actor workers from generating with their own weights, or None when nothing does."""
        g, w = self.generation, self.workers
        if self.rollout.asynchronous:
            return "rollout.asynchronous: false (asynchronous rollout generates in rollout workers while the actor trains)"
        if g.engine != "hf":
            return f"generation.engine: hf (got {g.engine})"
        if w.colocate != "all":
            return f"workers.colocate: all (got {w.colocate})"
        if g.engines != w.actor:
            return f"generation.engines equal to workers.actor (got {g.engines} and {w.actor})"
        if self.deepspeed.zero_stage == 3:
            return "whole weights on each actor worker: deepspeed.zero_stage below 3 (got 3)"
        return None

    @property
    def hybrid(self) -> bool:
        """The actor workers are the rollout engines (`workers.hybrid`)."""
        return self.workers.hybrid is not False and self.hybrid_blocker() is None

    def edges(self) -> dict[str, str]:
        return {**super().edges(), **({"reward_model": self.reward.model} if self.reward.model else {})}

    def sources(self) -> dict[str, str]:
        sources = super().sources()
        if self.reward.function:
            path, _, name = self.reward.function.rpartition(":")
            sources[f"reward_function:{name}"] = path  # its content, not its path, is in the cache key
        if self.environment:
            path, _, name = self.environment.path.rpartition(":")
            sources[f"environment:{name}"] = path
        if self.agent:
            path, _, name = self.agent.path.rpartition(":")
            sources[f"agent:{name}"] = path
        return sources

