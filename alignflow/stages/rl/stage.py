"""RL stage: PPO, GRPO, Dr. GRPO, REINFORCE++(-baseline), RLOO on Ray worker groups.

Run by hand:  alignflow stage rl --config configs/tiny-grpo.yaml
              (finds its `from:` model published by `alignflow stage sft`; or pass --input from=URI,
              and --input reward_model=URI for a reward model)

This process is the driver. It starts the roles as Ray worker groups (`workers.py`: actor,
rollout, and as the config needs them reference, critic, reward model; placed by
`stages.common.workers.plan_slots`) and runs the loop, one RL step at a time:
generate and score through the executor (`executors.py`: single-turn with the reward function
or reward model, or multi-turn episodes with an environment; overlong penalty; dynamic
sampling) -> old / reference log-probs and values -> KL and advantages (pure functions) ->
train actor (and critic) -> push the actor's weights to the rollout workers -> log ->
checkpoint. With `rollout.asynchronous`, the rollout workers generate and the driver scores
the next step's samples in a thread while this step's go through the trainers (one step
off-policy, as OpenRLHF's async training); the push waits for them. Checkpoints hold the
actor's and critic's DeepSpeed states and RNGs and, in the actor's client state, the driver's
(metric history, adaptive KL coefficient); prompts and sampling seeds are functions of (seed,
step), so a resumed run continues exactly (an asynchronous run's checkpoint also holds the next
step's samples: the weights that drew them are gone).
"""

from __future__ import annotations

import os
import sys
import time
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable

import numpy as np
import torch

from alignflow.config import ConfigError, PipelineConfig
from alignflow.stages.rl.config import RLConfig
from alignflow.infra import manifest, storage
from alignflow.stages.common.data import global_batch
from alignflow.stages.common.generation import Rollout, SamplingParams
from alignflow.stages.common.models import fetch_published_model, load_tokenizer
from alignflow.stages.common.progress import peak_rss_mib
from alignflow.stages.common.publish import Files, finish_publish, publish_dir
from alignflow.stages.common.run import TrainingRun, total_steps
from alignflow.stages.common.workers import WorkerGroup, connect_ray, plan_slots, release
from alignflow.stages.rl.advantages import advantages
from alignflow.stages.rl.data import PromptRow, load_prompts
from alignflow.stages.rl.executors import Episodes, Executor, MultiTurn, Scorer, SingleTurn, action_tokens, load_environment
from alignflow.stages.rl.experience import Experience
from alignflow.stages.rl.kl import adaptive_kl_coef, kl_per_token
from alignflow.stages.rl.agents import AgentExecutor, load_agent
from alignflow.stages.rl.openai_server import OpenAIServer
from alignflow.stages.rl.remote import RemoteReward
from alignflow.stages.rl.rewards import FunctionReward, overlong_penalty
from alignflow.stages.common.vllm_engine import require_vllm
from alignflow.stages.common.rollout import KILL_ENGINE_ENV, EngineError, RolloutWorker, generate_on  # noqa: F401 (EngineError: re-exported)
from alignflow.stages.rl.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardModelWorker

