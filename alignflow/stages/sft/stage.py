"""SFT stage: next-token loss on response tokens, DeepSpeed, exact resume, HF publish.

Run by hand:   python -m alignflow.stages.sft --config configs/tiny.yaml [--set sft.optim.lr=1e-4]
Two workers:   torchrun --nproc_per_node 2 -m alignflow.stages.sft --config configs/tiny.yaml
Inside a job:  `main(cfg)` is what the Ray job calls.

Where this departs from the usual recipe: the loss is the mean over all response
tokens of the optimizer step (summed NLL / step token count, like TRL's
`average_tokens_across_devices`), not a mean of per-micro-batch means, so the
update does not depend on how the step is split over micro-batches and workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from alignflow.config import PipelineConfig, SFTConfig, Stage, dump_config
from alignflow.infra import manifest, storage
from alignflow.lineage import data_inputs, data_sources, stage_cache_key, stage_output_uri
from alignflow.stages.common.checkpoint import Checkpointer, seed_everything, staging_dir
from alignflow.stages.common.data import DataError, Sample, collate, global_batch, pack, rank_micro_batches, steps_per_epoch
from alignflow.stages.common.logprobs import token_logprobs
from alignflow.stages.common.models import load_causal_lm, load_tokenizer
from alignflow.stages.common.progress import MetricsLog, Timer
from alignflow.stages.common.publish import metrics_json, model_card, publish
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.common.tracking import StageTracking, plot_curves
from alignflow.stages.sft.data import load_sft_samples
from alignflow.stages.sft.losses import sft_loss

FAIL_AT_STEP_ENV = "ALIGNFLOW_FAIL_AT_STEP"  # tests: crash after this optimizer step (after its checkpoint)


class InjectedFailure(RuntimeError):
    """Raised at the step named by ALIGNFLOW_FAIL_AT_STEP, to test resume for real."""


@dataclass
class SFTData:
    train: list[Sample]
    held_out: list[Sample]
    stats: dict[str, Any]
    packed: bool

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.train]


def total_steps(num_train: int, sft: SFTConfig) -> int:
    per_epoch = steps_per_epoch(num_train, sft.batch.global_batch_size)
    if per_epoch == 0:
        raise DataError(
            f"{num_train} training rows{' after packing' if sft.data.packing else ''} are fewer than "
            f"batch.global_batch_size={sft.batch.global_batch_size}: not one optimizer step"
        )
    steps = per_epoch * sft.batch.epochs
    return min(steps, sft.batch.max_steps) if sft.batch.max_steps else steps


def main(cfg: PipelineConfig, output_uri: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    clock = Timer()
    sft = cfg.stage(Stage.SFT)
    fingerprints = data_inputs(sft)  # hashed once: the cache key and the manifest both use it
    key = stage_cache_key(cfg, Stage.SFT, data=fingerprints)
    out = output_uri or stage_output_uri(cfg, Stage.SFT, key)
    done = manifest.verify(out)
    if done is not None:
        print(f"sft: already complete at {out} (cache key {key})", flush=True)
        return {"stage": "sft", "uri": out, "cache_key": key, "cached": True, "metrics": done.meta.get("metrics", {})}

    tokenizer = load_tokenizer(sft.model)
    train, held, stats = load_sft_samples(sft.data, tokenizer, sft.batch.seed)  # bad data fails before any model work
    data = SFTData(pack(train, sft.data.max_len) if sft.data.packing else train,
                   pack(held, sft.data.max_len) if sft.data.packing else held, stats, sft.data.packing)
    steps = total_steps(len(data.train), sft)

    strategy = Strategy(sft.deepspeed, sft.batch, sft.optim)
    seed_everything(sft.batch.seed + strategy.rank)
    with strategy.model_init():
        model = load_causal_lm(sft.model)
    strategy.prepare(model, steps)
    checkpoints = Checkpointer(strategy, out, sft.checkpoint.keep_last, staging_dir(key))
    start, history = resume(checkpoints)
    log = MetricsLog(strategy.is_main, steps, sft.logging.progress, "tokens_per_s", history)
    tracking = StageTracking(strategy.is_main)
    log.add_sink(tracking.log_metrics)
    for record in history:  # a resumed attempt runs under a new MLflow run: give it the whole curve
        tracking.log_metrics(int(record["step"]), {k: v for k, v in record.items() if k != "step"})
    if start == 0:
        log.log(0, evaluate(strategy, data, sft.batch.micro_batch_size, tokenizer.pad_token_id), echo=True)

    # ------------------------------------------------------------------ train
    timings = {"time/setup_s": clock.lap()}
    fail_at = int(os.environ.get(FAIL_AT_STEP_ENV, 0))
    for step in range(start, steps):
        metrics = train_step(strategy, data, step, sft, tokenizer.pad_token_id)
        number = step + 1
        if number % sft.logging.eval_every == 0 or number == steps:
            metrics.update(evaluate(strategy, data, sft.batch.micro_batch_size, tokenizer.pad_token_id))
        log.log(number, metrics, echo=number % sft.logging.log_every == 0 or number == steps)
        if number % sft.checkpoint.every_steps == 0 and number < steps:
            checkpoints.save(number, {"history": log.history})
        if number == fail_at:
            raise InjectedFailure(f"{FAIL_AT_STEP_ENV}={fail_at}: failing after step {number}")
    log.close()
    timings["time/train_s"] = clock.lap()

    # ------------------------------------------------------------------ publish
    summary = publish_result(cfg, key, fingerprints, out, strategy, tokenizer, log, tracking, data, start, timings)
    strategy.close()
    return {"stage": "sft", "uri": out, "cache_key": key, "cached": False, "metrics": summary, "resumed_from_step": start or None}


def publish_result(cfg: PipelineConfig, key: str, fingerprints: dict[str, str], out: str, strategy: Strategy, tokenizer, log: MetricsLog,
                   tracking: StageTracking, data: SFTData, start: int, timings: dict[str, float]) -> dict[str, float]:
    """HF model + config + metrics + curves + model card, manifest last; artifacts to MLflow."""
    sft = cfg.stage(Stage.SFT)
    summary = {**log.summary(), **timings}
    if log.history and log.history[0]["step"] == 0 and "eval/loss" in log.history[0]:
        summary["eval/loss_initial"] = log.history[0]["eval/loss"]
    staging = staging_dir(key)
    files: dict[str, str | bytes] = {}
    if strategy.is_main:
        sources = {src: fingerprints[name] for name, src in data_sources(sft).items()}
        curves = plot_curves(log.history, ["loss", "eval/loss", "lr", "tokens_per_s"], staging / "curves.png")
        files = {
            "config.yaml": dump_config(cfg),
            "metrics.json": metrics_json(log.history, summary, {"data": data.stats, "resumed_from_step": start or None}),
            "MODEL_CARD.md": model_card("sft", sft.model.name_or_path, sources, sft.config_hash(), key, summary),
            "curves.png": curves.read_bytes(),
        }
    meta = {"stage": "sft", "cache_key": key, "config_hash": sft.config_hash(), "inputs": fingerprints,
            "metrics": summary, "mlflow_run_id": tracking.run_id}
    _, local = publish(strategy, tokenizer, out, staging, files, meta)
    tracking.log_artifacts([local / name for name in (*files, "MANIFEST.json")])
    if strategy.is_main:
        print(f"sft: published model to {storage.join(out, 'model')}\nsft: metrics in {storage.join(out, 'metrics.json')}", flush=True)
    return summary


def resume(checkpoints: Checkpointer) -> tuple[int, list[dict]]:
    step = checkpoints.latest()
    if step is None:
        return 0, []
    state = checkpoints.load(step)
    if checkpoints.strategy.is_main:
        print(f"sft: resumed from checkpoint at step {step}", flush=True)
    return step, state.get("history", [])


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
        logits = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False).logits
        loss, parts = sft_loss(token_logprobs(logits, batch.input_ids), batch.loss_mask, step_targets)
        strategy.backward(loss)
        strategy.step()  # DeepSpeed updates only at the accumulation boundary
        nll += float(parts["nll_sum"])
        real += batch.num_tokens
    nll_all, real_all = strategy.all_reduce_sum([nll, real])
    seconds = timer.lap()
    return {"loss": nll_all / step_targets, "lr": lr, "grad_norm": strategy.grad_norm(),
            "tokens": real_all, "tokens_per_s": real_all / seconds, "step_time_s": seconds}


@torch.no_grad()
def evaluate(strategy: Strategy, data: SFTData, micro: int, pad_id: int) -> dict[str, float]:
    """Token-mean NLL over the held-out set. Every rank runs the same number of forwards
    (ZeRO-3 gathers parameters collectively); surplus forwards are discarded."""
    if not data.held_out:
        return {}
    engine = strategy.engine
    engine.eval()
    chunks = [data.held_out[k:k + micro] for k in range(0, len(data.held_out), micro)]
    rounds = -(-len(chunks) // strategy.world_size)
    nll, targets = 0.0, 0.0
    for r in range(rounds):
        j = r * strategy.world_size + strategy.rank
        batch = collate(chunks[j if j < len(chunks) else 0], pad_id, data.packed).to(strategy.device)
        logits = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False).logits
        _, parts = sft_loss(token_logprobs(logits, batch.input_ids), batch.loss_mask, 1.0)
        if j < len(chunks):
            nll += float(parts["nll_sum"])
            targets += float(parts["tokens"])
    engine.train()
    nll_all, targets_all = strategy.all_reduce_sum([nll, targets])
    return {"eval/loss": nll_all / max(targets_all, 1.0)}
