"""Eval stage: model stages side by side on held-out data, one table, no training.

Run by hand:  python -m alignflow.stages --config configs/tiny.yaml --stage eval --set 'eval.models=[sft]'
              (finds the published models the way every stage finds its inputs; or pass --input model:sft=URI)

Per model, in `models` order, each metric whose section is set (`EvalConfig`):
- `eval/accuracy`: the verifier (the RL reward-function contract, scored as RL's held-out evaluation
  scores) over greedy answers to `prompts`; right = reward >= 1. With `samples` = k > 0 also
  `eval/accuracy@sampled` (mean over the k sampled answers) and `eval/pass@k` (any of the k right);
- `eval/reward`: mean raw score (not normalized) of the greedy answers under the `reward_model` stage;
- `eval/pairwise_accuracy`: on `pairs`, an rm stage's score(chosen) > score(rejected); a policy's implicit
  DPO reward log π(y|x) - log π_ref(y|x) (DPO, Rafailov et al. 2023, Eq. 5, β = 1: β does not change the
  sign) larger for chosen, with π_ref the model the policy started from. A tie is not right;
- `eval/nll`: NLL per response token on `nll` rows (the SFT stage's held-out loss);
- `eval/agent/reward`: mean reward of the `agent` function's episodes, one per prompt, greedy, against an
  OpenAI-compatible endpoint in front of the model (`stages/rl/openai_server.py`, as in the rl stage; a dropped
  episode scores 0), with `eval/agent/<metric>` the means of the metrics it returns, `eval/agent/calls` and
  `eval/agent/dropped_fraction`.
Metrics that do not apply to a kind (answers of an rm stage, NLL of a reward model) are left out.

Where this departs from the training stages: every row of each file is held out (`eval_path` and
`eval_fraction` are ignored), and it runs in one process (generation is not sharded over ranks).
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Callable

import torch

from alignflow.config import ConfigError, PipelineConfig, StageKind, dump_config
from alignflow.config.base import BatchConfig, DeepSpeedConfig, ModelConfig
from alignflow.infra import manifest, storage
from alignflow.stages.common.checkpoint import remove_staging, seed_everything, staging_dir
from alignflow.stages.common.data import every_row
from alignflow.stages.common.generation import HFGenerator, Rollout, SamplingParams
from alignflow.stages.common.models import fetch_published_model, load_causal_lm, load_reward_model, load_tokenizer, resolve_model_path
from alignflow.stages.common.pairs import Pair, load_pairs, pair_logps, pair_rewards
from alignflow.stages.common.publish import finish_publish, publish_dir
from alignflow.stages.common.rowwise import all_rows
from alignflow.stages.common.run import TrainingRun
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.common.tracking import StageTracking
from alignflow.stages.dpo.losses import preference_loss
from alignflow.stages.eval.config import EvalConfig
from alignflow.stages.rl.data import PromptRow, load_prompts
from alignflow.stages.rl.agents import AgentExecutor, load_agent
from alignflow.stages.rl.executors import Scorer
from alignflow.stages.rl.openai_server import OpenAIServer
from alignflow.stages.rl.rewards import FunctionReward
from alignflow.stages.rm.losses import pairwise_loss
from alignflow.stages.rm.scoring import RewardScorer
from alignflow.stages.sft.data import load_sft_samples
from alignflow.stages.sft.stage import SFTData, held_out_loss

METRICS = ("eval/accuracy", "eval/accuracy@sampled", "eval/pass@k", "eval/reward", "eval/pairwise_accuracy", "eval/nll")
Generate = Callable[[list[list[int]], SamplingParams], list[Rollout]]


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)  # inputs, digests, key, output: as every stage
    if run.done:
        return run.cached_result()
    section: EvalConfig = run.section
    inputs, digests, fingerprints, key, out = run.inputs, run.input_digests, run.fingerprints, run.key, run.out
    if section.generation.engine == "vllm" and section.answers:
        from alignflow.stages.common.vllm_engine import require_vllm

        require_vllm()  # before any model work
    fetch = lambda role: fetch_published_model(inputs[role], digests[role])  # noqa: E731
    micro = section.micro_batch_size
    strategy = Strategy(DeepSpeedConfig(), BatchConfig(global_batch_size=micro, micro_batch_size=micro), None)  # sets torch threads
    judge = RewardScorer(fetch("reward_model"), strategy.device) if section.reward_model else None
    agent = load_agent(section.agent.path) if section.agent else None  # a broken file fails before any model work

    # ------------------------------------------------------------------ evaluate
    table = {}
    for name in section.models:
        seed_everything(section.seed)
        table[name] = evaluate_model(section, cfg.kind(name), cfg.section(name).model, fetch(f"model:{name}"),
                                     lambda name=name: reference_path(cfg, name, inputs, fetch), strategy, judge, stage, agent)
        print(f"{stage}: {name}: {json.dumps(table[name])}", flush=True)

    # ------------------------------------------------------------------ publish
    meta_inputs = {**fingerprints, **{f"upstream:{r}": {"uri": u, "digest": digests[r]} for r, u in inputs.items()}}
    summary = publish_table(cfg, stage, key, out, table, meta_inputs, strategy)
    return {"stage": stage, "uri": out, "cache_key": key, "cached": False, "metrics": summary}


def reference_path(cfg: PipelineConfig, name: str, inputs: dict[str, str], fetch: Callable[[str], str]) -> str:
    """The model policy `name` started from: its `from:` stage's published model (input `reference:<name>`),
    or for a root stage its `model.name_or_path`."""
    role = f"reference:{name}"
    if role in inputs:
        return fetch(role)
    given = cfg.section(name).model.name_or_path
    if not given:
        raise ConfigError(f"{name}: no reference model for its implicit reward: pass --input {role}=<published stage folder>")
    return resolve_model_path(given)


# --------------------------------------------------------------------------- one model


@torch.no_grad()
def evaluate_model(section: EvalConfig, kind: StageKind, model_cfg: ModelConfig, path: str, reference: Callable[[], str],
                   strategy: Strategy, judge: RewardScorer | None, stage: str = "eval", agent: Callable | None = None) -> dict[str, float]:
    """`stage`: the eval stage's name, for the options that data errors name (`<stage>.pairs.prompt_key`);
    `agent`: the loaded `section.agent` function."""
    tokenizer = load_tokenizer(path)
    if kind == StageKind.RM:
        return reward_model_metrics(section, path, model_cfg, tokenizer, strategy, stage)
    model = strategy.prepare_frozen(load_causal_lm(path, model_cfg))
    out: dict[str, float] = {}
    if section.answers:  # answers first: all_rows below leaves the model in train mode
        generate = generator(section, model, path, tokenizer)
        rows = load_prompts(every_row(section.prompts), tokenizer, section.seed, f"{stage}.prompts")[0]
        if section.verifier or judge is not None:
            out.update(answer_metrics(section, rows, generate, tokenizer, judge))
        if agent is not None:
            out.update(agent_metrics(section, agent, rows, generate, tokenizer))
    if section.nll is not None:
        samples = load_sft_samples(every_row(section.nll), tokenizer, section.seed, f"{stage}.nll")[0]
        out["eval/nll"] = held_out_loss(strategy, SFTData([], samples, {}, False), section.micro_batch_size,
                                        tokenizer.pad_token_id)["eval/loss"]
    if section.pairs is not None:
        pairs = load_pairs(every_row(section.pairs), tokenizer, section.seed, f"{stage}.pairs")[0]
        out["eval/pairwise_accuracy"] = implicit_reward_accuracy(strategy, pairs, reference(), model_cfg, section, tokenizer.pad_token_id)
    return out


def generator(section: EvalConfig, model: torch.nn.Module, path: str, tokenizer) -> Generate:
    """The RL stage's generators, in this process: HF `generate` on the loaded model, or one vLLM engine."""
    gen = section.generation
    if gen.engine == "vllm":
        from alignflow.stages.common.vllm_engine import VLLMGenerator

        engine = VLLMGenerator(path, tokenizer.eos_token_id, seed=section.seed, max_model_len=section.prompts.max_len + gen.max_new_tokens,
                               tensor_parallel_size=gen.tensor_parallel_size, gpu_memory_utilization=gen.gpu_memory_utilization,
                               threads=torch.get_num_threads())
        return engine.generate
    hf = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, gen.batch_size)

    def generate(prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        model.eval()
        return hf.generate(prompts, params)

    return generate


def answer_metrics(section: EvalConfig, rows: list[PromptRow], generate: Generate, tokenizer,
                   judge: RewardScorer | None) -> dict[str, float]:
    ids, gen = [r.ids for r in rows], section.generation
    greedy = generate(ids, SamplingParams(gen.max_new_tokens, temperature=0, stop_token_ids=gen.stop_token_ids))
    out: dict[str, float] = {}
    if section.verifier:
        no_penalty = lambda lengths: torch.zeros(len(lengths))  # noqa: E731
        verify = Scorer(tokenizer, FunctionReward(section.verifier), None, no_penalty)
        out["eval/accuracy"] = float((verify(rows, greedy) >= 1).double().mean())
        if section.samples:
            k = section.samples
            params = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k, n=k, seed=section.seed,
                                    stop_token_ids=gen.stop_token_ids)
            right = (verify(rows, generate(ids, params)) >= 1).double().view(len(rows), k)  # the k samples of a prompt are consecutive
            out["eval/accuracy@sampled"] = float(right.mean())
            out["eval/pass@k"] = float(right.amax(1).mean())
    if judge is not None:
        out["eval/reward"] = float(judge.score_ids([r.prompt_ids + r.response_ids for r in greedy]).mean())
    return out