CURVES = ["reward/mean", "eval/reward", "train/success", "eval/success", "train/kl", "train/policy_loss", "train/entropy",
          "train/response_length"]


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    rl = run.section
    if rl.generation.engine == "vllm":
        require_vllm()  # before any download or model work
    base = run.base_model()
    reward_model = reward_model_path(run, rl)
    tokenizer = load_tokenizer(base)
    train, held, stats = load_prompts(run.data, tokenizer, rl.batch.seed, f"{stage}.data")  # bad data fails before any model work
    # Reward sources load before any worker starts, so a broken file fails fast.
    function = reward_function(rl)
    environment = load_environment(rl.environment.path) if rl.environment else None
    agent = load_agent(rl.agent.path) if rl.agent else None
    steps = total_steps(len(train), rl, "prompts", ("rollout.prompts_per_step", rl.rollout.prompts_per_step))
    disconnect = connect_ray()
    roles = server = loop = None
    try:
        roles = Roles(rl, base, reward_model, tokenizer.pad_token_id, steps, run.out, run.key)
        run.params = dict(zip(("params/trainable", "params/total"), roles.actor.call("parameter_counts")[0]))
        if agent is not None:  # the agent's endpoint, in front of the rollout engines
            server = OpenAIServer(tokenizer, roles.generate, model_name=rl.agent.model_name, host=rl.agent.host,
                                  sampling=SamplingParams(rl.generation.max_new_tokens), seed=rl.batch.seed)
            print(f"{stage}: agent endpoint {server.url} (model {rl.agent.model_name!r}; API key = episode id)", flush=True)
        loop = Loop(rl, train, held, tokenizer, roles, make_executor(rl, tokenizer, roles, function, environment, agent, server),
                    steps)
        run.start_with(RLTrainer(roles, run.key, disconnect), steps, "gen_tokens_per_s", loop.evaluate)
        loop.resume(run.resumed_state)

        # -------------------------------------------------------------- train
        run.train(loop.step, loop.evaluate, state=loop.state)
        run.timings["memory/peak_rss_mib"] = roles.peak_rss_mib()

        # -------------------------------------------------------------- publish
        return run.publish(tokenizer, CURVES, stats)
    finally:
        if server is not None:
            server.close()
        if isinstance(function, RemoteReward):
            function.close()
        if roles is not None:
            roles.shutdown()
        if loop is not None:
            loop.close()
        disconnect()


def reward_model_path(run: TrainingRun, rl: RLConfig) -> str | None:
    if not rl.reward.model:
        return None
    if "reward_model" not in run.inputs:
        raise ConfigError(f"{run.stage}.reward.model={rl.reward.model!r} scores with that rm stage's model: run it first, "
                          "or pass --input reward_model=<published rm folder>")
    return fetch_published_model(run.inputs["reward_model"], run.input_digests["reward_model"])


def reward_function(rl: RLConfig) -> FunctionReward | RemoteReward | None:
    """The reward function, or the reward service (already answering: a down service fails here, before any worker)."""
    if rl.reward.url:
        h = rl.reward.http
        remote = RemoteReward(rl.reward.url, timeout_s=h.timeout_s, retries=h.retries, backoff_s=h.backoff_s,
                              batch_size=h.batch_size, concurrency=h.concurrency, auth_env=h.auth_env)
        remote.check()
        return remote
    return FunctionReward(rl.reward.function) if rl.reward.function else None


def make_executor(rl: RLConfig, tokenizer, roles: "Roles", function: FunctionReward | RemoteReward | None, environment,
                  agent=None, server: OpenAIServer | None = None) -> Executor:
    """Episodes of the user's agent, multi-turn episodes with the environment, else one response per sample scored
    by the reward source."""
    if agent is not None:
        a = rl.agent
        return AgentExecutor(server, agent, a.path, concurrency=a.concurrency, timeout_s=a.timeout_s,
                             max_dropped_fraction=a.max_dropped_fraction)
    g, r = rl.generation, rl.reward
    penalty = lambda lengths: overlong_penalty(lengths, g.max_new_tokens, r.overlong_buffer, r.overlong_penalty)  # noqa: E731
    if environment is not None:
        return MultiTurn(roles.generate, environment, rl.environment.path, tokenizer, rl.environment.max_turns, penalty)
    return SingleTurn(roles.generate, Scorer(tokenizer, function, roles.score if roles.reward else None, penalty))


