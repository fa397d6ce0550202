"""Reward-model stage: a causal LM backbone with a scalar head, trained on preference pairs.

Run by hand:  alignflow stage rm --config configs/tiny-ppo.yaml
              (finds its `from:` model published by `alignflow stage sft`; or pass --input from=URI)

The model is transformers' `AutoModelForSequenceClassification` with one label on top of the
SFT backbone; the score is read at the last non-padding token (the EOS ending the response).
A pair is one row with the prompt once (`stages.common.pairs`); its two scores are read at
the two EOS positions. After training, the mean and std of the reward over
the training responses go into the published `config.json` (`alignflow_reward_mean`/`_std`),
for the RL stage to normalise with; `alignflow.stages.rm.scoring.RewardScorer` loads it back.
"""

from __future__ import annotations

from typing import Any

import torch

from alignflow.config import PipelineConfig
from alignflow.stages.rm.config import RMConfig
from alignflow.stages.common.checkpoint import seed_everything
from alignflow.stages.common.models import REWARD_MEAN, REWARD_STD, load_reward_model, load_tokenizer, with_lora
from alignflow.stages.common.pairs import Pair, load_pairs, pair_rewards
from alignflow.stages.common.progress import Timer
from alignflow.stages.common.rowwise import RowBuffer, all_rows, step_rows
from alignflow.stages.common.run import TrainingRun, total_steps
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.rm.losses import pairwise_loss

CURVES = ["train/loss", "train/accuracy", "train/margin", "eval/accuracy", "eval/margin", "train/pairs_per_s"]


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    rm = run.section
    base = run.base_model()
    tokenizer = load_tokenizer(base)
    train, held, stats = load_pairs(run.data, tokenizer, rm.batch.seed, f"{stage}.data")  # bad data fails before any model work
    steps = total_steps(len(train), rm, "pairs")

    strategy = Strategy(rm.deepspeed, rm.batch, rm.optim)
    seed_everything(rm.batch.seed)  # the new score head starts the same on every rank
    with strategy.model_init():
        model = with_lora(load_reward_model(base, rm.model, tokenizer.pad_token_id), rm.lora, reward=True)
    seed_everything(rm.batch.seed + strategy.rank)
    strategy.prepare(model, steps)
    head = strategy.unwrap().score
    score = lambda pairs: pair_rewards(strategy.engine, head, pairs, tokenizer.pad_token_id, strategy.device)  # noqa: E731
    evaluate = lambda: held_out(strategy, held, rm, score)  # noqa: E731
    run.start(strategy, steps, "pairs_per_s", evaluate)

    # ------------------------------------------------------------------ train
    run.train(lambda step: train_step(strategy, train, step, rm, score), evaluate)

    # ------------------------------------------------------------------ publish
    norm = reward_normalization(strategy, train, rm.batch.micro_batch_size, score)
    strategy.unwrap().config.update({REWARD_MEAN: norm["reward/mean"], REWARD_STD: norm["reward/std"]})
    return run.publish(tokenizer, CURVES, stats, final=norm)


def margins(pairs: list[Pair], rm: RMConfig) -> torch.Tensor | None:
    return torch.tensor([p.margin for p in pairs]) if rm.data.margin_key or rm.data.margin_from else None


def train_step(strategy: Strategy, train: list[Pair], step: int, rm: RMConfig, score) -> dict[str, float]:
    timer = Timer()
    indices, mine = step_rows(strategy, train, rm.batch, step)
    lr, step_rewards = strategy.lr(), RowBuffer(len(indices))
    for micro in mine:
        pairs = [train[indices[k]] for k in micro]
        chosen, rejected = score(pairs)
        loss, _ = pairwise_loss(chosen, rejected, rm.loss, margins(pairs, rm))
        strategy.backward(loss * (len(micro) / len(indices)))  # this micro-batch's share of the step mean
        strategy.step()
        step_rewards.put(micro, {"chosen": chosen, "rejected": rejected})
    r = step_rewards.gather(strategy)
    loss, m = pairwise_loss(r["chosen"], r["rejected"], rm.loss, margins([train[i] for i in indices], rm))
    seconds = timer.lap()
    return {"loss": float(loss), **named(m), "lr": lr, "grad_norm": strategy.grad_norm(),
            "pairs_per_s": len(indices) / seconds, "step_time_s": seconds}


def held_out(strategy: Strategy, held: list[Pair], rm: RMConfig, score) -> dict[str, float]:
    if not held:
        return {}
    r = all_rows(strategy, [len(p) for p in held], rm.batch.micro_batch_size,
                 lambda rows: dict(zip(("chosen", "rejected"), score([held[i] for i in rows]))))
    loss, m = pairwise_loss(r["chosen"], r["rejected"], rm.loss, margins(held, rm))
    return {"eval/loss": float(loss), **named(m, "eval/")}


def named(metrics: dict[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    names = {"accuracy": "accuracy", "reward_chosen": "reward/chosen", "reward_rejected": "reward/rejected", "margin": "margin"}
    return {prefix + names[k]: float(v) for k, v in metrics.items()}


def reward_normalization(strategy: Strategy, train: list[Pair], micro: int, score) -> dict[str, float]:
    """Mean and std of the trained model's reward over every training response (chosen and rejected)."""
    r = all_rows(strategy, [len(p) for p in train], micro, lambda rows: dict(zip(("chosen", "rejected"), score([train[i] for i in rows]))))
    rewards = torch.cat([r["chosen"], r["rejected"]]).double()
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())}
