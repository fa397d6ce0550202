"""GRPO throughput: alignflow's RL stage against TRL's `GRPOTrainer`: time per RL step, completions/s and tokens/s,
with the phase breakdown (generation + scoring, log-probs, training, weight sync).

Run:   .venv/bin/python benchmarks/grpo_throughput.py [--steps 100] [--warmup 5] [--model builtin:tiny|builtin:small|DIR]
                                                      [--repeats 1] [--wait-idle 0] [--json out.json]
                                                      [--frameworks alignflow,trl] [--precision fp32|bf16]

Each framework runs in its own subprocess (this same file with `--worker ...`), one after another, with the same torch
thread count (all cores this process may use) and the same environment (`worker_env` of benchmarks/sft_throughput.py,
whose helpers this file reuses; RAY_ADDRESS is removed so alignflow always starts its own private Ray). The parent
prints a markdown table and, with --json, writes every figure and every per-step record.

An "RL step" is one round of: sample 16 prompts x 8 completions (128), score them, compute the old log-probs (where
the framework needs a pass for them), train on them (2 optimizer steps of 64 completions), and, where the generator is
a separate process, push the new weights to it.

Frameworks (--frameworks): `alignflow` as shipped (configs/tiny.yaml's rl defaults: the hybrid layout, in which the
actor worker generates from its own weights, and no old-log-prob pass while the generator's log-probs are the
actor's); `alignflow-separate`, the layout before issue 15 (`workers.hybrid=false`, `policy.old_logprobs=recompute`: a
separate rollout worker with a weight push every step, and the no-grad pass over the batch), with everything else as
shipped; `alignflow-async`, `rollout.asynchronous=true` with `workers.colocate=pairs`: the rollout worker generates
step t+1's samples on half the cores (--threads / 2 torch threads) while the actor trains on step t's on the other
half; its "generation" phase is the time the step waits for them; `alignflow-no-pass`,
`policy.old_logprob_tolerance=1.0`: the generator's log-probs always stand in for the old ones, so the guard never
runs the old-log-prob pass (in bf16, where the pass runs every step, this shows what it costs); `trl`.

The same work on both sides
- model: the same local HF folder, fp32, sdpa attention, no gradient checkpointing, no bf16 (TRL's configs default to
  gradient checkpointing and bf16: both are turned off explicitly). `--precision bf16` runs each framework's own bf16
  mode instead: alignflow `rl.model.dtype=bfloat16` with `rl.deepspeed.precision=bf16` (bf16 weights, so the actor
  also generates in bf16; fp32 master weights in the optimizer; the old-log-prob pass comes back on the steps where the
  generator's log-probs differ from the trainer's by more than `policy.old_logprob_tolerance`), TRL `bf16=True`
  (autocast over fp32 weights, generation included). `builtin:tiny` (the default) has seeded random
  weights: it never produces a right answer, so every reward is 0, every group's advantages are 0 and the gradients
  are 0 on both sides. The work is still all done (generation, log-probs, forward/backward, clipping, AdamW step), so
  the speed figures hold, but nothing is learned. `--model DIR` takes any local HF folder, e.g. the `model/` folder
  an `alignflow stage sft --config configs/tiny.yaml` run publishes, to run the same comparison from an SFT model
  whose rewards are not all 0.
- prompts: data/rl/train.jsonl (`{"prompt", "answer"}`), all 2000 rows for training (alignflow: `data.eval_path`
  unset and `data.eval_fraction=0`, so there is no held-out set and no evaluation at all). alignflow renders each
  prompt with the tokenizer's chat template (`chat_prompt_text`); TRL gets conversational prompts
  (`[{"role": "user", "content": prompt}]`) and renders them with the same template. The TRL worker checks, for every
  row, that TRL's prompt token ids (`GRPOTrainer._tokenize_prompts`) equal alignflow's (`load_prompts`)
  (`same_prompt_ids_as_alignflow`).
- the same prompts in the same steps: alignflow picks the 16 prompts of step s with `global_batch(2000, 16, s, seed)`;
  the TRL worker lays its dataset out in exactly that order (16 rows per step, for every step of the run) and turns
  its sampler's shuffling off (`shuffle_dataset=False`), so its RepeatSampler hands generation k the same 16 prompts
  (each repeated 8 times) as alignflow's step k.
- reward: the shipped `rewards/tiny_tasks.py:exact_answer`. alignflow calls it with (prompts, completions, prompt_ids,
  completion_ids, **columns); TRL calls reward functions with (prompts, completions, completion_ids, **columns) with
  conversational prompts/completions, so the TRL worker wraps it in a small adapter that passes the prompt text, the
  completion text and the prompt ids and returns the same floats. The worker checks on the first generation that the
  adapter's values equal alignflow's `FunctionReward` on the same inputs, and that TRL's completion text is
  `tokenizer.decode(completion_ids, skip_special_tokens=True)` as in alignflow (`reward_adapter_matches_alignflow`).
- GRPO settings: 16 prompts x 8 samples = 128 completions per RL step, at most 8 new tokens, temperature 1.0, top-p 1,
  no top-k; advantages (r - mean(r)) / std(r) per group (alignflow `group_norm`, TRL `scale_rewards="group"`,
  the default), broadcast to every token; no KL and no reference model (alignflow `kl.coef=0`, TRL `beta=0`);
  clipped surrogate with clip 0.2 / 0.28 (alignflow `policy.clip_low/clip_high`, TRL `epsilon/epsilon_high`), the
  token-level loss (sum over the step's completion tokens / their count: alignflow `policy.aggregation=token`, TRL
  `loss_type="dapo"`, its default); one policy epoch over the rollout batch (alignflow `policy.epochs=1`, TRL
  `num_iterations=1`); no entropy bonus.
- batches: one generation of 128 completions feeds 2 optimizer steps of 64 completions, each ONE forward/backward of
  64 rows. alignflow: `rollout.prompts_per_step=16`, `batch.global_batch_size=64`, `batch.micro_batch_size=64`.
  TRL: `per_device_train_batch_size=64`, `gradient_accumulation_steps=1`, `steps_per_generation=2` (so
  `generation_batch_size=128`: TRL generates once every 2 optimizer steps). Because the second optimizer step trains
  on samples from the policy before the first one, both compute the old log-probs with a no-grad forward over the 128
  rows after generation, in 2 chunks of 64 (TRL does that when gradient_accumulation_steps is not a multiple of
  steps_per_generation x num_iterations; alignflow-separate always does). alignflow as shipped takes the generator's
  log-probs instead: its generator is the actor itself, and the first micro-batch checks that they agree (the pass
  would run past `policy.old_logprob_tolerance`; here it never does, `train/old_logprob_pass` is 0). alignflow generates the 128 sequences in one batch
  (`generation.batch_size=128`, as configs/tiny.yaml ships it) because TRL's transformers path generates the whole generation
  batch in one `model.generate` call.
- optimizer: torch.optim.AdamW (alignflow: fused, its default, inside a DeepSpeed ZeRO-0 fp32 engine; TRL
  `optim="adamw_torch"`, its default, non-fused),
  lr 1e-4 constant, no warmup, betas (0.9, 0.95), eps 1e-8, no weight decay, grad-norm clipping at 1.0.
- generation: TRL `use_vllm=False` (its transformers `generate` path: sampling with a KV cache, stop at EOS);
  alignflow's HF rollout backend (`HFGenerator`: its own sampling loop over the model with a KV cache, stop when
  every row has produced EOS).

What is measured (per RL step; the first --warmup RL steps are not timed)
- alignflow: the published metrics.json `history` gives each step's phases, timed by the driver (`Loop.step`):
  `phase/generate_and_score_s` (prompt pick, the Ray call to the worker that generates, decode + reward
  function), `phase/inference_s` (building the batch's tensors and, where it runs, the actor's no-grad old log-prob
  pass, through Ray), `phase/train_s` (advantages and the actor's 2 optimizer steps, through Ray; where the guard finds the
  generator's log-probs past the tolerance, e.g. in bf16, the old-log-prob pass runs here, inside the actor's call), `phase/sync_s` (the
  actor's full weights through Ray's object store into the rollout worker; 0 in the hybrid layout). Step time = the sum of these four. The worker also wraps `Loop.step` to record its whole
  span: "unaccounted" = span - phase sum (the per-step metrics computed after the sync; should be ~0), and the
  loop wall (first timed step start -> last timed step end, so it also holds what runs between steps: the metrics
  log) shows whether anything else takes time between steps. Setup (Ray start, the actor and rollout worker
  processes, model loads, DeepSpeed engine) is `time/setup_s`, reported separately and not in the per-step figures.
- TRL: one RL step = TRL optimizer steps 2k and 2k+1. Step time = for both optimizer steps, from the call of
  `Trainer.get_batch_samples` (data fetch) to the `on_step_end` callback (after clipping, optimizer and scheduler
  step), summed (the logging between the two optimizer steps is left out, as alignflow's metric logging is; it is
  the "unaccounted" column for TRL).
  Phases, by wrapping GRPOTrainer methods: log-probs = the no-grad `_get_per_token_logps_and_entropies` calls inside
  `_generate_and_score_completions` (the old log-probs); generation + scoring = the generating `_prepare_inputs` call
  (`_generate_and_score_completions` plus the shuffle/split of the generation batch) minus the log-probs; training =
  step time - that `_prepare_inputs` call (data fetch, the 2 forward/backward passes with their metrics, clipping,
  optimizer). Weight sync: none; TRL generates with the model it trains (one process, no vLLM), so there is nothing
  to push (0). Setup = the worker's imports done -> first data fetch (prompt rows, model and tokenizer load, trainer
  construction, the first `train()` preparations); not in the per-step figures. (The worker's own imports are in the
  JSON as `imports_s`; alignflow's `time/setup_s` likewise excludes the driver's imports but includes the actor
  processes' start, imports and model loads, which is most of it.)
- sub-phases (JSON and the detail lines): alignflow driver side: `Roles.generate` (the Ray call that generates) and
  the scorer (decode + reward); TRL: `_generate_single_turn` (`model.generate`) and `_calculate_rewards`.
- generated tokens: completion tokens including the EOS (alignflow: `train/response_length` x 128, from the response mask;
  TRL: the lengths of the completion ids passed to the reward function, which include the EOS). completions/s =
  128 x timed steps / summed step time; generated tokens/s = generated tokens / summed step time.
  "vs TRL" = TRL's s/step / alignflow's s/step (> 1: alignflow is faster).
- reward: the mean reward of each step's 128 completions (alignflow `reward/mean`; TRL: from the adapter); the table
  shows the first and last step's.

Differences that remain (each is part of what the framework does; none changes the result of a step beyond rounding)
- processes: alignflow runs the policy trainer (actor, which in the hybrid layout also generates; alignflow-separate:
  and the generator, a second Ray actor) plus the driver and Ray's own daemons (GCS, raylet, monitors), so every
  phase pays Ray calls and serialisation (the experience to the actor; alignflow-separate: the weights to the rollout
  worker), and Ray's daemons use some CPU all the time; TRL runs everything in one process on one model. The actors
  share one placement-group bundle of --threads CPUs (`workers.colocate=all`), each with --threads torch threads.
- prompt sharing: alignflow prefills each prompt once for its 8 samples, and its training forwards run the rows of a
  micro-batch that share a prompt as one row (the prompt once, a 4D mask; groups packed into rows of 1.5x the widest
  group), which computes the same outputs from fewer tokens; TRL runs every completion as its own padded row.
- generation: alignflow samples with its own loop (temperature-scaled log-softmax of every step's logits, kept as
  the sampling log-probs); TRL uses `model.generate` (logits processors, stopping criteria). Different random
  streams, so the completions (and their lengths) differ; with the random tiny model almost every completion runs
  to the 8-token limit on both sides (see tokens/completion).
- the LM head: TRL computes log-probs (and, in training, entropies) with its fused LM head over the completion
  positions only; alignflow runs the full LM head over every position and gathers the completion positions.
- metrics: TRL computes clip ratios, entropy means and reward statistics with several `.item()` syncs per step;
  alignflow computes its metrics once per step.
- loss normaliser: alignflow divides each optimizer step's summed token losses by that step's completion tokens; TRL
  (`dapo`) by the generation batch's completion tokens / 2. Equal when the two halves hold equal token counts (they
  do when every completion has 8 tokens).
- std in the advantage: both unbiased; + 1e-6 (alignflow) vs + 1e-4 (TRL) in the denominator.
- the order of the rows within a step's two optimizer batches (both shuffle the 128 rows, with different RNGs).

Noise: the table's "other CPU load" column is the share of all cores that other processes used while each worker ran:
machine-wide busy time from /proc/stat minus the CPU time of the worker's whole process tree (Ray's actors and
daemons included) and of this parent process. The worker's tree is sampled from /proc every 0.5 s by the parent
(`TreeCPU`; the kernel's RUSAGE_CHILDREN misses Ray's actor processes, whose CPU time the raylet does not pass on),
and the worker makes itself a child subreaper so that Ray's orphaned processes stay in its tree and are reaped by it.
On a 2-core machine a competing process slows these small workloads a lot (see sft_throughput.py), so a run with more
than ~5% is flagged and should not be compared. `--wait-idle SECONDS` waits for an idle machine before each run;
`--repeats N` runs the frameworks round-robin N times and reports medians.
"""

from __future__ import annotations

import argparse
import itertools
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
from sft_throughput import (  # noqa: E402
    add_precision_argument, busy_cpu_seconds, children_cpu_seconds, cpu_threads, wait_until_idle, worker_env,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "tiny.yaml"
DEFAULT_DATA = ROOT / "data" / "rl" / "train.jsonl"
EVAL_DATA = ROOT / "data" / "rl" / "eval.jsonl"  # the held-out prompts of --eval-every
REWARD_SPEC = f"{ROOT / 'rewards' / 'tiny_tasks.py'}:exact_answer"

PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
COMPLETIONS = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT  # 128 per RL step
OPTIM_BATCH = 64  # completions per optimizer step (one forward/backward of 64 rows)
OPTIM_STEPS_PER_RL_STEP = COMPLETIONS // OPTIM_BATCH  # 2
MAX_NEW_TOKENS = 8
TEMPERATURE = 1.0
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
MAX_PROMPT_LEN = 64  # alignflow's rl.data.max_len: prompts must be shorter (they are ~10 tokens)
LR = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
GRAD_CLIP = 1.0
SEED = 42
NEVER = 10**9  # eval / checkpoint / log cadence that never triggers inside the run
PHASES = ("gen_s", "logp_s", "train_s", "sync_s")
PHASE_NAMES = {"gen_s": "generation + scoring", "logp_s": "log-probs", "train_s": "training", "sync_s": "weight sync"}


# alignflow as shipped, and the layout before issue 15's hybrid actor and skipped old-log-prob pass (a separate
# rollout worker with a weight push every step, and the no-grad pass over the batch), measured in the same run; the
# asynchronous rollout; and the guard never calling the pass back (what the pass costs where it runs, as in bf16).
ALIGNFLOW_VARIANTS = {
    "alignflow": [],
    "alignflow-separate": ["rl.workers.hybrid=false", "rl.policy.old_logprobs=recompute"],
    "alignflow-async": ["rl.rollout.asynchronous=true", "rl.workers.colocate=pairs"],
    "alignflow-no-pass": ["rl.policy.old_logprob_tolerance=1.0"],
}
FRAMEWORKS = [*ALIGNFLOW_VARIANTS, "trl"]


def own_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux): Ray's processes whose parent exits first stay
    in this process's tree (which the parent samples, see `TreeCPU`) and are reaped here by `reap_children`."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_children(timeout_s: float = 30.0) -> list[int]:
    """Wait (up to timeout_s) for every child of this process to exit; returns the pids still running after that."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid:
            continue
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    me = str(os.getpid())
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    left.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return left


class TreeCPU:
    """CPU seconds used by a process and all its descendants, sampled from /proc every `interval_s` in a thread.

    RUSAGE_CHILDREN misses Ray's actor processes (started by the raylet, their CPU time does not reach the worker's
    rusage: in testing it held a sixth to a third of the tree's CPU time), so the parent samples the worker's process tree
    instead. Each process counts with the last CPU time seen for it (utime + stime, its own, not its children's), so
    the CPU a process uses after the last sample is missed (at most `interval_s` per process)."""

    def __init__(self, root: int, interval_s: float = 0.5):
        import threading

        self.root, self.interval_s = root, interval_s
        self.seen: dict[tuple[int, str], float] = {}  # (pid, start time) -> last CPU seconds seen
        self.names: dict[tuple[int, str], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")
        self._thread.start()

    def _sample(self) -> None:
        procs: dict[int, tuple[int, str, float, str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            procs[int(entry.name)] = (int(rest[1]), rest[19], (int(rest[11]) + int(rest[12])) / self._tick, name)
        children: dict[int, list[int]] = {}
        for pid, (ppid, *_rest) in procs.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.root]
        while todo:
            pid = todo.pop()
            if pid in procs:
                _, start, cpu, name = procs[pid]
                self.seen[(pid, start)] = cpu
                self.names[(pid, start)] = name
            todo += children.get(pid, [])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.seen.values())

    def top(self, n: int = 8) -> list[tuple[str, int, float]]:
        rows = sorted(((self.names[k], k[0], v) for k, v in self.seen.items()), key=lambda r: -r[2])
        return [(name, pid, round(cpu, 2)) for name, pid, cpu in rows[:n]]


# =========================================================================== workers (one per subprocess)


def worker_alignflow(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from alignflow.config import load_config
    from alignflow.stages.common.models import resolve_model_path
    from alignflow.stages.rl import stage

    subreaper = become_subreaper()
    total = args.warmup + args.steps
    overrides = [
        "name=throughput-bench",
        "register.enabled=false",  # the rl stage runs standalone from the model folder given below (no `from:`):
        # beside tiny.yaml's sft stage it is a second final model, and the benchmark registers nothing
        f"storage.root={args.tmp}/outputs",
        f"rl.model.name_or_path={resolve_model_path(args.model)}",
        f"rl.model.dtype={'bfloat16' if args.precision == 'bf16' else 'float32'}",
        "rl.model.attn_implementation=sdpa",
        "rl.model.gradient_checkpointing=false",
        f"rl.data.path={args.data}",
        "rl.data.eval_path=",  # None: no held-out file ...
        "rl.data.eval_fraction=0.0",  # ... and no held-out split: every prompt trains, evaluation is a no-op
        f"rl.data.max_len={MAX_PROMPT_LEN}",
        f"rl.generation.max_new_tokens={MAX_NEW_TOKENS}",
        f"rl.generation.temperature={TEMPERATURE}",
        "rl.generation.top_p=1.0",
        "rl.generation.top_k=0",
        f"rl.generation.n_samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"rl.generation.batch_size={COMPLETIONS}",  # one generate batch, as TRL's one model.generate call
        f"rl.reward.function={REWARD_SPEC}",
        "rl.reward.overlong_buffer=0",
        "rl.advantage.estimator=group_norm",
        "rl.kl.coef=0.0",
        f"rl.policy.clip_low={CLIP_LOW}",
        f"rl.policy.clip_high={CLIP_HIGH}",
        "rl.policy.aggregation=token",
        "rl.policy.epochs=1",
        "rl.policy.entropy_coef=0.0",
        f"rl.rollout.prompts_per_step={PROMPTS_PER_STEP}",
        "rl.rollout.dynamic_sampling=false",
        f"rl.optim.lr={LR}",
        f"rl.optim.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"rl.optim.eps={EPS}",
        "rl.optim.weight_decay=0.0",
        f"rl.optim.grad_clip={GRAD_CLIP}",
        "rl.optim.warmup_steps=0",
        "rl.optim.scheduler=constant",
        f"rl.batch.global_batch_size={OPTIM_BATCH}",
        f"rl.batch.micro_batch_size={OPTIM_BATCH}",
        f"rl.batch.max_steps={total}",
        "rl.batch.epochs=100000",  # max_steps decides
        f"rl.batch.seed={SEED}",
        "rl.deepspeed.zero_stage=0",
        f"rl.deepspeed.precision={args.precision}",
        "rl.workers.actor=1",
        # asynchronous rollout: the rollout worker and the actor run at once, each on half the cores
        f"rl.workers.cpus_per_worker={max(1, args.threads // 2) if args.worker == 'alignflow-async' else args.threads}",
        "rl.workers.colocate=all",
        f"rl.logging.eval_every={NEVER}",
        f"rl.logging.log_every={NEVER}",
        "rl.logging.progress=false",
        f"rl.checkpoint.every_steps={NEVER}",
        *ALIGNFLOW_VARIANTS[args.worker],
        # --eval-every: the stage's own held-out evaluation (greedy, before step 1 and every K steps; not in step times)
        *([f"rl.data.eval_path={EVAL_DATA}", f"rl.logging.eval_every={args.eval_every}"] if args.eval_every else []),
    ]
    cfg = load_config(args.config, overrides)

    spans: list[tuple[float, float]] = []
    rollout_calls: list[float] = []
    score_calls: list[float] = []
    setup: dict[str, float] = {}
    loop_step, roles_generate, scorer_call = stage.Loop.step, stage.Roles.generate, stage.Scorer.__call__
    roles_init, connect_ray = stage.Roles.__init__, stage.connect_ray

    def timed(record, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                record(t0, time.perf_counter())
        return wrapper

    # Driver-side only (the actors run in their own processes); per-step phases come from metrics.json. Generation and
    # scoring are counted inside RL steps only (not in the held-out evaluations of --eval-every).
    in_step = [False]

    def stepping(*a, **k):
        in_step[0] = True
        try:
            return loop_step(*a, **k)
        finally:
            in_step[0] = False

    stage.Loop.step = timed(lambda t0, t1: spans.append((t0, t1)), stepping)
    stage.Roles.generate = timed(lambda t0, t1: in_step[0] and rollout_calls.append(t1 - t0), roles_generate)
    stage.Scorer.__call__ = timed(lambda t0, t1: in_step[0] and score_calls.append(t1 - t0), scorer_call)
    stage.Roles.__init__ = timed(lambda t0, t1: setup.__setitem__("workers_start_s", t1 - t0), roles_init)
    stage.connect_ray = timed(lambda t0, t1: setup.__setitem__("ray_start_s", t1 - t0), connect_ray)
    t_main = time.perf_counter()
    result = stage.main(cfg, "rl", output_uri=str(Path(args.tmp) / "rl-out"))
    main_s = time.perf_counter() - t_main
    leftover = reap_children() if subreaper else []
    metrics = json.loads((Path(result["uri"]) / "metrics.json").read_text())
    history = [h for h in metrics["history"] if h["step"] >= 1 and "phase/train_s" in h]
    if len(history) != total or len(spans) != total:
        raise RuntimeError(f"expected {total} steps, metrics.json has {len(history)}, timed {len(spans)}")
    if len(rollout_calls) != total or len(score_calls) != total:
        raise RuntimeError(f"expected one generation per step, got {len(rollout_calls)} rollout calls and {len(score_calls)} scorings")
    steps = []
    for i, h in enumerate(history):
        # Asynchronous rollout: generation runs beside the step; what it adds is the wait for it before the weight push
        exposed_gen = h["phase/generate_and_score_s"] + h.get("phase/wait_for_rollout_s", 0.0)
        phases = {"gen_s": exposed_gen, "logp_s": h["phase/inference_s"], "train_s": h["phase/train_s"],
                  "sync_s": h["phase/sync_s"]}
        steps.append({
            "step": h["step"], **phases, "step_time_s": sum(phases.values()), "span_s": spans[i][1] - spans[i][0],
            "completions": COMPLETIONS, "gen_tokens": round(h["train/response_length"] * COMPLETIONS),
            "reward_mean": h["reward/mean"], "gen_tokens_per_s_reported": h.get("train/gen_tokens_per_s"),
            "rollout_call_s": rollout_calls[i], "score_s": score_calls[i],
            "old_logprob_pass": h.get("train/old_logprob_pass"), "logprob_mismatch": h.get("train/logprob_mismatch"),
            "policy_loss": h.get("train/policy_loss"), "entropy": h.get("train/entropy"), "clip_frac": h.get("train/clip_frac"),
            "t_begin": spans[i][0], "t_end": spans[i][1],
        })
    summary = metrics.get("summary", {})
    import deepspeed
    import ray
    import transformers

    return {
        "steps": steps,
        "evals": {int(h["step"]): h["eval/reward"] for h in metrics["history"] if "eval/reward" in h},
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
                     "ray": ray.__version__},
        "setup_s": summary.get("time/setup_s"),
        "setup_parts": setup,
        "main_s": main_s,
        "summary_timings": {k: v for k, v in summary.items() if k.startswith("time/")},
        "subreaper": subreaper,
        "leftover_child_pids": leftover,
        "train_prompts": metrics.get("data", {}).get("train", {}).get("used"),
    }


class HeldOutBase:
    """TRL's held-out evaluation, as alignflow's rl stage evaluates: greedy answers (at most MAX_NEW_TOKENS, ending at
    EOS) to the prompts of data/rl/eval.jsonl, scored by the same reward function; the mean is the accuracy. Before
    the first step and every `every` RL steps (2 optimizer steps each)."""

    def __init__(self, model, tokenizer, reward, every: int, out: dict[int, float], ours) -> None:
        from alignflow.config.base import PromptDataConfig
        from alignflow.stages.rl.data import load_prompts

        self.model, self.tokenizer, self.reward, self.every, self.out = model, tokenizer, reward, every, out
        self.rows, _, _ = load_prompts(PromptDataConfig(path=str(EVAL_DATA), max_len=MAX_PROMPT_LEN, eval_fraction=0.0), ours, SEED)

    def accuracy(self) -> float:
        import torch

        pad, eos, scores = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, []
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for k in range(0, len(self.rows), 100):
                chunk = self.rows[k:k + 100]
                width = max(len(r.ids) for r in chunk)
                ids = torch.tensor([[pad] * (width - len(r.ids)) + r.ids for r in chunk])
                attn = torch.tensor([[0] * (width - len(r.ids)) + [1] * len(r.ids) for r in chunk])
                out = self.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                          eos_token_id=eos, pad_token_id=pad)[:, width:].tolist()
                completions = [c[:c.index(eos) + 1] if eos in c else c for c in out]
                texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
                columns = {key: [r.columns[key] for r in chunk] for key in chunk[0].columns}
                scores += self.reward([r.text for r in chunk], texts, [r.ids for r in chunk], completions, columns).tolist()
        self.model.train(training)
        return sum(scores) / len(scores)

    def on_train_begin(self, args, state, control, **kw):
        self.out[0] = self.accuracy()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % (self.every * OPTIM_STEPS_PER_RL_STEP) == 0:
            self.out[state.global_step // OPTIM_STEPS_PER_RL_STEP] = self.accuracy()


def HeldOut(*a, **k):
    from transformers import TrainerCallback

    return type("HeldOut", (HeldOutBase, TrainerCallback), {})(*a, **k)


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from alignflow.config.base import PromptDataConfig
    from alignflow.stages.common.data import global_batch
    from alignflow.stages.common.models import load_tokenizer, resolve_model_path
    from alignflow.stages.rl.data import load_prompts
    from alignflow.stages.rl.rewards import FunctionReward

    become_subreaper()
    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    path = resolve_model_path(args.model)
    t_imports = time.perf_counter()

    # alignflow's prompt rows (file order; no held-out split) and its per-step prompt picks
    ours = load_tokenizer(path)
    train, held, _ = load_prompts(PromptDataConfig(path=args.data, max_len=MAX_PROMPT_LEN, eval_fraction=0.0), ours, SEED)
    if held:
        raise RuntimeError("expected no held-out prompts")
    order = [i for step in range(total) for i in global_batch(len(train), PROMPTS_PER_STEP, step, SEED)]
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": train[i].text}], **train[i].columns} for i in order])
    ids_of = {r.text: r.ids for r in train}

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")

    reference = FunctionReward(REWARD_SPEC)  # alignflow's own caller of the function, for the adapter check
    generations: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}

    def exact_answer(prompts, completions, completion_ids, **kwargs):
        """TRL's reward-function call -> the shipped function with alignflow's arguments (same floats back)."""
        columns = {k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_extra", "log_metric", "environments")}
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        users = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        prompt_ids = [ids_of[u] for u in users]
        values = [float(v) for v in reference.fn(prompts=users, completions=texts, prompt_ids=prompt_ids,
                                                 completion_ids=completion_ids, **columns)]
        if not checks:
            theirs = reference(users, texts, prompt_ids, completion_ids, columns).tolist()
            decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
            checks["reward_adapter_matches_alignflow"] = theirs == values and decoded == texts
            checks["completion_is_conversational"] = isinstance(completions[0], list)
        generations.append({"n": len(values), "reward_mean": sum(values) / len(values),
                            "gen_tokens": sum(len(ids) for ids in completion_ids),
                            "eos_fraction": sum(bool(ids) and ids[-1] == tokenizer.eos_token_id for ids in completion_ids) / len(values)})
        return values

    config = GRPOConfig(
        output_dir=str(Path(args.tmp) / "trl-out"),
        max_steps=total * OPTIM_STEPS_PER_RL_STEP,  # TRL counts optimizer steps
        per_device_train_batch_size=OPTIM_BATCH,
        gradient_accumulation_steps=1,
        steps_per_generation=OPTIM_STEPS_PER_RL_STEP,  # generation_batch_size = 64 x 2 = 128 completions
        num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        use_vllm=False, use_transformers_continuous_batching=False,
        beta=0.0, num_iterations=1, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH,
        scale_rewards="group", loss_type="dapo", importance_sampling_level="token",
        mask_truncated_completions=False, top_entropy_quantile=1.0, entropy_coef=0.0,
        shuffle_dataset=False,  # the dataset is already in alignflow's per-step prompt order
        learning_rate=LR,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, non-fused, as alignflow
        max_grad_norm=GRAD_CLIP,
        lr_scheduler_type="constant", warmup_steps=0,
        bf16=args.precision == "bf16", fp16=False, gradient_checkpointing=False,  # bf16: autocast, fp32 weights
        use_cpu=True,
        eval_strategy="no", save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, dataloader_pin_memory=False,
        seed=SEED, data_seed=SEED,
    )

    class Timing(TrainerCallback):
        def __init__(self) -> None:
            self.end: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.end.append(time.perf_counter())

    class Timed(GRPOTrainer):
        """Records, per optimizer step, when it starts fetching its batch; per generation, the generating
        `_prepare_inputs` call, the no-grad log-prob forwards inside it, model.generate and the reward call."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fetch: list[float] = []
            self.prepare: list[float] = []  # duration of each generating _prepare_inputs call
            self.logp: list[float] = []  # no-grad log-prob time inside each generation
            self.generate_s: list[float] = []
            self.reward_s: list[float] = []
            self.logp_rows: list[list[int]] = []
            self._in_generation = False

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            t0 = time.perf_counter()
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                self.fetch.append(t0)
            return batches, num_items

        def _prepare_inputs(self, generation_batch):
            t0 = time.perf_counter()
            before = len(self.logp)
            out = super()._prepare_inputs(generation_batch)
            if len(self.logp) > before:  # this call generated
                self.prepare.append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            self._in_generation, self._logp_now, self._rows_now = True, 0.0, []
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self._in_generation = False
                self.logp.append(self._logp_now)
                self.logp_rows.append(self._rows_now)

        def _get_per_token_logps_and_entropies(self, model, input_ids, *a, **k):
            t0 = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(model, input_ids, *a, **k)
            if self._in_generation and not torch.is_grad_enabled():
                self._logp_now += time.perf_counter() - t0
                self._rows_now.append((int(input_ids.shape[0]), k.get("batch_size")))
            return out

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                self.generate_s.append(time.perf_counter() - t0)

        def _calculate_rewards(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._calculate_rewards(*a, **k)
            finally:
                self.reward_s.append(time.perf_counter() - t0)

    timing = Timing()
    evals: dict[int, float] = {}
    callbacks: list[Any] = [timing]
    if args.eval_every:  # after Timing's on_step_end, so outside the step times
        callbacks.append(HeldOut(model, tokenizer, reference, args.eval_every, evals, ours))
    trainer = Timed(model=model, reward_funcs=[exact_answer], args=config, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=callbacks)
    trl_ids, _, _ = trainer._tokenize_prompts([[{"role": "user", "content": r.text}] for r in train])
    same_prompt_ids = [list(x) for x in trl_ids] == [r.ids for r in train]
    gen_cfg = trainer.generation_config
    info: dict[str, Any] = {
        "same_prompt_ids_as_alignflow": same_prompt_ids,
        "prompts_checked": len(train),
        "dataset_rows": len(dataset),
        "attn_implementation": model.config._attn_implementation,
        "bf16": bool(config.bf16),
        "generation_batch_size": config.generation_batch_size,
        "steps_per_generation": config.steps_per_generation,
        "generation_config": {k: getattr(gen_cfg, k, None) for k in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "eos_token_id")},
        "reference_model": trainer.ref_model is not None,
        "use_vllm": bool(trainer.use_vllm),
    }
    trainer.train()
    info["gradient_checkpointing"] = bool(getattr(trainer.model, "is_gradient_checkpointing", False))
    info.update(checks)
    leftover = reap_children(5.0)

    n_opt = len(timing.end)
    if n_opt != total * OPTIM_STEPS_PER_RL_STEP or len(trainer.fetch) < n_opt:
        raise RuntimeError(f"expected {total * OPTIM_STEPS_PER_RL_STEP} optimizer steps, got {n_opt} step ends, {len(trainer.fetch)} fetches")
    if not (len(trainer.prepare) == len(generations) == len(trainer.logp) == total):
        raise RuntimeError(f"expected {total} generations, got {len(trainer.prepare)} generating calls, {len(generations)} "
                           f"reward calls, {len(trainer.logp)} scorings")
    for k, rows in enumerate(trainer.logp_rows):
        if [tuple(r) for r in rows] != [(COMPLETIONS, OPTIM_BATCH)]:  # one call over the 128 rows, in chunks of 64
            raise RuntimeError(f"generation {k + 1}: old log-prob calls (rows, chunk) {rows}, expected one of ({COMPLETIONS}, {OPTIM_BATCH})")
    steps = []
    for k in range(total):
        opt = range(k * OPTIM_STEPS_PER_RL_STEP, (k + 1) * OPTIM_STEPS_PER_RL_STEP)
        step_time = sum(timing.end[i] - trainer.fetch[i] for i in opt)
        prepare, logp = trainer.prepare[k], trainer.logp[k]
        g = generations[k]
        steps.append({
            "step": k + 1, "gen_s": prepare - logp, "logp_s": logp, "train_s": step_time - prepare, "sync_s": 0.0,
            "step_time_s": step_time, "span_s": timing.end[opt[-1]] - trainer.fetch[opt[0]],
            "completions": g["n"], "gen_tokens": g["gen_tokens"], "reward_mean": g["reward_mean"], "eos_fraction": g["eos_fraction"],
            "generate_call_s": trainer.generate_s[k], "reward_call_s": trainer.reward_s[k],
            "t_begin": trainer.fetch[opt[0]], "t_end": timing.end[opt[-1]],
        })
    return {
        "steps": steps,
        "evals": evals,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "setup_s": trainer.fetch[0] - t_imports,
        "imports_s": t_imports - t_start,
        "leftover_child_pids": leftover,
        **info,
    }


# =========================================================================== parent: run, summarise, print


def summarise(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    timed = result["steps"][warmup:]
    n = len(timed)
    seconds = sum(s["step_time_s"] for s in timed)
    completions = sum(s["completions"] for s in timed)
    tokens = sum(s["gen_tokens"] for s in timed)
    wall = timed[-1]["t_end"] - timed[0]["t_begin"]
    out: dict[str, Any] = {
        "timed_steps": n,
        "step_time_s": seconds / n,
        "median_step_time_s": statistics.median(s["step_time_s"] for s in timed),
        "completions_per_s": completions / seconds,
        "gen_tokens_per_s": tokens / seconds,
        "tokens_per_completion": tokens / completions,
        "gen_phase_tokens_per_s": tokens / sum(s["gen_s"] for s in timed),
        **{p: sum(s[p] for s in timed) / n for p in PHASES},
        "unaccounted_s": sum(s["span_s"] - s["step_time_s"] for s in timed) / n,
        "loop_wall_s": wall,
        "loop_wall_step_s": wall / n,
        "setup_s": result.get("setup_s"),
        "reward_first": result["steps"][0].get("reward_mean"),
        "reward_last": result["steps"][-1].get("reward_mean"),
        "reward_mean_timed": sum(s["reward_mean"] for s in timed) / n,
    }
    if all(s.get("old_logprob_pass") is not None for s in timed):  # alignflow: on how many steps the guard ran the pass
        out["old_logprob_passes"] = int(sum(s["old_logprob_pass"] for s in timed))
        out["logprob_mismatch_max"] = max(s["logprob_mismatch"] for s in timed)
    for key in ("rollout_call_s", "score_s", "generate_call_s", "reward_call_s"):
        if all(key in s for s in timed):
            out[key] = sum(s[key] for s in timed) / n
    evals = {int(k): v for k, v in result.get("evals", {}).items()}  # JSON keys are strings
    if 0 in evals:
        # training time = the summed step times (warmup steps included) up to the first evaluation 10 points up
        elapsed = list(itertools.accumulate(s["step_time_s"] for s in result["steps"]))
        hit = min((k for k, v in evals.items() if k > 0 and v >= evals[0] + 0.10 - 1e-9), default=None)
        out.update(accuracy_initial=evals[0], accuracy_final=evals[max(evals)], steps_to_plus10=hit,
                   time_to_plus10_s=elapsed[hit - 1] if hit else None,
                   evals=" ".join(f"{k}:{v:.3f}" for k, v in sorted(evals.items())))
    return out


def worker_command(args: argparse.Namespace, framework: str, out: Path, tmp: Path) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", framework,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model, "--precision", args.precision,
        "--data", str(args.data), "--config", str(args.config), "--threads", str(args.threads), "--eval-every", str(args.eval_every),
        "--tmp", str(tmp), "--worker-out", str(out),
    ]


def run_one(args: argparse.Namespace, framework: str, workdir: Path, index: int) -> dict[str, Any]:
    tmp = workdir / f"{framework}-{index}"
    tmp.mkdir(parents=True)
    out = tmp / "result.json"
    cmd = worker_command(args, framework, out, tmp)
    log_path = tmp / "worker.log"
    env = worker_env(args.threads, tmp)
    env.pop("RAY_ADDRESS", None)  # alignflow must start its own private Ray, never join another cluster
    env.update(TQDM_DISABLE="1", HF_DATASETS_CACHE=str(tmp / "hf-datasets"), RAY_USAGE_STATS_ENABLED="0")
    if args.wait_idle > 0:
        wait_until_idle(args.wait_idle)
    print(f"running {framework} (log: {log_path}) ...", file=sys.stderr, flush=True)
    t0, busy0, mine0, self0 = time.perf_counter(), busy_cpu_seconds(), children_cpu_seconds(), own_cpu_seconds()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        tree = TreeCPU(proc.pid)
        proc.wait()
    elapsed, busy1, mine1, self1 = time.perf_counter() - t0, busy_cpu_seconds(), children_cpu_seconds(), own_cpu_seconds()
    polled = tree.stop()
    record: dict[str, Any] = {"framework": framework, "command": shlex.join(cmd), "process_wall_s": elapsed}
    if busy0 is not None and busy1 is not None:
        # CPU used by everything else on the machine while the worker ran, as a share of all cores:
        # anything well above 0 means the timings are contended and not to be trusted. The worker's CPU is its
        # process tree's (Ray's actors and daemons included): the larger of what the kernel reports for its reaped
        # descendants and what the /proc sampling saw; this process's own CPU (the sampling) is not "other" either.
        mine = max(mine1 - mine0, polled)
        others = max(0.0, (busy1 - busy0) - mine - (self1 - self0))
        record["other_cpu_share"] = others / (elapsed * (os.cpu_count() or 1))
        record["worker_cpu_s"] = mine
        record["worker_cpu_rusage_s"] = mine1 - mine0
        record["worker_cpu_polled_s"] = polled
        record["worker_cpu_top"] = tree.top()
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-25:]
        errors = [line for line in tail if "Error" in line or "error" in line]
        record["error"] = (errors[-1] if errors else (tail[-1] if tail else f"exit code {proc.returncode}")).strip()
        record["log_tail"] = tail
        print(f"  failed: {record['error']}", file=sys.stderr, flush=True)
        return record
    result = json.loads(out.read_text())
    record.update(result=result, summary=summarise(result, args.warmup))
    s = record["summary"]
    contention = f", other processes used {record['other_cpu_share']:.0%} of the CPU" if "other_cpu_share" in record else ""
    print(f"  {s['step_time_s']:.3f} s/step, {s['completions_per_s']:,.1f} completions/s, {s['gen_tokens_per_s']:,.0f} tokens/s "
          f"({elapsed:.0f}s in all{contention})", file=sys.stderr, flush=True)
    if result.get("leftover_child_pids"):
        print(f"  note: child processes still running after the worker's end: {result['leftover_child_pids']}", file=sys.stderr, flush=True)
    return record


