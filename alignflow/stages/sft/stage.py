"""SFT stage: next-token loss on response tokens, DeepSpeed, exact resume, HF publish.

Run by hand:   python -m alignflow.stages --config configs/tiny.yaml --stage sft [--set sft.optim.lr=1e-4]
Two workers:   alignflow stage sft --config configs/tiny.yaml --nproc 2   (torchrun)
Inside a job:  `main(cfg, "sft")` is what the Ray job calls (the stage's name in the config).

Where this departs from the usual recipe: the loss is the mean over all response
tokens of the optimizer step (summed NLL / step token count, like TRL's
`average_tokens_across_devices`), not a mean of per-micro-batch means, so the
update does not depend on how the step is split over micro-batches and workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignflow.config import PipelineConfig
from alignflow.stages.sft.config import SFTConfig
from alignflow.stages.common.checkpoint import seed_everything
from alignflow.stages.common.data import Sample, collate, global_batch, pack, rank_micro_batches
from alignflow.stages.common.logprobs import forward_logprobs, sequence_logprobs
from alignflow.stages.common.models import load_causal_lm, load_tokenizer, with_lora
from alignflow.stages.common.progress import Timer
from alignflow.stages.common.rowwise import all_rows
from alignflow.stages.common.run import FAIL_AT_STEP_ENV, InjectedFailure, TrainingRun, total_steps  # noqa: F401 (re-exported)
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.sft.data import load_sft_samples
from alignflow.stages.sft.losses import sft_loss


@dataclass
class SFTData:
    train: list[Sample]
    held_out: list[Sample]
    stats: dict[str, Any]
    packed: bool

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.train]


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    sft = run.section
    base = run.base_model()
    tokenizer = load_tokenizer(base)
    train, held, stats = load_sft_samples(run.data, tokenizer, sft.batch.seed, f"{stage}.data")  # bad data fails before any model work
    data = SFTData(pack(train, sft.data.max_len) if sft.data.packing else train,
                   pack(held, sft.data.max_len) if sft.data.packing else held, stats, sft.data.packing)
    steps = total_steps(len(data.train), sft, "rows after packing" if sft.data.packing else "rows")

    strategy = Strategy(sft.deepspeed, sft.batch, sft.optim)
    seed_everything(sft.batch.seed + strategy.rank)
    with strategy.model_init():
        model = with_lora(load_causal_lm(base, sft.model), sft.lora)
    strategy.prepare(model, steps)
    evaluate = lambda: held_out_loss(strategy, data, sft.batch.micro_batch_size, tokenizer.pad_token_id)  # noqa: E731
    run.start(strategy, steps, "tokens_per_s", evaluate)

    # ------------------------------------------------------------------ train
    run.train(lambda step: train_step(strategy, data, step, sft, tokenizer.pad_token_id), evaluate)

    # ------------------------------------------------------------------ publish
    return run.publish(tokenizer, ["train/loss", "eval/loss", "train/lr", "train/tokens_per_s"], data.stats)


def train_step(strategy: Strategy, data: SFTData, step: int, sft: SFTConfig, pad_id: int) -> dict[str, float]:
    timer = Timer()
    engine = strategy.engine
    indices = global_batch(len(data.train), sft.batch.global_batch_size, step, sft.batch.seed)
    mine = rank_micro_batches(indices, data.lengths, sft.batch.micro_batch_size, strategy.world_size, strategy.rank)
    local_targets = sum(sum(data.train[i].loss_mask[1:]) for micro in mine for i in micro)
    (step_targets,) = strategy.all_reduce_sum([local_targets])
    lr = strategy.lr()
    nll, real = 0.0, 0
    for micro in mine:
        batch = collate([data.train[i] for i in micro], pad_id, data.packed).to(strategy.device)
        loss, parts = sft_loss(forward_logprobs(engine, batch), batch.loss_mask, step_targets)
        strategy.backward(loss)
        strategy.step()  # DeepSpeed updates only at the accumulation boundary
        nll += float(parts["nll_sum"])
        real += batch.num_tokens
    nll_all, real_all = strategy.all_reduce_sum([nll, real])
    seconds = timer.lap()
    return {"loss": nll_all / step_targets, "lr": lr, "grad_norm": strategy.grad_norm(),
            "tokens": real_all, "tokens_per_s": real_all / seconds, "step_time_s": seconds}


def held_out_loss(strategy: Strategy, data: SFTData, micro: int, pad_id: int) -> dict[str, float]:
    """Token-mean NLL over the held-out set."""
    if not data.held_out:
        return {}

    def forward(rows: list[int]) -> dict[str, torch.Tensor]:
        batch = collate([data.held_out[i] for i in rows], pad_id, data.packed).to(strategy.device)
        logps = forward_logprobs(strategy.engine, batch)
        return {"nll": -sequence_logprobs(logps, batch.loss_mask), "targets": batch.loss_mask[:, 1:].sum(-1)}

    sums = all_rows(strategy, [len(s) for s in data.held_out], micro, forward)
    return {"eval/loss": float(sums["nll"].sum() / sums["targets"].sum().clamp(min=1.0))}
