"""Per-step metrics: kept as history (metrics.json has every figure), printed as a progress line
(step/total, ETA, headline figures to 4 significant digits) every `log_every` steps and at least
every PROGRESS_EVERY_S seconds, and shown on a rich progress bar when `logging.progress` is on."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


PROGRESS_EVERY_S = 10.0
# Every figure's first path part is its group: MLflow draws one chart section per group, and the same name is
# used in trained runs, cache-hit runs, metrics.json and the README. A training step's figures without one of
# these groups go under `train/` (`loss` -> `train/loss`, `rewards/margin` -> `train/rewards/margin`).
METRIC_GROUPS = ("train", "eval", "reward", "phase", "data", "time", "system")
# The figures a progress line shows when a record has them (every figure is in metrics.json).
HEADLINE_FIGURES = ("train/loss", "eval/loss", "train/accuracy", "eval/accuracy", "train/rewards/accuracy", "eval/rewards/accuracy",
                    "reward/mean", "eval/reward", "train/kl", "train/lr", "train/tokens_per_s", "train/pairs_per_s",
                    "train/samples_per_s", "train/rows_per_s")


def grouped(name: str) -> str:
    """The name a figure is logged under: its own group, else `train/`."""
    return name if name.split("/", 1)[0] in METRIC_GROUPS else f"train/{name}"


def progress_line(step: int, total: int, seconds_per_step: float | None, record: dict[str, float], headline: str) -> str:
    """`step 25/290 (8.6%), ETA 1m02s: loss=1.234 lr=0.003 tokens_per_s=1.234e+04` (the console drops `train/`)."""
    eta = "" if seconds_per_step is None else f", ETA {_duration(seconds_per_step * (total - step))}"
    names = [k for k in (*HEADLINE_FIGURES, headline) if k in record] or [k for k in record if k != "step"]
    figures = " ".join(f"{k.removeprefix('train/')}={record[k]:.4g}" for k in dict.fromkeys(names))
    return f"step {step}/{total} ({100 * step / max(total, 1):.1f}%){eta}: {figures}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class MetricsLog:
    """Rank 0's record of a stage's metrics. Other ranks hold an inactive one."""

    def __init__(self, active: bool, total_steps: int, show_progress: bool, headline: str, history: list[dict] | None = None,
                 label: str = "train"):
        self.active, self.headline, self.total = active, grouped(headline), total_steps
        self.history: list[dict[str, Any]] = list(history or [])
        self._first_step = self.history[-1]["step"] if self.history else 0  # a resumed run's ETA counts from here
        self._started = self._printed = time.monotonic()
        self._bar = None
        if active and show_progress:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[figure]}"), TimeRemainingColumn(), transient=False,
            )
            done = self.history[-1]["step"] if self.history else 0
            self._task = self._bar.add_task(label, total=total_steps, completed=done, figure="")
            self._bar.start()
        self._sink = None

    def add_sink(self, fn) -> None:
        """Another consumer of every record (MLflow, when tracking is on)."""
        self._sink = fn

    def log(self, step: int, metrics: dict[str, float], echo: bool) -> None:
        if not self.active:
            return
        metrics = {grouped(k): float(v) for k, v in metrics.items()}
        record = {"step": step, **metrics}
        self.history.append(record)
        if self._sink:
            self._sink(step, metrics)
        if self._bar is not None:
            figure = f"{self.headline}={metrics.get(self.headline, float('nan')):,.0f}" if self.headline in metrics else ""
            self._bar.update(self._task, completed=step, figure=figure)
        now = time.monotonic()
        if echo or now - self._printed >= PROGRESS_EVERY_S:
            done = step - self._first_step
            per_step = (now - self._started) / done if done > 0 else None
            print(progress_line(step, self.total, per_step, record, self.headline), file=sys.stdout, flush=True)
            self._printed = now

    def summary(self) -> dict[str, float]:
        """Latest value of every metric."""
        out: dict[str, float] = {}
        for record in self.history:
            out.update({k: v for k, v in record.items() if k != "step"})
        return out

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
