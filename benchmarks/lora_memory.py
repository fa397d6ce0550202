"""Full training against LoRA: peak memory (RSS) and step time of alignflow's stages, measured.

Run:   .venv/bin/python benchmarks/lora_memory.py [--model builtin:small] [--steps 20] [--rl-steps 8] [--rank 16] [--set KEY=VALUE]
                                                  [--runs sft-full,...,grpo-lora] [--json out.json]

Each run is one stage process (`python -m alignflow.stages`, configs/tiny.yaml's settings for that stage kind,
the model given by --model, one process, fp32, all cores), started one after another. Peak RSS is the kernel's
high-water mark (ru_maxrss): model, gradients, optimizer state, activations, DeepSpeed, the libraries and the
data. "To the end of training" is the stage's `memory/peak_rss_mib` (taken when the last step ends); "with
publish" is the whole process's (`os.wait4`), which adds gathering the weights and writing the HF folder(s).
GRPO trains in a Ray actor worker: its figure is that worker's own peak (`train/actor_peak_rss_mib`), and a full
run has a reference worker beside it (kl.coef 0.01) that a LoRA run does not start. Step time is the median
`train/step_time_s` (GRPO: the training phase, `phase/train_s`) over every step but the first two. Both stages start from --model's weights (random for the built-ins: the figures are
about memory and time, not learning). `dpo-*` runs compute the reference's log-probs once before the first step
(`precomputed`, the time is `reference pass`), except `dpo-lora-otf`, which computes them in each step with the
adapter off (`reference: on_the_fly`). LoRA: rank --rank, alpha 2 x rank, every linear layer but the head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUNS = {
    "sft-full": ("sft", []),
    "sft-lora": ("sft", ["lora"]),
    "dpo-full": ("dpo", []),
    "dpo-lora": ("dpo", ["lora"]),
    "dpo-lora-otf": ("dpo", ["lora", "dpo.reference=on_the_fly"]),
    "grpo-full": ("rl", ["rl.kl.coef=0.01"]),
    "grpo-lora": ("rl", ["lora", "rl.kl.coef=0.01"]),
}


def overrides(stage: str, extra: list[str], args, root: str) -> list[str]:
    steps = args.rl_steps if stage == "rl" else args.steps
    out = [f"storage.root={root}", "register.enabled=false", f"{stage}.model.name_or_path={args.model}", f"{stage}.batch.max_steps={steps}",
           f"{stage}.logging.progress=false", f"{stage}.logging.eval_every=100000", f"{stage}.checkpoint.every_steps=100000"]
    out += [f"{stage}.{o}" for o in args.set]
    for e in extra:
        out += [f"{stage}.lora.rank={args.rank}", f"{stage}.lora.alpha={2 * args.rank}"] if e == "lora" else [e]
    return out


def run(name: str, args) -> dict:
    stage, extra = RUNS[name]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as root:
        summary = Path(root) / "summary.json"
        cmd = [sys.executable, "-m", "alignflow.stages", "--config", "configs/tiny.yaml", "--stage", stage,
               "--summary-json", str(summary)]
        cmd += [a for o in overrides(stage, extra, args, root) for a in ("--set", o)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name} failed:\n{stderr[-3000:]}")
        result = json.loads(summary.read_text())
        history = json.loads((Path(result["uri"]) / "metrics.json").read_text())["history"]
    m = result["metrics"]
    if stage == "rl":  # the actor trains in a Ray worker: its own peak, and the step's training phase
        times = [r["phase/train_s"] for r in history if "phase/train_s" in r][2:]
        train_peak = max(r["train/actor_peak_rss_mib"] for r in history if "train/actor_peak_rss_mib" in r)
    else:
        times = [r["train/step_time_s"] for r in history if "train/step_time_s" in r][2:]
        train_peak = m["memory/peak_rss_mib"]
    return {"run": name, "train_peak_rss_mib": train_peak, "process_peak_rss_mib": usage.ru_maxrss / 1024,
            "step_time_s": statistics.median(times), "trainable": m["params/trainable"], "total": m["params/total"],
            "reference_s": m.get("time/reference_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rl-steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every run's stage section, e.g. model.gradient_checkpointing=true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name in args.runs.split(","):
        rows.append(run(name, args))
        print(f"done: {rows[-1]}", file=sys.stderr, flush=True)
    print(f"\n{args.model}, {args.steps} steps ({args.rl_steps} for GRPO), LoRA rank {args.rank} {' '.join(args.set)}\n")
    print("| run | trained parameters | peak RSS to the end of training (MiB) | peak RSS with publish (MiB) | step time (s) "
          "| reference pass (s) |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ref = f"{r['reference_s']:.1f}" if r["reference_s"] and r["reference_s"] > 0.05 else "-"
        whole = f"{r['process_peak_rss_mib']:,.0f}" if not r["run"].startswith("grpo") else "-"
        print(f"| {r['run']} | {r['trainable']:,} of {r['total']:,} | {r['train_peak_rss_mib']:,.0f} | {whole} "
              f"| {r['step_time_s']:.3f} | {ref} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
