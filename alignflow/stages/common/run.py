"""What every training stage does around its own math, written once.

A stage reads: `run = TrainingRun(cfg, name, output_uri, inputs, expected_key)`; return the cached
result if `run.done`; load data and model; `run.start(...)` (checkpoints, resume, metrics,
MLflow); `run.train(train_step, evaluate)`; `run.publish(...)`. The step and evaluation
functions are the stage's own; cadence of eval, checkpoints and logs is handled here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Protocol

from alignflow.config import ConfigError, PipelineConfig, dump_config
from alignflow.config.base import data_edges
from alignflow.infra import manifest, storage
from alignflow.lineage import data_inputs, data_sources, input_digests, locate_inputs, stage_cache_key, stage_output_uri
from alignflow.stages.common.checkpoint import Checkpointer, remove_staging, staging_dir
from alignflow.stages.common.datasets import dataset_file
from alignflow.stages.common.data import DataError, describe_rows, row_metrics, steps_per_epoch
from alignflow.stages.common.models import fetch_published_model, parameter_counts, resolve_model_path
from alignflow.stages.common.progress import MetricsLog, Timer, peak_rss_mib
from alignflow.stages.common.publish import Files, metrics_json, model_card, publish, training_line
from alignflow.stages.common.strategy import Strategy
from alignflow.stages.common.tracking import StageTracking, plot_curves

FAIL_AT_STEP_ENV = "ALIGNFLOW_FAIL_AT_STEP"  # tests: crash after this optimizer step (after its checkpoint)
BASE_MODEL_INPUT = "from"  # the input role of the model a stage starts from


class InjectedFailure(RuntimeError):
    """Raised at the step named by ALIGNFLOW_FAIL_AT_STEP, to test resume for real."""


def total_steps(num_train: int, section, unit: str = "rows", per_step: tuple[str, int] | None = None) -> int:
    """Steps of the run: epochs x steps per epoch, capped by batch.max_steps. A step takes
    batch.global_batch_size items, or `per_step` = (its config name, count) (RL: prompts per step)."""
    name, size = per_step or ("batch.global_batch_size", section.batch.global_batch_size)
    per_epoch = steps_per_epoch(num_train, size)
    if per_epoch == 0:
        raise DataError(f"{num_train} training {unit} are fewer than {name}={size}: not one step")
    steps = per_epoch * section.batch.epochs
    return min(steps, section.batch.max_steps) if section.batch.max_steps else steps


def check_cache_key(stage: str, key: str, expected: str | None) -> None:
    """The task computed the key it waits on; a different one here means the data or an input changed in
    between (or the two sides run different code): refuse, as bad input, rather than publish elsewhere."""
    if expected is not None and key != expected:
        raise ConfigError(f"{stage}: this job's cache key {key} differs from the one the flow computed ({expected}): "
                          "the stage's data, code or inputs changed after the flow started; run it again")


class Trainer(Protocol):
    """What TrainingRun needs from whatever trains: checkpoints, the published model, an end."""

    is_main: bool

    def latest_checkpoint(self) -> int | None: ...
    def load_checkpoint(self, step: int) -> dict[str, Any]: ...
    def save_checkpoint(self, step: int, state: dict[str, Any]) -> None: ...
    def publish(self, tokenizer, stage_uri: str, staging: Path, files: Files, meta: dict[str, Any]) -> Path: ...
    def close(self) -> None: ...


class LocalTrainer:
    """A stage trained in this process (and its torchrun peers): one Strategy, one Checkpointer."""

    def __init__(self, strategy: Strategy, checkpoints: Checkpointer):
        self.strategy, self.checkpoints, self.is_main = strategy, checkpoints, strategy.is_main

    def latest_checkpoint(self) -> int | None:
        return self.checkpoints.latest()

    def load_checkpoint(self, step: int) -> dict[str, Any]:
        return self.checkpoints.load(step)

    def save_checkpoint(self, step: int, state: dict[str, Any]) -> None:
        self.checkpoints.save(step, state)

    def publish(self, tokenizer, stage_uri: str, staging: Path, files: Files, meta: dict[str, Any]) -> Path:
        return publish(self.strategy, tokenizer, stage_uri, staging, files, meta)[1]

    def close(self) -> None:
        self.strategy.close()


class TrainingRun:
    """One attempt at one stage: where it publishes, what it starts from, its metrics and checkpoints."""

    def __init__(self, cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
                 expected_key: str | None = None):
        self.clock = Timer()
        self.cfg, self.stage, self.section = cfg, stage, cfg.section(stage)
        self.inputs = dict(inputs) if inputs else locate_inputs(cfg, stage)  # name -> published stage URI
        self.input_digests = input_digests(self.inputs)
        self.fingerprints = data_inputs(self.section)  # hashed once: the cache key and the manifest both use it
        self.key = stage_cache_key(cfg, stage, self.input_digests, data=self.fingerprints)
        check_cache_key(stage, self.key, expected_key)
        self.out = output_uri or stage_output_uri(cfg, stage, self.key)
        self.done = manifest.verify(self.out)
        self.staging = staging_dir(self.key, self.out)
        self.timings: dict[str, float] = {}
        self.start_step, self.total_steps = 0, 0
        self.resumed_state: dict[str, Any] = {}  # the client state of the checkpoint a run resumed from
        self.params: dict[str, int] = {}  # trained and total parameters of a stage trained in this process

    @property
    def data(self):
        """The section's data as the loaders read it: the rows of `data.stage` (dataset stages) as one local Parquet file."""
        data = self.section.data
        if data.stage is None:
            return data
        edges = data_edges(data)
        sources = [(self.inputs[role], self.input_digests[role]) for role in edges]
        return data.model_copy(update={"path": dataset_file(sources, list(edges.values())), "stage": None})

    def cached_result(self) -> dict[str, Any]:
        print(f"{self.stage}: already complete at {self.out} (cache key {self.key})", flush=True)
        return {"stage": self.stage, "uri": self.out, "cache_key": self.key, "cached": True,
                "metrics": self.done.meta.get("metrics", {})}

    # ------------------------------------------------------------------ setup

    @property
    def base_model_name(self) -> str:
        """What the model card and logs call the starting model."""
        return self.inputs.get(BASE_MODEL_INPUT) or self.section.model.name_or_path or "?"

    def base_model(self) -> str:
        """Local folder (or hub name) of the model this stage starts from."""
        given, upstream = self.section.model.name_or_path, self.inputs.get(BASE_MODEL_INPUT)
        name = self.stage
        if given and upstream:
            raise ConfigError(f"{name}: two starting models: {name}.model.name_or_path={given!r} and the input "
                              f"{BASE_MODEL_INPUT}={upstream}; give one")
        if upstream:
            return fetch_published_model(upstream, self.input_digests[BASE_MODEL_INPUT])
        if given:
            return resolve_model_path(given)
        raise ConfigError(f"{name}: no model to start from: set `{name}.from: <stage>` or {name}.model.name_or_path, "
                          f"or pass --input from=<published stage folder>")

    def start(self, strategy: Strategy, total_steps: int, headline: str, evaluate: Callable[[], dict[str, float]]) -> int:
        """Checkpoints, resume, metrics log and MLflow for a stage trained in this process."""
        trainable, total = parameter_counts(strategy.unwrap())
        self.params = {"params/trainable": trainable, "params/total": total}
        trainer = LocalTrainer(strategy, Checkpointer(strategy, self.out, self.section.checkpoint.keep_last, self.staging))
        return self.start_with(trainer, total_steps, headline, evaluate)

    def start_with(self, trainer: "Trainer", total_steps: int, headline: str, evaluate: Callable[[], dict[str, float]]) -> int:
        """The same for any trainer (RL's is a set of Ray worker groups); evaluates the starting
        model on a fresh run."""
        self.trainer, self.total_steps = trainer, total_steps
        self.start_step, history = self._resume()
        self.log = MetricsLog(trainer.is_main, total_steps, self.section.logging.progress, headline, history)
        self.tracking = StageTracking(trainer.is_main)
        datasets = {n: (src, self.fingerprints[n]) for n, src in data_sources(self.section).items() if n in ("data", "eval_data")}
        for role in data_edges(self.section.data):  # a dataset stage's rows: its manifest has the schema
            published = manifest.read_manifest(self.inputs[role])
            datasets[role] = (self.inputs[role], self.input_digests[role], published.meta.get("schema") if published else None)
        self.tracking.log_datasets(datasets)
        self.log.add_sink(self.tracking.log_metrics)
        for record in history:  # a resumed attempt runs under a new MLflow run: give it the whole curve
            self.tracking.log_metrics(int(record["step"]), {k: v for k, v in record.items() if k != "step"})
        if self.start_step == 0:
            self.log.log(0, evaluate(), echo=True)
        self.timings["time/setup_s"] = self.clock.lap()
        return self.start_step

    def _resume(self) -> tuple[int, list[dict]]:
        step = self.trainer.latest_checkpoint()
        if step is None:
            return 0, []
        state = self.resumed_state = self.trainer.load_checkpoint(step)
        if self.trainer.is_main:
            print(f"{self.stage}: resumed from checkpoint at step {step}", flush=True)
        return step, state.get("history", [])

    # ------------------------------------------------------------------ train

    def train(self, train_step: Callable[[int], dict[str, float]], evaluate: Callable[[], dict[str, float]],
              state: Callable[[], dict[str, Any]] = dict) -> None:
        """Steps from the resume point to the end; `state()` is saved with each checkpoint next to
        the metric history (and comes back from `start`'s resume as the checkpoint's client state)."""
        logging, every = self.section.logging, self.section.checkpoint.every_steps
        fail_at = int(os.environ.get(FAIL_AT_STEP_ENV, 0))
        last = self.total_steps
        for step in range(self.start_step, last):
            metrics = train_step(step)
            number = step + 1
            if number % logging.eval_every == 0 or number == last:
                metrics.update(evaluate())
            self.log.log(number, metrics, echo=number % logging.log_every == 0 or number == last)
            if number % every == 0 and number < last:
                self.trainer.save_checkpoint(number, {**state(), "history": self.log.history})
            if number == fail_at:
                raise InjectedFailure(f"{FAIL_AT_STEP_ENV}={fail_at}: failing after step {number}")
        self.log.close()
        self.timings["time/train_s"] = self.clock.lap()
        if isinstance(self.trainer, LocalTrainer):  # RL trains in its workers, which report their own
            self.timings["memory/peak_rss_mib"] = peak_rss_mib()

    # ------------------------------------------------------------------ publish

    def publish(self, tokenizer, curves: list[str], data_stats: dict[str, Any], final: dict[str, float] | None = None) -> dict[str, Any]:
        """HF model + config + metrics + curves + model card, manifest last; artifacts to MLflow.
        `final`: figures computed after training (they join the summary and MLflow)."""
        trainer, name = self.trainer, self.stage
        self.timings["time/final_s"] = self.clock.lap()  # the stage's own figures after training (`final`)
        rows = {part: describe_rows(stats) for part, stats in data_stats.items() if stats.get("read")}
        final = {**(final or {}), **row_metrics(data_stats)}
        self.tracking.log_metrics(self.total_steps, final)
        self.tracking.log_params({f"data.{part}.rows": line for part, line in rows.items()})
        summary = {**self.log.summary(), **final, **self.timings, **self.params}
        first = self.log.history[0] if self.log.history and self.log.history[0]["step"] == 0 else {}
        summary.update({f"{k}_initial": v for k, v in first.items() if k.startswith("eval/")})
        files: Files = {}
        if trainer.is_main:
            sources = {src: self.fingerprints[n] for n, src in data_sources(self.section).items()}
            sources.update({uri: self.input_digests[n] for n, uri in self.inputs.items()})
            # Drawn beside the model's save (an actor's, for RL), not after it: 0.2-0.4 s off every stage.
            drawing = ThreadPoolExecutor(1)
            plot = drawing.submit(lambda: plot_curves(self.log.history, curves, self.staging / "curves.png").read_bytes())
            drawing.shutdown(wait=False)  # `finish_publish` waits for the bytes
            files = {
                "config.yaml": dump_config(self.cfg),
                "metrics.json": metrics_json(self.log.history, summary, {"data": data_stats, "resumed_from_step": self.start_step or None}),
                "MODEL_CARD.md": model_card(name, self.base_model_name, sources, self.section.config_hash(), self.key, summary, rows,
                                            training_line(self.section.lora, self.params)),
                "curves.png": plot,
            }
        inputs = {**self.fingerprints, **{f"upstream:{n}": {"uri": u, "digest": self.input_digests[n]} for n, u in self.inputs.items()}}
        meta = {"stage": name, "cache_key": self.key, "config_hash": self.section.config_hash(), "inputs": inputs,
                "metrics": summary, "mlflow_run_id": self.tracking.run_id}
        local = trainer.publish(tokenizer, self.out, self.staging, files, meta)
        self.tracking.log_artifacts([local / f for f in (*files, manifest.STAGE_MANIFEST)])
        self.tracking.close()
        if trainer.is_main:
            print(f"{name}: published model to {storage.join(self.out, 'model')}\n{name}: metrics in {storage.join(self.out, 'metrics.json')}", flush=True)
        trainer.close()
        if trainer.is_main:
            remove_staging(self.staging)
        return {"stage": name, "uri": self.out, "cache_key": self.key, "cached": False, "metrics": summary,
                "resumed_from_step": self.start_step or None}
