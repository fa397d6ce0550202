"""The RL roles as Ray actors: actor (policy, trained), critic (trained, PPO only), reference
(frozen), reward model (frozen) and rollout (the generator). Thin shells: the math is in
`losses.py` / `advantages.py`, the training seam in `stages/common/strategy.py`.

Trained roles hold a DeepSpeed engine across their workers and see the whole step's
experience; each worker takes its micro-batches of each optimizer step (as in the other
stages), so a step's update does not depend on the number of workers. Frozen roles
(reference, reward model) get the whole batch too and each worker computes its share of the
rows; under ZeRO-3 their weights are partitioned over the group like the trained roles'.
Either way the rows form the same micro-batches for any number of workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from alignflow.stages.rl.config import RLConfig
from alignflow.infra import storage
from alignflow.stages.common.checkpoint import Checkpointer, seed_everything, staging_dir
from alignflow.stages.common.data import rank_micro_batches
from alignflow.stages.common.generation import HFGenerator, Rollout, SamplingParams
from alignflow.stages.common.models import is_lora, load_causal_lm, parameter_counts, load_reward_model, load_tokenizer, merged_state_dict, with_lora
from alignflow.stages.common.reference import adapter_off
from alignflow.stages.common.rowwise import RowBuffer, all_rows
from alignflow.stages.common.progress import peak_rss_mib
from alignflow.stages.common.workers import Worker
from alignflow.stages.rl.experience import Experience, response_logprobs, response_values
from alignflow.stages.rl.kl import kl_per_token
from alignflow.stages.rl.losses import aggregate, policy_loss, truncated_is_weight, value_loss


def per_row(strategy, micro: int, exp: Experience, forward, rows: list[int] | None = None) -> torch.Tensor:
    """(B, R) values of every row (or of `rows` only, 0 elsewhere), computed in micro-batches split over the group (a
    collective: every worker of the role calls it with the whole batch and the same `rows`, and every worker gets
    them all)."""
    rows = list(range(len(exp))) if rows is None else rows
    lengths = exp.lengths
    values = all_rows(strategy, [lengths[i] for i in rows], micro,
                      lambda chunk: {"v": forward(exp.micro_batch([rows[j] for j in chunk]).to(strategy.device))},
                      width=exp.mask.shape[1])
    out = torch.zeros(exp.mask.shape, dtype=torch.float32)
    if rows:
        out[rows] = values["v"]
    return out * exp.mask


def stochastic_forward(model: torch.nn.Module) -> bool:
    """Whether a forward in training mode draws dropout masks (a LoRA adapter's dropout, attention dropout)."""
    attention = float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0)
    return model.training and (attention > 0 or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()))


def frozen_strategy(rl: RLConfig):
    """The training seam for a forward-only role: process group and, under ZeRO-3, partitioned weights."""
    from alignflow.stages.common.strategy import Strategy

    return Strategy(rl.deepspeed, rl.batch, None)


def optimizer_batches(n: int, global_batch: int, seed: int, step: int, epoch: int) -> list[list[int]]:
    """The rows of each optimizer step over one pass of a rollout batch: a function of (seed, step, epoch)."""
    order = np.random.default_rng([seed, step, epoch]).permutation(n).tolist()
    return [order[k:k + global_batch] for k in range(0, n - global_batch + 1, global_batch)]