def agent_metrics(section: EvalConfig, agent: Callable, rows: list[PromptRow], generate: Generate, tokenizer) -> dict[str, float]:
    """One greedy episode of the agent per prompt, through the endpoint the rl stage trains agents with."""
    a, gen = section.agent, section.generation
    greedy = SamplingParams(gen.max_new_tokens, temperature=0, stop_token_ids=gen.stop_token_ids)
    server = OpenAIServer(tokenizer, generate, model_name=a.model_name, host=a.host, sampling=greedy, seed=section.seed)
    try:
        executor = AgentExecutor(server, agent, a.path, concurrency=a.concurrency, timeout_s=a.timeout_s,
                                 max_dropped_fraction=a.max_dropped_fraction)
        episodes = executor.run(rows, greedy)
    finally:
        server.close()
    return {"eval/agent/reward": float(episodes.scores.double().mean()),  # a dropped episode scores 0: it failed
            **{f"eval/{k}": float(v.double().nanmean()) for k, v in episodes.stats.items()}}


def implicit_reward_accuracy(strategy: Strategy, pairs: list[Pair], reference: str, model_cfg: ModelConfig,
                             section: EvalConfig, pad_id: int) -> float:
    """Summed response log-probs of chosen and rejected under the policy (the strategy's engine now), then
    under the reference (loaded in its place); DPO's reward accuracy with β = 1."""
    lengths = [len(p) for p in pairs]
    logps = lambda rows: pair_logps(strategy.engine, [pairs[i] for i in rows], pad_id, strategy.device)  # noqa: E731
    policy = all_rows(strategy, lengths, section.micro_batch_size, logps)
    strategy.prepare_frozen(load_causal_lm(reference, model_cfg))
    ref = all_rows(strategy, lengths, section.micro_batch_size, logps)
    _, metrics = preference_loss(policy["chosen"], policy["rejected"], ref["chosen"], ref["rejected"], beta=1.0)
    return float(metrics["rewards/accuracy"])


