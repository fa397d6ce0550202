"""DPO stage (DPO, cDPO, IPO, optional NLL term) with reference log-probs computed once.

Run by hand:  alignflow stage dpo --config configs/tiny-tulu3.yaml
              (finds its `from:` model published by `alignflow stage sft`; or pass --input from=URI)

The policy starts from the SFT model; the frozen reference is that same model, so its
log-probs of every chosen and rejected response are computed before the first step and
stored with the stage (`stages.common.reference`): no reference model in memory and no
reference forward per step. With LoRA, `reference: on_the_fly` computes them in each step
instead, as the policy with its adapter off. Log-probs are sums over response tokens; a pair is one row
with the prompt once (`stages.common.pairs`). The loss is a mean over the pairs of the whole optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from alignflow.config import PipelineConfig
from alignflow.stages.dpo.config import DPOConfig
from alignflow.stages.common.checkpoint import seed_everything
from alignflow.stages.common.models import load_causal_lm, load_tokenizer, with_lora
from alignflow.stages.common.pairs import Pair, load_pairs, pair_logps
from alignflow.stages.common.progress import Timer
from alignflow.stages.common.reference import Reference
from alignflow.stages.common.rowwise import RowBuffer, all_rows, step_rows
from alignflow.stages.common.run import TrainingRun, total_steps
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.dpo.losses import preference_loss

CURVES = ["train/loss", "train/rewards/accuracy", "train/rewards/margin", "eval/rewards/accuracy", "eval/rewards/margin", "train/pairs_per_s"]


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    dpo = run.section
    base = run.base_model()
    tokenizer = load_tokenizer(base)
    train, held, stats = load_pairs(run.data, tokenizer, dpo.batch.seed, f"{stage}.data")  # bad data fails before any model work
    steps = total_steps(len(train), dpo, "pairs")

    strategy = Strategy(dpo.deepspeed, dpo.batch, dpo.optim)
    seed_everything(dpo.batch.seed + strategy.rank)
    with strategy.model_init():
        model = with_lora(load_causal_lm(base, dpo.model), dpo.lora)
    strategy.prepare(model, steps)
    logps = lambda pairs: pair_logps(strategy.engine, pairs, tokenizer.pad_token_id, strategy.device)  # noqa: E731
    clock = Timer()
    # Before resume: the weights are still the reference's (and with LoRA the adapter is switched off).
    ref = Reference(strategy, dpo.reference, {
        "train": ([len(p) for p in train], lambda rows: logps([train[i] for i in rows])),
        "eval": ([len(p) for p in held], lambda rows: logps([held[i] for i in rows])),
    }, dpo.batch.micro_batch_size, run.out, run.staging)
    run.timings["time/reference_s"] = clock.lap()
    evaluate = lambda: held_out(strategy, held, ref, dpo, logps)  # noqa: E731
    run.start(strategy, steps, "pairs_per_s", evaluate)

    # ------------------------------------------------------------------ train
    run.train(lambda step: train_step(strategy, train, ref, step, dpo, logps), evaluate)

    # ------------------------------------------------------------------ publish
    return run.publish(tokenizer, CURVES, stats)


def loss_of(policy: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], dpo: DPOConfig):
    """`ref`: the reference's values of the same rows, in the same order."""
    device = policy["chosen"].device
    return preference_loss(policy["chosen"], policy["rejected"], ref["chosen"].to(device), ref["rejected"].to(device),
                           dpo.beta, dpo.loss, dpo.label_smoothing, policy["nll"], dpo.nll_weight)


def train_step(strategy: Strategy, train: list[Pair], ref: Reference, step: int, dpo: DPOConfig, logps) -> dict[str, float]:
    timer = Timer()
    indices, mine = step_rows(strategy, train, dpo.batch, step)
    lr, step_logps = strategy.lr(), RowBuffer(len(indices))
    step_ref = ref.rows("train", indices, mine)
    for micro in mine:
        policy = logps([train[indices[k]] for k in micro])
        loss, _ = loss_of(policy, {k: v[micro] for k, v in step_ref.items()}, dpo)
        strategy.backward(loss * (len(micro) / len(indices)))  # this micro-batch's share of the step mean
        strategy.step()
        step_logps.put(micro, policy)
    loss, m = loss_of(step_logps.gather(strategy), step_ref, dpo)
    seconds = timer.lap()
    return {"loss": float(loss), **{k: float(v) for k, v in m.items()}, "lr": lr, "grad_norm": strategy.grad_norm(),
            "pairs_per_s": len(indices) / seconds, "step_time_s": seconds}


def held_out(strategy: Strategy, held: list[Pair], ref: Reference, dpo: DPOConfig, logps) -> dict[str, float]:
    if not held:
        return {}
    policy = all_rows(strategy, [len(p) for p in held], dpo.batch.micro_batch_size, lambda rows: logps([held[i] for i in rows]))
    loss, m = loss_of(policy, ref.all("eval"), dpo)
    return {"eval/loss": float(loss), **{f"eval/{k}": float(v) for k, v in m.items()}}
