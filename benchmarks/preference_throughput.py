"""Preference training throughput: alignflow's DPO and RM stages against TRL's `DPOTrainer` and `RewardTrainer`.

Run:   .venv/bin/python benchmarks/preference_throughput.py [--stage dpo|rm|dpo,rm] [--steps 57] [--warmup 5]
                                                            [--model builtin:tiny|builtin:small] [--repeats 1]
                                                            [--wait-idle 0] [--json out.json]
                                                            [--frameworks alignflow,trl,trl-precompute]

Each (stage, framework) pair runs in its own subprocess (this same file with `--worker ...`), one after another,
with the same torch thread count (all cores this process may use) and the same environment (`worker_env` of
benchmarks/sft_throughput.py, whose helpers this file reuses). The parent prints one markdown table per stage and,
with --json, writes every figure and every per-step record.

Variants
- dpo: `alignflow` (alignflow/stages/dpo/stage.py: reference log-probs computed ONCE for the whole training set
  before step 1, no reference model kept), `trl` (DPOTrainer with its default `precompute_ref_log_probs=False`:
  a second, frozen model runs a reference forward on every micro-batch) and `trl-precompute` (DPOTrainer with
  `precompute_ref_log_probs=True`: TRL's own one-time pass, in `DPOTrainer.__init__`).
- rm: `alignflow` (alignflow/stages/rm/stage.py) and `trl` (RewardTrainer).

The same work on both sides
- model: the same local HF folder (`builtin:tiny` by default), fp32, sdpa attention, no gradient checkpointing
  (TRL's configs default to gradient checkpointing and bf16; both are turned off explicitly). DPO:
  `AutoModelForCausalLM`; RM: `AutoModelForSequenceClassification` with num_labels=1 and
  `config.pad_token_id = tokenizer.pad_token_id` on both sides (alignflow: `load_reward_model`).
- data: data/preference/train.jsonl, all 2000 pairs for training (alignflow: `data.eval_fraction=0`, no eval file).
  alignflow renders the prompt with the tokenizer's chat template and tokenizes `response + eos` after it; TRL gets
  conversational rows (prompt=[user turn], chosen/rejected=[assistant turn]). With this template both give the same
  token ids (DPO: also the same prompt/response split, i.e. the same log-prob mask); the TRL worker checks this
  against alignflow's own `load_pairs` before training (`same_tokens_as_alignflow`).
- batch: 32 pairs per optimizer step = micro-batch 16 pairs x 2 gradient-accumulation steps, one process, max
  length 64. A micro-batch of 16 pairs is one (32, T) forward on both sides (chosen rows, then rejected rows).
  The loss is the mean over the step's 32 pairs on both sides (TRL: mean per micro-batch / 2 accumulation steps).
- losses: DPO sigmoid loss (alignflow `loss: dpo`, TRL `loss_type=["sigmoid"]`), beta 0.1, no label smoothing, no
  NLL term; log-probs are sums over response tokens on both sides. RM: -log sigmoid(r_chosen - r_rejected), no
  margin, no reward centring.
- optimizer: torch.optim.AdamW (non-fused, the same implementation on both sides), lr 1e-3, betas (0.9, 0.95),
  eps 1e-8, no weight decay, grad-norm clipping at 1.0, 5 warmup steps then cosine to 0.1 x lr (HF's warmup starts
  at lr 0; this does not change the work).
- steps: `--warmup` + `--steps` optimizer steps; the first `--warmup` are not timed. The defaults (5 + 57 = 62)
  are exactly one epoch of the 2000 pairs (62 full steps; the incomplete tail of 16 pairs is dropped by
  alignflow, and the TRL worker drops it too by trimming its prepared dataset to 1984 pairs).

What is measured
- step time: alignflow: `train/step_time_s` of the published metrics.json (from entering `train_step`: batch selection,
  collation, forward/backward of both micro-batches, DeepSpeed step with clipping, optimizer and LR scheduler).
  TRL: from the call of `Trainer.get_batch_samples` for the step (data loading + collation) to the `on_step_end`
  callback (after clip, optimizer, scheduler, zero_grad): the same scope; logging, eval and saving are outside it on
  both sides. For TRL's default DPO this includes the per-step reference forward (that is where TRL does it).
- pairs/s (per step): 32 x timed steps / summed step time of the timed steps (the time-weighted mean of the per-step
  rates). "loop wall" is first timed step start -> last timed step end, so it also holds what runs between steps
  (per-step metric logging on both sides).
- reference pass (DPO): alignflow: `time/reference_s` of the metrics.json summary (log-probs of every training pair
  under the starting model, micro-batches of 16 pairs, plus writing them next to the stage output). trl-precompute:
  wall time of `DPOTrainer._precompute_ref_logps` for the training set (its DataLoader at
  `precompute_ref_batch_size=16` pairs, the forwards, and caching the result as a `datasets` column). trl: none (0).
- one epoch (DPO): pairs/s = pairs of one epoch (62 x 32 = 1984) / (reference pass + step time of one epoch).
  When the run has at least 62 steps the step time of the first 62 steps is used ("measured", warmup steps included);
  otherwise it is estimated as 62 x the mean timed step time ("est."). The RM has no reference pass, so its epoch
  figure would be its per-step figure and is not shown.
- tokens/step: real (non-pad) tokens of the step's forwards, counted from the collated batches on both sides
  (alignflow: by wrapping `stages.common.pairs.collate_pairs` during the training steps; TRL: `attention_mask.sum()`
  of the collated micro-batches). "padded" is the tensor size (rows x width), i.e. what the forwards computed.
  alignflow runs a pair as ONE row with the prompt once (`prompt | chosen | rejected`, a 4D mask hides the chosen
  tokens from the rejected ones; prefix sharing, Wang et al. 2024), TRL as two rows that each repeat the prompt, so
  alignflow's tokens/step are fewer for the same pairs: that is one of the two speed levers being measured (the
  other is DPO's one-time reference pass). The per-pair outputs are the same (tests/unit/test_preference_data.py).

Differences that remain (each is part of what the framework does; none changes the work per pair)
- batch composition: alignflow sorts the 32 pairs of a step by length before cutting micro-batches (less padding);
  TRL's default sampler does not. Its reference pass also length-sorts; TRL's precompute DataLoader goes in dataset
  order. See the padded column.
- the LM head (DPO): TRL computes per-token log-probs in chunks with a fused LM head (no full logits tensor), and
  also entropy, mean logits and top-1 accuracy of every micro-batch, with several `.item()` syncs (metrics);
  alignflow materialises the logits and takes a log-softmax over them.
- metrics: TRL's RewardTrainer also computes min/mean/max reward, accuracy and margin per micro-batch (`.item()`);
  alignflow computes its step metrics once per step from the per-pair values.
- RM after training: alignflow scores every training response once more after the last step (mean/std for reward
  normalisation, published in config.json). That is outside the timed steps and not counted here.
- truncation: alignflow cuts a response at max_len; TRL's RewardTrainer drops pairs longer than max_length and its
  DPO collator truncates like alignflow. With these samples (12-18 tokens per sequence with the tiny tokenizer) nothing is cut or dropped; the
  worker records how many pairs TRL kept (`rows_prepared`).
- engine: alignflow runs the model inside a DeepSpeed ZeRO-0 engine (fp32), TRL inside `transformers.Trainer` +
  accelerate. TRL disables dropout (`disable_dropout=True`); the built-in models have none.
- different (random) batch orders and score-head initialisations on the two sides, so losses are comparable only
  roughly.

Noise: the table's "other CPU load" column is the share of all cores that other processes used while each worker
ran (from /proc/stat minus the worker's own CPU time). On a 2-core machine a competing process slows these
small-kernel workloads a lot (see sft_throughput.py), so a run with more than ~5% is flagged and should not be
compared. `--wait-idle SECONDS` waits for an idle machine before each run; `--repeats N` runs the settings
round-robin N times and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_throughput import (add_precision_argument, busy_cpu_seconds, children_cpu_seconds, cpu_threads,  # noqa: E402
                            wait_until_idle, worker_env)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "tiny.yaml"
DEFAULT_DATA = ROOT / "data" / "preference" / "train.jsonl"

GLOBAL_BATCH = 32  # pairs per optimizer step
MICRO_BATCH = 16  # pairs per forward/backward (one (32, T) batch: chosen rows, then rejected rows)
MAX_LEN = 64
LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
GRAD_CLIP = 1.0
LR_WARMUP = 5
MIN_LR_RATIO = 0.1
BETA = 0.1
SEED = 42
NEVER = 10**9  # eval / checkpoint / log cadence that never triggers inside the run

VARIANTS = {"dpo": ("alignflow", "trl", "trl-precompute"), "rm": ("alignflow", "trl")}
LABELS = {
    ("dpo", "alignflow"): "reference log-probs once, before step 1; prompt once per pair",
    ("dpo", "trl"): "reference model forward every step (TRL default)",
    ("dpo", "trl-precompute"): "precompute_ref_log_probs=True",
    ("rm", "alignflow"): "one row per pair, prompt once (prefix sharing)",
    ("rm", "trl"): "chosen + rejected rows in one forward",
}


# =========================================================================== workers (one per subprocess)


def worker_alignflow(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from alignflow.config import load_config
    from alignflow.stages.common.models import resolve_model_path

    if args.stage == "dpo":
        from alignflow.stages.dpo import stage
    else:
        from alignflow.stages.rm import stage

    s = args.stage
    total = args.warmup + args.steps
    overrides = [
        "name=throughput-bench",
        "register.enabled=false",  # the stage runs standalone from the model folder given below (no `from:`):
        # beside tiny.yaml's sft stage it is a second final model, and the benchmark registers nothing
        f"storage.root={args.tmp}/outputs",
        f"{s}.model.name_or_path={resolve_model_path(args.model)}",
        f"{s}.model.dtype=float32",
        f"{s}.model.attn_implementation=sdpa",
        f"{s}.model.gradient_checkpointing=false",
        f"{s}.data.path={args.data}",
        f"{s}.data.eval_path=",  # None: no held-out file ...
        f"{s}.data.eval_fraction=0.0",  # ... and no held-out split: every pair trains, eval is a no-op
        f"{s}.data.max_len={MAX_LEN}",
        f"{s}.batch.global_batch_size={GLOBAL_BATCH}",
        f"{s}.batch.micro_batch_size={MICRO_BATCH}",
        f"{s}.batch.max_steps={total}",
        f"{s}.batch.epochs=100000",  # max_steps decides
        f"{s}.batch.seed={SEED}",
        f"{s}.optim.lr={LR}",
        f"{s}.optim.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"{s}.optim.eps={EPS}",
        f"{s}.optim.weight_decay=0.0",
        f"{s}.optim.grad_clip={GRAD_CLIP}",
        f"{s}.optim.warmup_steps={LR_WARMUP}",
        f"{s}.optim.scheduler=cosine",
        f"{s}.optim.min_lr_ratio={MIN_LR_RATIO}",
        f"{s}.deepspeed.zero_stage=0",
        f"{s}.deepspeed.precision={args.precision}",
        f"{s}.logging.eval_every={NEVER}",
        f"{s}.logging.log_every={NEVER}",
        f"{s}.logging.progress=false",
        f"{s}.checkpoint.every_steps={NEVER}",
    ]
    if s == "dpo":
        overrides += ["dpo.loss=dpo", f"dpo.beta={BETA}", "dpo.label_smoothing=0.0", "dpo.nll_weight=0.0"]
    else:
        overrides += ["rm.loss=sigmoid", "rm.data.margin_key="]
    cfg = load_config(args.config, overrides)

    spans: list[tuple[float, float]] = []
    counts: list[dict[str, int]] = []
    current: dict[str, int] | None = None
    from alignflow.stages.common import pairs as pairs_module

    train_step, collate_pairs = stage.train_step, pairs_module.collate_pairs

    def counted_collate_pairs(pairs, pad_id):  # tokens of the training steps only (not the reference pass or eval)
        batch = collate_pairs(pairs, pad_id)
        if current is not None:
            current["tokens"] += sum(len(p) for p in pairs)  # real tokens of the shared-prompt rows
            current["padded"] += int(batch.input_ids.numel())
            current["micro_rows"].append(len(pairs))  # pairs per forward (packed into fewer rows)
        return batch

    def timed_train_step(*a, **k):  # loop wall time and token counts; per-step figures come from metrics.json
        nonlocal current
        current = {"tokens": 0, "padded": 0, "micro_rows": []}
        t0 = time.perf_counter()
        try:
            return train_step(*a, **k)
        finally:
            spans.append((t0, time.perf_counter()))
            counts.append(current)
            current = None

    stage.train_step = timed_train_step  # main() and pair_logps / pair_rewards look the names up at call time
    pairs_module.collate_pairs = counted_collate_pairs
    result = stage.main(cfg, s, output_uri=str(Path(args.tmp) / f"{s}-out"))
    metrics = json.loads((Path(result["uri"]) / "metrics.json").read_text())
    history = [h for h in metrics["history"] if h["step"] >= 1 and "train/step_time_s" in h]
    if len(history) != total or len(spans) != total:
        raise RuntimeError(f"expected {total} steps, metrics.json has {len(history)}, timed {len(spans)}")
    for i, c in enumerate(counts):
        if c["micro_rows"] != [MICRO_BATCH] * (GLOBAL_BATCH // MICRO_BATCH):  # one shared-prompt block per pair
            raise RuntimeError(f"alignflow step {i + 1} ran forwards of {c['micro_rows']} pairs, expected 2 x {MICRO_BATCH}")
    steps = [
        {"step": h["step"], "pairs": GLOBAL_BATCH, "tokens": counts[i]["tokens"], "padded": counts[i]["padded"],
         "step_time_s": h["train/step_time_s"], "pairs_per_s_reported": h.get("train/pairs_per_s"), "loss": h["train/loss"],
         "t_begin": spans[i][0], "t_end": spans[i][1]}
        for i, h in enumerate(history)
    ]
    import deepspeed

    out: dict[str, Any] = {
        "steps": steps,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "train_pairs": metrics.get("data", {}).get("train", {}).get("used"),
        "summary_timings": {k: v for k, v in metrics.get("summary", {}).items() if k.startswith("time/")},
    }
    if s == "dpo":
        out["reference_s"] = metrics["summary"]["time/reference_s"]
    return out


def preference_rows(path: str) -> list[dict[str, Any]]:
    """The JSONL rows as TRL conversational preference rows."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]}
        for r in rows
    ]


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    from alignflow.stages.common.models import resolve_model_path

    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # as alignflow's load_tokenizer
        tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.Dataset.from_list(preference_rows(args.data))
    common = dict(
        output_dir=str(Path(args.tmp) / "trl-out"),
        max_steps=total,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GLOBAL_BATCH // MICRO_BATCH,
        max_length=MAX_LEN,
        learning_rate=LR,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, non-fused, as alignflow
        max_grad_norm=GRAD_CLIP,
        warmup_steps=LR_WARMUP,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
        bf16=args.precision == "bf16", fp16=False, gradient_checkpointing=False,  # bf16: autocast, fp32 weights
        use_cpu=True,
        eval_strategy="no", save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False,
        seed=SEED, data_seed=SEED,
    )

    precompute: dict[str, float] = {}
    if args.stage == "dpo":
        from trl import DPOConfig, DPOTrainer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        config = DPOConfig(
            **common,
            loss_type=["sigmoid"], beta=BETA, label_smoothing=0.0,
            precompute_ref_log_probs=args.worker == "trl-precompute",
            precompute_ref_batch_size=MICRO_BATCH,  # as alignflow's reference pass: 16 pairs per forward
        )
        base = DPOTrainer
    else:
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32, attn_implementation="sdpa")
        model.config.pad_token_id = tokenizer.pad_token_id  # as alignflow's load_reward_model
        config = RewardConfig(**common)
        base = RewardTrainer
    model.config.use_cache = False

    class Timing(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.losses: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    class Timed(base):  # type: ignore[misc, valid-type]
        """Records when each optimizer step starts fetching its micro-batches, their tokens and shapes, and how long
        TRL's one-time reference pass takes (DPO with precompute_ref_log_probs=True; it runs inside __init__)."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fetch: list[float] = []
            self.tokens: list[int] = []
            self.padded: list[int] = []
            self.micro_rows: list[list[int]] = []

        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            precompute[name] = precompute.get(name, 0.0) + time.perf_counter() - t0
            return out

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            t0 = time.perf_counter()
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                self.fetch.append(t0)
                self.tokens.append(sum(int(b["attention_mask"].sum()) for b in batches))
                self.padded.append(sum(int(b["input_ids"].numel()) for b in batches))
                self.micro_rows.append([int(b["input_ids"].shape[0]) for b in batches])
            return batches, num_items

    timing = Timing()
    trainer = Timed(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timing])
    same = same_tokens_as_alignflow(trainer.train_dataset, tokenizer, args)
    rows_prepared = len(trainer.train_dataset)
    # Drop the incomplete tail (as alignflow does) so every optimizer step has 2 full micro-batches of 16 pairs.
    # The reference log-probs (trl-precompute) were computed for all prepared pairs, as alignflow's are.
    trainer.train_dataset = trainer.train_dataset.select(range(rows_prepared - rows_prepared % GLOBAL_BATCH))
    info: dict[str, Any] = {
        "attn_implementation": model.config._attn_implementation,
        "same_tokens_as_alignflow": same,
        "rows_input": len(dataset),
        "rows_prepared": rows_prepared,  # pairs after TRL's tokenization and length filter
        "rows_used": len(trainer.train_dataset),
        "bf16": bool(config.bf16),
    }
    if args.stage == "dpo":
        info["reference_model_per_step"] = trainer.ref_model is not None
        info["precompute_s"] = dict(precompute)
        if args.worker == "trl-precompute":
            if "train" not in precompute:
                raise RuntimeError("precompute_ref_log_probs=True, but TRL's reference pass did not run (a cached file?)")
            info["reference_s"] = precompute["train"]
        else:
            info["reference_s"] = 0.0  # the reference forward runs inside every step
    trainer.train()
    info["gradient_checkpointing"] = bool(getattr(trainer.model, "is_gradient_checkpointing", False))  # Trainer turns it on in train()

    n = len(timing.end)
    if n != total or len(trainer.fetch) < n or len(timing.begin) != n:
        raise RuntimeError(f"expected {total} steps, got {n} step ends, {len(timing.begin)} begins, {len(trainer.fetch)} fetches")
    accumulation = GLOBAL_BATCH // MICRO_BATCH
    for i, rows in enumerate(trainer.micro_rows[:n]):
        if rows != [2 * MICRO_BATCH] * accumulation:  # each micro-batch: 16 chosen + 16 rejected rows
            raise RuntimeError(f"TRL step {i + 1} got micro-batches of {rows} rows, expected {accumulation} x {2 * MICRO_BATCH}")
    steps = [
        {"step": i + 1, "pairs": GLOBAL_BATCH, "tokens": trainer.tokens[i], "padded": trainer.padded[i],
         "step_time_s": timing.end[i] - trainer.fetch[i], "compute_time_s": timing.end[i] - timing.begin[i],
         "loss": timing.losses[i] if i < len(timing.losses) else None,
         "t_begin": trainer.fetch[i], "t_end": timing.end[i]}
        for i in range(n)
    ]
    trl_num_tokens = int(trainer._total_train_tokens)
    info["trl_num_tokens"] = trl_num_tokens
    info["tokens_match_trl_num_tokens"] = trl_num_tokens == sum(trainer.tokens[:n])
    return {
        "steps": steps,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        **info,
    }


def same_tokens_as_alignflow(prepared, tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    """Whether TRL's tokenized pairs equal alignflow's (as multisets). DPO: prompt+chosen and prompt+rejected ids with
    their response masks, after the collator's keep-start truncation to max_length. RM: chosen and rejected ids."""
    from alignflow.config.base import PreferenceDataConfig
    from alignflow.stages.common.pairs import load_pairs

    train, _, _ = load_pairs(PreferenceDataConfig(path=args.data, max_len=MAX_LEN, eval_fraction=0.0), tokenizer, SEED)
    if args.stage == "dpo":
        ours = sorted((tuple(p.chosen.input_ids), tuple(p.chosen.loss_mask), tuple(p.rejected.input_ids), tuple(p.rejected.loss_mask))
                      for p in train)
        theirs = sorted(
            (tuple((r["prompt_ids"] + r["chosen_ids"])[:MAX_LEN]), tuple(([0] * len(r["prompt_ids"]) + [1] * len(r["chosen_ids"]))[:MAX_LEN]),
             tuple((r["prompt_ids"] + r["rejected_ids"])[:MAX_LEN]), tuple(([0] * len(r["prompt_ids"]) + [1] * len(r["rejected_ids"]))[:MAX_LEN]))
            for r in prepared
        )
    else:
        ours = sorted((tuple(p.chosen.input_ids), tuple(p.rejected.input_ids)) for p in train)
        theirs = sorted((tuple(r["chosen_ids"]), tuple(r["rejected_ids"])) for r in prepared)
    return {"equal": ours == theirs, "alignflow_pairs": len(ours), "trl_pairs": len(theirs)}


# =========================================================================== parent: run, summarise, print


def summarise(result: dict[str, Any], warmup: int, steps_per_epoch: int) -> dict[str, Any]:
    timed = result["steps"][warmup:]
    pairs = sum(s["pairs"] for s in timed)
    seconds = sum(s["step_time_s"] for s in timed)
    wall = timed[-1]["t_end"] - timed[0]["t_begin"]
    out: dict[str, Any] = {
        "timed_steps": len(timed),
        "pairs": pairs,
        "tokens_per_step": sum(s["tokens"] for s in timed) / len(timed),
        "padded_per_step": sum(s["padded"] for s in timed) / len(timed),
        "step_time_s_total": seconds,
        "mean_step_time_s": seconds / len(timed),
        "pairs_per_s": pairs / seconds,
        "median_step_pairs_per_s": statistics.median(s["pairs"] / s["step_time_s"] for s in timed),
        "loop_wall_s": wall,
        "wall_pairs_per_s": pairs / wall,
        "loss_first": result["steps"][0].get("loss"),
        "loss_last": result["steps"][-1].get("loss"),
    }
    if all("compute_time_s" in s for s in timed):
        out["compute_pairs_per_s"] = pairs / sum(s["compute_time_s"] for s in timed)
    if result.get("reference_s") is not None:
        ref = float(result["reference_s"])
        epoch_pairs = steps_per_epoch * GLOBAL_BATCH
        out["reference_s"] = ref
        out["epoch_pairs"] = epoch_pairs
        estimated_s = ref + steps_per_epoch * out["mean_step_time_s"]
        out["epoch_estimated_s"] = estimated_s
        out["epoch_estimated_pairs_per_s"] = epoch_pairs / estimated_s
        if len(result["steps"]) >= steps_per_epoch:  # the run covered a whole epoch: use its real step times
            measured_s = ref + sum(s["step_time_s"] for s in result["steps"][:steps_per_epoch])
            out["epoch_measured_s"] = measured_s
            out["epoch_measured_pairs_per_s"] = epoch_pairs / measured_s
        out["epoch_pairs_per_s"] = out.get("epoch_measured_pairs_per_s", out["epoch_estimated_pairs_per_s"])
        out["epoch_s"] = out.get("epoch_measured_s", estimated_s)
    return out


def worker_command(args: argparse.Namespace, stage: str, framework: str, out: Path, tmp: Path) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", framework, "--stage", stage,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model, "--precision", args.precision,
        "--data", str(args.data), "--config", str(args.config), "--threads", str(args.threads),
        "--tmp", str(tmp), "--worker-out", str(out),
    ]