def reward_model_metrics(section: EvalConfig, path: str, model_cfg: ModelConfig, tokenizer, strategy: Strategy,
                         stage: str = "eval") -> dict[str, float]:
    """An rm stage answers nothing and predicts no tokens: only its pairwise accuracy applies."""
    if section.pairs is None:
        return {}
    pairs = load_pairs(every_row(section.pairs), tokenizer, section.seed, f"{stage}.pairs")[0]
    model = strategy.prepare_frozen(load_reward_model(path, model_cfg, tokenizer.pad_token_id))
    score = lambda rows: dict(zip(("chosen", "rejected"), pair_rewards(  # noqa: E731
        strategy.engine, model.score, [pairs[i] for i in rows], tokenizer.pad_token_id, strategy.device)))
    scores = all_rows(strategy, [len(p) for p in pairs], section.micro_batch_size, score)
    return {"eval/pairwise_accuracy": float(pairwise_loss(scores["chosen"], scores["rejected"])[1]["accuracy"])}


# --------------------------------------------------------------------------- the table


def publish_table(cfg: PipelineConfig, stage: str, key: str, out: str, table: dict[str, dict[str, float]],
                  inputs: dict[str, Any], strategy: Strategy) -> dict[str, float]:
    """metrics.json, table.md/.csv, chart.png and config.yaml, then the manifest last; all to MLflow too."""
    summary = {f"{name}/{metric}": value for name, row in table.items() for metric, value in row.items()}
    tracking = StageTracking(strategy.is_main)
    if not strategy.is_main:
        return summary
    columns = [m for m in METRICS if any(m in row for row in table.values())]
    columns += sorted({m for row in table.values() for m in row if m.startswith("eval/agent/")})
    markdown = markdown_table(table, columns)
    print(markdown, flush=True)
    staging = staging_dir(key, out)
    local = publish_dir(out, staging)
    local.mkdir(parents=True, exist_ok=True)
    (local / manifest.STAGE_MANIFEST).unlink(missing_ok=True)  # a stale one must not be uploaded with the files
    files: dict[str, str | bytes] = {
        "metrics.json": json.dumps({"models": table, "summary": summary}, indent=2),
        "table.md": markdown, "table.csv": csv_table(table, columns),
        "chart.png": chart(table, columns), "config.yaml": dump_config(cfg),
    }
    meta = {"stage": stage, "cache_key": key, "config_hash": cfg.section(stage).config_hash(), "inputs": inputs,
            "metrics": summary, "mlflow_run_id": tracking.run_id}
    tracking.log_metrics(0, summary)
    finish_publish(out, local, files, meta)
    tracking.log_artifacts([local / f for f in (*files, manifest.STAGE_MANIFEST)])
    remove_staging(staging)
    print(f"{stage}: published the table to {storage.join(out, 'table.md')}", flush=True)
    return summary


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def markdown_table(table: dict[str, dict[str, float]], columns: list[str]) -> str:
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for name, row in table.items()]
    return "\n".join(lines) + "\n"


def csv_table(table: dict[str, dict[str, float]], columns: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["model", *columns])
    writer.writerows([name, *(repr(row[c]) if c in row else "" for c in columns)] for name, row in table.items())
    return buffer.getvalue()


def chart(table: dict[str, dict[str, float]], columns: list[str]) -> bytes:
    """One panel per metric (their scales differ: accuracies in [0, 1], NLL in nats), a bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    colors = [f"C{i % 10}" for i in range(len(names))]
    fig, axes = plt.subplots(1, max(1, len(columns)), figsize=(3 * max(1, len(columns)), 3), squeeze=False)
    for ax, metric in zip(axes[0], columns):
        values = [table[n].get(metric, math.nan) for n in names]
        ax.bar(range(len(names)), values, color=colors)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(metric)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()
