"""The chunked LM head (issue 15, point 5): time and peak memory of a training micro-batch's log-probs, against the
model's full logits.

Run:   .venv/bin/python benchmarks/lm_head.py [--models builtin:small,builtin:small-32k] [--repeats 7] [--json out.json]

Each (model, path) runs in its own process, one after another: fp32, all cores, the model's weights as loaded
(random for the built-ins: this is about time and memory, not learning). The work is SFT's: 16 packed rows of
`data/sft/train.jsonl` (max length 64, the benchmark settings of `sft_throughput.py`), `forward_logprobs`, the
token-mean NLL over the response tokens, backward. Paths:
- chunked: what alignflow runs (`logprobs.plain_head` finds the head): the model's last hidden state, the head on the
  response positions alone, a chunk of rows at a time, the logits recomputed in the backward (`lm_head.py`);
- full: the model's own (tokens x vocabulary) logits at every position, then the log-softmax of each
  (`token_logprobs`): what `forward_logprobs` did before this change, and what most trainers do.
Figures: the median wall time of forward + backward over --repeats after 2 warm-up steps, and the peak memory the
step adds: the kernel's high-water mark of the process's RSS (VmHWM, reset through /proc/self/clear_refs just
before the step) minus the RSS before it. "logits" is the size of one fp32 (tokens x vocabulary) tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS, MAX_LEN = 16, 64


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def full_logits_logprobs(model, batch):
    """(B, T-1) next-token log-probs from the model's full logits (`forward_logprobs` before the chunked head)."""
    from alignflow.stages.common.logprobs import token_logprobs

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   use_cache=False).logits
    return token_logprobs(logits, batch.input_ids)


def worker(model_name: str, path: str, repeats: int) -> dict:
    import torch

    from alignflow.stages.common import logprobs
    from alignflow.stages.common.data import collate, pack
    from alignflow.stages.common.models import load_tokenizer, resolve_model_path
    from alignflow.stages.sft.config import DataConfig
    from alignflow.stages.sft.data import load_sft_samples
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(model_name)
    tokenizer = load_tokenizer(folder)
    train, _, _ = load_sft_samples(DataConfig(path=str(ROOT / "data/sft/train.jsonl"), max_len=MAX_LEN, eval_fraction=0.0), tokenizer, 0)
    batch = collate(pack(train, MAX_LEN)[:ROWS], tokenizer.pad_token_id, True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.use_cache = False
    targets = batch.loss_mask[:, 1:].sum()
    forward = logprobs.forward_logprobs if path == "chunked" else full_logits_logprobs

    def step() -> tuple[float, int]:
        model.zero_grad(set_to_none=False)
        rss = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the RSS now
        start = time.perf_counter()
        loss = -(forward(model, batch) * batch.loss_mask[:, 1:]).sum() / targets
        loss.backward()
        return time.perf_counter() - start, status_kib("VmHWM") - rss

    for _ in range(2):
        step()
    runs = [step() for _ in range(repeats)]
    tokens = int(batch.input_ids.numel())
    return {"model": model_name, "path": path, "vocab": model.config.vocab_size, "tokens": tokens,
            "response_tokens": int(targets), "step_s": statistics.median(t for t, _ in runs),
            "peak_added_mib": statistics.median(m for _, m in runs) / 1024,
            "logits_mib": tokens * model.config.vocab_size * 4 / 2**20, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="builtin:small,builtin:small-32k")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.repeats)))
        return
    rows = []
    for name in args.models.split(","):
        for path in ("chunked", "full"):
            out = subprocess.run([sys.executable, __file__, "--worker", name, path, "--repeats", str(args.repeats)],
                                 cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{name} {path}: {rows[-1]['step_s']:.3f} s, +{rows[-1]['peak_added_mib']:.0f} MiB", file=sys.stderr, flush=True)
    print(f"SFT micro-batch: {ROWS} packed rows of max length {MAX_LEN}, forward + backward, median of {args.repeats}\n")
    print("| model | vocabulary | tokens (response) | one fp32 logits tensor (MiB) | path | step (s) | peak memory added (MiB) |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['vocab']:,} | {r['tokens']:,} ({r['response_tokens']:,}) | {r['logits_mib']:.0f} | {r['path']} "
              f"| {r['step_s']:.3f} | {r['peak_added_mib']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