class Roles:
    """The worker groups of one RL run, and the calls that span groups."""

    def __init__(self, rl: RLConfig, base: str, reward_model: str | None, pad_id: int, steps: int, out: str, key: str):
        self.rl, est = rl, rl.advantage.estimator
        wanted = {"actor": rl.workers.actor, **({} if rl.hybrid else {"rollout": rl.generation.engines})}
        self.needs_reference = rl.kl.coef > 0 or rl.kl.target is not None
        if self.needs_reference and rl.lora is None:  # under LoRA the reference is the actor with its adapter off
            wanted["reference"] = rl.workers.reference
        if est.needs_critic:
            wanted["critic"] = rl.workers.critic
        if reward_model:
            wanted["reward"] = rl.workers.reward
        slots = self.slots = self._plan(wanted)
        optimizer_steps = steps * rl.policy.epochs * (rl.rollout.prompts_per_step * rl.generation.n_samples_per_prompt // rl.batch.global_batch_size)
        self.groups: dict[str, WorkerGroup] = {}
        setups = {  # PPO's critic starts from the reward model when there is one
            "actor": (ActorWorker, (rl, base, optimizer_steps, out, key)),
            "rollout": (RolloutWorker, (rl.generation, rl.model, base, None, rl.batch.seed,
                                        rl.lora.rank if rl.generation.weight_sync == "adapter" else None, os.environ.get(KILL_ENGINE_ENV))),
            "reference": (ReferenceWorker, (rl, base)),
            "critic": (CriticWorker, (rl, reward_model or base, pad_id, optimizer_steps, out, key)),
            "reward": (RewardModelWorker, (rl, reward_model)),
        }
        try:
            self._start({role: setups[role] for role in slots})  # slots: `_plan` may take the rollout out of `wanted`
        except BaseException:
            self.shutdown()  # no actor or placement group outlives a failed start
            raise
        self.actor = self.groups["actor"]
        self.rollout = self.actor if rl.hybrid else self.groups["rollout"]  # hybrid: the actor workers generate
        print("rl: worker groups " + ", ".join(f"{role} x{len(self.slots[role])}" for role in self.slots)
              + (" (hybrid: the actor generates)" if rl.hybrid else ""), flush=True)
        self.reference, self.critic, self.reward = (self.groups.get(r) for r in ("reference", "critic", "reward"))

    def _plan(self, wanted: dict[str, int]) -> dict[str, list]:
        """Slots for every role. A tensor-parallel engine gets a bundle of its own with its TP GPUs: vLLM
        starts one process per GPU inside the rollout worker, on the GPUs Ray gave that worker."""
        w, tp = self.rl.workers, self.rl.generation.tensor_parallel_size
        apart = {"rollout": wanted.pop("rollout")} if tp > 1 and "rollout" in wanted else {}
        slots = plan_slots(wanted, w.cpus_per_worker, w.gpus_per_worker, w.colocate)
        try:
            slots.update(plan_slots(apart, w.cpus_per_worker, w.gpus_per_worker * tp, "none") if apart else {})
        except BaseException:
            release(slots)
            raise
        return slots

    def _start(self, setups: dict[str, tuple[type, tuple]]) -> None:
        """Every role's workers start at once and set up at once: imports, model loads and DeepSpeed's init
        overlap, a process each (on the tiny model this halves an RL stage's start). vLLM engines on GPUs set
        up after the rest: vLLM sizes its KV cache from the device memory free when it starts, which a
        trainer loading beside it would change."""
        import ray

        for role, (cls, _) in setups.items():
            self.groups[role] = WorkerGroup(role, cls, self.slots[role])
        trainers = [role for role in setups if role != "rollout"]
        waves = [trainers, ["rollout"]] if self.rl.workers.gpus_per_worker > 0 and "rollout" in setups else [list(setups)]
        for wave in waves:
            refs = [ref for role in wave for ref in (*self.groups[role].joined, *self.groups[role].submit("setup", *setups[role][1]))]
            ray.get(refs)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """Prompts sharded over the rollout engines (a dead engine fails the step: the stage resumes from its checkpoint)."""
        return generate_on(self.rollout, prompts, params, self.rl.generation.engine)

    def before_training(self) -> None:
        if self.rl.generation.sleep:  # colocated on GPUs: the engines give their memory to the trainers
            self.rollout.call("sleep")

    def after_training(self) -> None:
        if self.rl.generation.sleep:
            self.rollout.call("wake_up")

    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        return self.reward.call("score", sequences)[0]

    def reference_logprobs(self, exp: Experience) -> torch.Tensor | None:
        """The reference's log-probs when the KL needs them: the reference role's, or under LoRA the actor's with its
        adapter off. Every worker of the role computes its share of the rows."""
        if not self.needs_reference:
            return None
        return self.reference.call("logprobs", exp)[0] if self.reference else self.actor.call("reference_logprobs", exp)[0]

    def sync_weights(self) -> None:
        """The actor's full weights (or, with `weight_sync: adapter`, its LoRA adapter) to every rollout worker,
        through the object store; nothing in the hybrid layout, where the actor generates."""
        import ray

        if self.rl.hybrid:
            return
        adapter = self.rl.generation.weight_sync == "adapter"
        refs = [(w.adapter if adapter else w.weights).remote() for w in self.actor.workers]  # a collective: every rank gathers
        self.rollout.call("load_adapter" if adapter else "load_weights", refs[0])
        ray.get(refs[1:])

    def peak_rss_mib(self) -> float:
        """The job's memory: the driver's peak resident memory plus every worker's, summed (an upper bound: the
        peaks need not coincide, and shared pages count once per process)."""
        import ray

        return peak_rss_mib() + sum(ray.get([ref for group in self.groups.values() for ref in group.submit("peak_rss_mib")]))

    def shutdown(self) -> None:
        """Kill every worker and free their placement groups; a second call does nothing."""
        for group in self.groups.values():
            group.kill()
        release(self.slots)
        self.groups, self.slots = {}, {}


class Loop:
    """One RL step at a time (see the module docstring), and the held-out evaluation."""

    def __init__(self, rl: RLConfig, train: list[PromptRow], held: list[PromptRow], tokenizer, roles: Roles, executor: Executor,
                 steps: int):
        self.rl, self.train, self.held, self.tokenizer, self.roles, self.executor = rl, train, held, tokenizer, roles, executor
        self.kl_coef = rl.kl.coef
        # The pass is skipped only where nothing before training reads the old log-probs and the loss does not
        # weigh the engine's against them (truncated importance sampling).
        kl_in_reward = roles.needs_reference and rl.kl.placement == "reward"
        self.recompute_old_logprobs = (rl.policy.old_logprobs == "recompute" or kl_in_reward or rl.rollout.asynchronous
                                       or rl.generation.importance_cap is not None)
        # Asynchronous rollout: the next step's samples, generating while this step trains.
        self.steps, self.prefetch, self.stopping = steps, None, threading.Event()

    def sample(self, step: int) -> tuple[list[PromptRow], Episodes, dict[str, float]]:
        """Prompts and their n scored samples each; with dynamic sampling, groups whose rewards
        are all equal are replaced by new prompts, up to max_sampling_rounds rounds."""
        rl, n, p = self.rl, self.rl.generation.n_samples_per_prompt, self.rl.rollout.prompts_per_step
        kept, dropped, first_kept, rounds = [], [], None, 0
        for round_ in range(rl.rollout.max_sampling_rounds if rl.rollout.dynamic_sampling else 1):
            if self.stopping.is_set():
                raise RuntimeError("rl: the stage is stopping; sampling ahead gave up")
            rounds += 1
            picks = (global_batch(len(self.train), p, step, rl.batch.seed) if round_ == 0 else
                     np.random.default_rng([rl.batch.seed, step, round_]).choice(len(self.train), p, replace=False).tolist())
            rows = [self.train[i] for i in picks]
            params = SamplingParams(rl.generation.max_new_tokens, rl.generation.temperature, rl.generation.top_p,
                                    rl.generation.top_k, n, seed=rl.batch.seed * 1_000_003 + step * 101 + round_,
                                    stop_token_ids=rl.generation.stop_token_ids)
            episodes = self.executor.run(rows, params)
            for g, row in enumerate(rows):
                group = (row, episodes.group(g, n))
                informative = not rl.rollout.dynamic_sampling or bool(group[1].scores.std() > 0)
                (kept if informative else dropped).append(group)
            first_kept = first_kept if first_kept is not None else len(kept) / p
            if len(kept) >= p:
                break
        groups = (kept + dropped)[:p]  # after the last round, uninformative groups fill the batch
        info = {"sampling_rounds": rounds, **({"dynamic_sampling/kept_fraction": first_kept} if rl.rollout.dynamic_sampling else {})}
        return [g[0] for g in groups], Episodes.cat([g[1] for g in groups]), info

    def take(self, step: int) -> tuple[list[PromptRow], Episodes, dict[str, float]]:
        """This step's samples: generated during the step before (asynchronous rollout), else now."""
        if self.prefetch is None:
            return self.sample(step)
        ahead, future = self.prefetch
        assert ahead == step, f"samples prefetched for step {ahead}, taken at step {step}"
        self.prefetch = None
        return future.result()

    def sample_ahead(self, step: int) -> Future:
        """`sample(step)` in a daemon thread: a failed stage exits without waiting for a reward function or an
        environment still scoring."""
        future: Future = Future()

        def run() -> None:
            start = time.perf_counter()
            try:
                rows, episodes, info = self.sample(step)
                future.set_result((rows, episodes, {**info, "phase/generate_ahead_s": time.perf_counter() - start}))
            except BaseException as exc:  # noqa: BLE001 (raised in the loop's thread by `result()`)
                future.set_exception(exc)

        threading.Thread(target=run, name=f"rollout-ahead-{step}", daemon=True).start()
        return future

    def state(self) -> dict[str, Any]:
        """The driver's part of a checkpoint: the KL coefficient and, with asynchronous rollout, the next step's
        samples (drawn with the weights before this step's update, which a resumed run no longer has)."""
        state: dict[str, Any] = {"kl_coef": self.kl_coef}
        if self.prefetch is not None:
            ahead, future = self.prefetch
            state["prefetched"] = (ahead, future.result())
        return state

    def resume(self, state: dict[str, Any]) -> None:
        self.kl_coef = state.get("kl_coef", self.rl.kl.coef)
        if "prefetched" in state:
            ahead, sample = state["prefetched"]
            done: Future = Future()
            done.set_result(sample)
            self.prefetch = (ahead, done)

    def close(self, timeout_s: float = 30.0) -> None:
        """After the workers are stopped and before Ray is left: a sample still in flight fails on its next Ray call
        (or stops before its next sampling round) instead of calling Ray after the disconnect, which would start
        a bare local Ray."""
        self.stopping.set()
        if self.prefetch is not None:
            wait([self.prefetch[1]], timeout=timeout_s)

    def step(self, step: int) -> dict[str, float]:
        rl, roles, clock = self.rl, self.roles, Clock()
        rows, episodes, info = self.take(step)
        scores = episodes.scores
        clock.lap("generate_and_score")
        exp = Experience.from_rollouts(episodes.rollouts, self.tokenizer.pad_token_id)
        if self.rl.rollout.asynchronous and step + 1 < self.steps:  # drawn by this step's weights, trained on by the next
            self.prefetch = (step + 1, self.sample_ahead(step + 1))
        old_logp = roles.actor.call("logprobs", exp)[0] if self.recompute_old_logprobs else None
        ref_logp = roles.reference_logprobs(exp)
        values = roles.critic.call("values", exp)[0] if roles.critic else None
        clock.lap("inference")
        behaviour = old_logp if old_logp is not None else exp.sampled_logp  # the KL as logged (placement: loss)
        kl = kl_per_token(behaviour, ref_logp, rl.kl.estimator) * exp.mask if ref_logp is not None else None
        penalty = self.kl_coef * kl if kl is not None and rl.kl.placement == "reward" else None
        adv, returns = advantages(rl.advantage.estimator, scores, exp.mask, n=rl.generation.n_samples_per_prompt,
                                  gamma=rl.advantage.gamma, lam=rl.advantage.lam, kl=penalty, values=values,
                                  reward_clip=rl.kl.reward_clip, present=episodes.present)
        roles.before_training()
        metrics = roles.actor.call("train", exp, old_logp, adv, ref_logp, self.kl_coef, step)[0]
        if roles.critic:
            metrics.update(roles.critic.call("train", exp, values, returns, step)[0])
        roles.after_training()
        clock.lap("train")
        if self.prefetch is not None:  # the engines finish the next step's samples before their weights change
            self.prefetch[1].result()
            clock.lap("wait_for_rollout")
        roles.sync_weights()
        clock.lap("sync")
        kl_mean = float((kl.sum() / exp.mask.sum()) if kl is not None else 0.0)
        # Generator vs trainer log-probs of the same tokens: ~0 with the HF backend (same kernels); vLLM's CPU
        # kernels stay within ~1e-6 here; a growing value means the engine's weights are not the actor's (with
        # asynchronous rollout it is the one step of staleness). Without the pass, the actor measured it on its
        # first micro-batch.
        if old_logp is not None:
            metrics["logprob_mismatch"] = float(((exp.sampled_logp - old_logp).abs() * exp.mask).sum() / exp.mask.sum())
            metrics["old_logprob_pass"] = 1.0
        generating = info.get("phase/generate_ahead_s", clock.times["generate_and_score"])
        metrics.update(self.rollout_metrics(episodes, exp, clock, generating), kl=kl_mean, kl_coef=self.kl_coef, **info)
        if rl.kl.target is not None and kl is not None:  # Ziegler et al. 2019: adapt β toward the target KL per sequence
            self.kl_coef = adaptive_kl_coef(self.kl_coef, float(kl.sum(-1).mean()), rl.kl.target, rl.kl.horizon, len(exp))
        return metrics

    def rollout_metrics(self, episodes: Episodes, exp: Experience, clock: "Clock", generating: float) -> dict[str, float]:
        generated, scores, rollouts = float(exp.mask.sum()), episodes.kept_scores, episodes.rollouts  # mask: policy tokens only
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                **{k: float(v.nanmean()) for k, v in episodes.stats.items()},  # multi-turn: turns, success; agents
                "response_length": generated / len(rollouts),
                "finished_fraction": sum(r.finish_reason == "stop" for r in rollouts) / len(rollouts),
                "gen_tokens_per_s": generated / max(generating, 1e-9),
                "train_tokens_per_s": float(exp.attention_mask.sum()) * self.rl.policy.epochs / max(clock.times["train"], 1e-9),
                **{f"phase/{k}_s": v for k, v in clock.times.items()}}  # per step; `time/*` is the whole stage

    def evaluate(self) -> dict[str, float]:
        """Greedy responses (or episodes) for the held-out prompts, scored by the reward source (for an
        exact-match reward function, the mean is the accuracy; for an environment, also `eval/success`)."""
        if not self.held:
            return {}
        gen = self.rl.generation
        episodes = self.executor.run(self.held, SamplingParams(gen.max_new_tokens, temperature=0, stop_token_ids=gen.stop_token_ids))
        rollouts = episodes.rollouts
        return {"eval/reward": float(episodes.scores.mean()),  # a dropped episode scores 0: it failed
                **{f"eval/{k}": float(v.nanmean()) for k, v in episodes.stats.items()},
                "eval/response_length": sum(action_tokens(r) for r in rollouts) / len(rollouts)}