def run_one(args: argparse.Namespace, stage: str, framework: str, workdir: Path, index: int, steps_per_epoch: int) -> dict[str, Any]:
    tmp = workdir / f"{stage}-{framework}-{index}"
    tmp.mkdir(parents=True)
    out = tmp / "result.json"
    cmd = worker_command(args, stage, framework, out, tmp)
    log_path = tmp / "worker.log"
    env = worker_env(args.threads, tmp)
    env.update(TQDM_DISABLE="1", HF_DATASETS_CACHE=str(tmp / "hf-datasets"))  # no stale TRL reference cache, no bars
    if args.wait_idle > 0:
        wait_until_idle(args.wait_idle)
    print(f"running {stage} {framework} (log: {log_path}) ...", file=sys.stderr, flush=True)
    t0, busy0, mine0 = time.perf_counter(), busy_cpu_seconds(), children_cpu_seconds()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    elapsed, busy1, mine1 = time.perf_counter() - t0, busy_cpu_seconds(), children_cpu_seconds()
    record: dict[str, Any] = {"stage": stage, "framework": framework, "command": shlex.join(cmd), "process_wall_s": elapsed}
    if busy0 is not None and busy1 is not None:
        # CPU used by everything else on the machine while the worker ran, as a share of all cores:
        # anything well above 0 means the timings are contended and not to be trusted.
        others = max(0.0, (busy1 - busy0) - (mine1 - mine0))
        record["other_cpu_share"] = others / (elapsed * (os.cpu_count() or 1))
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-25:]
        errors = [line for line in tail if "Error" in line or "error" in line]
        record["error"] = (errors[-1] if errors else (tail[-1] if tail else f"exit code {proc.returncode}")).strip()
        record["log_tail"] = tail
        print(f"  failed: {record['error']}", file=sys.stderr, flush=True)
        return record
    result = json.loads(out.read_text())
    record.update(result=result, summary=summarise(result, args.warmup, steps_per_epoch))
    contention = f", other processes used {record['other_cpu_share']:.0%} of the CPU" if "other_cpu_share" in record else ""
    epoch = f", 1 epoch incl. reference pass {record['summary']['epoch_pairs_per_s']:,.1f} pairs/s" if "epoch_pairs_per_s" in record["summary"] else ""
    print(f"  {record['summary']['pairs_per_s']:,.1f} pairs/s per step{epoch} ({elapsed:.0f}s in all{contention})", file=sys.stderr, flush=True)
    return record


