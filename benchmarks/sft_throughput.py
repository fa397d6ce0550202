"""SFT training throughput: alignflow's SFT stage against TRL's `SFTTrainer`.

Run:   .venv/bin/python benchmarks/sft_throughput.py [--steps 60] [--warmup 5] [--model builtin:tiny|builtin:small]
                                                     [--repeats 1] [--wait-idle 0] [--json out.json]
                                                     [--frameworks alignflow,trl] [--packing-modes off,on]

Each (framework, packing) pair runs in its own subprocess (this same file with `--worker ...`), one
after another, with the same torch thread count (all cores this process may use) and the same
environment. The parent prints a markdown table and, with --json, writes every figure and every
per-step record.

The same work on both sides
- model: the same local HF folder (`builtin:tiny` by default), loaded the same way: fp32, sdpa attention,
  no gradient checkpointing (TRL's SFTConfig defaults to gradient checkpointing and bf16; both are turned off).
- data: data/sft/train.jsonl (all rows), rendered with the tokenizer's chat template. alignflow tokenizes
  `prompt` / `response + eos`; TRL gets conversational prompt-completion rows
  (prompt=[user turn], completion=[assistant turn]) and `completion_only_loss=True`. With this template both
  give the same token ids and the same loss mask (prompt tokens masked, response + `<|end|>` trained); the
  TRL worker checks this against alignflow's own tokenization before training (`same_tokens_as_alignflow`).
- batch: 32 rows per optimizer step = micro-batch 16 x 2 gradient-accumulation steps, max length 64, on one
  process. The loss is the sum of response-token NLL over the step divided by the step's response-token
  count on both sides (alignflow by design; TRL through `num_items_in_batch`).
- optimizer: torch.optim.AdamW (non-fused, the same implementation on both sides), lr 3e-3,
  betas (0.9, 0.95), eps 1e-8, no weight decay, grad-norm clipping at 1.0, 10 warmup steps then cosine
  to 0.1 x lr (schedules differ in detail: HF's warmup starts at lr 0; this does not change the work).
- steps: `--warmup` + `--steps` optimizer steps; the first `--warmup` are not timed.
- packing: with packing on, a "row" is a packed row of at most 64 tokens on both sides (best-fit
  decreasing in both), so a step holds ~5x more samples than without packing; tokens/s is the comparable
  figure, not steps/s.

What is measured
- tokens: real (non-pad) tokens fed to the model in the step, prompt tokens included.
  alignflow: `tokens` of each step in the published metrics.json (sum of sample lengths).
  TRL: counted by this script from the collated micro-batches: `attention_mask.sum()` without packing,
  `input_ids.numel()` with padding-free packing (no padding exists; pad_to_multiple_of is None on CPU).
  This is exactly what TRL's own `num_tokens` metric counts; the worker checks that its total equals
  TRL's `num_tokens` (`tokens_match_trl_num_tokens`).
- step time: alignflow: `train/step_time_s` of metrics.json (from entering `train_step`: batch selection,
  collation, forward/backward of both micro-batches, DeepSpeed step with clipping, optimizer and LR
  scheduler). TRL: from the call of `Trainer.get_batch_samples` for the step (data loading + collation)
  to the `on_step_end` callback (after clip, optimizer, scheduler, zero_grad), so the same scope:
  logging, eval and saving are outside it on both sides. TRL's `on_step_begin -> on_step_end` span
  (compute only, no data loading) is in the JSON as `compute_tokens_per_s`.
- tokens/s: total tokens / total step time over the timed steps (the time-weighted mean of the
  per-step rates). "loop wall" is first timed step start -> last timed step end, so it also holds what
  runs between steps (per-step metric logging on both sides).

Differences that remain (each is part of what the framework does; none changes the work per step)
- batch composition: alignflow sorts the 32 rows of a step by length before cutting micro-batches
  (less padding); TRL's default sampler does not. The samples are short (~10-20 tokens), so padding is small
  either way, and the padding is not counted as tokens on either side.
- packed rows: alignflow feeds a (16, <=64) batch with restarting position ids and no attention mask;
  TRL (packing=True, default "bfd" strategy, which forces padding_free) flattens the 16 packed rows into
  one (1, ~1000) sequence. In both, transformers builds a block-diagonal causal mask from the position ids
  (sdpa on CPU), but TRL's sdpa call then spans the whole ~1000-token sequence: padding-free is meant for
  FlashAttention's varlen kernels (TRL's docs say so), which do not exist on CPU. It works on CPU (correct
  masking, similar loss curve), it is just not faster than TRL without packing there.
- the incomplete tail: alignflow drops the rows of an epoch that do not fill a whole step; the TRL worker
  drops them too (trims its prepared dataset to a multiple of 32 rows) and checks that every TRL step
  had exactly 2 micro-batches, of 16 rows each where the collated batch shows its rows (padded mode;
  padding-free flattens them).
- the LM head: TRL computes per-token log-probs in chunks with a fused LM head (no full logits tensor) and
  also computes entropy and token accuracy every micro-batch (with `.item()` syncs); alignflow
  materialises the logits and computes a log-softmax over them.
- engine: alignflow runs the model inside a DeepSpeed ZeRO-0 engine (fp32), TRL inside
  `transformers.Trainer` + accelerate.
- different (random) batch orders on the two sides, so the losses are comparable only roughly.

Noise: the table's "other CPU load" column is the share of all cores that other processes used while
each worker ran (from /proc/stat minus the worker's own CPU time). On a 2-core machine a competing process
slowed these small-kernel workloads by 10-40x in testing (likely OpenMP threads waiting on descheduled peers), so a run with
more than ~5% is flagged and should not be compared. `--wait-idle SECONDS` waits for an idle machine
before each run; `--repeats N` runs the settings round-robin N times and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "tiny.yaml"
DEFAULT_DATA = ROOT / "data" / "sft" / "train.jsonl"

GLOBAL_BATCH = 32
MICRO_BATCH = 16
MAX_LEN = 64
LR = 3e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
GRAD_CLIP = 1.0
LR_WARMUP = 10
MIN_LR_RATIO = 0.1
SEED = 42
NEVER = 10**9  # eval / checkpoint / log cadence that never triggers inside the run


def cpu_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_until_idle(max_wait_s: float, threshold: float = 0.10, sample_s: float = 3.0) -> float | None:
    """Wait (up to max_wait_s) until the machine's busy share over `sample_s` is below `threshold`.
    Returns the last measured share (None where /proc/stat is unavailable)."""
    deadline = time.monotonic() + max_wait_s
    cores = os.cpu_count() or 1
    while True:
        b0, t0 = busy_cpu_seconds(), time.monotonic()
        if b0 is None:
            return None
        time.sleep(sample_s)
        share = (busy_cpu_seconds() - b0) / ((time.monotonic() - t0) * cores)
        if share < threshold or time.monotonic() >= deadline:
            return share
        print(f"  machine busy ({share:.0%} of the CPU), waiting ...", file=sys.stderr, flush=True)


def children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: alignflow's deepspeed.precision=bf16 (bf16 weights, fp32 master weights in the optimizer) "
                        "against TRL's bf16=True (autocast over fp32 weights); matmuls run on AMX or AVX-512 BF16 where the CPU has them")


def worker_env(threads: int, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), ALIGNFLOW_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false", TMPDIR=str(tmp),  # alignflow's staging folder goes under TMPDIR
        PYTHONUNBUFFERED="1", WANDB_DISABLED="true",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# =========================================================================== workers (one per subprocess)


def worker_alignflow(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from alignflow.config import load_config
    from alignflow.stages.sft import stage

    total = args.warmup + args.steps
    overrides = [
        "name=throughput-bench",
        f"storage.root={args.tmp}/outputs",
        f"sft.model.name_or_path={args.model}",
        "sft.model.dtype=float32",
        "sft.model.attn_implementation=sdpa",
        "sft.model.gradient_checkpointing=false",
        f"sft.data.path={args.data}",
        f"sft.data.max_len={MAX_LEN}",
        f"sft.data.packing={'true' if args.packing else 'false'}",
        f"sft.batch.global_batch_size={GLOBAL_BATCH}",
        f"sft.batch.micro_batch_size={MICRO_BATCH}",
        f"sft.batch.max_steps={total}",
        "sft.batch.epochs=100000",  # max_steps decides
        f"sft.batch.seed={SEED}",
        f"sft.optim.lr={LR}",
        f"sft.optim.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"sft.optim.eps={EPS}",
        "sft.optim.weight_decay=0.0",
        f"sft.optim.grad_clip={GRAD_CLIP}",
        f"sft.optim.warmup_steps={LR_WARMUP}",
        "sft.optim.scheduler=cosine",
        f"sft.optim.min_lr_ratio={MIN_LR_RATIO}",
        "sft.deepspeed.zero_stage=0",
        f"sft.deepspeed.precision={args.precision}",
        f"sft.logging.eval_every={NEVER}",  # eval runs only before step 1 and after the last step
        f"sft.logging.log_every={NEVER}",
        "sft.logging.progress=false",
        f"sft.checkpoint.every_steps={NEVER}",
    ]
    cfg = load_config(args.config, overrides)

    spans: list[tuple[float, float]] = []
    train_step = stage.train_step

    def timed_train_step(*a, **k):  # only to get the loop wall time; per-step figures come from metrics.json
        t0 = time.perf_counter()
        out = train_step(*a, **k)
        spans.append((t0, time.perf_counter()))
        return out

    stage.train_step = timed_train_step  # main() looks the name up at call time
    if args.worker == "alignflow-full":  # the lever measured: log-probs from the model's full logits, not the chunked head
        from lm_head import full_logits_logprobs

        stage.forward_logprobs = full_logits_logprobs
    result = stage.main(cfg, "sft", output_uri=str(Path(args.tmp) / "sft-out"))
    metrics = json.loads((Path(result["uri"]) / "metrics.json").read_text())
    history = [h for h in metrics["history"] if h["step"] >= 1 and "train/step_time_s" in h]
    if len(history) != total or len(spans) != total:
        raise RuntimeError(f"expected {total} steps, metrics.json has {len(history)}, timed {len(spans)}")
    steps = [
        {"step": h["step"], "tokens": int(h["train/tokens"]), "step_time_s": h["train/step_time_s"], "loss": h["train/loss"],
         "t_begin": spans[i][0], "t_end": spans[i][1]}
        for i, h in enumerate(history)
    ]
    import deepspeed
    return {
        "steps": steps,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "rows_per_step": GLOBAL_BATCH,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from alignflow.stages.common.models import resolve_model_path

    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}], "completion": [{"role": "assistant", "content": r["response"]}]}
        for r in rows
    ])

    config = SFTConfig(
        output_dir=str(Path(args.tmp) / "trl-out"),
        max_steps=total,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GLOBAL_BATCH // MICRO_BATCH,
        max_length=MAX_LEN,
        packing=args.packing,  # packing_strategy "bfd" (default) turns padding_free on
        completion_only_loss=True,
        learning_rate=LR,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, non-fused, as alignflow (SFTConfig may default to the fused one)
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

    class TimedSFTTrainer(SFTTrainer):
        """Records when each optimizer step starts fetching its micro-batches, their real tokens and their shape."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fetch: list[float] = []
            self.tokens: list[int] = []
            self.micro_rows: list[list[int]] = []

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            t0 = time.perf_counter()
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                self.fetch.append(t0)
                # Padded: attention_mask.sum() = non-pad tokens. Padding-free: one (1, N) row, no pad at all.
                self.tokens.append(sum(int(b["attention_mask"].sum()) if "attention_mask" in b else int(b["input_ids"].numel()) for b in batches))
                # Rows per micro-batch (padding-free: the packed rows are flattened, so count only the micro-batches).
                self.micro_rows.append([int(b["input_ids"].shape[0]) if "attention_mask" in b else -1 for b in batches])
            return batches, num_items

    timing = Timing()
    trainer = TimedSFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timing])
    same = same_tokens_as_alignflow(trainer.train_dataset, tokenizer, args) if not args.packing else None
    # Drop the incomplete tail (as alignflow does) so every optimizer step has 2 full micro-batches of 16 rows:
    # otherwise the last step of each epoch is short (e.g. 990 packed rows = 30 full steps + 30 rows).
    rows_prepared = len(trainer.train_dataset)
    trainer.train_dataset = trainer.train_dataset.select(range(rows_prepared - rows_prepared % GLOBAL_BATCH))
    info: dict[str, Any] = {
        "padding_free": bool(trainer.padding_free),
        "attn_implementation": model.config._attn_implementation,
        "same_tokens_as_alignflow": same,
        "rows_prepared": rows_prepared,  # rows after TRL's tokenization (and packing)
        "rows_used": len(trainer.train_dataset),
    }
    trainer.train()

    n = len(timing.end)
    if n != total or len(trainer.fetch) < n or len(timing.begin) != n:
        raise RuntimeError(f"expected {total} steps, got {n} step ends, {len(timing.begin)} begins, {len(trainer.fetch)} fetches")
    accumulation = GLOBAL_BATCH // MICRO_BATCH
    for i, rows in enumerate(trainer.micro_rows[:n]):
        if len(rows) != accumulation or any(r not in (MICRO_BATCH, -1) for r in rows):
            raise RuntimeError(f"TRL step {i + 1} got micro-batches of {rows} rows, expected {accumulation} x {MICRO_BATCH}")
    steps = [
        {"step": i + 1, "tokens": trainer.tokens[i], "step_time_s": timing.end[i] - trainer.fetch[i],
         "compute_time_s": timing.end[i] - timing.begin[i], "loss": timing.losses[i] if i < len(timing.losses) else None,
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
        "rows_per_step": GLOBAL_BATCH,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **info,
    }


def same_tokens_as_alignflow(prepared, tokenizer, args: argparse.Namespace) -> bool:
    """True when TRL's tokenized rows equal alignflow's samples (ids and loss mask), as multisets."""
    from alignflow.stages.sft.config import DataConfig
    from alignflow.stages.sft.data import load_sft_samples

    train, _, _ = load_sft_samples(DataConfig(path=args.data, max_len=MAX_LEN, eval_fraction=0.0), tokenizer, SEED)
    ours = sorted((tuple(s.input_ids), tuple(s.loss_mask)) for s in train)
    theirs = sorted(
        (tuple(r["input_ids"]), tuple(int(label != -100) for label in r["labels"])) for r in prepared
    )
    return ours == theirs


# =========================================================================== parent: run, summarise, print


def summarise(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    timed = result["steps"][warmup:]
    tokens = sum(s["tokens"] for s in timed)
    seconds = sum(s["step_time_s"] for s in timed)
    wall = timed[-1]["t_end"] - timed[0]["t_begin"]
    out = {
        "timed_steps": len(timed),
        "tokens": tokens,
        "tokens_per_step": tokens / len(timed),
        "step_time_s_total": seconds,
        "tokens_per_s": tokens / seconds,
        "median_step_tokens_per_s": statistics.median(s["tokens"] / s["step_time_s"] for s in timed),
        "loop_wall_s": wall,
        "wall_tokens_per_s": tokens / wall,
        "loss_first": result["steps"][0].get("loss"),
        "loss_last": result["steps"][-1].get("loss"),
    }
    if all("compute_time_s" in s for s in timed):
        out["compute_tokens_per_s"] = tokens / sum(s["compute_time_s"] for s in timed)
    return out


def worker_command(args: argparse.Namespace, framework: str, packing: bool, out: Path, tmp: Path) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", framework,
        "--packing", "on" if packing else "off",
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model, "--precision", args.precision,
        "--data", str(args.data), "--config", str(args.config), "--threads", str(args.threads),
        "--tmp", str(tmp), "--worker-out", str(out),
    ]


def run_one(args: argparse.Namespace, framework: str, packing: bool, workdir: Path, index: int) -> dict[str, Any]:
    tmp = workdir / f"{framework}-{'packed' if packing else 'padded'}-{index}"
    tmp.mkdir(parents=True)
    out = tmp / "result.json"
    cmd = worker_command(args, framework, packing, out, tmp)
    log_path = tmp / "worker.log"
    if args.wait_idle > 0:
        wait_until_idle(args.wait_idle)
    print(f"running {framework} packing={'on' if packing else 'off'} (log: {log_path}) ...", file=sys.stderr, flush=True)
    t0, busy0, mine0 = time.perf_counter(), busy_cpu_seconds(), children_cpu_seconds()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(args.threads, tmp), stdout=log, stderr=subprocess.STDOUT)
    elapsed, busy1, mine1 = time.perf_counter() - t0, busy_cpu_seconds(), children_cpu_seconds()
    record: dict[str, Any] = {"framework": framework, "packing": packing, "command": shlex.join(cmd), "process_wall_s": elapsed}
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
    record.update(result=result, summary={**summarise(result, args.warmup), "peak_rss_mib": result.get("peak_rss_mib")})
    contention = f", other processes used {record['other_cpu_share']:.0%} of the CPU" if "other_cpu_share" in record else ""
    print(f"  {record['summary']['tokens_per_s']:,.0f} tokens/s ({elapsed:.0f}s in all{contention})", file=sys.stderr, flush=True)
    return record


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (framework, packing): the median over repeats of each figure."""
    rows = []
    for framework in ("alignflow", "alignflow-full", "trl"):
        for packing in (False, True):
            runs = [r for r in records if r["framework"] == framework and r["packing"] == packing]
            if not runs:
                continue
            ok = [r for r in runs if "summary" in r]
            row: dict[str, Any] = {"framework": framework, "packing": packing, "command": runs[0]["command"], "runs": len(runs), "ok": len(ok)}
            shares = [r["other_cpu_share"] for r in runs if "other_cpu_share" in r]
            row["other_cpu_share"] = max(shares) if shares else None
            if ok:
                for key in ok[0]["summary"]:
                    values = [r["summary"][key] for r in ok if r["summary"].get(key) is not None]
                    row[key] = statistics.median(values) if values else None
                if framework == "trl":
                    for key in ("padding_free", "same_tokens_as_alignflow", "tokens_match_trl_num_tokens"):
                        row[key] = ok[0]["result"].get(key)
            else:
                row["error"] = runs[0]["error"]
            rows.append(row)
    # Ratios against TRL with the same packing setting, and best against best.
    trl = {r["packing"]: r for r in rows if r["framework"] == "trl" and "tokens_per_s" in r}
    for r in rows:
        base = trl.get(r["packing"])
        r["ratio_vs_trl_same_packing"] = r["tokens_per_s"] / base["tokens_per_s"] if base and "tokens_per_s" in r else None
    return rows


def best(rows: list[dict[str, Any]], framework: str) -> dict[str, Any] | None:
    ok = [r for r in rows if r["framework"] == framework and "tokens_per_s" in r]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"SFT throughput, model `{args.model}`, {GLOBAL_BATCH} rows/step ({MICRO_BATCH} x {GLOBAL_BATCH // MICRO_BATCH} accumulation), "
        f"max length {MAX_LEN}, {args.precision}, {args.threads} torch threads, {args.steps} timed steps after {args.warmup} warmup steps"
        + (f", median of {args.repeats} runs" if args.repeats > 1 else "") + (f" ({meta['versions']})" if meta["versions"] else ""),
        "",
        "| framework | packing | timed steps | tokens/step | tokens/s | vs TRL (same packing) | loop wall (s) | tokens/s (loop wall) | loss first -> last | peak RSS (MiB) | other CPU load | command |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        packing = "on" if r["packing"] else "off"
        if r["framework"] == "trl" and r["packing"] and r.get("padding_free"):
            packing = "on (bfd, padding-free)"
        if "tokens_per_s" not in r:
            lines.append(f"| {r['framework']} | {packing} | failed | | | | | | {r.get('error', '')[:200].replace('|', '/')} | | `{r['command']}` |")
            continue
        ratio = r["ratio_vs_trl_same_packing"]
        lines.append(
            f"| {r['framework']} | {packing} | {r['timed_steps']} | {r['tokens_per_step']:,.0f} | {r['tokens_per_s']:,.0f} | "
            f"{fmt(ratio, '.2f') + 'x' if ratio is not None else 'n/a'} | {r['loop_wall_s']:.2f} | {r['wall_tokens_per_s']:,.0f} | "
            f"{fmt(r['loss_first'], '.3f')} -> {fmt(r['loss_last'], '.3f')} | {fmt(r.get('peak_rss_mib'), ',.0f')} | {fmt(r['other_cpu_share'], '.0%')} | `{r['command']}` |"
        )
    a, t = best(rows, "alignflow"), best(rows, "trl")
    lines.append("")
    if a and t:
        lines.append(
            f"Best vs best: alignflow (packing {'on' if a['packing'] else 'off'}) {a['tokens_per_s']:,.0f} tokens/s vs "
            f"TRL (packing {'on' if t['packing'] else 'off'}) {t['tokens_per_s']:,.0f} tokens/s: "
            f"**{a['tokens_per_s'] / t['tokens_per_s']:.2f}x**"
        )
    checks = [r for r in rows if r["framework"] == "trl" and "tokens_per_s" in r]
    for r in checks:
        lines.append(
            f"TRL packing {'on' if r['packing'] else 'off'}: tokens counted == TRL's num_tokens: {r.get('tokens_match_trl_num_tokens')}"
            + ("" if r["packing"] else f"; TRL's tokenized rows == alignflow's (ids and loss mask): {r.get('same_tokens_as_alignflow')}")
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
        "tokens/s = real (non-pad, prompt included) tokens / summed step time over the timed steps; step time covers "
        "batch fetch + collation + forward/backward + optimizer step, not logging/eval/saving (see the docstring of "
        "benchmarks/sft_throughput.py).",
    ]
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    from alignflow.stages.common.models import resolve_model_path

    resolve_model_path(args.model)  # build the built-in model once, outside any timing
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    packings = [p.strip() == "on" for p in args.packing_modes.split(",") if p.strip()]
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="sft-throughput-"))
    try:
        for index in range(args.repeats):  # round-robin, so slow drift in machine load hits every setting
            for framework in frameworks:
                for packing in packings:
                    records.append(run_one(args, framework, packing, workdir, index))
    finally:
        if args.keep_workdir:
            print(f"kept worker folders and logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = aggregate(records)
    versions = {}
    for r in records:
        versions.update(r.get("result", {}).get("versions", {}))
    meta = {"versions": ", ".join(f"{k} {v}" for k, v in sorted(versions.items())), "threads": args.threads}
    table = markdown(rows, args, meta)
    print(table)
    if args.json:
        payload = {
            "settings": {
                "model": args.model, "data": str(args.data), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                "threads": args.threads, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "max_len": MAX_LEN,
                "lr": LR, "betas": BETAS, "grad_clip": GRAD_CLIP, "versions": versions,
                "argv": shlex.join([sys.executable, *sys.argv]),
            },
            "rows": rows,
            "runs": [{k: v for k, v in r.items()} for r in records],
            "markdown": table,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0 if all("summary" in r for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="timed optimizer steps (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps before them (default 5)")
    p.add_argument("--model", default="builtin:tiny", help="builtin:tiny (default), builtin:small, builtin:small-32k, or a local HF folder")
    p.add_argument("--json", default=None, metavar="PATH", help="also write all figures and per-step records here")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting, round-robin; the table shows medians")
    p.add_argument("--frameworks", default="alignflow,trl",
                   help="comma list of alignflow,alignflow-full (log-probs from the model's full logits),trl")
    p.add_argument("--packing-modes", default="off,on", help="comma list of off,on")
    add_precision_argument(p)
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to leave the CPU idle (default 0: do not wait)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the worker folders (logs, published models) instead of deleting them")
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch threads for every run (default: all usable cores)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help=argparse.SUPPRESS)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help=argparse.SUPPRESS)
    # worker mode (used by the parent)
    p.add_argument("--worker", choices=["alignflow", "alignflow-full", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--packing", choices=["on", "off"], default="off", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --repeats >= 1")
    args.data = str(Path(args.data).resolve())

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker is None:
        return parent(args)
    args.packing = args.packing == "on"
    result = (worker_trl if args.worker == "trl" else worker_alignflow)(args)
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