class Clock:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = now - self._last
        self._last = now


class RLTrainer:
    """The Trainer of TrainingRun for RL: checkpoints and the published model live in the worker groups."""

    is_main = True

    def __init__(self, roles: Roles, key: str, disconnect: Callable[[], None]):
        self.roles, self.key, self.disconnect = roles, key, disconnect
        self.trained = [g for g in (roles.actor, roles.critic) if g is not None]

    def latest_checkpoint(self) -> int | None:
        """The newest step every trained role has a verified checkpoint of."""
        common = set.intersection(*(set(g.call("published_steps")[0]) for g in self.trained))
        for step in sorted(common, reverse=True):
            if all(g.call("latest", {step})[0] == step for g in self.trained):
                return step
        return None

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        state = self.roles.actor.call("load_checkpoint", step)[0]
        if self.roles.critic:
            self.roles.critic.call("load_checkpoint", step)
        self.roles.sync_weights()
        return state

    def save_checkpoint(self, step: int, state: dict[str, Any]) -> None:
        self.roles.actor.call("save_checkpoint", step, state)
        if self.roles.critic:
            self.roles.critic.call("save_checkpoint", step, {})

    def publish(self, tokenizer, stage_uri: str, staging, files: Files, meta: dict[str, Any]):
        local = publish_dir(stage_uri, staging)
        (local / manifest.STAGE_MANIFEST).unlink(missing_ok=True)
        local.mkdir(parents=True, exist_ok=True)
        self.roles.actor.call("save_model", storage.join(stage_uri, "model"), self.key)
        # Nothing runs on Ray after the save: the workers' exit and the driver's disconnect (0.3 s in Ray's shutdown)
        # overlap the rest of the publish.
        leaving = threading.Thread(target=self._leave_ray, name="ray-disconnect")
        leaving.start()
        try:
            finish_publish(stage_uri, local, files, meta)
        finally:
            leaving.join()
        return local

    def _leave_ray(self) -> None:
        try:
            self.roles.shutdown()
            self.disconnect()
        except Exception as exc:  # the stage's `finally` stops the workers and disconnects again
            print(f"rl: stopping the worker groups after the model's save failed ({exc!r}); retried at the stage's end",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass
