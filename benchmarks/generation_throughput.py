"""Rollout generation throughput: the vLLM CPU engine (`VLLMGenerator`) against the HF backend (`HFGenerator`), and
the RL step breakdown with each.

Run:   .venv/bin/python benchmarks/generation_throughput.py                      # tokens/s, builtin:tiny and builtin:small
       .venv/bin/python benchmarks/generation_throughput.py --rl                 # RL step phases, GRPO on the tiny SFT model
       .venv/bin/python benchmarks/generation_throughput.py --rl --rl-models tiny,small
Smoke: .venv/bin/python benchmarks/generation_throughput.py --quick              # 4 prompts x 8 tokens, builtin:tiny only
       .venv/bin/python benchmarks/generation_throughput.py --rl --quick         # 2 RL steps, 3 SFT steps
Options: [--models tiny,small|DIR] [--backends hf,vllm] [--prompts data|random] [--new-tokens 64] [--timed 3]
         [--threads N] [--no-unseeded] [--rl-steps 10] [--rl-skip 2] [--set KEY=VALUE ...] [--wait-idle S]
         [--json out.json] [--keep-workdir]

Every measurement runs in its own subprocess (this same file with `--worker gen|sft|rl ...`), one after another, each
writing its figures to a JSON file that the parent reads; the parent prints markdown tables. Separate processes are
required, not just tidy: vLLM (in-process engine on CPU) initialises torch.distributed in its process and replaces
`torch.set_num_threads` with a no-op for the rest of the process, so an HF measurement after it in the same process
would not be comparable. Every worker gets the same environment (`worker_env` of benchmarks/sft_throughput.py:
OMP_NUM_THREADS = MKL_NUM_THREADS = --threads, default all usable cores, i.e. 2 on the development machine) and calls
`torch.set_num_threads(--threads)` before any model work; the vLLM engine gets `threads=--threads`. The table shows
`torch.get_num_threads()` read after the timed calls in each worker, so an engine that changed it would show.

Mode 1, generation (default): tokens/s of one generator, outside the RL loop
- models: `builtin:tiny` (0.80M parameters) and `builtin:small` (23.65M), both seeded random weights, fp32 (`--models`
  also takes a local HF folder). The parameter counts printed are read from the safetensors headers (tied weights once).
- prompts (`--prompts data`, the default): the first 64 rows of data/rl/train.jsonl rendered exactly as the RL stage
  renders them (chat template with the generation prompt, `encode`), 9-12 tokens each; the HF backend left-pads them
  in its batch, as it does in the RL loop. `--prompts random`: random non-special token ids, all `--prompt-len` (16)
  long, no padding anywhere. The same prompt ids go to both backends.
- shapes: 64 prompts x 1 sample (one rollout batch) and 8 prompts x 8 samples (the GRPO shape); 64 sequences each,
  temperature 1.0, top-p 1, no top-k, `--new-tokens` (64) new tokens for EVERY sequence: end-of-sequence is turned
  off on both sides so that both generate the same number of tokens (random weights sample the EOS token now and
  then; the table's "EOS sampled" column counts the sequences that would have stopped early):
    - HF: `HFGenerator(model, eos_token_id=-1, ...)`: an id no sampled token can equal, so no row ever finishes;
    - vLLM: `VLLMGenerator` always puts its EOS into `stop_token_ids`; vLLM rejects an out-of-vocabulary stop id
      when the request is added (`SamplingParams(stop_token_ids=[-1])` constructs, then generate raises
      VLLMValidationError "out-of-vocab token ids"), and with `ignore_eos=True` it still stops at `stop_token_ids`. So the
      engine is built as the RL stage builds it (real EOS) and, while timing, `vllm.SamplingParams` is wrapped so that
      every `SamplingParams(...)` that `VLLMGenerator.generate` builds gets `ignore_eos=True, stop_token_ids=[]`;
      everything else (per-prompt seeds, processed log-probs, no detokenization, conversion to `Rollout`s) is the
      engine's own code path. Each call is checked: every rollout has exactly `--new-tokens` tokens and finish reason
      "length", on both sides.
  Each shape: one untimed warm-up call, then `--timed` (3) timed calls of `generate(prompts, params)` with the same
  arguments; tokens/s = generated tokens of one call (64 x new tokens) / the median call time. The vLLM prefix cache
  is cleared before every call (outside the timing), as the RL loop does after each weight sync.
- "vllm, unseeded": the same engine with the per-request `seed` dropped (alignflow passes seed + i for each prompt so
  that rollouts are reproducible; seeded requests make vLLM's sampler draw from a generator per request). Shown to
  price that choice; `--no-unseeded` leaves it out.
- start: "imports" = the worker's imports (torch, transformers, alignflow; plus vllm in the vLLM worker), tokenizer
  load and prompt building, "engine start" = `load_causal_lm` + `HFGenerator(...)` for HF, `VLLMGenerator(...)` (the `vllm.LLM`:
  config, model load, 1 GiB KV cache, in-process engine core) for vLLM. Paid once per rollout worker, not per call.

Mode 2, `--rl`: the RL stage with each backend
- tiny: the SFT stage of configs/tiny.yaml is run first (a worker of its own) into a temporary storage root; then for
  each backend the rl stage (`alignflow.stages.rl.stage.main`) runs in a worker of its own on configs/tiny.yaml with
  `rl.from=sft`, `rl.generation.engine=hf|vllm`, `rl.batch.max_steps=--rl-steps` (10), `rl.logging.eval_every=1000`,
  checkpoints off, a storage root of its own, and the SFT model as its `from` input (as tests/integration do). So: 16
  prompts x 8 samples per step, at most 8 new tokens, EOS on (the SFT model's answers are ~4 tokens), real rewards,
  a private Ray with the actor and the rollout engine colocated in one bundle of `rl.workers.cpus_per_worker` (2)
  CPUs, each with 2 torch threads.
- small (`--rl-models tiny,small`): the same rl stage standalone (no `from:`, `rl.model.name_or_path` = the
  builtin:small folder, `register.enabled=false`): no SFT model for it (25M parameters: too slow to train here), so it starts from random
  weights, every reward is 0 and the answers run to the 8-token limit more often; the speed figures still hold.
- read from the published metrics.json history: per step `phase/generate_and_score_s`, `phase/inference_s`,
  `phase/train_s`, `phase/sync_s` (timed by the driver in `Loop.step`) and `train/gen_tokens_per_s` (generated tokens /
  generate-and-score time); the table shows the median of each over steps skip+1..N (`--rl-skip`, default 2: steps
  3..10), s/step = the median of the per-step sum of the four phases. setup = the run's `time/setup_s` (Ray start,
  worker processes, model loads, vLLM engine start): paid once per run.
- `--set KEY=VALUE` (repeatable) adds config overrides to the RL runs, e.g. `--set rl.generation.max_new_tokens=64`.

Noise: the "other CPU load" column is the share of all cores that other processes used while each worker ran
(machine-wide /proc/stat busy time minus the worker's whole process tree, sampled from /proc: `TreeCPU` of
benchmarks/grpo_throughput.py). On 2 cores a competing process changes these figures a lot: a run above ~5% is flagged
and should not be compared. `--wait-idle SECONDS` waits for an idle machine before each worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_throughput import TreeCPU, become_subreaper, own_cpu_seconds, reap_children  # noqa: E402
from sft_throughput import busy_cpu_seconds, children_cpu_seconds, cpu_threads, wait_until_idle, worker_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny.yaml"
PROMPT_DATA = ROOT / "data" / "rl" / "train.jsonl"
SEED = 42
TEMPERATURE = 1.0
NO_EOS = -1  # HFGenerator's EOS id for fixed-length generation: no sampled token id equals it
SHAPES = [(64, 1), (8, 8)]  # (prompts, samples per prompt): one rollout batch, and the GRPO shape
QUICK_SHAPES = [(4, 1), (2, 2)]
QUICK_NEW_TOKENS = 8
QUICK_RL_STEPS, QUICK_SFT_STEPS = 2, 3
NEVER = 10**9
# The sft stage's logging, and the rl kind's through `defaults:` (a `--set rl.…` alone would add an rl stage).
QUIET = [f"{s}.logging.{k}" for s in ("sft", "defaults.rl") for k in ("progress=false", "log_every=1000")]
PHASES = {"gen_s": "phase/generate_and_score_s", "inference_s": "phase/inference_s", "train_s": "phase/train_s", "sync_s": "phase/sync_s"}


def model_name(spec: str) -> str:
    return spec if spec.startswith("builtin:") or "/" in spec or Path(spec).exists() else f"builtin:{spec}"


def parameter_count(path: str) -> int:
    """Parameters in the folder's safetensors files, from their headers (no torch): shapes summed, each tensor once."""
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n
    return total


# =========================================================================== workers (one per subprocess)


def make_prompts(args: argparse.Namespace, tokenizer, count: int) -> list[list[int]]:
    if args.prompts == "random":
        rng = random.Random(SEED)
        special = set(tokenizer.all_special_ids)
        pool = [i for i in range(len(tokenizer)) if i not in special]
        return [[rng.choice(pool) for _ in range(args.prompt_len)] for _ in range(count)]
    from alignflow.stages.common.data import chat_prompt_text, encode

    rows = [json.loads(line) for line in PROMPT_DATA.read_text().splitlines() if line.strip()][:count]
    return [encode(tokenizer, chat_prompt_text(tokenizer, row["prompt"])) for row in rows]


@contextlib.contextmanager
def fixed_length_vllm(seeded: bool):
    """While active, every `vllm.SamplingParams(...)` (VLLMGenerator.generate imports it at call time) ignores EOS and
    has no stop ids, and without `seeded` no per-request seed: every sequence runs to max_tokens."""
    import vllm

    original = vllm.SamplingParams

    def params(*a, **kw):
        kw.update(ignore_eos=True, stop_token_ids=[])
        if not seeded:
            kw["seed"] = None
        return original(*a, **kw)

    vllm.SamplingParams = params
    try:
        yield
    finally:
        vllm.SamplingParams = original


def worker_gen(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import transformers

    from alignflow.config.base import ModelConfig
    from alignflow.stages.common.generation import HFGenerator, SamplingParams
    from alignflow.stages.common.models import load_causal_lm, load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    prompts = make_prompts(args, tokenizer, max(p for p, _ in shapes))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    imports_s = time.perf_counter() - t0

    variants: list[tuple[str, Any]] = []  # (label, context manager factory) over one generator
    if args.backend == "hf":
        t = time.perf_counter()
        gen = HFGenerator(load_causal_lm(path, ModelConfig()), NO_EOS, tokenizer.pad_token_id, args.hf_batch_size)
        start_s = time.perf_counter() - t
        variants.append(("hf", contextlib.nullcontext))
        before_call = lambda: None  # noqa: E731
    else:
        t = time.perf_counter()
        import vllm

        from alignflow.stages.common.vllm_engine import VLLMGenerator

        versions["vllm"] = vllm.__version__
        imports_s += time.perf_counter() - t
        t = time.perf_counter()
        gen = VLLMGenerator(path, tokenizer.eos_token_id, seed=SEED, threads=args.threads)
        start_s = time.perf_counter() - t
        variants.append(("vllm", lambda: fixed_length_vllm(seeded=True)))
        if args.unseeded:
            variants.append(("vllm, unseeded", lambda: fixed_length_vllm(seeded=False)))
        before_call = gen.llm.reset_prefix_cache  # as after every weight sync in the RL loop
    threads_after_start = torch.get_num_threads()

    rows = []
    for label, patch in variants:
        for n_prompts, n in shapes:
            params = SamplingParams(args.new_tokens, temperature=TEMPERATURE, top_p=1.0, top_k=0, n=n, seed=SEED)
            batch = prompts[:n_prompts]
            times, eos_sampled = [], 0
            for call in range(1 + args.timed):  # the first is the warm-up
                before_call()
                with patch():
                    t = time.perf_counter()
                    rollouts = gen.generate(batch, params)
                    elapsed = time.perf_counter() - t
                bad = [r for r in rollouts if len(r.response_ids) != args.new_tokens or r.finish_reason != "length"]
                if len(rollouts) != n_prompts * n or bad:
                    raise RuntimeError(f"{label}: expected {n_prompts * n} rollouts of exactly {args.new_tokens} tokens, got "
                                       f"{len(rollouts)}, {len(bad)} of another length/finish reason "
                                       f"(e.g. {[(len(r.response_ids), r.finish_reason) for r in bad[:3]]})")
                if call:
                    times.append(elapsed)
                    eos_sampled = max(eos_sampled, sum(tokenizer.eos_token_id in r.response_ids for r in rollouts))
                else:
                    warmup_s = elapsed
            tokens = n_prompts * n * args.new_tokens
            median = statistics.median(times)
            rows.append({"variant": label, "prompts": n_prompts, "n": n, "sequences": n_prompts * n, "new_tokens": args.new_tokens,
                         "tokens_per_call": tokens, "warmup_s": warmup_s, "times_s": times, "median_s": median,
                         "tokens_per_s": tokens / median, "eos_sampled_sequences": eos_sampled})
            print(f"{label} {n_prompts}x{n}: {tokens / median:,.0f} tokens/s (median of {times})", flush=True)
    lengths = [len(p) for p in prompts]
    return {"backend": args.backend, "model": args.model, "path": path, "rows": rows, "imports_s": imports_s, "start_s": start_s,
            "threads_requested": args.threads, "threads_after_start": threads_after_start, "threads_after": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "prompt_lengths": [min(lengths), statistics.mean(lengths), max(lengths)],
            "versions": versions}


def worker_sft(args: argparse.Namespace) -> dict[str, Any]:
    from alignflow.config import load_config
    from alignflow.stages.sft.stage import main

    overrides = [f"storage.root={args.tmp}/out", *QUIET, "sft.checkpoint.every_steps=1000000"]
    overrides += [f"sft.batch.max_steps={QUICK_SFT_STEPS}", "sft.logging.eval_every=1000"] if args.quick else []
    t = time.perf_counter()
    result = main(load_config(CONFIG, overrides), "sft")
    return {"uri": result["uri"], "wall_s": time.perf_counter() - t, "metrics": result.get("metrics", {})}


def worker_rl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from alignflow.config import load_config
    from alignflow.stages.common.models import resolve_model_path
    from alignflow.stages.rl.stage import main

    subreaper = become_subreaper()
    overrides = [f"storage.root={args.tmp}/out", *QUIET, f"rl.generation.engine={args.backend}", f"rl.batch.max_steps={args.rl_steps}",
                 "rl.logging.eval_every=1000", f"rl.checkpoint.every_steps={NEVER}"]
    if args.sft_uri:
        overrides.append("rl.from=sft")
        inputs = {"from": args.sft_uri}
    else:  # the rl stage standalone from the base model (not from the sft stage: two final models, none registered)
        overrides += [f"rl.model.name_or_path={resolve_model_path(args.model)}", "register.enabled=false"]
        inputs = None
    overrides += args.set or []
    cfg = load_config(CONFIG, overrides)
    t = time.perf_counter()
    result = main(cfg, "rl", None, inputs)
    main_s = time.perf_counter() - t
    leftover = reap_children() if subreaper else []
    metrics = json.loads((Path(result["uri"]) / "metrics.json").read_text())
    steps = [h for h in metrics["history"] if h.get("step", 0) >= 1 and PHASES["train_s"] in h]
    if len(steps) != args.rl_steps:
        raise RuntimeError(f"expected {args.rl_steps} RL steps in metrics.json, found {len(steps)}")
    records = [{"step": h["step"], **{k: h[v] for k, v in PHASES.items()}, "gen_tokens_per_s": h.get("train/gen_tokens_per_s"),
                "response_length": h.get("train/response_length"), "reward_mean": h.get("reward/mean"),
                "logprob_mismatch": h.get("train/logprob_mismatch")} for h in steps]
    summary, rl = metrics.get("summary", {}), cfg.section("rl")
    return {"backend": args.backend, "model": args.model, "from_sft": bool(args.sft_uri), "steps": records,
            "setup_s": summary.get("time/setup_s"), "main_s": main_s, "threads": torch.get_num_threads(),
            "completions_per_step": rl.rollout.prompts_per_step * rl.generation.n_samples_per_prompt,
            "max_new_tokens": rl.generation.max_new_tokens, "cpus_per_worker": rl.workers.cpus_per_worker,
            "leftover_child_pids": leftover, "overrides": overrides}


# =========================================================================== parent


def run_worker(args: argparse.Namespace, name: str, worker_args: list[str], workdir: Path) -> dict[str, Any]:
    tmp = workdir / name
    tmp.mkdir(parents=True)
    out, log_path = tmp / "result.json", tmp / "worker.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), *worker_args, "--threads", str(args.threads), "--tmp", str(tmp),
           "--worker-out", str(out), "--prompts", args.prompts, "--prompt-len", str(args.prompt_len)]
    cmd += ["--quick"] if args.quick else []
    env = worker_env(args.threads, tmp)
    env.pop("RAY_ADDRESS", None)  # the rl stage must start its own private Ray, never join another cluster
    env.update(TQDM_DISABLE="1", RAY_USAGE_STATS_ENABLED="0", VLLM_NO_USAGE_STATS="1", HF_DATASETS_CACHE=str(tmp / "hf-datasets"))
    if args.wait_idle > 0:
        wait_until_idle(args.wait_idle)
    print(f"running {name} (log: {log_path}) ...", file=sys.stderr, flush=True)
    t0, busy0, mine0, self0 = time.perf_counter(), busy_cpu_seconds(), children_cpu_seconds(), own_cpu_seconds()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        tree = TreeCPU(proc.pid)
        proc.wait()
    elapsed, busy1, mine1, self1 = time.perf_counter() - t0, busy_cpu_seconds(), children_cpu_seconds(), own_cpu_seconds()
    polled = tree.stop()
    record: dict[str, Any] = {"name": name, "command": shlex.join(cmd), "process_wall_s": elapsed}
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - max(mine1 - mine0, polled) - (self1 - self0))
        record["other_cpu_share"] = others / (elapsed * (os.cpu_count() or 1))
        record["worker_cpu_top"] = tree.top()  # (process name, pid, CPU seconds): where the worker tree's CPU went
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-25:]
        errors = [line for line in tail if "Error" in line or "error" in line]
        record["error"] = (errors[-1] if errors else (tail[-1] if tail else f"exit code {proc.returncode}")).strip()
        record["log_tail"] = tail
        print(f"  failed: {record['error']}", file=sys.stderr, flush=True)
        return record
    record["result"] = json.loads(out.read_text())
    contention = f", other processes used {record['other_cpu_share']:.0%} of the CPU" if "other_cpu_share" in record else ""
    print(f"  done in {elapsed:.0f}s{contention}", file=sys.stderr, flush=True)
    return record


fmt = lambda v, spec, suffix="": "n/a" if v is None else format(v, spec) + suffix  # noqa: E731


def contention_note(records: list[dict[str, Any]]) -> list[str]:
    contended = [r["name"] for r in records if (r.get("other_cpu_share") or 0) > 0.05]
    if not contended:
        return []
    return [f"WARNING: other processes used more than 5% of the CPU during {', '.join(contended)} (column 'other CPU load'); "
            "those timings are contended and not comparable. Rerun on an idle machine."]


def gen_markdown(records: list[dict[str, Any]], args: argparse.Namespace, params: dict[str, int]) -> str:
    versions: dict[str, str] = {}
    for r in records:
        versions.update(r.get("result", {}).get("versions", {}))
    ok = [r for r in records if "result" in r]
    lengths = ok[0]["result"]["prompt_lengths"] if ok else None
    prompts = (f"data/rl/train.jsonl prompts as the RL stage renders them ({lengths[0]}-{lengths[2]} tokens)" if lengths and args.prompts == "data"
               else f"random token ids, {args.prompt_len} tokens each")
    lines = [
        f"Rollout generation, {prompts}, temperature {TEMPERATURE}, exactly {args.new_tokens} new tokens per sequence (EOS off on "
        f"both sides), fp32, {args.threads} torch threads (OMP_NUM_THREADS={args.threads}), median of {args.timed} calls after 1 "
        f"warm-up ({', '.join(f'{k} {v}' for k, v in sorted(versions.items()))})",
        "",
        "| model | shape | backend | tokens/s | vs HF | s/call | warm-up call (s) | imports (s) | engine start (s) | torch threads | EOS sampled | other CPU load |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for model, count in params.items():
        mine = [r for r in records if r["model"] == model]
        for failed in (r for r in mine if "result" not in r):
            lines.append(f"| {model} | | {failed['backend']} | failed: {failed.get('error', '')[:200].replace('|', '/')} |" + " |" * 8)
        good = [r for r in mine if "result" in r]
        shapes = sorted({(row["prompts"], row["n"]) for r in good for row in r["result"]["rows"]}, key=lambda s: -s[0])
        for shape in shapes:
            entries = [(r, row) for r in good for row in r["result"]["rows"] if (row["prompts"], row["n"]) == shape]
            hf = next((row for r, row in entries if row["variant"] == "hf"), None)
            for r, row in entries:
                res = r["result"]
                ratio = row["tokens_per_s"] / hf["tokens_per_s"] if hf else None
                lines.append(
                    f"| `{model}` ({count / 1e6:.1f}M) | {shape[0]} prompts x {shape[1]} | {row['variant']} | {row['tokens_per_s']:,.0f} | "
                    f"{fmt(ratio, '.2f', 'x')} | {row['median_s']:.3f} | {row['warmup_s']:.3f} | {res['imports_s']:.1f} | {res['start_s']:.1f} | "
                    f"{res['threads_after']} | {row['eos_sampled_sequences']}/{row['sequences']} | {fmt(r.get('other_cpu_share'), '.0%')} |")
            vllm = next((row for r, row in entries if row["variant"] == "vllm"), None)
            if hf and vllm:
                a, b = hf["tokens_per_s"], vllm["tokens_per_s"]
                winner = "vLLM" if b > a else "HF"
                verdicts.append(f"`{model}`, {shape[0]} prompts x {shape[1]}: **{winner}** faster, {max(a, b) / min(a, b):.2f}x "
                                f"(HF {a:,.0f} vs vLLM {b:,.0f} tokens/s)")
    lines += ["", *verdicts, *contention_note(records), "", f"Invocation: `{shlex.join([sys.executable, *sys.argv])}`", "",
              "tokens/s = generated tokens of one call / its median time; s/call excludes engine start. EOS sampled = sequences "
              "(of the last timed call) that sampled the EOS token, which would have ended them with EOS on. See the docstring "
              "of benchmarks/generation_throughput.py."]
    return "\n".join(lines)


def rl_summary(result: dict[str, Any], skip: int) -> dict[str, Any]:
    steps = result["steps"]
    timed = [s for s in steps if s["step"] > skip] or steps  # too few steps (--quick): all of them
    med = lambda key: statistics.median(s[key] for s in timed if s.get(key) is not None)  # noqa: E731
    out = {k: med(k) for k in PHASES}
    out.update(step_s=statistics.median(sum(s[k] for k in PHASES) for s in timed), gen_tokens_per_s=med("gen_tokens_per_s"),
               response_length=med("response_length"), steps_used=[timed[0]["step"], timed[-1]["step"]],
               reward_first=steps[0]["reward_mean"], reward_last=steps[-1]["reward_mean"],
               logprob_mismatch_max=max((s["logprob_mismatch"] or 0) for s in steps))
    return out


def rl_markdown(records: list[dict[str, Any]], args: argparse.Namespace, sft: dict[str, Any] | None) -> str:
    ok = [r for r in records if "result" in r]
    first = ok[0]["result"] if ok else {}
    used = ok[0]["summary"]["steps_used"] if ok else [args.rl_skip + 1, args.rl_steps]
    lines = [
        f"RL step breakdown (GRPO, configs/tiny.yaml: {first.get('completions_per_step', '?')} completions per step, at most "
        f"{first.get('max_new_tokens', '?')} new tokens, EOS on), {args.rl_steps} steps per run, medians over steps "
        f"{used[0]}..{used[1]}, actor and rollout engine colocated on {fmt(first.get('cpus_per_worker'), 'g')} CPUs, "
        f"{args.threads} torch threads per worker",
        "",
        "| model | backend | s/step | generate + score (s) | old log-probs (s) | train (s) | weight sync (s) | gen tokens/s "
        "| tokens/completion | reward first -> last | max logprob mismatch | setup (s, once) | other CPU load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        if "result" not in r:
            lines.append(f"| {r['model']} | {r['backend']} | failed: {r.get('error', '')[:200].replace('|', '/')} |" + " |" * 10)
            continue
        s = r["summary"]
        by_model.setdefault(r["model"], {})[r["backend"]] = s
        share = lambda k: f"{s[k]:.3f} ({s[k] / s['step_s']:.0%})"  # noqa: E731
        start = "SFT model" if r["result"]["from_sft"] else "random weights"
        lines.append(
            f"| `{r['model']}` ({start}) | {r['backend']} | {s['step_s']:.3f} | {share('gen_s')} | {share('inference_s')} | {share('train_s')} | "
            f"{share('sync_s')} | {s['gen_tokens_per_s']:,.0f} | {s['response_length']:.2f} | {fmt(s['reward_first'], '.3f')} -> "
            f"{fmt(s['reward_last'], '.3f')} | {s['logprob_mismatch_max']:.1e} | {fmt(r['result']['setup_s'], '.1f')} | "
            f"{fmt(r.get('other_cpu_share'), '.0%')} |")
    lines.append("")
    for model, backends in by_model.items():
        if "hf" in backends and "vllm" in backends:
            a, b = backends["hf"]["step_s"], backends["vllm"]["step_s"]
            lines.append(f"`{model}`: s/RL step HF {a:.3f} vs vLLM {b:.3f}: **{'vLLM' if b < a else 'HF'}** faster, {max(a, b) / min(a, b):.2f}x; "
                         f"generate + score HF {backends['hf']['gen_s']:.3f} vs vLLM {backends['vllm']['gen_s']:.3f} s")
    if sft:
        lines.append(f"The tiny SFT model: {sft.get('uri')} (trained in {fmt(sft.get('wall_s'), '.0f')} s, not in these figures).")
    lines += [*contention_note(records), "", f"Invocation: `{shlex.join([sys.executable, *sys.argv])}`", "",
              "s/step = median over the steps of generate + score + old log-probs + train + weight sync (the driver's phase timers, "
              "metrics.json `phase/*_s`); gen tokens/s = the stage's `train/gen_tokens_per_s` (generated tokens / generate + score time). "
              "setup = `time/setup_s` (Ray, worker processes, model loads, engine start). See the docstring of "
              "benchmarks/generation_throughput.py."]
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    from alignflow.stages.common.models import resolve_model_path

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="generation-throughput-"))
    records: list[dict[str, Any]] = []
    sft = None
    try:
        if not args.rl:
            models = ["builtin:tiny"] if args.quick else [model_name(m.strip()) for m in args.models.split(",") if m.strip()]
            params = {m: parameter_count(resolve_model_path(m)) for m in models}  # builds the built-in models outside any timing
            for m, count in params.items():
                print(f"{m}: {count:,} parameters", file=sys.stderr, flush=True)
            for m in models:
                for b in backends:
                    rec = run_worker(args, f"gen-{b}-{Path(m.replace(':', '-')).name}",
                                     ["--worker", "gen", "--backend", b, "--model", m, "--new-tokens", str(args.new_tokens),
                                      "--timed", str(args.timed), "--hf-batch-size", str(args.hf_batch_size),
                                      *([] if args.unseeded else ["--no-unseeded"])], workdir)
                    records.append({**rec, "model": m, "backend": b})
            table = gen_markdown(records, args, params)
        else:
            models = ["builtin:tiny"] if args.quick else [model_name(m.strip()) for m in args.rl_models.split(",") if m.strip()]
            for m in models:
                resolve_model_path(m)
            if "builtin:tiny" in models:
                rec = run_worker(args, "sft-tiny", ["--worker", "sft"], workdir)
                records.append({**rec, "model": "builtin:tiny", "backend": "sft"})
                if "result" not in rec:
                    print(f"the tiny SFT stage failed: {rec.get('error')}\n" + "\n".join(rec.get("log_tail", [])), file=sys.stderr)
                    return 1
                sft = rec["result"]
            runs = []
            for m in models:
                for b in backends:
                    extra = ["--sft-uri", sft["uri"]] if m == "builtin:tiny" else []
                    extra += [a for kv in args.set or [] for a in ("--set", kv)]
                    rec = run_worker(args, f"rl-{b}-{Path(m.replace(':', '-')).name}",
                                     ["--worker", "rl", "--backend", b, "--model", m, "--rl-steps", str(args.rl_steps), *extra], workdir)
                    rec.update(model=m, backend=b)
                    if "result" in rec:
                        rec["summary"] = rl_summary(rec["result"], args.rl_skip)
                    runs.append(rec)
            records += runs
            table = rl_markdown(runs, args, sft)
    finally:
        if args.keep_workdir:
            print(f"kept worker folders and logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table)
    if args.json:
        payload = {"settings": {k: v for k, v in vars(args).items()}, "argv": shlex.join([sys.executable, *sys.argv]),
                   "runs": records, "markdown": table}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0 if all("result" in r for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rl", action="store_true", help="the RL step breakdown per backend instead of generation tokens/s")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: builtin:tiny only; {QUICK_SHAPES} (prompts, n) x {QUICK_NEW_TOKENS} tokens; "
                        f"with --rl {QUICK_RL_STEPS} RL steps from a {QUICK_SFT_STEPS}-step SFT model")
    p.add_argument("--backends", default="hf,vllm", help="comma list of hf,vllm (default both)")
    p.add_argument("--models", default="tiny,small", help="generation mode: comma list of tiny, small, builtin:..., or local HF folders")
    p.add_argument("--prompts", choices=["data", "random"], default="data",
                   help="data: data/rl/train.jsonl rendered as the RL stage does (default); random: random ids of --prompt-len")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt with --prompts random (default 16)")
    p.add_argument("--new-tokens", type=int, default=None, help=f"new tokens per sequence (default 64; {QUICK_NEW_TOKENS} with --quick)")
    p.add_argument("--timed", type=int, default=3, help="timed calls per shape after one warm-up; the median counts (default 3)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="HFGenerator batch size (rl.generation.batch_size's default, 64)")
    p.add_argument("--no-unseeded", dest="unseeded", action="store_false", help="leave out the vLLM run without per-request seeds")
    p.add_argument("--rl-models", default="tiny", help="--rl: comma list of tiny (from its SFT model), small (from random weights)")
    p.add_argument("--rl-steps", type=int, default=None, help=f"--rl: RL steps per run (default 10; {QUICK_RL_STEPS} with --quick)")
    p.add_argument("--rl-skip", type=int, default=2, help="--rl: first steps left out of the medians (default 2)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="--rl: config override for the RL runs (repeatable)")
    p.add_argument("--threads", type=int, default=cpu_threads(), help="torch / OpenMP threads for every worker (default: all usable cores)")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS", help="before each worker, wait up to this long for an idle machine")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure here")
    p.add_argument("--keep-workdir", action="store_true", help="keep the worker folders (logs, published models)")
    # worker mode (used by the parent)
    p.add_argument("--worker", choices=["gen", "sft", "rl"], help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--sft-uri", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (QUICK_NEW_TOKENS if args.quick else 64)
    args.rl_steps = args.rl_steps or (QUICK_RL_STEPS if args.quick else 10)
    if args.timed < 1 or args.new_tokens < 1 or args.rl_steps < 1 or args.rl_skip < 0:
        p.error("--timed, --new-tokens and --rl-steps must be >= 1, --rl-skip >= 0")
    unknown = [b for b in args.backends.split(",") if b.strip() and b.strip() not in ("hf", "vllm")]
    if unknown:
        p.error(f"--backends: {', '.join(unknown)} not among hf, vllm")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker is None:
        return parent(args)
    result = {"gen": worker_gen, "sft": worker_sft, "rl": worker_rl}[args.worker](args)
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