class TrainedRole(Worker):
    """Shared by actor and critic: engine, checkpoints, per-row inference across the group."""

    role = ""

    def _init(self, rl: RLConfig, load_model, optim, total_steps: int, stage_uri: str, key: str) -> torch.nn.Module:
        from alignflow.stages.common.strategy import Strategy

        self.rl = rl
        self.strategy = Strategy(rl.deepspeed, rl.batch, optim)
        with self.strategy.model_init():  # under ZeRO-3 the weights are partitioned as they load
            model = load_model()
        self.strategy.prepare(model, total_steps)
        self.checkpoints = Checkpointer(self.strategy, stage_uri, rl.checkpoint.keep_last, staging_dir(key, stage_uri), role=self.role)
        return model

    def _train(self, exp: Experience, step: int, micro_loss) -> dict[str, float]:
        """One pass per policy epoch over the rollout batch, one optimizer step per global batch.
        `micro_loss(sub, rows, num_tokens, num_sequences)` returns this micro-batch's share of the
        step loss and a dict of sums for the metrics."""
        rl, s, lengths = self.rl, self.strategy, exp.lengths
        sums: dict[str, float] = {}
        norms = []
        for epoch in range(rl.policy.epochs):
            for rows in optimizer_batches(len(exp), rl.batch.global_batch_size, rl.batch.seed, step, epoch):
                num_tokens = float(exp.mask[rows].sum().clamp(min=1))
                for micro in rank_micro_batches(rows, lengths, rl.batch.micro_batch_size, s.world_size, s.rank):
                    loss, parts = micro_loss(exp.micro_batch(micro).to(s.device), micro, num_tokens, float(len(rows)))
                    s.backward(loss)
                    s.step()
                    for k, v in parts.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                norms.append(s.grad_norm())
        keys = sorted(sums)
        totals = dict(zip(keys, s.all_reduce_sum([sums[k] for k in keys])))
        return {**totals, "grad_norm": float(np.mean(norms)), "lr": s.lr(), "optimizer_steps": len(norms)}

    def published_steps(self) -> list[int]:
        return self.checkpoints.published_steps()

    def latest(self, among: set[int] | None = None) -> int | None:
        return self.checkpoints.latest(among)

    def save_checkpoint(self, step: int, state: dict[str, Any]) -> None:
        self.checkpoints.save(step, state)

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        return self.checkpoints.load(step)