CHECK_KEYS = ("same_prompt_ids_as_alignflow", "prompts_checked", "reward_adapter_matches_alignflow", "completion_is_conversational",
              "generation_batch_size", "steps_per_generation", "generation_config", "reference_model", "use_vllm",
              "gradient_checkpointing", "bf16", "attn_implementation", "setup_parts", "subreaper", "leftover_child_pids")


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per framework: the median over repeats of each figure."""
    rows = []
    for framework in FRAMEWORKS:
        runs = [r for r in records if r["framework"] == framework]
        if not runs:
            continue
        ok = [r for r in runs if "summary" in r]
        row: dict[str, Any] = {"framework": framework, "command": runs[0]["command"], "runs": len(runs), "ok": len(ok)}
        shares = [r["other_cpu_share"] for r in runs if "other_cpu_share" in r]
        row["other_cpu_share"] = max(shares) if shares else None
        if ok:
            for key in ok[0]["summary"]:
                values = [r["summary"][key] for r in ok if r["summary"].get(key) is not None]
                numbers = all(isinstance(v, (int, float)) for v in values)
                row[key] = (statistics.median(values) if numbers else values[0]) if values else None
            for key in CHECK_KEYS:
                if key in ok[0]["result"]:
                    row[key] = ok[0]["result"][key]
        else:
            row["error"] = runs[0]["error"]
        rows.append(row)
    trl = next((r for r in rows if r["framework"] == "trl" and "step_time_s" in r), None)
    for r in rows:
        ok = trl is not None and "step_time_s" in r
        r["speedup_vs_trl"] = trl["step_time_s"] / r["step_time_s"] if ok else None
        r["tokens_ratio_vs_trl"] = r["gen_tokens_per_s"] / trl["gen_tokens_per_s"] if ok else None
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    fmt = lambda v, spec, suffix="": "n/a" if v is None else format(v, spec) + suffix  # noqa: E731
    lines = [
        f"GRPO throughput, model `{args.model}`, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples = {COMPLETIONS} completions "
        f"per RL step, max {MAX_NEW_TOKENS} new tokens, 2 optimizer steps of {OPTIM_BATCH}, {args.precision}, {args.threads} torch threads, "
        f"{args.steps} timed RL steps after {args.warmup} warmup steps"
        + (f", median of {args.repeats} runs" if args.repeats > 1 else "") + (f" ({meta['versions']})" if meta["versions"] else ""),
        "",
        "| framework | s/step | completions/s | gen tokens/s | vs TRL (s/step) | generation + scoring (s) | log-probs (s) | training (s) "
        "| weight sync (s) | unaccounted (s) | loop wall / step (s) | setup (s) | tokens/completion | reward first -> last | other CPU load | command |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        if "step_time_s" not in r:
            lines.append(f"| {r['framework']} | failed: {r.get('error', '')[:200].replace('|', '/')} |" + " |" * 14 + f" `{r['command']}` |")
            continue
        share = lambda p: f"{r[p]:.3f} ({r[p] / r['step_time_s']:.0%})"  # noqa: E731
        sync = share("sync_s") if r["framework"].startswith("alignflow") else "none (0)"
        lines.append(
            f"| {r['framework']} | {r['step_time_s']:.3f} | {r['completions_per_s']:,.1f} | {r['gen_tokens_per_s']:,.0f} | "
            f"{fmt(r['speedup_vs_trl'], '.2f', 'x')} | {share('gen_s')} | {share('logp_s')} | {share('train_s')} | {sync} | "
            f"{r['unaccounted_s']:.3f} | {r['loop_wall_step_s']:.3f} | {fmt(r.get('setup_s'), '.1f')} | {r['tokens_per_completion']:.2f} | "
            f"{fmt(r['reward_first'], '.3f')} -> {fmt(r['reward_last'], '.3f')} | {fmt(r['other_cpu_share'], '.0%')} | `{r['command']}` |"
        )
    lines.append("")
    for r in rows:
        if r.get("accuracy_initial") is not None:
            hit = (f"+10 points at step {r['steps_to_plus10']}, after {r['time_to_plus10_s']:.1f} s of step time"
                   if r.get("steps_to_plus10") else "never +10 points")
            lines.append(f"{r['framework']}: held-out greedy accuracy {r['accuracy_initial']:.3f} -> {r['accuracy_final']:.3f}; "
                         f"{hit} (step:accuracy {r['evals']})")
    lines.append("")
    a = next((r for r in rows if r["framework"] == "alignflow" and "step_time_s" in r), None)
    t = next((r for r in rows if r["framework"] == "trl" and "step_time_s" in r), None)
    if a and t:
        lines.append(
            f"alignflow vs TRL: {a['step_time_s']:.3f} vs {t['step_time_s']:.3f} s per RL step, {a['completions_per_s']:,.1f} vs "
            f"{t['completions_per_s']:,.1f} completions/s: **{t['step_time_s'] / a['step_time_s']:.2f}x**; generated tokens/s "
            f"{a['gen_tokens_per_s']:,.0f} vs {t['gen_tokens_per_s']:,.0f}: {a['gen_tokens_per_s'] / t['gen_tokens_per_s']:.2f}x"
        )
        lines.append("")
        lines.append("| phase (s/step) | alignflow | TRL | TRL / alignflow |")
        lines.append("|---|---:|---:|---:|")
        for p in PHASES:
            ratio = f"{t[p] / a[p]:.2f}x" if a[p] > 0 and t[p] > 0 else "n/a"
            lines.append(f"| {PHASE_NAMES[p]} | {a[p]:.3f} | {t[p]:.3f} | {ratio} |")
        lines.append(f"| step | {a['step_time_s']:.3f} | {t['step_time_s']:.3f} | {t['step_time_s'] / a['step_time_s']:.2f}x |")
        lines.append("")
    if a:
        parts = a.get("setup_parts") or {}
        lines.append(
            f"alignflow: inside generation + scoring, the Ray call that generates took {fmt(a.get('rollout_call_s'), '.3f')} s/step and "
            f"decode + reward {fmt(a.get('score_s'), '.3f')} s/step; generation-phase rate {a['gen_phase_tokens_per_s']:,.0f} tokens/s. "
            f"Setup {fmt(a.get('setup_s'), '.1f')} s (Ray start {fmt(parts.get('ray_start_s'), '.1f')} s, actor + rollout workers "
            f"{fmt(parts.get('workers_start_s'), '.1f')} s). "
            + (f"Old-log-prob pass on {a['old_logprob_passes']} of {a['timed_steps']} timed steps (largest generator-vs-actor gap "
               f"{a['logprob_mismatch_max']:.1e} a token, tolerance from the config). " if a.get('old_logprob_passes') is not None else "")
            + f"Ray processes reaped by the worker: {a.get('subreaper')}; left running: {a.get('leftover_child_pids') or 'none'}."
        )
    if t:
        lines.append(
            f"TRL: inside generation + scoring, model.generate took {fmt(t.get('generate_call_s'), '.3f')} s/step and the reward call "
            f"{fmt(t.get('reward_call_s'), '.3f')} s/step; generation-phase rate {t['gen_phase_tokens_per_s']:,.0f} tokens/s. "
            f"Setup {fmt(t.get('setup_s'), '.1f')} s. No weight sync: it generates with the model it trains (use_vllm={t.get('use_vllm')}). "
            f"Checks: prompt token ids == alignflow's for all {t.get('prompts_checked')} prompts: {t.get('same_prompt_ids_as_alignflow')}; "
            f"reward adapter == alignflow's FunctionReward (and completion text == alignflow's decode): {t.get('reward_adapter_matches_alignflow')}; "
            f"generation batch {t.get('generation_batch_size')} = {t.get('steps_per_generation')} optimizer steps; "
            f"reference model {t.get('reference_model')}; gradient checkpointing {t.get('gradient_checkpointing')}, bf16 {t.get('bf16')}, "
            f"attention {t.get('attn_implementation')}; generation config {t.get('generation_config')}."
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
        f"s/step = the RL step's generation + scoring, log-probs, training and weight-sync time (TRL: data fetch -> on_step_end "
        f"of its 2 optimizer steps); completions/s = {COMPLETIONS} / s/step; gen tokens = completion tokens incl. EOS. "
        "unaccounted = the step's whole span minus its phases (TRL: the logging between its 2 optimizer steps); loop wall / "
        "step also holds what runs between steps (logging). With builtin:tiny (random weights) every reward is 0, so the "
        "advantages and gradients are 0: all the work runs, nothing is learned. "
        "Setup (not in the per-step figures): alignflow `time/setup_s` (Ray, worker processes, models, engine); TRL after its "
        "imports -> first data fetch. See the docstring of benchmarks/grpo_throughput.py.",
    ]
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    from alignflow.stages.common.models import resolve_model_path

    resolve_model_path(args.model)  # build the built-in model once, outside any timing
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    records = []
    workdir = Path(tempfile.mkdtemp(prefix="grpo-throughput-"))
    try:
        for index in range(args.repeats):  # round-robin, so slow drift in machine load hits every framework
            for framework in frameworks:
                records.append(run_one(args, framework, workdir, index))
    finally:
        if args.keep_workdir:
            print(f"kept worker folders and logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    versions: dict[str, str] = {}
    for r in records:
        versions.update(r.get("result", {}).get("versions", {}))
    meta = {"versions": ", ".join(f"{k} {v}" for k, v in sorted(versions.items())), "threads": args.threads}
    rows = aggregate(records)
    table = markdown(rows, args, meta)
    print(table)
    if args.json:
        payload = {
            "settings": {
                "model": args.model, "data": str(args.data), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                "threads": args.threads, "precision": args.precision, "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES_PER_PROMPT,
                "optimizer_batch": OPTIM_BATCH, "max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE,
                "clip": [CLIP_LOW, CLIP_HIGH], "lr": LR, "betas": BETAS, "eps": EPS, "grad_clip": GRAD_CLIP, "reward": REWARD_SPEC,
                "versions": versions, "argv": shlex.join([sys.executable, *sys.argv]),
            },
            "rows": rows,
            "runs": records,
            "markdown": table,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0 if all("summary" in r for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="timed RL steps (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed RL steps before them (default 5)")
    p.add_argument("--model", default="builtin:tiny",
                   help="builtin:tiny (default), builtin:small, or a local HF folder (e.g. a published SFT model)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write all figures and per-step records here")
    p.add_argument("--repeats", type=int, default=1, help="runs per framework, round-robin; the table shows medians")
    p.add_argument("--frameworks", default="alignflow,trl", help=f"comma list of {', '.join(FRAMEWORKS)}")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to leave the CPU idle (default 0: do not wait)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the worker folders (logs, published models) instead of deleting them")
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch threads for every run (default: all usable cores)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="held-out greedy accuracy (data/rl/eval.jsonl) before step 1 and every K RL steps, outside the step "
                        "times, and the training time each framework takes to gain 10 points (default 0: none)")
    add_precision_argument(p)
    p.add_argument("--data", default=str(DEFAULT_DATA), help=argparse.SUPPRESS)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help=argparse.SUPPRESS)
    # worker mode (used by the parent)
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --repeats >= 1")
    unknown = [f for f in args.frameworks.split(",") if f.strip() and f.strip() not in FRAMEWORKS]
    if unknown:
        p.error(f"--frameworks: {', '.join(unknown)} not among {', '.join(FRAMEWORKS)}")
    args.data = str(Path(args.data).resolve())

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker is None:
        return parent(args)
    result = (worker_trl if args.worker == "trl" else worker_alignflow)(args)
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
