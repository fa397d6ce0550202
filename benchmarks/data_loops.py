"""What the data loops buy per generated sample, and what the generate stage costs.

Run:   .venv/bin/python benchmarks/data_loops.py --learning      # SFT, rejection sampling, iterative DPO by round, GRPO
       .venv/bin/python benchmarks/data_loops.py --throughput    # generate: 1 and 2 engines, hf and vllm, tiny and small
Options: [--root DIR] (default: a new temp folder; the learning run's stages are cached there)
         [--models tiny,small] [--engines hf,vllm] [--prompts 256] [--samples 4] [--new-tokens 32]

--learning runs `benchmarks/data_loops.yaml` (configs/tiny-iterative-dpo.yaml plus a rejection-sampling branch and two
GRPO stages from the same SFT model) stage by stage with the stage command (`python -m alignflow.stages`), in
dependency order, then prints the eval stage's table with the samples each model's loop generated: rejection sampling
and each DPO round sample 512 prompts x 8 = 4096; GRPO samples 16 prompts x 8 = 128 a step, so 32 steps = 4096 and
96 steps = 12288 (3 rounds). Every model is scored by one eval stage: greedy accuracy on the 200 held-out prompts.

--throughput runs one generate stage per (model, engine kind, engine count) on the first --prompts rows of
data/rl/train.jsonl, --samples samples each, --new-tokens at most, from the model's seeded random weights, each in a
fresh storage folder and its own process (vLLM replaces torch's thread setting in its process). One engine gets both
CPUs of the private Ray instance (2 threads); two engines get one each. Figures: generated tokens per second of
generation (the stage's `generate/tokens_per_s`: tokens over the time of the generate calls, engine start excluded)
and the stage's wall time with its start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEARNING = ROOT / "benchmarks" / "data_loops.yaml"
SAMPLES = {"sft": 0, "rs_sft": 4096, "online.1.dpo": 4096, "online.2.dpo": 8192, "online.3.dpo": 12288, "grpo_4k": 4096,
           "grpo_12k": 12288}


def stage(config: Path | str, name: str, *overrides: str) -> dict:
    """One stage by the stage command; its summary."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "alignflow.stages", "--config", str(config), "--stage", name, "--summary-json", out.name,
               *(a for o in overrides for a in ("--set", o))]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def learning(root: str) -> None:
    from alignflow.config import load_config

    cfg = load_config(LEARNING, [f"storage.root={root}"])
    quiet = [f"{s}.logging.progress=false" for s in ("sft", *(f"defaults.{k}" for k in ("dpo", "rl")), "rs_sft")]
    for name in cfg.order():
        start = time.time()
        summary = stage(LEARNING, name, f"storage.root={root}", *quiet)
        print(f"{name}: {'cached' if summary['cached'] else f'{time.time() - start:.0f} s'}", flush=True)
    table = json.loads((Path(summary["uri"]) / "metrics.json").read_text())["models"]
    print("\n| model | samples generated | held-out accuracy (greedy, 200 prompts) |\n|---|---|---|")
    for model, row in table.items():
        print(f"| {model} | {SAMPLES.get(model, '?')} | {row['eval/accuracy']:.3f} |")


def throughput(root: str, models: list[str], kinds: list[str], prompts: int, samples: int, new_tokens: int) -> None:
    rows = []
    for model in models:
        for kind in kinds:
            for engines in (1, 2):
                folder = Path(root) / f"{model}-{kind}-{engines}"
                start = time.time()
                summary = stage(ROOT / "configs" / "tiny-rejection-sampling.yaml", "generate", f"storage.root={folder}",
                                "generate.from=null", f"generate.model.name_or_path=builtin:{model}",
                                f"generate.prompts.max_samples={prompts}", f"generate.shard_size={prompts}",
                                f"generate.generation.n_samples_per_prompt={samples}", f"generate.generation.max_new_tokens={new_tokens}",
                                f"generate.generation.engine={kind}", f"generate.generation.engines={engines}",
                                f"generate.cpus_per_engine={2 / engines:g}")
                m = summary["metrics"]
                rows.append((model, kind, engines, m["generate/tokens_per_s"], m["generate/mean_completion_tokens"], time.time() - start))
                print(rows[-1], flush=True)
    print(f"\n| model | engine | engines | tokens/s generating | mean tokens / completion | stage wall s (with start) |\n"
          "|---|---|---|---|---|---|")
    for model, kind, engines, tps, length, wall in rows:
        print(f"| builtin:{model} | {kind} | {engines} | {tps:.0f} | {length:.1f} | {wall:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning", action="store_true")
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--root", default=None)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="af-bench-loops-")
    if args.learning or not args.throughput:
        learning(root)
    if args.throughput:
        throughput(root, args.models.split(","), args.engines.split(","), args.prompts, args.samples, args.new_tokens)


if __name__ == "__main__":
    main()