class ActorWorker(TrainedRole):
    role = "actor"

    def setup(self, rl: RLConfig, model_path: str, total_steps: int, stage_uri: str, key: str) -> None:
        seed_everything(rl.batch.seed)
        self.tokenizer = load_tokenizer(model_path)
        model = self._init(rl, lambda: with_lora(load_causal_lm(model_path, rl.model), rl.lora), rl.optim, total_steps, stage_uri, key)
        seed_everything(rl.batch.seed + self.strategy.rank)
        self.generator = None
        if rl.hybrid:  # the rollout engine is this worker: it samples from the very weights it trains
            training = model.training
            self.generator = HFGenerator(model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, rl.generation.batch_size)
            model.train(training)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """Hybrid layout: sample with the policy's own module (eval mode for the call: no dropout)."""
        model = self.generator.model
        training = model.training
        model.eval()
        try:
            return self.generator.generate(prompts, params)
        finally:
            model.train(training)

    def logprobs(self, exp: Experience, rows: list[int] | None = None) -> torch.Tensor:
        temperature = self.rl.generation.temperature
        return per_row(self.strategy, self.rl.batch.micro_batch_size, exp,
                       lambda sub: response_logprobs(self.strategy.engine, sub, temperature)[0], rows)

    def parameter_counts(self) -> tuple[int, int]:
        return parameter_counts(self.strategy.unwrap())

    def reference_logprobs(self, exp: Experience) -> torch.Tensor:
        """The reference's log-probs under LoRA: the policy with its adapter off (no reference role)."""
        with adapter_off(self.strategy):
            return self.logprobs(exp)

    def train(self, exp: Experience, old_logp: torch.Tensor | None, advantages: torch.Tensor, ref_logp: torch.Tensor | None,
              kl_coef: float, step: int) -> dict[str, float]:
        """`old_logp` None: the generator's log-probs stand in for the old ones (`policy.old_logprobs: auto`), checked
        by `_old_logprobs` on the first micro-batch."""
        rl = self.rl
        kl_in_loss = ref_logp is not None and rl.kl.placement == "loss" and kl_coef > 0
        old_state: dict[str, Any] = {"old": old_logp}

        def micro_loss(sub: Experience, rows: list[int], num_tokens: float, num_sequences: float):
            r = sub.mask.shape[1]
            logp, entropy = response_logprobs(self.strategy.engine, sub, rl.generation.temperature, with_entropy=True)
            if old_state["old"] is None:
                old_state.update(self._old_logprobs(exp, sub, rows, logp.detach()))
            old = old_state["old"][rows, :r].to(logp.device)
            cap, floor = rl.generation.importance_cap, rl.generation.importance_floor
            weight = truncated_is_weight(old, sub.sampled_logp, sub.mask, cap, floor) if cap is not None else None
            loss, m = policy_loss(logp, old, advantages[rows, :r], sub.mask, rl.policy.clip_low, rl.policy.clip_high,
                                  rl.policy.dual_clip, rl.policy.aggregation, num_tokens, num_sequences, weight)
            tokens = sub.mask.sum()
            parts = {"policy_loss": loss.detach(), "clip_tokens": m["clip_frac"] * tokens, "tokens": tokens,
                     "entropy_sum": (entropy.detach() * sub.mask).sum(), "approx_kl_sum": m["approx_kl"] * tokens}
            if rl.policy.entropy_coef:
                loss = loss - rl.policy.entropy_coef * aggregate(entropy, sub.mask, rl.policy.aggregation, num_tokens, num_sequences)
            if kl_in_loss:
                kl = kl_per_token(logp, ref_logp[rows, :r].to(logp.device), rl.kl.estimator)
                kl_loss = kl_coef * aggregate(kl, sub.mask, rl.policy.aggregation, num_tokens, num_sequences)
                loss = loss + kl_loss
                parts["kl_loss"] = kl_loss.detach()
            return loss, parts

        sums = self._train(exp, step, micro_loss)
        steps = max(1, sums["optimizer_steps"])
        checked = {k: old_state[k] for k in ("logprob_mismatch", "old_logprob_pass", "old_logprob_rows") if k in old_state}
        return {**checked, "policy_loss": sums["policy_loss"] / steps, "clip_frac": sums["clip_tokens"] / max(sums["tokens"], 1),
                "entropy": sums["entropy_sum"] / max(sums["tokens"], 1), "approx_kl": sums["approx_kl_sum"] / max(sums["tokens"], 1),
                **({"kl_loss": sums["kl_loss"] / steps} if "kl_loss" in sums else {}),
                "grad_norm": sums["grad_norm"], "lr": sums["lr"], "actor_peak_rss_mib": peak_rss_mib()}

    def _old_logprobs(self, exp: Experience, first: Experience, first_rows: list[int], logp: torch.Tensor) -> dict[str, Any]:
        """The old log-probs of the whole batch, decided on the step's first micro-batch: no update has happened
        yet, so `logp` are the old policy's own. When the generator's log-probs of the same tokens are within
        `policy.old_logprob_tolerance` of them (mean per token over every rank's first micro-batch), they are the
        old log-probs; otherwise the no-grad pass runs now, still at the old weights (every rank decides alike),
        over the rows that no rank's first micro-batch has just scored (`_rescore`)."""
        gap, tokens = self.strategy.all_reduce_sum([float(((logp - first.sampled_logp).abs() * first.mask).sum()),
                                                    float(first.mask.sum())])
        mismatch = gap / max(tokens, 1.0)
        if mismatch <= self.rl.policy.old_logprob_tolerance:
            return {"old": exp.sampled_logp, "logprob_mismatch": mismatch, "old_logprob_pass": 0.0, "old_logprob_rows": 0.0}
        old, rows = self._rescore(exp, first_rows, logp)
        return {"old": old, "logprob_mismatch": mismatch, "old_logprob_pass": 1.0, "old_logprob_rows": float(rows)}

    def _rescore(self, exp: Experience, first_rows: list[int], logp: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(old log-probs of every row, rows the pass scored). Each rank's first micro-batch ran at the old weights,
        so its `logp` are old log-probs already (half the batch of a GRPO step of two optimizer steps): they are
        summed over ranks and the pass scores the rest. Not where the training forward draws dropout masks: there
        the pass, in eval mode, scores every row."""
        if stochastic_forward(self.strategy.unwrap()):
            return self.logprobs(exp), len(exp)
        known = RowBuffer(len(exp), exp.mask.shape[1])
        known.put(first_rows, {"logp": logp, "scored": torch.ones_like(logp)})
        got = known.gather(self.strategy)
        rest = got["scored"][:, 0].eq(0).nonzero().flatten().tolist()
        return got["logp"] + self.logprobs(exp, rest), len(rest)  # both 0 where the mask is

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (gathered under ZeRO-3; every rank must call); LoRA: merged, under the base
        model's names. The engines load full weights either way (see README, LoRA)."""
        state = self.strategy.full_state_dict()
        model = self.strategy.unwrap()
        if state is not None:  # a tied weight under each of its names: engines load by name (vLLM's lm_head)
            first: dict[int, str] = {}
            for name, param in model.named_parameters(remove_duplicate=False):
                if first.setdefault(id(param), name) != name:
                    state.setdefault(name, state[first[id(param)]])
        return merged_state_dict(model, state) if state is not None and is_lora(model) else state

    def adapter(self):
        """(PEFT config, adapter weights in PEFT's file names) on rank 0, None elsewhere: what vLLM loads as a LoRA
        adapter. Only the trained parameters are gathered (every rank must call)."""
        from peft import get_peft_model_state_dict

        state = self.strategy.full_state_dict(trained_only=True)
        if state is None:
            return None
        model = self.strategy.unwrap()
        return model.peft_config["default"], get_peft_model_state_dict(model, state_dict=state)

    def save_model(self, model_uri: str, key: str) -> None:
        """The HF folder of the policy: written in place when storage is local, else staged and uploaded."""
        from alignflow.stages.common.publish import ADAPTER_DIR, save_hf_model

        stage_uri = model_uri.rsplit("/", 1)[0]
        local = storage.local_path(model_uri) if storage.is_local(model_uri) else staging_dir(key, stage_uri) / "actor-model" / "model"
        save_hf_model(self.strategy, self.tokenizer, local)  # LoRA: and the adapter beside it
        if self.strategy.is_main and not storage.is_local(model_uri):
            storage.upload_dir(local, model_uri)
            if (local.parent / ADAPTER_DIR).is_dir():
                storage.upload_dir(local.parent / ADAPTER_DIR, storage.join(stage_uri, ADAPTER_DIR))
        self.strategy.barrier()


class CriticWorker(TrainedRole):
    role = "critic"

    def setup(self, rl: RLConfig, model_path: str, pad_id: int, total_steps: int, stage_uri: str, key: str) -> None:
        seed_everything(rl.batch.seed + 1)  # a new value head starts the same on every rank
        model = self._init(rl, lambda: load_reward_model(model_path, rl.model, pad_id), rl.critic.optim, total_steps, stage_uri, key)
        self.head = model.score

    def values(self, exp: Experience) -> torch.Tensor:
        return per_row(self.strategy, self.rl.batch.micro_batch_size, exp,
                       lambda sub: response_values(self.strategy.engine, self.head, sub))

    def train(self, exp: Experience, old_values: torch.Tensor, returns: torch.Tensor, step: int) -> dict[str, float]:
        clip = self.rl.critic.value_clip

        def micro_loss(sub: Experience, rows: list[int], num_tokens: float, num_sequences: float):
            r = sub.mask.shape[1]
            values = response_values(self.strategy.engine, self.head, sub)
            loss, m = value_loss(values, old_values[rows, :r], returns[rows, :r], sub.mask, clip, num_tokens)
            tokens = sub.mask.sum()
            return loss, {"value_loss": loss.detach(), "value_clip_tokens": m["value_clip_frac"] * tokens, "tokens": tokens}

        sums = self._train(exp, step, micro_loss)
        return {"value_loss": sums["value_loss"] / max(1, sums["optimizer_steps"]),
                "value_clip_frac": sums["value_clip_tokens"] / max(sums["tokens"], 1), "critic_grad_norm": sums["grad_norm"]}


class ReferenceWorker(Worker):
    def setup(self, rl: RLConfig, model_path: str) -> None:
        self.rl, self.strategy = rl, frozen_strategy(rl)
        with self.strategy.model_init():  # under ZeRO-3 the weights are partitioned as they load
            model = load_causal_lm(model_path, rl.model)
        self.strategy.prepare_frozen(model)

    def logprobs(self, exp: Experience) -> torch.Tensor:
        temperature = self.rl.generation.temperature
        return per_row(self.strategy, self.rl.batch.micro_batch_size, exp,
                       lambda sub: response_logprobs(self.strategy.engine, sub, temperature)[0])


class RewardModelWorker(Worker):
    def setup(self, rl: RLConfig, model_path: str) -> None:
        from alignflow.stages.rm.scoring import RewardScorer

        self.strategy = frozen_strategy(rl)
        with self.strategy.model_init():
            self.scorer = RewardScorer(model_path, self.strategy.device, rl.model.dtype, rl.reward.normalize, rl.generation.batch_size)
        self.strategy.prepare_frozen(self.scorer.model)  # the scorer runs the module; under ZeRO-3 its hooks gather weights

    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """(N,) scores of all sequences (a collective, like `per_row`): one scorer batch per forward."""
        return all_rows(self.strategy, [len(s) for s in sequences], self.scorer.batch_size,
                        lambda rows: {"score": self.scorer.score_ids([sequences[i] for i in rows])})["score"]
