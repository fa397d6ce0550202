"""Generate stage: N sampled completions per prompt from a model, published as a Parquet dataset.

Run by hand:  python -m alignflow.stages --config configs/tiny-rejection-sampling.yaml --stage generate

Rows (one per completion, the n samples of a prompt consecutive): `prompt` (the prompt column as given, text or
messages), `completion` (the decoded sample, special tokens left out), `prompt_ids`, `completion_ids` and `logprobs`
(the engine's, per sampled token: what the label stage scores and a trainer could reuse), `finish_reason`
(`stop` or `length`), `prompt_index`, `sample_index`, and the prompt row's other columns (e.g. `answer`).

The prompts are cut into shards of `shard_size`; each finished shard is stored under `checkpoints/shards/` before
the next starts, so a job killed mid-run resumes at its first unfinished shard and regenerates nothing finished.
Shard k samples with seed `seed + k`: a resumed run's rows are an uninterrupted run's (same engines and count).
"""

from __future__ import annotations

import os
import time
from typing import Any

from alignflow.config import PipelineConfig
from alignflow.stages.common.data import every_row, load_rows, prompt_value
from alignflow.stages.common.datasets import GENERATED_COLUMNS, ShardStore, publish_rows
from alignflow.stages.common.generation import Rollout, SamplingParams
from alignflow.stages.common.models import load_tokenizer
from alignflow.stages.common.progress import MetricsLog
from alignflow.stages.common.rollout import KILL_ENGINE_ENV, RolloutWorker, generate_on
from alignflow.stages.common.run import FAIL_AT_STEP_ENV, InjectedFailure, TrainingRun
from alignflow.stages.common.tracking import StageTracking
from alignflow.stages.common.workers import WorkerGroup, connect_ray, plan_slots, release
from alignflow.stages.generate.config import GenerateConfig
from alignflow.stages.rl.data import PromptRow, prompt_row


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    section: GenerateConfig = run.section
    if section.generation.engine == "vllm":
        from alignflow.stages.common.vllm_engine import require_vllm

        require_vllm()  # before any model work
    model_path = run.base_model()
    tokenizer = load_tokenizer(model_path)
    prompts = every_row(section.prompts)
    rows, _, data_stats = load_rows(prompts, lambda where, row: (prompt_row(row, where, tokenizer, prompts, f"{stage}.prompts"),
                                                                 prompt_value(row, where, prompts, prompts.prompt_key, f"{stage}.prompts.prompt_key")),
                                    section.seed, f"{stage}.prompts")
    shards = [rows[i:i + section.shard_size] for i in range(0, len(rows), section.shard_size)]
    store = ShardStore(run.out)
    todo = [k for k in range(len(shards)) if not store.done(k)]
    if len(todo) < len(shards):
        print(f"{stage}: resuming: {len(shards) - len(todo)} of {len(shards)} shards already generated", flush=True)

    # ------------------------------------------------------------------ generate
    tracking = StageTracking(True)
    done = [{"step": len(shards) - len(todo)}] if len(todo) < len(shards) else None  # the bar starts at the shards stored
    log = MetricsLog(True, len(shards), True, "generate/tokens_per_s", done, label="generate")
    log.add_sink(tracking.log_metrics)
    totals = {"rows": 0, "tokens": 0, "seconds": 0.0}
    if todo:
        generate_shards(section, model_path, shards, todo, tokenizer, store, log, totals)
    log.close()

    # ------------------------------------------------------------------ publish
    parts = [store.rows(k) for k in range(len(shards))]
    return publish(run, tracking, parts, totals, data_stats)


def generate_shards(section: GenerateConfig, model_path: str, shards: list[list[tuple[PromptRow, Any]]], todo: list[int],
                    tokenizer, store: ShardStore, log: MetricsLog, totals: dict[str, float]) -> None:
    """The engines (Ray actors) sample each unfinished shard in turn; a shard is stored before the next starts."""
    gen, fail_at = section.generation, int(os.environ.get(FAIL_AT_STEP_ENV, 0))
    disconnect = connect_ray()
    slots = plan_slots({"rollout": gen.engines}, section.cpus_per_engine, 0, "none")
    try:
        group = WorkerGroup("rollout", RolloutWorker, slots["rollout"])
        max_len = section.prompts.max_len + gen.max_new_tokens
        group.call("setup", gen, section.model, model_path, max_len, section.seed, None, os.environ.get(KILL_ENGINE_ENV))
        print(f"generate: {gen.engines} {gen.engine} engine(s), {len(todo)} shard(s) of up to {section.shard_size} prompts "
              f"x {gen.n_samples_per_prompt} samples", flush=True)
        for k in todo:
            start = time.perf_counter()
            params = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k, n=gen.n_samples_per_prompt,
                                    seed=section.seed + k, stop_token_ids=gen.stop_token_ids)
            rollouts = generate_on(group, [row.ids for row, _ in shards[k]], params, gen.engine)
            store.save(k, shard_rows(shards[k], k * section.shard_size, rollouts, gen.n_samples_per_prompt, tokenizer))
            seconds, tokens = time.perf_counter() - start, sum(len(r.response_ids) for r in rollouts)
            totals.update(rows=totals["rows"] + len(rollouts), tokens=totals["tokens"] + tokens, seconds=totals["seconds"] + seconds)
            log.log(k + 1, {"generate/tokens_per_s": tokens / seconds, "generate/rows_done": sum(len(s) for s in shards[:k + 1]) *
                            gen.n_samples_per_prompt}, echo=True)
            if k + 1 == fail_at:
                raise InjectedFailure(f"{FAIL_AT_STEP_ENV}={fail_at}: failing after shard {k + 1}")
    finally:
        release(slots)
        disconnect()


def shard_rows(shard: list[tuple[PromptRow, Any]], first_index: int, rollouts: list[Rollout], n: int, tokenizer) -> list[dict[str, Any]]:
    """One row per rollout; rollout j is sample j % n of prompt j // n of the shard."""
    out = []
    for j, r in enumerate(rollouts):
        row, prompt = shard[j // n]
        out.append({"prompt": prompt, "completion": tokenizer.decode(r.response_ids, skip_special_tokens=True),
                    "prompt_ids": r.prompt_ids, "completion_ids": r.response_ids, "logprobs": r.logprobs,
                    "finish_reason": r.finish_reason, "prompt_index": first_index + j // n, "sample_index": j % n,
                    **{k: v for k, v in row.columns.items() if k not in GENERATED_COLUMNS}})
    return out


def publish(run: TrainingRun, tracking: StageTracking, parts: list[list[dict]], totals: dict[str, float], data_stats: dict) -> dict[str, Any]:
    rows = [r for p in parts for r in p]
    return publish_rows(run, tracking, parts, {
        "generate/rows": float(len(rows)),
        "generate/prompts": float(data_stats["train"]["used"]),
        "generate/finished_fraction": sum(r["finish_reason"] == "stop" for r in rows) / max(1, len(rows)),
        "generate/mean_completion_tokens": sum(len(r["completion_ids"]) for r in rows) / max(1, len(rows)),
        **({"generate/tokens_per_s": totals["tokens"] / totals["seconds"]} if totals["seconds"] else {}),
    })