CHECK_KEYS = ("same_tokens_as_alignflow", "tokens_match_trl_num_tokens", "rows_prepared", "rows_used",
              "reference_model_per_step", "gradient_checkpointing", "bf16", "attn_implementation")


def aggregate(records: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    """One row per framework variant of `stage`: the median over repeats of each figure."""
    rows = []
    for framework in VARIANTS[stage]:
        runs = [r for r in records if r["stage"] == stage and r["framework"] == framework]
        if not runs:
            continue
        ok = [r for r in runs if "summary" in r]
        row: dict[str, Any] = {"stage": stage, "framework": framework, "command": runs[0]["command"], "runs": len(runs), "ok": len(ok)}
        shares = [r["other_cpu_share"] for r in runs if "other_cpu_share" in r]
        row["other_cpu_share"] = max(shares) if shares else None
        if ok:
            for key in ok[0]["summary"]:
                values = [r["summary"][key] for r in ok if r["summary"].get(key) is not None]
                row[key] = statistics.median(values) if values else None
            row["epoch_measured"] = all("epoch_measured_pairs_per_s" in r["summary"] for r in ok)
            for key in CHECK_KEYS:
                if key in ok[0]["result"]:
                    row[key] = ok[0]["result"][key]
        else:
            row["error"] = runs[0]["error"]
        rows.append(row)
    for base in ("trl", "trl-precompute"):
        ref = next((r for r in rows if r["framework"] == base and "pairs_per_s" in r), None)
        for r in rows:
            ok = ref is not None and "pairs_per_s" in r
            r[f"ratio_vs_{base}"] = r["pairs_per_s"] / ref["pairs_per_s"] if ok else None
            both = ok and r.get("epoch_pairs_per_s") and ref.get("epoch_pairs_per_s")
            r[f"epoch_ratio_vs_{base}"] = r["epoch_pairs_per_s"] / ref["epoch_pairs_per_s"] if both else None
    return rows


def markdown(stage: str, rows: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    fmt = lambda v, spec, suffix="": "n/a" if v is None else format(v, spec) + suffix  # noqa: E731
    spe = meta["steps_per_epoch"]
    title = "DPO" if stage == "dpo" else "Reward model"
    lines = [
        f"{title} throughput, model `{args.model}`, {GLOBAL_BATCH} pairs/step ({MICRO_BATCH} x {GLOBAL_BATCH // MICRO_BATCH} accumulation), "
        f"max length {MAX_LEN}, {args.precision}, {args.threads} torch threads, {args.steps} timed steps after {args.warmup} warmup steps"
        + (f", median of {args.repeats} runs" if args.repeats > 1 else "") + (f" ({meta['versions']})" if meta["versions"] else ""),
        "",
    ]
    dpo = stage == "dpo"
    if dpo:
        lines += [
            f"| framework | reference | timed steps | tokens/step (padded) | pairs/s per step | vs TRL | vs TRL precompute | reference pass (s) "
            f"| 1 epoch ({spe} steps) s | 1 epoch pairs/s | vs TRL | vs TRL precompute | loop wall (s) | loss first -> last | other CPU load | command |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
    else:
        lines += [
            "| framework | forward | timed steps | tokens/step (padded) | pairs/s per step | vs TRL | loop wall (s) | pairs/s (loop wall) | loss first -> last | other CPU load | command |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
    for r in rows:
        label = LABELS[(stage, r["framework"])]
        if "pairs_per_s" not in r:
            cells = 13 if dpo else 8
            lines.append(f"| {r['framework']} | {label} | failed: {r.get('error', '')[:200].replace('|', '/')} |" + " |" * cells + f" `{r['command']}` |")
            continue
        head = (f"| {r['framework']} | {label} | {r['timed_steps']} | {r['tokens_per_step']:,.0f} ({r['padded_per_step']:,.0f}) | "
                f"{r['pairs_per_s']:,.1f} | {fmt(r['ratio_vs_trl'], '.2f', 'x')} | ")
        tail = f"{fmt(r['loss_first'], '.3f')} -> {fmt(r['loss_last'], '.3f')} | {fmt(r['other_cpu_share'], '.0%')} | `{r['command']}` |"
        if dpo:
            how = "" if r.get("epoch_measured") else " (est.)"
            lines.append(
                head + f"{fmt(r['ratio_vs_trl-precompute'], '.2f', 'x')} | {fmt(r.get('reference_s'), '.2f')} | "
                f"{fmt(r.get('epoch_s'), '.1f')}{how} | {fmt(r.get('epoch_pairs_per_s'), ',.1f')}{how} | "
                f"{fmt(r['epoch_ratio_vs_trl'], '.2f', 'x')} | {fmt(r['epoch_ratio_vs_trl-precompute'], '.2f', 'x')} | "
                f"{r['loop_wall_s']:.2f} | " + tail
            )
        else:
            lines.append(head + f"{r['loop_wall_s']:.2f} | {r['wall_pairs_per_s']:,.1f} | " + tail)
    lines.append("")
    a = next((r for r in rows if r["framework"] == "alignflow" and "pairs_per_s" in r), None)
    for base in ("trl", "trl-precompute"):
        t = next((r for r in rows if r["framework"] == base and "pairs_per_s" in r), None)
        if a and t:
            line = (f"alignflow vs {base}: per step {a['pairs_per_s']:,.1f} vs {t['pairs_per_s']:,.1f} pairs/s: "
                    f"**{a['pairs_per_s'] / t['pairs_per_s']:.2f}x**")
            if dpo and a.get("epoch_pairs_per_s") and t.get("epoch_pairs_per_s"):
                line += (f"; one epoch with the reference pass {a['epoch_pairs_per_s']:,.1f} vs {t['epoch_pairs_per_s']:,.1f} pairs/s: "
                         f"**{a['epoch_pairs_per_s'] / t['epoch_pairs_per_s']:.2f}x**")
            lines.append(line)
    for r in rows:
        if r["framework"] == "alignflow" or "pairs_per_s" not in r:
            continue
        same = r.get("same_tokens_as_alignflow") or {}
        lines.append(
            f"{r['framework']}: TRL's tokenized pairs == alignflow's (ids{' and response masks' if dpo else ''}): {same.get('equal')} "
            f"({same.get('trl_pairs')} vs {same.get('alignflow_pairs')} pairs); tokens counted == TRL's num_tokens: "
            f"{r.get('tokens_match_trl_num_tokens')}; pairs used {r.get('rows_used')} of {r.get('rows_prepared')}; "
            f"gradient checkpointing {r.get('gradient_checkpointing')}, bf16 {r.get('bf16')}, attention {r.get('attn_implementation')}"
            + (f"; reference model forward per step: {r.get('reference_model_per_step')}" if dpo else "")
        )
    contended = [r for r in rows if (r.get("other_cpu_share") or 0) > 0.05]
    if contended:
        lines.append(
            f"WARNING: other processes used more than 5% of the CPU during {len(contended)} of the runs (column 'other CPU load'); "
            "those timings are contended and not comparable. Rerun on an idle machine."
        )
    lines += [
        "",
        f"Invocation: `{shlex.join([sys.executable, *sys.argv])}`",
        "",
        "pairs/s per step = 32 x timed steps / their summed step time (batch fetch + collation + forward/backward + optimizer "
        "step; not logging/eval/saving). tokens/step = real tokens of the chosen + rejected rows (padded: tensor size).",
    ]
    if dpo:
        lines.append(
            f"1 epoch = {spe} steps x {GLOBAL_BATCH} pairs = {spe * GLOBAL_BATCH} pairs; its time = the one-time reference pass "
            f"(alignflow: `time/reference_s`; trl-precompute: TRL's `_precompute_ref_logps` for the training set; trl: none, "
            f"its reference forward is inside every step) + the step time of the first {spe} steps when the run had that many, "
            f"else {spe} x the mean timed step time (marked est.). See the docstring of benchmarks/preference_throughput.py."
        )
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    from alignflow.stages.common.models import resolve_model_path

    resolve_model_path(args.model)  # build the built-in model once, outside any timing
    stages = [s.strip() for s in args.stage.split(",") if s.strip()]
    wanted = [f.strip() for f in args.frameworks.split(",") if f.strip()] if args.frameworks else None
    pairs_in_file = sum(1 for line in Path(args.data).read_text().splitlines() if line.strip())
    steps_per_epoch = pairs_in_file // GLOBAL_BATCH
    plan = [(s, f) for s in stages for f in VARIANTS[s] if wanted is None or f in wanted]
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="preference-throughput-"))
    try:
        for index in range(args.repeats):  # round-robin, so slow drift in machine load hits every setting
            for stage, framework in plan:
                records.append(run_one(args, stage, framework, workdir, index, steps_per_epoch))
    finally:
        if args.keep_workdir:
            print(f"kept worker folders and logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    versions: dict[str, str] = {}
    for r in records:
        versions.update(r.get("result", {}).get("versions", {}))
    meta = {"versions": ", ".join(f"{k} {v}" for k, v in sorted(versions.items())), "threads": args.threads,
            "steps_per_epoch": steps_per_epoch}
    tables, all_rows = [], {}
    for stage in stages:
        rows = aggregate(records, stage)
        all_rows[stage] = rows
        tables.append(markdown(stage, rows, args, meta))
    text = "\n\n".join(tables)
    print(text)
    if args.json:
        payload = {
            "settings": {
                "model": args.model, "data": str(args.data), "stages": stages, "steps": args.steps, "warmup": args.warmup,
                "repeats": args.repeats, "threads": args.threads, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                "max_len": MAX_LEN, "lr": LR, "betas": BETAS, "eps": EPS, "grad_clip": GRAD_CLIP, "lr_warmup": LR_WARMUP,
                "beta": BETA, "pairs_in_file": pairs_in_file, "steps_per_epoch": steps_per_epoch, "versions": versions,
                "argv": shlex.join([sys.executable, *sys.argv]),
            },
            "rows": all_rows,
            "runs": records,
            "markdown": text,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0 if all("summary" in r for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="dpo,rm", help="dpo, rm, or dpo,rm (default: both, one table each)")
    p.add_argument("--steps", type=int, default=57, help="timed optimizer steps (default 57: with --warmup 5, one epoch of 62)")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps before them (default 5)")
    p.add_argument("--model", default="builtin:tiny", help="builtin:tiny (default), builtin:small, or a local HF folder")
    add_precision_argument(p)
    p.add_argument("--json", default=None, metavar="PATH", help="also write all figures and per-step records here")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting, round-robin; the table shows medians")
    p.add_argument("--frameworks", default=None,
                   help="comma list of alignflow,trl,trl-precompute (default: all; trl-precompute is DPO only)")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to leave the CPU idle (default 0: do not wait)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the worker folders (logs, published models) instead of deleting them")
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch threads for every run (default: all usable cores)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help=argparse.SUPPRESS)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help=argparse.SUPPRESS)
    # worker mode (used by the parent)
    p.add_argument("--worker", choices=["alignflow", "trl", "trl-precompute"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --repeats >= 1")
    stages = [s.strip() for s in args.stage.split(",") if s.strip()]
    if not stages or any(s not in VARIANTS for s in stages):
        p.error(f"--stage: comma list of {', '.join(VARIANTS)}")
    if args.frameworks:
        known = {f for s in stages for f in VARIANTS[s]}
        unknown = [f for f in args.frameworks.split(",") if f.strip() and f.strip() not in known]
        if unknown:
            p.error(f"--frameworks: {', '.join(unknown)} not among {', '.join(sorted(known))} for --stage {args.stage}")
    args.data = str(Path(args.data).resolve())

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker is None:
        return parent(args)
    if len(stages) != 1 or args.worker not in VARIANTS[stages[0]]:
        p.error(f"worker {args.worker} needs one --stage that has it")
    args.stage = stages[0]
    result = (worker_alignflow if args.worker == "alignflow" else worker_trl)(args)
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
