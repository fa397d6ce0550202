"""Per-step metrics: kept as history, printed as JSON lines, shown on a rich progress bar."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsLog:
    """Rank 0's record of a stage's metrics. Other ranks hold an inactive one."""

    def __init__(self, active: bool, total_steps: int, show_progress: bool, headline: str, history: list[dict] | None = None):
        self.active, self.headline = active, headline
        self.history: list[dict[str, Any]] = list(history or [])
        self._bar = None
        if active and show_progress:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[figure]}"), TimeRemainingColumn(), transient=False,
            )
            done = self.history[-1]["step"] if self.history else 0
            self._task = self._bar.add_task("train", total=total_steps, completed=done, figure="")
            self._bar.start()
        self._sink = None

    def add_sink(self, fn) -> None:
        """Another consumer of every record (MLflow, when tracking is on)."""
        self._sink = fn

    def log(self, step: int, metrics: dict[str, float], echo: bool) -> None:
        if not self.active:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        if self._sink:
            self._sink(step, metrics)
        if self._bar is not None:
            figure = f"{self.headline}={metrics.get(self.headline, float('nan')):,.0f}" if self.headline in metrics else ""
            self._bar.update(self._task, completed=step, figure=figure)
        if echo:
            print(json.dumps(record), file=sys.stdout, flush=True)

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
