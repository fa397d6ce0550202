"""KTO stage: unpaired desirable / undesirable completions, reference log-probs computed once.

Run by hand:  alignflow stage kto --config configs/tiny-compare.yaml
              (finds its `from:` model published by `alignflow stage sft`; or pass --input from=URI)

The KL reference point of each optimizer step (see `losses.py`) pairs the prompt at position
k of the step's global batch with the completion at position k+1 (cyclically): mismatched
pairs from the batch itself, as in the paper. Batches are a function of (seed, step), so
these pairs are known before training and the reference's log-probs of them are computed
once with the rest (or, with LoRA and `reference: on_the_fly`, in each step with the adapter off). The policy's side is a no-gradient forward over the whole step before
its micro-batches, so every micro-batch and worker uses the same z0: the update does not
depend on how the step is split.
"""

from __future__ import annotations

from typing import Any

import torch

from alignflow.config import PipelineConfig
from alignflow.stages.kto.config import KTOConfig
from alignflow.stages.common.checkpoint import seed_everything
from alignflow.stages.common.data import Sample, global_batch
from alignflow.stages.common.models import load_causal_lm, load_tokenizer, with_lora
from alignflow.stages.common.progress import Timer
from alignflow.stages.common.reference import Reference, sequence_logps
from alignflow.stages.common.rowwise import RowBuffer, all_rows, step_rows
from alignflow.stages.common.run import TrainingRun, total_steps
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.kto.data import KTORow, load_kto_rows
from alignflow.stages.kto.losses import kto_loss, kto_reference_point

CURVES = ["train/loss", "train/kl", "train/rewards/margin", "eval/rewards/desirable", "eval/rewards/undesirable", "train/rows_per_s"]


class KTOData:
    """Rows as samples, their labels, and the mismatched samples behind each step's KL estimate."""

    def __init__(self, rows: list[KTORow], kto: KTOConfig, steps: int | None):
        self.samples = [r.sample() for r in rows]
        self.desirable = torch.tensor([r.desirable for r in rows], dtype=torch.bool)
        if steps is None:  # held-out rows: one fixed cyclic pairing
            self.mismatched = [rows[k].mismatched(rows[(k + 1) % len(rows)]) for k in range(len(rows))] if len(rows) > 1 else []
        else:  # training: step s, batch position k -> mismatched[s * G + k]
            self.mismatched = []
            for step in range(steps):
                idx = global_batch(len(rows), kto.batch.global_batch_size, step, kto.batch.seed)
                self.mismatched += [rows[i].mismatched(rows[idx[(k + 1) % len(idx)]]) for k, i in enumerate(idx)]

def lengths(samples: list[Sample]) -> list[int]:
    return [len(s) for s in samples]


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    kto = run.section
    base = run.base_model()
    tokenizer = load_tokenizer(base)
    train_rows, held_rows, stats = load_kto_rows(run.data, tokenizer, kto.batch.seed, f"{stage}.data")  # bad data fails before any model work
    steps = total_steps(len(train_rows), kto)
    train, held = KTOData(train_rows, kto, steps), KTOData(held_rows, kto, None)
    stats["desirable"] = {"train": int(train.desirable.sum()), "eval": int(held.desirable.sum())}

    strategy = Strategy(kto.deepspeed, kto.batch, kto.optim)
    seed_everything(kto.batch.seed + strategy.rank)
    with strategy.model_init():
        model = with_lora(load_causal_lm(base, kto.model), kto.lora)
    strategy.prepare(model, steps)
    logps = lambda samples: {"logps": sequence_logps(strategy.engine, samples, tokenizer.pad_token_id, strategy.device)}  # noqa: E731
    of = lambda samples: (lengths(samples), lambda rows: logps([samples[i] for i in rows]))  # noqa: E731
    clock = Timer()
    # Before resume: the weights are still the reference's (and with LoRA the adapter is switched off).
    ref = Reference(strategy, kto.reference, {"train": of(train.samples), "train_kl": of(train.mismatched),
                                              "eval": of(held.samples), "eval_kl": of(held.mismatched)},
                    kto.batch.micro_batch_size, run.out, run.staging)
    run.timings["time/reference_s"] = clock.lap()
    evaluate = lambda: held_out(strategy, held, ref, kto, logps)  # noqa: E731
    run.start(strategy, steps, "rows_per_s", evaluate)

    # ------------------------------------------------------------------ train
    run.train(lambda step: train_step(strategy, train, ref, step, kto, logps), evaluate)

    # ------------------------------------------------------------------ publish
    return run.publish(tokenizer, CURVES, stats)


def loss_of(policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, kto: KTOConfig):
    return kto_loss(policy, ref.to(policy.device), desirable.to(policy.device), kl, kto.beta, kto.desirable_weight, kto.undesirable_weight)


def train_step(strategy: Strategy, data: KTOData, ref: Reference, step: int, kto: KTOConfig, logps) -> dict[str, float]:
    timer = Timer()
    indices, mine = step_rows(strategy, data.samples, kto.batch, step)
    g, lr = len(indices), strategy.lr()
    first = step * g  # this step's mismatched samples are data.mismatched[first:first + g]
    ref_kl = ref.rows("train_kl", list(range(first, first + g)), mine)["logps"]
    step_ref = ref.rows("train", indices, mine)["logps"]
    with torch.no_grad():  # the policy's side of the KL reference point, over the whole step
        mismatched = RowBuffer(g)
        for micro in mine:
            mismatched.put(micro, logps([data.mismatched[first + k] for k in micro]))
        kl = kto_reference_point(mismatched.gather(strategy)["logps"], ref_kl)
    step_logps = RowBuffer(g)
    for micro in mine:
        rows = [indices[k] for k in micro]
        policy = logps([data.samples[i] for i in rows])["logps"]
        loss, _ = loss_of(policy, step_ref[micro], data.desirable[rows], kl, kto)
        strategy.backward(loss * (len(micro) / g))  # this micro-batch's share of the step mean
        strategy.step()
        step_logps.put(micro, {"logps": policy})
    loss, m = loss_of(step_logps.gather(strategy)["logps"], step_ref, data.desirable[indices], kl, kto)
    seconds = timer.lap()
    return {"loss": float(loss), **{k: float(v) for k, v in m.items()}, "lr": lr, "grad_norm": strategy.grad_norm(),
            "rows_per_s": g / seconds, "step_time_s": seconds}


def held_out(strategy: Strategy, data: KTOData, ref: Reference, kto: KTOConfig, logps) -> dict[str, float]:
    if len(data.samples) < 2:
        return {}
    micro = kto.batch.micro_batch_size
    policy = all_rows(strategy, lengths(data.samples), micro, lambda rows: logps([data.samples[i] for i in rows]))["logps"]
    policy_kl = all_rows(strategy, lengths(data.mismatched), micro, lambda rows: logps([data.mismatched[i] for i in rows]))["logps"]
    kl = kto_reference_point(policy_kl, ref.all("eval_kl")["logps"])
    loss, m = loss_of(policy, ref.all("eval")["logps"], data.desirable, kl, kto)
    return {"eval/loss": float(loss), **{f"eval/{k}": float(v) for k, v in m.items()}}
